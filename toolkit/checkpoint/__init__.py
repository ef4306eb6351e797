"""Checkpoints of global-tensor training state: sharded, resharding, atomic, checked.

``torch.distributed.checkpoint`` (DCP) is the planning and resharding
engine: global tensors speak its chunk protocol (``chunks.ShardView``), so
each rank writes only its own box (replicas once, partial values reduced
first) and reads only the saved chunks that overlap the box it needs in the
layout it loads into. What DCP does not give is done here, each for a
stated reason: a storage layer of raw bytes, JSON metadata and a CRC-32 per
record (``storage``: loading unpickles nothing, checksums come from memory,
and it is faster than DCP's ``torch.save`` per chunk), a manifest written
last with every file's size (truncation and bit flips are caught, naming the
file), write-then-rename publication with a ``latest`` pointer and
keep-last-k (a crash never leaves a half checkpoint as latest), name-keyed
optimizer state (layouts with other parameter sets reload it), per-rank
entries (RNG states) and tied-parameter aliases.

API (all collective over the world; without ``torch.distributed`` a world of one)::

    from toolkit import checkpoint as ckpt

    state = {
        "model": model.state_dict(),                              # global tensors; a stage's own
        "optim": ckpt.optimizer_state_dict(optimizer, model),     # keyed by parameter name
        "scheduler": scheduler.state_dict(),                      # plain data
        "sampler": sampler_state,                                 # plain data (e.g. {"epoch": 0, "index": 1234})
        "step": step,
        "rng": ckpt.rng_state(),                                  # per rank (``per_rank``)
        "extra": {"model_config": {...}},                         # JSON
    }
    path = ckpt.save(run_dir + "/checkpoints", step, state, keep_last=2, tied=TIED)

    path = ckpt.latest(run_dir + "/checkpoints")                  # None if there is none
    template = {"model": model.state_dict(), "optim": ckpt.optimizer_state_dict(optimizer, model),
                "scheduler": None, "sampler": None, "step": None, "rng": None, "extra": None}
    out = ckpt.load(path, template)                               # tensors filled in place
    ckpt.load_optimizer_state_dict(optimizer, model, out["optim"])
    scheduler.load_state_dict(out["scheduler"]); ckpt.set_rng_state(out["rng"]); step = out["step"]

On disk (``<root>/step_<N>/``): ``__<rank>_0.distcp`` (each rank's tensor
chunks as raw bytes), ``metadata.json`` (every tensor's global shape, dtype
and chunks: file, offset, length, CRC-32), ``state.json`` (plain data, the
tree's shape, aliases, each tensor's saving placement and SBP), ``manifest.json`` (every file's size, CRC-32 of the
JSON files, written last). See ``directory`` for ``latest`` and the
``.tmp`` protocol. ``verify(path)`` checks every byte of a checkpoint; ``tensor_shapes(path, key, names)``
finds the saved shapes of named tensors without reading them, ``plain_value(path, key)`` a key saved as
plain data (both from the verified metadata alone, in one process).
"""
from .directory import latest
from .errors import CheckpointError
from .load import load, plain_value, tensor_shapes, verify
from .optimizer import StateLike, load_optimizer_state_dict, optimizer_state_dict
from .rng import rng_state, set_rng_state
from .save import save

__all__ = ["save", "load", "latest", "verify", "tensor_shapes", "plain_value", "CheckpointError",
           "optimizer_state_dict", "load_optimizer_state_dict", "StateLike", "rng_state", "set_rng_state"]
