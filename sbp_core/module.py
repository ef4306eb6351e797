"""``distribute_module``: give an ordinary ``nn.Module`` SBP layouts from a plan.

A plan maps name patterns (``fnmatch``, matched against dotted names) to an
N-d SBP:

- parameter and buffer names, e.g. ``"*.c_attn.weight": (B, S(1))``; the
  first matching pattern wins; unmatched ones are ``B`` on every axis; a
  parameter under several names (a tied LM head) takes the first pattern
  that matches any of its names;
- ``"<module pattern>:input"`` / ``":output"``: the module's first tensor
  input / its tensor output is boxed to that layout (a forward hook calling
  ``to_global``, differentiable); ``":inputs"``: every positional global
  tensor input (e.g. a class-split loss head's embeddings and labels). This is how a plan pins activation
  layouts — Megatron's ``B`` before a column-parallel linear, or sequence
  parallel's ``S(1)`` around LayerNorm — without touching the model code.

Every rank must call it with the same module (same seed for the same
initial values): each parameter's global value is the rank's own full
value, and a rank keeps only its shard (no communication). A parameter on
the meta device (a table too big to build whole on every rank, or any
parameter of a model that builds only shards), and likewise a meta buffer
(a class-id table laid out like such rows), is built shard by shard: its
module's ``init_shard(name, box)`` returns the values of the box
``((start, length), ...)`` this rank holds; a module without one is served
by the nearest module above it that has one, asked with the name relative
to it (GPT-2's model initialises every parameter). Gradients are
boxed to their parameter's layout while backward runs (``P -> B``
all-reduce for data parallel), in buckets of about ``bucket_bytes`` started
as soon as backward has accumulated every gradient of one
(``sbp_core.grad_buckets``, as DDP's) and waited for when backward ends, so
``torch.optim`` steps local shards without communicating. A sparse row
gradient (``sbp_core.sparse``) is boxed to that layout with its row splits
as ``B``. Under ``defer_grad_boxing()`` (gradient accumulation: every
micro-batch but the last) gradients stay in the layout they arrive in —
partial terms add locally, no traffic — and the last micro-batch's backward
boxes the sums; ``box_grads(module)`` boxes whatever is left (all of them
when every backward was deferred) in one collective.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from .boxing.coalesced import box_many
from .declare import adopt, distribute
from .global_tensor import GlobalTensor
from .grad_buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradBuckets, defer_grad_boxing  # noqa: F401  (defer_grad_boxing: re-exported)
from .layout import Layout, local_box
from .process_groups import world_rank
from .sbp import Broadcast, format_sbp, nd_sbp
from .sparse import SparseGlobalTensor, sparse_sbp_for


def _match(plan: dict, *names: str):
    """The SBP of the first pattern of ``plan`` matching any of ``names`` (a parameter's names), or ``None``."""
    for pattern, sbp in plan.items():
        if ":" not in pattern and any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return sbp
    return None


def _on_mesh(sbp: tuple, placement) -> tuple:
    """A split over a mesh axis of one device is that device's whole tensor: say ``B``.

    Same values, but ops then see a replicated layout and take their plain
    signature (a vocab-split LM head on a tp axis of size 1 would otherwise
    run the model-parallel softmax for nothing).
    """
    return tuple(Broadcast() if n == 1 and s.is_split else s for s, n in zip(sbp, placement.shape))


def _set_grad(param, grad) -> None:
    param.grad = grad


@torch.no_grad()
def box_grads(module: nn.Module) -> None:
    """Box every accumulated gradient of ``module`` to its parameter's layout, coalesced.

    DDP's buckets as one boxing of a list: the gradients that need the same
    kind of step (``P -> B`` over data parallel, typically all of them) share
    one collective (``boxing.coalesced.box_many``: reduce-scatter plus
    all-gather of one packed buffer, each element summed in one order
    whatever the bucket); anything else is boxed alone.
    Sparse row gradients (``SparseGlobalTensor``) are boxed alone, to the
    layout their table's rows allow (``sparse_sbp_for``). Every rank calls it
    with the same module structure.
    """
    todo = []
    for p in module.parameters():
        if isinstance(p.grad, SparseGlobalTensor):
            if p.grad.sbp != sparse_sbp_for(p.sbp):
                p.grad = p.grad.to_global(sbp=sparse_sbp_for(p.sbp))
        elif isinstance(p.grad, GlobalTensor) and p.grad.sbp != p.sbp:
            todo.append(p)
    items = [(p.grad._local, p.grad.layout, p.grad.layout.with_sbp(p.sbp)) for p in todo]
    for p, local, (_, _, dst) in zip(todo, box_many(items), items):
        p.grad = GlobalTensor(local, dst)


def planned_sbp(module: nn.Module, placement, plan: dict | None = None) -> dict:
    """``{parameter name: SBP}`` that ``distribute_module(module, placement, plan)`` gives each parameter (the
    names of ``named_parameters()``), without building anything."""
    aliases = _aliases(module)
    broadcast = tuple(Broadcast() for _ in placement.shape)
    return {n: _on_mesh(nd_sbp(_match(dict(plan or {}), *aliases[id(p)]) or broadcast, placement.ndim), placement)
            for n, p in module.named_parameters()}


def _aliases(module: nn.Module) -> dict:
    """``{id(parameter): its names}`` in module order: a tied parameter (an LM head's weight, the embedding's it
    shares) has several, and the plan's first entry that matches one of them gives its layout."""
    aliases: dict = {}
    for n, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(n)
    return aliases


def distribute_module(module: nn.Module, placement, plan: dict | None = None,
                      bucket_bytes: int = BUCKET_BYTES) -> nn.Module:
    """Replace ``module``'s parameters and buffers by global tensors, in place; returns it.

    A parameter this rank holds whole, on the placement's device, keeps its
    storage as its local tensor (``declare.adopt``): no second copy.

    ``bucket_bytes``: gradient bytes boxed by one collective during backward (module docstring)."""
    plan = dict(plan or {})
    aliases = _aliases(module)
    names = {n for ns in aliases.values() for n in ns} | {n for n, _ in module.named_buffers()}
    module_names = {n for n, _ in module.named_modules()}
    for pattern in plan:
        target, _, where = pattern.partition(":")
        pool = module_names if where else names
        if where not in ("", "input", "inputs", "output"):
            raise ValueError(f"plan key {pattern!r}: after ':' use 'input', 'inputs' or 'output'")
        if not any(fnmatch.fnmatchcase(n, target) for n in pool):
            kind = "module" if where else "parameter or buffer"
            raise ValueError(f"plan key {pattern!r} matches no {kind} of {type(module).__name__}; "
                             f"some names: {sorted(pool)[:8]}")
    broadcast = tuple(Broadcast() for _ in placement.shape)
    done: dict = {}  # id(old parameter) -> new one, so tied parameters stay one parameter
    trained = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for pname, param in list(mod.named_parameters(recurse=False)):
            if id(param) in done:
                setattr(mod, pname, done[id(param)])
                continue
            sbp = _on_mesh(nd_sbp(_match(plan, *aliases[id(param)]) or broadcast, placement.ndim), placement)
            if param.is_meta:
                g = _materialize(module, mod, prefix + pname, param, placement, sbp)
            else:
                g = adopt(param.detach(), placement, sbp)
            new = nn.Parameter(g, requires_grad=param.requires_grad)
            if new.requires_grad:
                trained.append(new)
            done[id(param)] = done[id(new)] = new  # a module under two names is visited twice
            setattr(mod, pname, new)
        for bname, buf in list(mod.named_buffers(recurse=False)):
            if buf is None or isinstance(buf, GlobalTensor):  # None, or distributed on an earlier visit
                continue
            sbp = _on_mesh(nd_sbp(_match(plan, prefix + bname) or broadcast, placement.ndim), placement)
            if buf.is_meta:
                mod._buffers[bname] = _materialize(module, mod, prefix + bname, buf, placement, sbp)
            else:
                mod._buffers[bname] = distribute(buf, placement, sbp)
        for where in ("input", "inputs", "output"):
            for pattern, sbp in plan.items():
                if pattern.endswith(":" + where) and fnmatch.fnmatchcase(mod_name, pattern.rsplit(":", 1)[0]):
                    _pin(mod, where, _on_mesh(nd_sbp(sbp, placement.ndim), placement))
    module._grad_buckets = GradBuckets(trained, [p.sbp for p in trained], _set_grad, bucket_bytes, min(
        bucket_bytes, FIRST_BUCKET_BYTES))
    return module


def init_shard_of(root: nn.Module, full_name: str):
    """``(init_shard, name relative to its module)``: the owner's ``init_shard``, else its nearest ancestor's."""
    parts = full_name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        init = getattr(root.get_submodule(".".join(parts[:cut])), "init_shard", None)
        if init is not None:
            return init, ".".join(parts[cut:])
    return None, full_name


def _materialize(root: nn.Module, mod: nn.Module, full_name: str, meta, placement, sbp: tuple) -> GlobalTensor:
    """A meta parameter's or buffer's global tensor: each member builds its own box with
    ``init_shard(name, box)`` (module docstring)."""
    init, name = init_shard_of(root, full_name)
    if init is None:
        raise ValueError(f"{full_name!r} is on the meta device and neither {type(mod).__name__} nor a "
                         "module above it has init_shard(name, box): build it with values, or give its module "
                         "init_shard")
    layout = Layout(placement, sbp, meta.shape, meta.dtype)
    me = world_rank()
    if me not in placement:
        return GlobalTensor(torch.empty(0, dtype=meta.dtype, device=placement.device()), layout)
    box = local_box(meta.shape, placement.shape, sbp, placement.coords(me))
    local = init(name, box).to(device=placement.device(), dtype=meta.dtype)
    want = tuple(n for _, n in box)
    if tuple(local.shape) != want:
        raise ValueError(f"init_shard({name!r}, {box}) returned shape {tuple(local.shape)}, expected {want}")
    return GlobalTensor(local, layout)


def _pin(mod: nn.Module, where: str, sbp: tuple) -> None:
    def box(x):
        if isinstance(x, GlobalTensor) and x.sbp != sbp:
            return x.to_global(sbp=sbp)
        return x

    if where == "input":
        mod.register_forward_pre_hook(lambda m, args: (box(args[0]),) + tuple(args[1:]) if args else args)
    elif where == "inputs":
        mod.register_forward_pre_hook(lambda m, args: tuple(box(a) for a in args))
    else:
        mod.register_forward_hook(lambda m, args, out: box(out) if isinstance(out, torch.Tensor) else out)


def describe_plan(module: nn.Module) -> str:
    """One line per global parameter: name, shape, SBP."""
    return "\n".join(
        f"{n:50s} {tuple(p.shape)} {format_sbp(p.sbp)}" for n, p in module.named_parameters() if isinstance(p, GlobalTensor)
    )
