"""One pipelined training step as actors; the schedule from placements, quotas and priorities.

The model is split into ``V = v * pp`` stages (chunks), ``v`` per pipeline
rank (``PipelineConfig.virtual``), placed as the schedule says
(``runtime.pipeline.schedule``: round robin, or a V for ``zbv``). Every
rank builds the same plan and runs its own actors. For stage ``s`` of ``V``
on each of its ranks ``r``:

- ``s{s}.data@r`` (data queue; first and last stage): micro-batch ``k``'s
  fields (``batch``), global tensors laid out ``data_sbp`` (no
  communication); the first stage reads the ``inputs`` fields, the last the
  ``labels`` fields. Where a read-ahead loads and copies the batches ahead
  (``toolkit.data.MicroBatches`` on a GPU) this is one compute actor that
  takes them;
- ``s{s}.F@r`` (compute): the stage's forward of micro-batch ``k``; its out
  register is the *activation stash* (the input leaves, the outputs and the
  autograd graph between them). Its registers count against its rank's
  activation budget (``stash_budget``: ``pp - s`` under 1F1B with one
  stage per rank, ``m`` under GPipe; with several stages per rank a pool
  they share): a rank cannot start a forward while that many micro-batches
  await their backward;
- ``s{s}.B@r`` (compute, higher priority than F with one stage per rank;
  with several, ``schedule.compute_actors`` ranks them): backward of micro-batch
  ``k`` (``loss / m`` on the last stage, the received output gradient
  elsewhere); gradients accumulate in the layout they arrive in
  (``defer_grad_boxing``: partial sums add locally, no traffic) except in
  the last micro-batch's backward, which boxes them to their parameters'
  layouts in buckets overlapping it (``sbp_core.grad_buckets``); its output
  is the gradient of each floating-point input boxed to the boundary layout. On a
  stage after the first that runs plain tensors (below), the last
  micro-batch's backward computes that input gradient alone and leaves the
  weights' gradients to ``reduce`` (``weight_pass``): the stage before,
  waiting for it, starts its last backward one weight pass earlier (with
  several stages per rank, on the rank's shallowest stage only: its last
  backward is the rank's last);
- ``s{s}.T@r`` (interleaved 1F1B and interleaved zero bubble, every stage
  but a rank's deepest): a credit for this stage's forward each time the
  rank's deepest stage runs a forward; ``F`` holds ``pp`` credits at the start, so it runs at
  most ``pp`` micro-batches ahead of that stage (``forward_credits``, ``credit_stage``);
- ``s{s}.W@r`` (zero-bubble schedules ``zb``/``zbv``, every stage but the
  first, lowest priority): the stage's backward is split for every
  micro-batch: ``B`` computes the input gradient alone and sends it, ``W``
  the weights' gradients (``weight_pass``), in a bubble; ``W`` reads the
  stash too, so the micro-batch's activations count against the budget
  until it ran (under ZeRO ``B`` computes both: the weight pass cannot
  reach the compute copies its cast makes);
- boundary actors (``runtime.pipeline.boundary``) carry activations from
  stage ``s`` to ``s + 1`` and gradients back, by cross-placement boxing:
  one set per tensor of the boundary (``acts[s]``: any number, any shapes
  and dtypes, as stage ``s``'s forward returns them; a tensor that is not
  floating point carries no gradient back);
- ``s{s}.reduce@r`` (compute, once per step, on the rank's first stage
  for all of its stages): runs the deferred weight
  pass if any, boxes any gradient left in
  another layout than its parameter's (``box_grads``, or ZeRO's
  ``sync_grads``) and sums tied parameters' gradients across stages;
- ``s{s}.update@r`` (compute, once per step): with a loss scale (fp16),
  unscaling the gradients and the job-wide overflow check
  (``sc.LossScaler``: every rank skips the same steps); global-norm
  clipping over all stages, the optimizer step (on the parameters' local tensors when it is
  element-wise, ``sc.step_on_locals``), ZeRO's ``refresh`` of its compute
  copies, the LR scheduler step, ``zero_grad``; returns the step's mean
  loss on the last stage.

Nothing here orders forwards and backwards: with the stash full a stage can
only run a backward, and a backward wins when both are ready, so stage
``s`` runs ``pp - s`` forwards, then alternates — 1F1B; with several
stages per rank the priorities, the rank's budget and the forward credits
of the schedule module make interleaved 1F1B. The ranks of a stage
form a lockstep gang (their actions call collectives with each other), so
they act in the order their first rank picks — unless that order is forced
(a stash of one register, evaluation), when they need no gang.

A stage whose placement holds one device (``sc.runs_local``), or a pure
data-parallel stage once its first micro-batch passed the audit
(``runtime.pipeline.plain_stage``), runs its forwards and backwards on
plain tensors: for the step, its module's global parameters are swapped
for leaves sharing their storage (``sc.LocalParameters``), micro-batch
fields and boundary activations enter as their locals, and ``reduce``
first hands the leaves' gradients back to the parameters (in their
layouts on one device; as ``P`` partial sums under data parallel, which
``box_grads`` then all-reduces), so gradient reduction, tied gradients,
clipping and the optimizer see global tensors as on any other stage. The
last stage of a data-parallel one divides its loss by its replicas and
gets the step's loss back by one scalar all-reduce. On one device with one
stage and no loss scale, where nothing of the update needs a global
gradient, the gradients stay on the leaves for an optimizer that takes
them (``sc.takes_local_grads``: an element-wise one, or lazy Adam with its
sparse row gradients where nothing clips): ``update`` clips them there and
steps the locals with them (``_update_on_leaves``), the per-parameter
wrapping and unwrapping of a gradient being, with a plain loop's work so
small, a few percent of a step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

import sbp_core as sc
from sbp_core import GlobalTensor, Layout
from sbp_core.layout import local_box
from sbp_core.dispatch import explaining
from sbp_core.loss_scale import skips_on_device
from sbp_core.process_groups import initialising, world_rank

from ..executor import run
from ..plan import ActorSpec, Plan
from . import plain_stage
from .boundary import as_tuple, boundary_actors
from .schedule import (check_schedule, chunk_ranks, compute_actors, credit_stage, forward_credits, split_backward,
                       stash_budget, stash_reserve, too_few_micro_batches)
from .tied import TiedGrads
from .weight_pass import input_first


FIRST_RUNS = 2  # a plan's runs that may hold one-time work (set-up, audit, compilation): see PipelineStep._run


@dataclass
class Stash:
    """One micro-batch's activations held between its forward and its backward."""

    inputs: tuple | None  # the stage's input leaves, one per boundary tensor (None on the first stage)
    output: object  # the boundary tensors (a tuple), or the loss on the last stage


@dataclass
class PipelineConfig:
    """Everything every rank must agree on.

    ``placements``: one per pipeline rank (disjoint); ``virtual``: stages
    (model chunks) per pipeline rank, placed as ``schedule`` says
    (``stage_placement``). ``batch``: ``{field: (global shape, dtype)}`` of
    one micro-batch, every field laid out ``data_sbp``;
    ``inputs``/``labels``: the fields the first and the last stage read;
    ``acts``: per boundary (stage ``s`` to ``s + 1``), the ``(global shape,
    dtype)`` of each tensor of a micro-batch that stage ``s``'s forward
    returns, in order (``[]`` for one stage;
    ``toolkit.stages.boundary_specs`` finds them from the model), all laid
    out ``act_sbp``. A stage whose boundary holds one tensor gets and
    returns that tensor; several, a tuple.
    """

    placements: list
    micro_batches: int
    batch: dict
    acts: list
    data_sbp: tuple
    act_sbp: tuple
    inputs: tuple
    labels: tuple
    schedule: str = "1f1b"
    max_grad_norm: float | None = None
    tied: list = field(default_factory=list)  # [(first-stage name, last-stage name)]
    timeout: float = 120.0
    rows_weigh_equally: bool = False  # the loss is a mean over rows of equal weight (``Recipe``, plain_stage)
    # A plain stage after the first splits its last backward (input gradient first: weight_pass).
    # Not under torch.compile: a compiled graph's backward is one node, which gives every gradient at once.
    split_last_backward: bool = True
    virtual: int = 1

    @property
    def n_stages(self) -> int:
        return len(self.placements) * self.virtual

    def stage_placement(self, stage: int):
        """The placement stage ``stage`` runs on (its pipeline rank's, ``chunk_ranks``)."""
        return self.placements[chunk_ranks(self.schedule, len(self.placements), self.virtual)[stage]]

    def check(self) -> None:
        pp, m = len(self.placements), self.micro_batches
        check_schedule(self.schedule, pp, self.virtual)
        if not isinstance(m, int) or m < 1 or too_few_micro_batches(m, pp):
            raise ValueError(f"{m} micro-batches for {pp} stages: a pipeline needs at least as many "
                             f"micro-batches as stages (raise gradient accumulation to >= {pp})")
        missing = [f for f in (*self.inputs, *self.labels) if f not in self.batch]
        if missing:
            raise ValueError(f"inputs/labels {missing} are not fields of the batch {sorted(self.batch)}")
        n = self.n_stages
        if len(self.acts) != n - 1 or not all(self.acts):
            raise ValueError(f"{n} stages need acts, {n - 1} boundaries of (shape, dtype) tensors; got {self.acts!r}")
        seen = set()
        for s, p in enumerate(self.placements):
            if seen & set(p.ranks):
                raise ValueError(f"pipeline rank {s}'s placement {p} shares ranks with an earlier one; they must be "
                                 "disjoint")
            seen |= set(p.ranks)

    def compute_actors(self, stage: int) -> dict:
        return compute_actors(self.schedule, len(self.placements), stage, self.micro_batches, self.virtual)

    def act_layouts(self, boundary: int, stage: int) -> list:
        """The layouts of boundary ``boundary``'s tensors on stage ``stage``'s placement."""
        return [Layout(self.stage_placement(stage), tuple(self.act_sbp), torch.Size(shape), dtype)
                for shape, dtype in self.acts[boundary]]

    def grad_slots(self, boundary: int) -> list:
        """The indices of boundary ``boundary``'s tensors that carry a gradient back (floating point)."""
        return [i for i, (_, dtype) in enumerate(self.acts[boundary]) if dtype.is_floating_point]


def _mean(losses: list):
    """The mean of a list of losses, summed in order (the same arithmetic wherever it runs)."""
    total = losses[0]
    for x in losses[1:]:
        total = total + x
    return total / len(losses)


def _mean_of_pieces(m: int, k, losses) -> float:
    """Rank 0's evaluation loss: the mean of the last stage's ``m`` per-micro-batch losses (one value when
    ``m`` is 1)."""
    return float(_mean(losses if m > 1 else [losses]))


def _piece(k, out):
    """Rank 0's copy of piece ``k``'s inference output."""
    return out


def _credit(k, stash) -> None:
    """A ``T`` actor's action: the deeper stage's forward of micro-batch ``k`` ran; its stash is not kept."""
    return None


def _without_credit(forward, k, *ins):
    """``forward`` of a stage whose last input is a credit (``forward_credits``), called without it."""
    return forward(k, *ins[:-1])


def stage_of(placements: list, rank: int) -> int | None:
    """The pipeline rank (index into ``placements``, which are disjoint) whose placement holds ``rank``, or ``None``."""
    return next((s for s, p in enumerate(placements) if rank in p), None)


class PipelineStep:
    """Runs training steps of one model split into stages, on every rank.

    Every rank of the world constructs it and calls ``step`` (building the
    plan's channels is collective); ``module`` and ``optimizer`` are this
    rank's (all of its stages' parameters), ``None`` on a rank in no stage
    (which then only joins those collectives). ``chunks``: ``{stage: the
    module its forward runs}`` for each stage on this rank, modules that
    share ``module``'s parameters (``toolkit.stages.chunk_views``); by
    default ``module`` itself, which serves a rank of one stage. A rank that
    holds both the first and the last stage (``zbv``) holds tied parameters
    as one object: nothing is exchanged for them. ``forward(module, x,
    labels)`` returns the stage output (``labels`` is ``None`` before the
    last stage) or the loss (last stage). ``batches`` gives this rank's
    local rows of micro-batch ``k`` (token ids; also the labels on the last
    stage): either a callable ``batches(step, k)``, or an object with the
    runtime data pipeline's ``read/decode/collate`` actions behind
    ``stages(device, quota, prefix)`` and a settable ``step`` (piece ``k``
    of a run is micro-batch ``k`` of step ``step``), as
    ``toolkit.data.MicroBatches``. ``step(i)`` returns the step's loss on
    the last stage's ranks and on rank 0, ``None`` elsewhere;
    ``evaluate(batches, m)`` the mean loss of ``m`` micro-batches, forward
    only, likewise; ``infer(batches, m, forward)`` the last stage's output of
    each of ``m`` pieces, forward only, on rank 0 (verification embeddings,
    say). ``loss_scale``: the last stage's backward starts from
    the loss times its scale, and each update unscales the gradients and
    skips the step (``skipped``) where any rank's overflowed. ``zero``: the
    ZeRO strategy that distributed ``module`` (``toolkit.zero.Zero``), or
    ``None``: it keeps gradients in its masters' layout (``reduce`` calls
    its ``sync_grads`` instead of boxing them), ``update`` calls its
    ``refresh`` after the optimizer step (``optimizer`` has no ZeRO hooks),
    and its stages stay on the dispatched path (its cast module keeps
    masters and compute copies apart).
    """

    def __init__(self, cfg: PipelineConfig, module, optimizer, forward: Callable, batches: Callable,
                 scheduler=None, trace_factory=None, loss_scale: "sc.LossScaler | None" = None, zero=None,
                 chunks: dict | None = None):
        cfg.check()
        self.cfg, self.module, self.optimizer, self.scheduler = cfg, module, optimizer, scheduler
        self.zero = zero
        self.loss_scale = loss_scale
        self.skipped = False  # the last step overflowed under the loss scale and did not update
        self.forward, self.batches = forward, batches
        self.trace_factory = trace_factory
        me = world_rank()
        self.pp = cfg.n_stages  # stages (model chunks) in all
        self.where = chunk_ranks(cfg.schedule, len(cfg.placements), cfg.virtual)  # stage -> its pipeline rank
        self.rank_index = stage_of(cfg.placements, me)  # this rank's pipeline rank, or None
        self.stages = [c for c in range(self.pp) if self.where[c] == self.rank_index]
        self.stage = self.stages[0] if self.stages else None  # this rank's first stage
        if self.stages and module is None:
            raise ValueError(f"rank {me} holds stages {self.stages} but got no module")
        if chunks is None and len(self.stages) > 1:
            raise ValueError(f"rank {me} holds stages {self.stages}: give each its module (chunks=)")
        self.chunks = dict(chunks) if chunks is not None else {s: module for s in self.stages}
        if sorted(self.chunks) != self.stages:
            raise ValueError(f"chunks are for stages {sorted(self.chunks)}, but rank {me} holds {self.stages}")
        self.placement = cfg.placements[self.rank_index] if self.stages else None
        # Built here, on every rank, because a placement's groups are built collectively;
        # global-norm clipping across stages meets on it.
        sc.placement(cfg.placements[0].device_type, sorted(r for p in cfg.placements for r in p.ranks))
        stage_placements = [cfg.stage_placement(c) for c in range(self.pp)]
        one_rank = stage_placements[0] is stage_placements[-1]  # zbv: tied parameters are one object here
        tied_stage = None if not self.stages else 0 if 0 in self.stages else self.pp - 1 if self.pp - 1 in self.stages \
            else self.stage
        self.tied = TiedGrads([] if one_rank else cfg.tied, module, stage_placements, tied_stage)
        # ZeRO's cast module keeps masters and compute copies apart: it stays on the dispatched path.
        one = bool(self.stages) and self.placement.size == 1 and zero is None
        self._replicas = plain_stage.replicas(cfg, self.rank_index, module, zero) if self.stages and not one else 0
        self._shards = sc.LocalParameters(module) if one else \
            sc.LocalParameters(module, partial=True) if self._replicas else None
        self._audit = bool(self._replicas)  # the next training step's first micro-batches audit the plain path
        self._audited = False  # passed: the data-parallel rank runs plain from now on
        self._auditing: set = set()  # stages whose first forward of this step is the audit
        self._verdicts: dict = {}  # stage -> its audit passed
        self._local = False  # this step runs the stages on plain tensors (decided per run, see _run)
        self._weight_passes: dict = {}  # (stage, micro-batch) -> its deferred weight gradients
        self._clipped = None  # the parameters whose gradients clipping measures (all but tied copies), once found
        # One device, one stage, no loss scale: the update needs nothing global of the gradients, so with an
        # optimizer that takes them (sc.takes_local_grads) they stay on the stage's leaves
        # (restore(hand_grads=False), _update_on_leaves). Sparse row gradients (nn.Embedding(sparse=True)) only
        # where nothing clips them: clip_local_ measures dense gradients.
        self._leaf_update = one and self.pp == 1 and loss_scale is None and not any(
            s.is_partial for p in module.parameters() if isinstance(p, GlobalTensor) for s in p.sbp)
        self._sparse_grads = self._leaf_update and any(getattr(m, "sparse", False) is True for m in module.modules())
        self._on_leaves = False  # this step's gradients stayed on the leaves
        self.step_index = 0
        self._losses = []
        self.last_trace, self.last_loss, self.grad_norm = None, None, None
        self._data_specs: dict = {}  # (stage, rank) -> the training batches' data actors, for both step plans
        self.plan = self._plan(self.batches, cfg.micro_batches, train=True)
        self._quiet_plan = None  # the step's plan without the loss's trip to rank 0 (step(report=False))
        self._eval_plans: dict = {}
        self._inferring = self._infer_batches = None  # during infer: (first-stage fields, forward), batches
        self._outputs: dict = {}  # the last run's sinks' outputs on this rank
        self._runs: dict = {}  # id(plan) -> its runs done (the first FIRST_RUNS wait under SBP_INIT_TIMEOUT)

    # -- actions ---------------------------------------------------------------------------

    def _data_actors(self, batches, s: int, r: int, mine: bool) -> tuple:
        """``(actors, name of the last)`` producing rank ``r``'s local micro-batches for stage ``s``.

        The training batches' actors are made once and shared by the step's two plans (reporting the loss
        and not): one read-ahead per data actor, whose window the next step reads on from whichever
        plan runs it."""
        prefix = f"s{s}.data@{r}"
        if hasattr(batches, "stages"):
            made = self._data_specs.get((s, r)) if batches is self.batches else None
            if made is not None:
                return made
            placement = self.cfg.stage_placement(s)
            device = placement.device() if placement.device_type == "cuda" else None
            # A role without the rank: a read-ahead's actor is a compute actor, and the ranks of a lockstep
            # gang must hold the same compute roles.
            specs = [replace(a, rank=r, role=a.name.replace(prefix, f"s{s}.data"))
                     for a in batches.stages(device=device, prefix=prefix)]
            if batches is self.batches:
                self._data_specs[(s, r)] = specs, specs[-1].name
            return specs, specs[-1].name

        def data(k):
            return batches(self.step_index, k)

        return [ActorSpec(prefix, data if mine else None, queue="data", rank=r)], prefix

    def _global_fields(self, local, names: tuple) -> dict:
        """``{field: GlobalTensor}`` of ``names`` from this rank's local micro-batch (no communication);
        the locals themselves on a rank that runs on plain tensors."""
        if not isinstance(local, dict):
            if len(self.cfg.batch) != 1:
                raise TypeError(f"the batch has fields {sorted(self.cfg.batch)}: its data must be a dict of them")
            local = {next(iter(self.cfg.batch)): local}
        if self._local:
            return {name: local[name] for name in names}
        out = {}
        for name in names:
            shape, dtype = self.cfg.batch[name]
            layout = Layout(self.placement, tuple(self.cfg.data_sbp), torch.Size(shape), dtype)
            out[name] = GlobalTensor(self._context_part(local[name], layout), layout)
        return out

    def _context_part(self, rows: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's part of its samples ``rows``: every rank of an axis splitting a dim other than the samples
        (context parallelism's sequence) reads the same samples (``toolkit.recipe.data_shard``) and keeps its
        box of that dim (a view; no communication)."""
        if not any(s.is_split and s.axis for s in layout.sbp):
            return rows
        box = local_box(layout.shape, layout.placement.shape, layout.sbp, layout.placement.coords(world_rank()))
        for dim, (start, n) in enumerate(box):
            if dim and n != rows.shape[dim]:
                rows = rows.narrow(dim, start, n)
        return rows

    def _split_inputs(self, s: int, ins: tuple) -> tuple:
        """``(x, labels)`` from stage ``s``'s F inputs: the first stage's data, else the boundary's tensors;
        then, on the last stage, its data again (the labels)."""
        last = s == self.pp - 1
        if s == 0:
            return ins[0], (ins[1] if last else None)
        return ins[:len(self.cfg.acts[s - 1])], (ins[-1] if last else None)

    def _forward(self, s: int, k, *ins):
        if s in self._auditing and k == 0:
            self._auditing.discard(s)
            st, self._verdicts[s] = plain_stage.audit(
                lambda: self._forward(s, k, *ins), lambda: self._plain_forward(s, k, *ins),
                self.placement, self._replicas, s == self.pp - 1)
            return st
        last = s == self.pp - 1
        x, labels = self._split_inputs(s, ins)
        if s == 0:
            x = self._global_fields(x, self.cfg.inputs)
        elif self._local:  # the received activations' locals, leaves of this stage's graph
            x = tuple(t._local.detach().requires_grad_(t.requires_grad) for t in x)
        if last:
            labels = self._global_fields(labels, self.cfg.labels)
        out = self.forward(self.chunks[s], x if s == 0 or len(x) > 1 else x[0], labels)
        if not last:
            out = as_tuple(out)
            if len(out) != len(self.cfg.acts[s]):
                raise ValueError(f"stage {s}'s forward returned {len(out)} tensors; its boundary has "
                                 f"{len(self.cfg.acts[s])} ({self.cfg.acts[s]})")
            if not self._local:  # one device: any act_sbp's local is the whole tensor
                out = tuple(t.to_global(sbp=self.cfg.act_sbp) for t in out)
        if last and self._local and self._replicas:  # this replica's share of the mean: the dispatched loss's partial
            out = out / self._replicas
        return Stash(x if s > 0 else None, out)

    def _plain_forward(self, s: int, k, *ins):
        """``_forward`` on plain tensors, this once (the audit's other side); the module's buffers
        (e.g. batch norm's running statistics, which a training forward updates) are left as they were."""
        buffers = [b.to_local() if isinstance(b, GlobalTensor) else b for b in self.module.buffers()]
        saved = [b.detach().clone() for b in buffers]
        self._shards.swap()
        self._local = True
        try:
            return self._forward(s, k, *ins)
        finally:
            self._local = False
            self._shards.restore()
            with torch.no_grad():
                for b, v in zip(buffers, saved):
                    b.copy_(v)

    def _eval_forward(self, s: int, k, *ins):
        with torch.no_grad():
            st = self._forward(s, k, *ins)
        if s == self.pp - 1:
            self._losses.append(st.output)
        return st

    def _eval_loss(self, k, _):
        """The evaluation's mean loss, once the last stage's ``m`` forwards ran."""
        losses, self._losses = self._losses, []
        self.last_loss = float(self._value(_mean(losses)))
        return self.last_loss

    def _eval_piece_loss(self, m: int, k, st):
        """Micro-batch ``k``'s loss (a 0-d tensor on the device) for rank 0, which averages them as they come
        (``_mean``, as ``_eval_loss`` does), so that no receive there waits for more than one micro-batch
        of the last stage's work; after the last, the mean is this rank's ``last_loss`` too."""
        loss = self._value(st.output).detach()
        self._losses[k] = loss  # the forwards may have run ahead: the list is in piece order
        if k == m - 1:
            losses, self._losses = self._losses, []
            self.last_loss = float(_mean(losses))
        return loss

    def _infer_forward(self, s: int, k, *ins):
        """Stage ``s``'s output for piece ``k`` of an ``infer`` run: ``infer``'s forward, no labels, no grad."""
        fields, infer = self._inferring
        x = self._global_fields(ins[0], fields) if s == 0 else ins
        with torch.no_grad():
            out = infer(self.chunks[s], x if s == 0 or len(x) > 1 else x[0])
        if s < self.pp - 1:
            out = as_tuple(out)
            if len(out) != len(self.cfg.acts[s]):
                raise ValueError(f"stage {s}'s inference forward returned {len(out)} tensors; its boundary has "
                                 f"{len(self.cfg.acts[s])} ({self.cfg.acts[s]})")
            out = tuple(t.to_global(sbp=self.cfg.act_sbp) for t in out)  # the boundary's layout (a tp partial summed)
        return Stash(None, out)

    @staticmethod
    def _infer_output(k, st):
        """The last stage's output of piece ``k``, whole (a global tensor's full value: its rows gathered)."""
        out = st.output
        return out.full_tensor() if isinstance(out, GlobalTensor) else out

    def _backward(self, s: int, k, stash: Stash, *grads):
        m = self.cfg.micro_batches
        if s == self.pp - 1:  # the last stage: its share of the mean loss, times fp16's loss scale if any
            loss = stash.output
            outputs, grads = [loss / m if self.loss_scale is None else loss / m * self.loss_scale.factor(loss)], None
        else:  # the boundary's floating-point tensors, seeded with the gradients the next stage sent
            slots = self.cfg.grad_slots(s)
            outputs = [stash.output[i] for i in slots]
            grads = [g._local if self._local else g for g in grads]
            kept = [j for j, t in enumerate(outputs) if t.requires_grad]  # an output cut from the graph has none
            outputs, grads = [outputs[j] for j in kept], [grads[j] for j in kept]
        inputs = None if stash.inputs is None else [stash.inputs[i] for i in self.cfg.grad_slots(s - 1)]
        weights = self.chunks[s].parameters()
        if split_backward(self.cfg.schedule, s) and outputs and self.zero is None:
            # Zero bubble: the input gradient now, for the stage before; the weights' in this stage's W actor.
            # (Not under ZeRO: its compute copies come from a cast of the masters, which the weight pass, asked
            # for the stage's parameters, cannot reach; there B computes both and W only frees the stash.)
            self._weight_passes[(s, k)] = input_first(outputs, grads, inputs, weights)
        elif self._local and inputs and k == m - 1 and self.cfg.split_last_backward and s == self.stage:
            # The stage before waits for these input gradients: the weights' gradients come in reduce (weight_pass).
            # Only on the rank's shallowest stage, whose last backward is the rank's last: a deeper stage's
            # deferred weight pass would wait behind the rest of the rank's backwards.
            self._weight_passes[(s, k)] = input_first(outputs, grads, inputs, weights)
        elif outputs:
            # All but the last micro-batch accumulate partial sums locally; the last one's backward
            # boxes the sums in buckets that overlap it (sbp_core.grad_buckets), as DDP's no_sync.
            with sc.defer_grad_boxing() if k < m - 1 else contextlib.nullcontext():
                torch.autograd.backward(outputs, grads)
        if s == self.pp - 1:
            self._losses.append(stash.output.detach())
        if inputs is None:
            return None
        # An input that no output depends on gets a zero gradient; on a plain stage the boundary's cut
        # takes a plain tensor as the whole (one-device) value.
        out = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
        return tuple(out if self._local else (g.to_global(sbp=self.cfg.act_sbp) for g in out))

    def _weight(self, s: int, k, stash, grads):
        """Stage ``s``'s weight pass of micro-batch ``k`` (zero-bubble schedules); frees its stash after."""
        weight_pass = self._weight_passes.pop((s, k), None)
        if weight_pass is not None:
            weight_pass()

    def _reduce(self, k, *outs):
        passes, self._weight_passes = self._weight_passes, {}
        for weight_pass in passes.values():  # the last backward's deferred weight gradients
            weight_pass()
        if self._local:
            sparse = self._sparse_grads
            keep = self._leaf_update and sc.takes_local_grads(self.optimizer, sparse) and not (
                sparse and self.cfg.max_grad_norm is not None)
            self._on_leaves = self._shards.restore(hand_grads=not keep, hold_sparse=keep and sparse)
        if self.zero is not None:  # ZeRO keeps gradients in its masters' layout
            self.zero.sync_grads()
        elif not (self._local and not self._replicas):  # one device: restore gave each its parameter's layout
            sc.box_grads(self.module)
        self.tied.sum_grads()
        if self.pp - 1 not in self.stages:
            return None
        losses, self._losses = self._losses, []
        return self._value(_mean(losses)).detach()  # on the device: read when logged

    def _value(self, loss):
        """A loss's whole value: a global tensor's full value; a replica's partial all-reduced; else as it is."""
        if isinstance(loss, GlobalTensor):
            return loss.full_tensor()
        if self._replicas:
            return plain_stage.loss_value(loss, self.placement)
        return loss

    def _update(self, k, loss):
        if self._on_leaves:
            return self._update_on_leaves(loss)
        norm, found = None, None
        self.skipped = False
        if self.loss_scale is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            found = self.loss_scale.found_inf(params, self.cfg.placements)
            self.loss_scale.update(found)
            if skips_on_device(self.optimizer):
                self.skipped = found  # a fused optimizer skips by the flag itself: read when logged
            else:
                self.skipped, found = bool(found.item()), None
        # An overflow is found on every rank alike (a job-wide flag): then none clips or steps. With the flag
        # left on the device every rank clips (an overflow's gradients come out inf or NaN) and the fused
        # step leaves everything as it was.
        if (found is not None or not self.skipped) and self.cfg.max_grad_norm is not None:
            # The last stage's tied copies hold the same summed gradient as the first stage's:
            # counted once in the norm, scaled like the rest.
            if self._clipped is None:
                copies = {id(p) for p in self.tied.copies()}
                self._clipped = [p for p in self.module.parameters() if id(p) not in copies]
            norm = sc.clip_grad_norm_(self._clipped, self.cfg.max_grad_norm, stages=self.cfg.placements)
            copies = self.tied.copies()
            if copies:
                coef = (self.cfg.max_grad_norm / (norm._local + 1e-6)).clamp(max=1.0)  # clip's own, no host read
                for p in copies:
                    p.grad.mul_(coef)
        # An element-wise optimizer steps the parameters' locals (no op dispatch); the state stays global.
        if found is not None:
            self.optimizer.found_inf, self.optimizer.grad_scale = found, None  # as GradScaler.step hands them
            try:
                sc.step_on_locals(self.optimizer)
            finally:
                self.optimizer.found_inf = None
        elif not self.skipped:
            sc.step_on_locals(self.optimizer)
        if self.zero is not None and (found is not None or not self.skipped):
            self.zero.refresh()  # the compute copies from the stepped masters
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tied.flush()
        self.grad_norm = None if norm is None else norm._local  # B: the value (to_local's autograd not needed)
        self.last_loss = loss
        return loss

    def _update_on_leaves(self, loss):
        """``_update`` on one device and one stage with the gradients left on the leaves: the same clip
        (``sc.clip_local_``: ``clip_grad_norm_``'s arithmetic) and optimizer step on the locals, without
        wrapping each gradient in a global tensor and taking it back out."""
        self._on_leaves, self.skipped, norm = False, False, None
        grads = self._shards.grads()
        try:
            if self.cfg.max_grad_norm is not None:
                norm = sc.clip_local_([g for g in grads.values() if g is not None], self.cfg.max_grad_norm)
            sc.step_on_locals(self.optimizer, grads=grads)
        finally:
            self._shards.drop_grads()
        if self.scheduler is not None:
            self.scheduler.step()
        self.grad_norm, self.last_loss = norm, loss
        return loss

    # -- plan ------------------------------------------------------------------------------

    def _boundaries(self, train: bool, device) -> tuple:
        """The boundary actors of every stage boundary: ``(actors, fwd_in, bwd_in)``, where ``fwd_in``/``bwd_in``
        map ``(stage, rank)`` to the assemble actors of the activations / gradients that stage receives there."""
        cfg, actors, fwd_in, bwd_in = self.cfg, [], {}, {}
        for s in range(self.pp - 1):
            src, dst = cfg.act_layouts(s, s), cfg.act_layouts(s, s + 1)
            for i in range(len(cfg.acts[s])):
                acts, asm = boundary_actors(f"s{s}.act" + (f".{i}" if i else ""),
                                            {r: f"s{s}.F@{r}" for r in cfg.stage_placement(s).ranks}, src[i], dst[i],
                                            train and dst[i].dtype.is_floating_point, device,
                                            select=lambda st, i=i: st.output[i])
                actors += acts
                for r, name in asm.items():
                    fwd_in[(s + 1, r)] = fwd_in.get((s + 1, r), ()) + (name,)
            if train:
                for j, i in enumerate(cfg.grad_slots(s)):
                    grads, gasm = boundary_actors(f"s{s + 1}.grad" + (f".{i}" if i else ""),
                                                  {r: f"s{s + 1}.B@{r}" for r in cfg.stage_placement(s + 1).ranks},
                                                  dst[i], src[i], False, device, select=lambda g, j=j: g[j])
                    actors += grads
                    for r, name in gasm.items():
                        bwd_in[(s, r)] = bwd_in.get((s, r), ()) + (name,)
        return actors, fwd_in, bwd_in

    def _plan(self, batches, m: int, train: bool, report: bool = True, infer: bool = False) -> Plan:
        """The actors of one training step (``train``) or one forward-only evaluation of ``m`` micro-batches;
        ``report``: the loss is sent to rank 0 where rank 0 is not on the last stage. ``infer``: the
        evaluation's last stage outputs each piece's result (to rank 0) instead of a loss, and reads no
        labels."""
        cfg, n, v, where = self.cfg, self.pp, self.cfg.virtual, self.where
        device = cfg.placements[0].device()
        actors, fwd_in, bwd_in = self._boundaries(train, device)
        pools, lockstep = {}, []
        for p, placement in enumerate(cfg.placements):
            if len(placement.ranks) > 1 and self._order_varies(p, train):
                lockstep.append(tuple(placement.ranks))
        for s in range(n):
            placement, first, last = cfg.stage_placement(s), s == 0, s == n - 1
            table = cfg.compute_actors(s)
            split = "W" in table
            tag = "" if v == 1 else str(s // len(cfg.placements))  # the stage's role name within its rank's gang
            for r in placement.ranks:
                f_in = () if first else fwd_in[(s, r)]
                if first or (last and not infer):
                    specs, data = self._data_actors(batches, s, r, s in self.stages and world_rank() == r)
                    actors += specs
                    f_in = (data,) + f_in if first else f_in
                    f_in += (data,) if last and not infer else ()
                forward = partial(self._infer_forward if infer else self._eval_forward if not train else
                                  self._forward, s)
                if not train:
                    actors.append(ActorSpec(f"s{s}.F@{r}", forward, inputs=f_in, quota=2, rank=r, role=f"F{tag}"))
                    if last and infer:
                        actors.append(ActorSpec(f"s{s}.out@{r}", self._infer_output, inputs=(f"s{s}.F@{r}",),
                                                quota=1, priority=2, rank=r, role="loss"))
                    elif last:
                        per_piece = report and 0 not in placement  # rank 0 averages the pieces as they come
                        actors.append(ActorSpec(f"s{s}.loss@{r}", partial(self._eval_piece_loss, m) if per_piece else
                                                self._eval_loss, inputs=(f"s{s}.F@{r}",), quota=1, priority=2,
                                                rank=r, every=1 if per_piece else m, role="loss"))
                    continue
                pool = f"stash@{r}" if v > 1 else ""  # the rank's stages share its activation budget
                if pool:
                    pools[pool] = stash_budget(cfg.schedule, len(cfg.placements), v, where[s], m)
                credits = {}
                if "T" in table:  # at most pp micro-batches ahead of the rank's deepest stage's forward
                    tq, tp, _ = table["T"]
                    turn, deeper = f"s{s}.T@{r}", f"s{credit_stage(len(cfg.placements), v, s)}.F@{r}"
                    actors.append(ActorSpec(turn, _credit, inputs=(deeper,), quota=tq, priority=tp, rank=r,
                                            role=f"T{tag}"))
                    f_in, credits = f_in + (turn,), {turn: forward_credits(cfg.schedule, len(cfg.placements), v, s)}
                    forward = partial(_without_credit, forward)
                b_in = (f"s{s}.F@{r}",) + (() if last else bwd_in.get((s, r), ()))
                (fq, fp, _), (bq, bp, _) = table["F"], table["B"]
                actors += [ActorSpec(f"s{s}.F@{r}", forward, inputs=f_in, quota=fq, priority=fp, rank=r,
                                     role=f"F{tag}", pool=pool, reserve=stash_reserve(len(cfg.placements), v, s)
                                     if pool else 0, credits=credits),
                           ActorSpec(f"s{s}.B@{r}", partial(self._backward, s), inputs=b_in, quota=bq, priority=bp,
                                     rank=r, role=f"B{tag}")]
                if split:
                    wq, wp, _ = table["W"]
                    actors.append(ActorSpec(f"s{s}.W@{r}", partial(self._weight, s),
                                            inputs=(f"s{s}.F@{r}", f"s{s}.B@{r}"), quota=wq, priority=wp, rank=r,
                                            role=f"W{tag}"))
        if train:
            actors += self._step_actors(m)
        last_leader = cfg.stage_placement(n - 1).ranks[0]
        if report and 0 not in cfg.stage_placement(n - 1):
            # The loss is known after reduce: rank 0 need not wait for the last stage's optimizer step.
            if train:
                # Read with rank 0's own reduce, so the loss is received once that ran (``runtime.executor``),
                # not waited for from the start of the step.
                own = (f"s{self._rank_first_stage(0)}.reduce@0",) if 0 in cfg.stage_placement(0) else ()
                reads = (f"s{self._rank_first_stage(n - 1)}.reduce@{last_leader}",) + own
                take = lambda k, loss, *_: loss  # noqa: E731
            elif infer:  # each piece's result as it comes
                reads, take = (f"s{n - 1}.out@{last_leader}",), _piece
            else:
                reads, take = (f"s{n - 1}.loss@{last_leader}",), partial(_mean_of_pieces, m)
            actors.append(ActorSpec("out@0" if infer else "loss@0", take, inputs=reads, queue="data", rank=0,
                                    every=1 if infer else m))
        return Plan(actors, lockstep, pools)

    def _rank_first_stage(self, stage: int) -> int:
        """The first stage on ``stage``'s pipeline rank (its reduce and update actors carry that stage's name)."""
        return self.where.index(self.where[stage])

    def _step_actors(self, m: int) -> list:
        """Each rank's ``reduce`` (after every backward, or weight pass, of its stages) and ``update``."""
        cfg, actors = self.cfg, []
        for p, placement in enumerate(cfg.placements):
            stages = [c for c in range(self.pp) if self.where[c] == p]
            s = stages[0]
            table = cfg.compute_actors(s)
            for r in placement.ranks:
                ends = tuple(f"s{c}.{'W' if 'W' in cfg.compute_actors(c) else 'B'}@{r}" for c in stages)
                (rq, rp, re), (uq, up, ue) = table["reduce"], table["update"]
                actors += [ActorSpec(f"s{s}.reduce@{r}", self._reduce, inputs=ends, quota=rq, priority=rp, rank=r,
                                     every=re, role="reduce"),
                           ActorSpec(f"s{s}.update@{r}", self._update, inputs=(f"s{s}.reduce@{r}",), quota=uq,
                                     priority=up, rank=r, every=ue, role="update")]
        return actors

    def _order_varies(self, p: int, train: bool) -> bool:
        """Can pipeline rank ``p``'s compute actors be ready two at a time (so its ranks need a lockstep gang)?

        Not when it holds one stage whose stash holds one micro-batch (the
        last stage under 1F1B, or ``pp = 1``): ``F`` needs a free stash
        register and ``B`` a full one, so they alternate, and
        ``reduce``/``update`` become ready only after the last ``B``. Nor in
        evaluation (``F`` per piece, then ``loss``). There every rank of the
        stage acts in that one order without the leader's per-action
        broadcast, which would otherwise sync the ranks at every action.
        """
        cfg = self.cfg
        if not train or cfg.virtual > 1:
            return train
        return "W" in cfg.compute_actors(p) or cfg.compute_actors(p)["F"][0] > 1

    def _run(self, plan, pieces: int, batches, train: bool, plain: bool = True):
        """One run of ``plan`` over ``pieces``; ``plain=False`` keeps every stage on global tensors."""
        if hasattr(batches, "stages"):
            batches.step = self.step_index
        trace = self.trace_factory() if self.trace_factory else None
        self.last_loss, self._weight_passes = None, {}
        self._local = plain and self._shards is not None and plain_stage.plain(self.placement, self._audited)
        self._auditing = set(self.stages) if self._audit and train and not explaining() else set()
        if self._auditing:
            self._audit, self._verdicts = False, {}
        if self._local:
            self._shards.swap()
        # A plan's first run holds one-time work that a rank's peers wait through: its channels' set-up
        # and, under torch.compile, each stage's compilation, one stage after another along the pipeline.
        # A data-parallel stage's first step runs (and audits) on global tensors, which stay eager: its
        # second, on plain tensors, is where it compiles. Counted per plan, alike on every rank.
        runs = self._runs.get(id(plan), 0)
        first = initialising() if runs < FIRST_RUNS else contextlib.nullcontext()
        try:
            with first:
                res = run(plan, pieces, timeout=self.cfg.timeout, trace=trace)
            self._runs[id(plan)] = runs + 1
        finally:  # evaluation, or a failed step: the module gets its global parameters back
            if self._shards is not None:
                self._shards.restore()
        if self._verdicts:  # the audit's step: plain from now on when every stage of the rank passed
            failed = sorted(s for s, ok in self._verdicts.items() if not ok)
            if failed and world_rank() == self.placement.ranks[0]:
                print(f"pipeline: stage(s) {failed} on ranks {list(self.placement.ranks)}: the data-parallel "
                      "audit found the forward on plain tensors off the one on global tensors beyond "
                      f"{plain_stage.AUDIT_RTOL:g} relative (something couples rows: batch statistics, a sum, "
                      "a dropout mask); they run on global tensors, exact and slower", flush=True)
            self._audited, self._verdicts = not failed, {}
        self.last_trace, self.last_stats = trace, res.stats
        if "loss@0" in res.outputs:
            return res.outputs["loss@0"][0]
        self._outputs = res.outputs
        return self.last_loss

    def evaluate(self, batches, micro_batches: int, index: int = 0):
        """Mean loss of ``micro_batches`` micro-batches of ``batches`` (step ``index``), forward only, in eval
        mode (no dropout, batch norm's running statistics; each module's mode is restored after)."""
        key = (id(batches), micro_batches)
        if key not in self._eval_plans:
            self._eval_plans[key] = self._plan(batches, micro_batches, train=False)
        saved, self.step_index = self.step_index, index
        try:
            with self._eval_mode():
                return self._run(self._eval_plans[key], micro_batches, batches, train=False)
        finally:
            self.step_index = saved

    @contextlib.contextmanager
    def _eval_mode(self):
        """The rank's modules in eval mode (no dropout, batch norm's running statistics); each module's own
        mode restored after."""
        modules = list({id(m): m for m in (self.module, *self.chunks.values()) if m is not None}.values())
        modes = [[(m, m.training) for m in root.modules()] for root in modules]
        for root in modules:
            root.train(False)
        try:
            yield
        finally:
            for m, mode in (pair for pairs in modes for pair in pairs):
                m.training = mode

    def infer(self, batches: Callable, micro_batches: int, forward: Callable, fields: tuple | None = None):
        """The last stage's output of each of ``micro_batches`` pieces, forward only, in eval mode: on rank 0
        a list of whole tensors in piece order, ``None`` elsewhere.

        ``batches(step, k)``: this rank's local rows of piece ``k`` on the first stage's ranks, laid out
        as a training micro-batch (the same fields' shapes and ``data_sbp``; the boundaries carry
        training micro-batch shapes). ``forward(module, x)``: a stage's output from its input (the
        first stage's ``x`` is ``{field: global tensor}`` of ``fields``, by default the inputs; later
        stages' the boundary tensors), no labels. Every stage runs on global tensors. Every rank calls
        it, with the same ``micro_batches``."""
        key = ("infer", micro_batches)
        if key not in self._eval_plans:
            self._eval_plans[key] = self._plan(lambda step, k: self._infer_batches(step, k), micro_batches,
                                               train=False, infer=True)
        self._inferring = (tuple(fields or self.cfg.inputs), forward)
        self._infer_batches = batches
        try:
            with self._eval_mode():
                self._run(self._eval_plans[key], micro_batches, None, train=False, plain=False)
        finally:
            self._inferring = self._infer_batches = None
        outputs, self._outputs = self._outputs, {}
        return outputs.get("out@0", outputs.get(f"s{self.pp - 1}.out@0")) if world_rank() == 0 else None

    def step(self, index: int | None = None, report: bool = True):
        """One optimizer step over ``micro_batches`` micro-batches; the mean loss where known, else ``None``.

        The loss (and ``grad_norm``) is a 0-d tensor on the stage's device: nothing in a step waits
        for the device, so reading it (``float``) is the caller's synchronisation, when it wants one.
        ``report=False``: the loss stays on the last stage's ranks (rank 0 gets ``None`` unless it is one
        of them), sparing rank 0 a message that waits for the last stage's reduce. Every rank must pass
        the same ``report`` (the two plans differ in a channel)."""
        if index is not None:
            self.step_index = index
        plan = self.plan
        if not report:
            if self._quiet_plan is None:
                self._quiet_plan = self._plan(self.batches, self.cfg.micro_batches, train=True, report=False)
            plan = self._quiet_plan
        loss = self._run(plan, self.cfg.micro_batches, self.batches, train=True)
        self.step_index += 1
        return loss
