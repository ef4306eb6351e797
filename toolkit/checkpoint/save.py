"""``save``: every rank writes what it holds; rank 0 publishes the checkpoint when all are done."""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from sbp_core import GlobalTensor

from . import _dist, chunks, directory, manifest, storage, tree
from .errors import CheckpointError
from .optimizer import StateLike

STATE_NAME = "state.json"
DEFAULT_PER_RANK = ("rng",)


def unwrap(exc: CheckpointException, what: str) -> CheckpointError:
    """One ``CheckpointError`` from DCP's per-rank failure report (ours kept verbatim when a rank raised one)."""
    failures = getattr(exc, "failures", {}) or {}
    for r, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, CheckpointError):
            return CheckpointError(str(inner))
    parts = []
    for r, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        parts.append(f"rank {r}: {type(inner).__name__}: {inner}")
    return CheckpointError(f"{what} failed: " + ("; ".join(parts) or str(exc)))


def _split(state: dict, per_rank) -> tuple:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of named parts (model, optim, ...), got {type(state).__name__}")
    shared = {k: v for k, v in state.items() if k not in per_rank}
    mine = {k: v for k, v in state.items() if k in per_rank}
    return shared, mine


def _local_view(state: dict, per_rank) -> tuple:
    """This rank's skeletons, tensors, same-data aliases and a summary of its tensors for the others."""
    shared, mine = _split(state, per_rank)
    tensors: dict = {}
    skip = lambda obj: isinstance(obj, StateLike)  # noqa: E731  (a parameter with no optimizer state yet)
    skeleton = tree.encode(shared, [], tensors, skip)
    rank_skeleton = tree.encode(mine, [tree.rank_token(_dist.rank())], tensors, skip)
    aliases, first = {}, {}
    for fqn in tensors:  # in state order: a tied parameter keeps its first name (the embedding's)
        key = chunks.same_data_key(tensors[fqn])
        if key is not None and key in first:
            aliases[fqn] = first[key]  # tied: one parameter under two names, saved once
        elif key is not None:
            first[key] = fqn
    summary = {fqn: chunks.describe(t) for fqn, t in tensors.items() if fqn not in aliases}
    return tensors, (skeleton, rank_skeleton, aliases, summary)


def _swap_token(fqn: str, old: str, new: str) -> str | None:
    tokens = fqn.split("/")
    if old not in tokens:
        return None
    return tree.join(new if t == old else t for t in tokens)


def plan_writes(views: list, tied) -> tuple:
    """Who writes what, from every rank's summary: ``(writers, aliases, layouts)`` by fqn.

    - a name that is a view of another tensor on every rank that holds its data
      is an alias (a tied parameter saved once);
    - a ``tied`` pair's second name is an alias of the first when both are saved
      (a pipeline's last-stage copy of the embedding);
    - a name held on several placements (a tied copy with the same name) is
      written by the placement with the lowest rank; replicas within it are
      de-duplicated by DCP; ``layouts`` records that placement and SBP (for
      people and tools: loading needs only the boxes in ``metadata.json``);
    - shapes and dtypes of one name must agree everywhere.
    """
    holders: dict = {}
    for r, (_, _, _, summary) in enumerate(views):
        for fqn, desc in summary.items():
            holders.setdefault(fqn, {})[r] = desc
    # A rank outside a tensor's placement cannot see that two names share data; only holders count.
    held = {fqn for fqn, descs in holders.items() if any(d[4] for d in descs.values())}
    aliases = {}
    for _, _, rank_aliases, _ in views:
        for fqn, target in rank_aliases.items():
            if fqn not in held:
                aliases[fqn] = target
                holders.pop(fqn, None)
    for first, second in tied:
        a, b = tree.key_token(first), tree.key_token(second)
        for fqn in sorted(holders):
            partner = _swap_token(fqn, b, a)
            if partner is not None and partner != fqn and partner in holders:
                da, db = next(iter(holders[partner].values())), next(iter(holders[fqn].values()))
                if da[2:4] == db[2:4]:
                    aliases[fqn] = partner
                    del holders[fqn]
    for fqn in aliases:  # an alias of an alias names the tensor actually written
        seen = {fqn}
        while aliases[fqn] in aliases and aliases[fqn] not in seen:
            seen.add(aliases[fqn])
            aliases[fqn] = aliases[aliases[fqn]]
    writers, layouts = {}, {}
    for fqn, descs in holders.items():
        shapes = {(d[2], d[3]) for d in descs.values()}
        if len(shapes) > 1:
            raise ValueError(f"state tensor {fqn!r} differs between ranks: "
                             + ", ".join(f"rank {r} shape {list(d[2])} {d[3]}" for r, d in sorted(descs.items())))
        placed = {d[1] for d in descs.values() if d[0] == "global"}
        if placed:
            owner = min(placed, key=lambda ranks: (min(ranks), ranks))
            writers[fqn] = sorted(r for r, d in descs.items() if d[0] == "global" and d[1] == owner)
            d = descs[writers[fqn][0]]
            layouts[fqn] = {"placement": torch.tensor(d[1]).reshape(d[5]).tolist(), "sbp": d[6]}
        else:
            writers[fqn] = sorted(descs)
    return writers, aliases, layouts


def save(ckpt_root: str, step: int, state: dict, keep_last: int | None = None, *,
         per_rank=DEFAULT_PER_RANK, tied=()) -> str:
    """Save ``state`` as ``<ckpt_root>/step_<step>``; collective over the world. Returns the directory.

    ``state``: a dict of parts, each a tree of dicts/lists/tuples with tensor
    or plain-data leaves (see ``toolkit.checkpoint`` for the parts a trainer
    saves). Global tensors are saved box by box, each box once; partial ones
    are reduced first. Plain tensors are taken as equal on every rank that
    has them and written once. Top-level keys in ``per_rank`` (RNG states)
    are saved for every rank separately. ``tied``: pairs of parameter names
    that are one tensor (``("transformer.wte.weight", "lm_head.weight")``);
    the second is saved as an alias of the first wherever both exist, so a
    pipeline's copy is not stored twice.

    Writes ``step_<step>.tmp`` (every rank its own file), then rank 0 writes
    ``metadata.json``, ``state.json`` and, last, ``manifest.json`` (every
    file's size; checksums), renames the directory to ``step_<step>``, points
    ``latest`` at it, and removes all but the ``keep_last`` newest checkpoints.
    """
    per_rank = tuple(per_rank)
    tied = [tuple(p) for p in tied]
    root = os.path.abspath(ckpt_root)
    name = directory.step_name(step)
    tmp = os.path.join(root, name + ".tmp")

    def prepare():
        if _dist.rank() == 0:
            os.makedirs(root, exist_ok=True)
            directory.remove_stale(root)
            os.makedirs(tmp)

    _dist.agree(prepare)
    local = {}

    def describe():
        local["tensors"], view = _local_view(state, per_rank)
        return view

    views = _dist.agree(describe)
    writers, aliases, layouts = plan_writes(views, tied)  # the same on every rank, from the same views
    digests = _dist.all_gather_object(_write_mine(tmp, local["tensors"], writers))

    def publish():
        if _dist.rank() != 0:
            return None
        files = {n: d for rank_digests, _ in digests for n, d in rank_digests.items()}
        files[storage.METADATA_NAME] = next(meta for _, meta in digests if meta is not None)
        merged = views[0][0]
        for skeleton, *_ in views[1:]:
            merged = tree.merge(merged, skeleton)
        state_doc = {"step": int(step), "world_size": len(views), "per_rank_keys": list(per_rank),
                     "tree": merged, "per_rank": {str(r): v[1] for r, v in enumerate(views)},
                     "aliases": aliases, "tied": [list(p) for p in tied], "layouts": layouts}
        spath = os.path.join(tmp, STATE_NAME)
        manifest.write_json_durably(spath, state_doc)
        files[STATE_NAME] = manifest.file_digest(spath)
        directory.fsync_dir(tmp)  # every rank's file is in the directory before the manifest says so
        manifest.write(tmp, {"step": int(step), "world_size": len(views), "files": files})
        final = directory.publish(root, tmp, name)
        directory.prune(root, keep_last, keep=name)
        return final

    return _dist.agree(publish)[0]


def _write_mine(tmp: str, tensors: dict, writers: dict) -> tuple:
    """Write the tensors ``writers`` gives this rank into ``tmp`` (``torch.distributed.checkpoint``'s format);
    ``(this rank's file digests, the metadata file's digest or None)``."""
    me = _dist.rank()
    mine = sorted(f for f in tensors if me in writers.get(f, ()))
    flat = {fqn: chunks.for_save(chunks.reduce_partial(tensors[fqn]) if isinstance(tensors[fqn], GlobalTensor)
                                 else tensors[fqn]) for fqn in mine}
    writer = storage.Writer(tmp)
    try:
        with _dist.single_process_quiet():
            dcp.save(flat, storage_writer=writer, no_dist=not _dist.initialized(),
                     process_group=_dist.group(),
                     planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except CheckpointException as exc:
        raise unwrap(exc, f"writing {tmp}") from None
    return writer.digests, writer.metadata_digest
