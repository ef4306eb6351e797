"""``load``: fill a template of the *current* layout from any checkpoint, each rank reading only its boxes."""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from sbp_core import GlobalTensor, Layout

from . import _dist, chunks, directory, manifest, storage, tree
from .errors import CheckpointError
from .optimizer import StateLike
from .save import STATE_NAME, unwrap

_MISSING = object()


class _Checkpoint:
    """One verified checkpoint directory: manifest, DCP metadata, the plain-data tree."""

    def __init__(self, path: str):
        self.path = directory.resolve(path)
        self.body = manifest.read(self.path)
        where = f"{self.path}/{storage.METADATA_NAME}"
        self.metadata = storage.decode_metadata(
            manifest.read_verified_json(self.path, storage.METADATA_NAME, self.body), where)
        doc = manifest.read_verified_json(self.path, STATE_NAME, self.body)
        self.step = doc["step"]
        self.world_size = doc["world_size"]
        self.tree = tree.decode(doc["tree"])
        self.per_rank = {int(r): tree.decode(v) for r, v in doc["per_rank"].items()}
        self.aliases = doc["aliases"]
        self.tied = [tuple(p) for p in doc["tied"]]
        self.per_rank_keys = tuple(doc["per_rank_keys"])

    def rank_source(self, rank: int) -> int:
        return rank if rank in self.per_rank else rank % self.world_size


class _Filler:
    """Walks a template beside the saved tree; collects what DCP must fill, builds the result."""

    def __init__(self, ckpt: _Checkpoint, tied):
        self.ckpt = ckpt
        self.md = ckpt.metadata.state_dict_metadata
        pairs = list(ckpt.tied) + [tuple(p) for p in tied]
        self.partners: dict = {}
        for a, b in pairs:
            self.partners.setdefault(a, []).append(b)
            self.partners.setdefault(b, []).append(a)
        self.flat: dict = {}  # fqn -> what DCP fills
        self.targets: list = []  # tensors to finish after DCP

    # -- names ----------------------------------------------------------
    def resolve(self, fqn: str) -> str | None:
        """The stored tensor behind ``fqn``: itself, a recorded alias, or a tied partner's name."""
        found = self.resolve_direct(fqn)
        if found is not None:
            return found
        tokens = fqn.split("/")
        for i, tok in enumerate(tokens):
            for name, partners in self.partners.items():
                if tok == tree.key_token(name):
                    for other in partners:
                        cand = tree.join(tokens[:i] + [tree.key_token(other)] + tokens[i + 1:])
                        found = self.resolve_direct(cand)
                        if found is not None:
                            return found
        return None

    def resolve_direct(self, fqn: str) -> str | None:
        """``fqn`` itself or the tensor it was recorded as an alias of."""
        if fqn in self.md:
            return fqn
        target = self.ckpt.aliases.get(fqn)
        return target if target in self.md else None

    def _register(self, fqn: str, t: torch.Tensor, what: str) -> torch.Tensor:
        target = self.resolve(fqn)
        if target is None:
            some = ", ".join(sorted(self.md)[:6])
            raise CheckpointError(f"{self.ckpt.path}: no tensor for {what} {fqn!r} (it holds {len(self.md)} "
                                  f"tensors, e.g. {some})")
        size = self.md[target].size
        if tuple(size) != tuple(t.shape):
            raise CheckpointError(f"{self.ckpt.path}: tensor {target!r} has shape {list(size)}, the state to "
                                  f"load expects {list(t.shape)} at {fqn!r}")
        if target != fqn:
            storage.add_alias(self.ckpt.metadata, fqn, target)
        self.flat[fqn] = chunks.for_load(t)
        self.targets.append(t)
        return t

    # -- walking ----------------------------------------------------------
    def child(self, saved, key):
        if not isinstance(saved, dict):
            return _MISSING
        if key in saved:
            return saved[key]
        for other in self.partners.get(key, ()):
            if other in saved:
                return saved[other]
        return _MISSING

    def fill(self, tmpl, saved, tokens: list):
        if isinstance(tmpl, torch.Tensor):
            return self._register(tree.join(tokens), tmpl, "template tensor")
        if isinstance(tmpl, StateLike):
            return self.fill(self._like(tmpl.param, saved, tokens), saved, tokens)
        if tmpl is None:
            return self.materialize(saved) if saved is not _MISSING else None
        if isinstance(tmpl, dict):
            return {k: self.fill(v, self.child(saved, k), tokens + [tree.key_token(k)]) for k, v in tmpl.items()}
        if isinstance(tmpl, (list, tuple)) and tree.holds_tensor(tmpl):
            seq = saved if isinstance(saved, (list, tuple)) and len(saved) == len(tmpl) else [_MISSING] * len(tmpl)
            out = [self.fill(v, s, tokens + [str(i)]) for i, (v, s) in enumerate(zip(tmpl, seq))]
            return type(tmpl)(out)
        if saved is _MISSING:
            return tmpl
        return self.materialize(saved)

    def _like(self, param, saved, tokens: list) -> dict:
        """Template for one parameter's optimizer state: tensors of its shape in its layout, others plain."""
        if saved is _MISSING or not isinstance(saved, dict):
            return {}
        out = {}
        for key, value in saved.items():
            if not isinstance(value, tree.Saved):
                out[key] = None
                continue
            target = self.resolve(value.fqn) or value.fqn
            md = self.md.get(target)
            if md is None:
                raise CheckpointError(f"{self.ckpt.path}: no tensor {value.fqn!r}")
            dtype = md.properties.dtype
            if isinstance(param, GlobalTensor) and tuple(md.size) == tuple(param.shape):
                layout = Layout(param.placement, param.sbp, param.shape, dtype)
                out[key] = GlobalTensor(torch.zeros(param._local.shape, dtype=dtype, device=param._local.device),
                                        layout)
            elif tuple(md.size) == tuple(param.shape):
                out[key] = torch.zeros(param.shape, dtype=dtype, device=param.device)
            else:
                out[key] = torch.zeros(md.size, dtype=dtype)
        return out

    def materialize(self, saved):
        """Saved values as they are; saved tensors as whole plain tensors."""
        if isinstance(saved, tree.Saved):
            target = self.resolve(saved.fqn)
            if target is None:
                raise CheckpointError(f"{self.ckpt.path}: state.json names tensor {saved.fqn!r}, "
                                      f"{storage.METADATA_NAME} has no such tensor")
            md = self.md[target]
            return self._register(saved.fqn, torch.empty(md.size, dtype=md.properties.dtype), "tensor")
        if isinstance(saved, dict):
            return {k: self.materialize(v) for k, v in saved.items()}
        if isinstance(saved, list):
            return [self.materialize(v) for v in saved]
        if isinstance(saved, tuple):
            return tuple(self.materialize(v) for v in saved)
        return saved


def load(path: str, template: dict | None = None, *, per_rank=None, tied=()) -> dict:
    """Fill ``template`` from the checkpoint at ``path``; collective over the world. Returns the filled state.

    ``path``: a checkpoint directory, or a root (its ``latest``). ``template``:
    the state in the *current* layout, shaped like what was saved. Its
    tensors are filled in place (global tensors box by box: each rank reads
    only the saved chunks its box overlaps, from any saved layout and world
    size; a partial axis' value lands on its first rank, the others get the
    identity). A ``None`` anywhere means "whatever was saved here", with
    tensors as whole plain tensors; ``load(path)`` returns everything. Plain
    values come from the checkpoint; a template key the checkpoint lacks keeps
    its template value, except tensors, which raise. Keys in ``per_rank``
    (default: those the save used) come from the same rank's saved entry
    (rank ``r % saved world`` when this world is larger). ``StateLike`` slots
    (see ``optimizer_state_dict``) become the saved optimizer state of that
    parameter, laid out like it. ``tied``: more name pairs to read one
    tensor under the other's name (those given to ``save`` are recorded).

    Raises ``CheckpointError`` naming the file for a missing, truncated or
    corrupted file (sizes from the manifest, CRC-32 of every record read),
    and naming the key for a tensor that is missing or has another shape.
    Names and shapes are checked before any tensor is filled; a record that
    fails its CRC is found as it is read, when the template's tensors read
    before it (and that record's bytes, read in place) are filled already.
    """
    local = {}

    def plan():
        ckpt = _Checkpoint(path)
        filler = _Filler(ckpt, tied)
        keys = ckpt.per_rank_keys if per_rank is None else tuple(per_rank)
        src = ckpt.rank_source(_dist.rank())
        saved_rank = ckpt.per_rank.get(src, {})
        if template is None:
            out = {**filler.materialize(ckpt.tree),
                   **{k: filler.materialize(v) for k, v in saved_rank.items()}}
        else:
            if not isinstance(template, dict):
                raise TypeError(f"template must be a dict of named parts or None, got {type(template).__name__}")
            out = {}
            for k, v in template.items():
                if k in keys:
                    out[k] = filler.fill(v, filler.child(saved_rank, k), [tree.rank_token(src), tree.key_token(k)])
                else:
                    out[k] = filler.fill(v, filler.child(ckpt.tree, k), [tree.key_token(k)])
        local.update(ckpt=ckpt, filler=filler, out=out)

    _dist.agree(plan)
    ckpt, filler = local["ckpt"], local["filler"]
    reader = storage.Reader(ckpt.path, ckpt.metadata)
    try:
        with _dist.single_process_quiet():
            dcp.load(filler.flat, storage_reader=reader, no_dist=not _dist.initialized(),
                     process_group=_dist.group(),
                     planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except CheckpointException as exc:
        raise unwrap(exc, f"reading {ckpt.path}") from None
    for t in filler.targets:
        chunks.finish_load(t)
    return local["out"]


def verify(path: str) -> str:
    """Check every byte of a checkpoint against its checksums (one process, no template); returns its directory."""
    ckpt = _Checkpoint(path)  # manifest, metadata.json and state.json in full
    for name, entry in sorted(ckpt.body["files"].items()):
        if manifest.ALGORITHM in entry:
            manifest.verify(ckpt.path, name, ckpt.body)
    storage.verify_records(ckpt.path, ckpt.metadata, ckpt.body)
    return ckpt.path


def tensor_shapes(path: str, key: str, names, tied=()) -> dict:
    """``{name: its saved shape, or None}`` for each of ``names`` under ``key`` (e.g. ``"model"`` and a
    model's state-dict names), found as ``load`` finds them (itself, a recorded alias, or a ``tied``
    partner; ``None``: the checkpoint holds no tensor for it), from the verified metadata alone: no tensor
    is read, one process."""
    filler = _Filler(_Checkpoint(path), tied)
    found = {n: filler.resolve(tree.join([tree.key_token(key), tree.key_token(n)])) for n in names}
    return {n: None if t is None else tuple(filler.md[t].size) for n, t in found.items()}


def plain_value(path: str, key: str):
    """What ``load(path, {key: None})`` gives for a ``key`` saved as plain data (``None`` when the
    checkpoint has none), from the verified ``state.json`` alone: one process, no tensor read."""
    ckpt = _Checkpoint(path)
    value = ckpt.tree.get(key) if isinstance(ckpt.tree, dict) else None
    if tree.holds_tensor(value):
        raise CheckpointError(f"{ckpt.path}: {key!r} holds tensors, not plain data")
    return value
