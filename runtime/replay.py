"""A run on one thread acts in an order its plan alone decides: recorded once, replayed after.

When all of a rank's actors run on the caller's thread (one device and its
data pipeline on a host without an accelerator: ``executor._run_on_caller``)
no message comes from elsewhere. Which actor acts next is then a function of
the plan and the number of pieces only: the counters (free registers, pool
slots, readable inputs, pieces left) start the same in every run and change
only by the actions' own messages, and the pick is the first ready actor in
priority order. So the executor runs such a plan once with every actor
logging what it read, and every later run of the same plan and piece count
replays that order (``Schedule.replay``): each action gets the values of the
pieces it read then, from a table, and a value leaves the table after its
last reader, as its register would be freed. The per-action picking,
messages and register bookkeeping (about 15 us an action on a 2-core VM, a
few percent of a small model's step) drop to a table lookup.

What the actions compute, and when each value is released, is the live
run's; so are the run's stats (recorded with the order) and its outputs.
An action that raises fails the run as in the live loop, naming the actor
and the piece.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Schedule:
    """The recorded order of one single-thread run.

    ``steps``: ``(aid, spec, piece, keys, keep, drop)`` per action in order:
    the actor, the piece, the keys of the values it reads (a list of keys
    for an accumulating edge), whether anything reads its output, and the
    keys it reads last. A key is ``(producer aid, piece)``; a register
    filled before the run (``ActorSpec.initial``: the consumer's value;
    ``credits``: ``None``) has a negative piece and is listed in ``prefill``.
    """

    steps: list
    prefill: list  # (key, consumer spec, producer name), or (key, None, None) for a credit
    sinks: dict  # aid -> the name of an actor whose outputs the run returns
    stats: dict  # the recorded run's ``RunResult.stats``

    @classmethod
    def record(cls, log: list, actors: dict, prefill: list, sinks: dict, stats: dict) -> "Schedule":
        """From the log the actors wrote (``Actor.log``) and ``actors`` (``{aid: Actor}`` of the run)."""
        last = {}  # key -> index of the step that reads it last
        for i, (_, _, keys) in enumerate(log):
            for k in keys:
                for key in (k if isinstance(k, list) else (k,)):
                    last[key] = i
        drops = [[] for _ in log]
        for key, i in last.items():
            drops[i].append(key)
        steps = [(aid, actors[aid].spec, piece, keys, (aid, piece) in last, tuple(drops[i]))
                 for i, (aid, piece, keys) in enumerate(log)]
        return cls(steps, list(prefill), dict(sinks), dict(stats))

    def replay(self, outputs: dict, fail) -> bool:
        """Run the recorded order, appending sinks' outputs to ``outputs[name]``; on an exception
        ``fail(spec, piece, exc)`` and ``False``."""
        values = {key: None if spec is None else spec.initial[src] for key, spec, src in self.prefill}
        sinks = self.sinks
        for aid, spec, piece, keys, keep, drop in self.steps:
            args = [values[k] if isinstance(k, tuple) else [values[key] for key in k] for k in keys]
            try:
                out = spec.action(piece, *args)
            except BaseException as exc:  # noqa: BLE001  (the executor re-raises it, naming the actor)
                fail(spec, piece, exc)
                return False
            if keep:
                values[(aid, piece)] = out
            for key in drop:
                del values[key]
            name = sinks.get(aid)
            if name is not None:
                outputs[name].append(out)
        return True
