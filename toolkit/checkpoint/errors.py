"""The one error a checkpoint raises for bad data on disk or a state that does not fit it."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not match the state it is loaded into.

    The message names the offending file or state key. A ``ValueError``
    because the checkpoint's *content* is what is wrong; every rank of a
    collective ``save``/``load`` raises it together, so a process group
    stays usable after it.
    """
