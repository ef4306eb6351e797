"""The one error type (and one warning type) of configuration checking.

Every check that can fail before a job starts raises :class:`ConfigError`, a
``ValueError`` whose message names the field, the offending value and what
would be valid. :func:`toolkit.config.validate` collects *all* problems of a
config and raises them together, so one run of ``train.py`` reports every
mistake at once; ``problems`` holds them one per entry.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; ``problems`` lists every problem found.

    Each problem is one sentence: ``"<field>=<value>: <what is wrong>; <what
    is valid>"``.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} configuration problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(message)


class ConfigWarning(UserWarning):
    """A configuration value is legal but has no effect or is adjusted (e.g. ZeRO with dp=1)."""
