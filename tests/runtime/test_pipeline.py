"""Pipelined GPT-2 equals one device; 1F1B and GPipe follow from the stash quota; bad input and dead ranks."""
from __future__ import annotations

import os
import time

import pytest
import torch

from runtime.pipeline import PipelineConfig
from runtime.pipeline.timeline import bubble, peak_held, theory
from benchkit.pipeline_parity import LAYOUTS, MICRO, TOLERANCE, compare, run_pipeline, schedule_report
from toolkit.rank_pool import get_pool
from toolkit.stages import stage_ranges

BATCH = {"ids": ((2, 4), torch.int64)}
ACT = (((2, 4, 8), torch.float32),)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device_training_on_its_own(name, dtype):
    res = get_pool(8).run(run_pipeline, name, dtype=dtype)
    errs = compare(res, dtype=dtype)
    assert all(e <= bar for e, bar in zip(errs, TOLERANCE[dtype])), (errs, TOLERANCE[dtype])


# pp2: one-device stages, run on plain tensors; a bound of 1e3 is above the norm: nothing is scaled, the
# last stage's tied copies included.
@pytest.mark.parametrize("name, max_norm", [("tp2_pp2", 0.05), ("pp2", 0.05), ("pp2", 1e3)])
def test_global_norm_clipping_spans_every_stage(name, max_norm):
    res = get_pool(8).run(run_pipeline, name, 2, "1f1b", MICRO, max_norm, dtype="float64")
    errs = compare(res, 2, max_grad_norm=max_norm, dtype="float64")
    assert all(e <= bar for e, bar in zip(errs, TOLERANCE["float64"])), errs


def _local_and_dispatched():
    """pp2: evaluation on plain tensors, then under ``sc.explain`` (dispatched), then a training step."""
    import sbp_core as sc
    from benchkit.pipeline_parity import build

    step, _ = build(1, 1, 2)
    local = step.evaluate(step.batches, MICRO)
    ran_local = step._local
    with sc.explain() as ops:
        dispatched = step.evaluate(step.batches, MICRO)
    explained_local = step._local
    step.step(0)
    return step.stage, local, dispatched, ran_local, explained_local, len(ops), step._local


def test_one_device_stages_run_on_plain_tensors_unless_explained():
    res = get_pool(8).run(_local_and_dispatched)
    for stage, local, dispatched, ran_local, explained_local, n_ops, trained_local in res:
        assert local == dispatched  # the same ops on the same locals: bit for bit
        if stage is None:
            continue
        assert ran_local and trained_local and not explained_local
        assert n_ops > 0  # explain lists the stage's ops
    assert res[0][1] is not None and res[1][1] is not None


def _quiet_steps():
    """tp2_pp2 (rank 0 on the first stage only): steps reporting and not, against steps that all report."""
    from benchkit.pipeline_parity import build

    losses = {}
    for way, reports in (("quiet", (True, False, False, True)), ("loud", (True,) * 4)):
        step, module = build(1, 2, 2, max_grad_norm=0.05)
        got = [step.step(i, report=r) for i, r in enumerate(reports)]
        losses[way] = [None if x is None else float(x) for x in got]
        params = {n: q.full_tensor() for n, q in module.named_parameters()} if module is not None else None
        losses[way + "_params"] = params
    return losses


def test_a_step_that_does_not_report_keeps_the_loss_on_the_last_stage():
    res = get_pool(8).run(_quiet_steps)
    first, last = res[0], res[2]  # rank 0: the first stage's; rank 2: the last stage's leader
    assert first["quiet"][1] is None and first["quiet"][2] is None  # not sent to rank 0
    assert None not in first["loud"] and None not in last["quiet"]
    assert first["quiet"][0] == first["loud"][0] and first["quiet"][3] == first["loud"][3]
    assert last["quiet"] == last["loud"] == first["loud"]  # the same steps: bit for bit, reported or not
    for r in res[:4]:
        for n, q in r["quiet_params"].items():
            assert torch.equal(q, r["loud_params"][n]), n


def _evaluate_between_steps():
    """pp2: two steps with an evaluation of step 5's batches between them, and two steps without one."""
    from benchkit.pipeline_parity import build

    out = []
    for evaluate in (True, False):
        step, _ = build(1, 1, 2)
        first = step.step()
        if evaluate:
            step.evaluate(step.batches, MICRO, index=5)
        out.append([first, step.step(), step.step_index])
    return [[None if x is None else float(x) if not isinstance(x, int) else x for x in o] for o in out]


def test_an_evaluation_leaves_the_step_index_where_training_was():
    for with_eval, without in get_pool(8).run(_evaluate_between_steps)[:2]:
        assert with_eval == without and with_eval[2] == 2, (with_eval, without)


def _evaluations_with_dropout():
    """pp2 with dropout 0.5, virtual stages (the chunks are views of the rank's module): two evaluations of
    one batch, the modes of the rank's modules and views after them, and a training step's loss."""
    import dataclasses

    from benchkit.pipeline_parity import CFG, build

    step, module = build(1, 1, 2, cfg=dataclasses.replace(CFG, embd_pdrop=0.5, resid_pdrop=0.5, attn_pdrop=0.5),
                         virtual=2)
    first = step.evaluate(step.batches, MICRO, index=1)
    second = step.evaluate(step.batches, MICRO, index=1)
    roots = [module, *step.chunks.values()] if module is not None else []
    training = all(m.training for root in roots for m in root.modules())
    return (None if first is None else float(first), None if second is None else float(second), training,
            float(step.step(0) or 0.0))


def test_an_evaluation_runs_without_dropout_and_leaves_training_on():
    for first, second, training, loss in get_pool(8).run(_evaluations_with_dropout)[:2]:
        assert first is not None and first == second  # dropout would draw other masks the second time
        assert training and loss > 0


def _audit_of_a_compiled_plain_forward():
    """The data-parallel audit of a stage whose plain forward is compiled: (its verdict, whether that forward
    ran inside a compiled frame, call by call)."""
    import sbp_core as sc
    from runtime.pipeline import plain_stage
    from runtime.pipeline.step import Stash
    from sbp_core import sbp

    placement = sc.placement("cpu", [0, 1])
    x = sc.distribute(torch.arange(8.0).reshape(4, 2), placement, (sbp.split(0),))
    seen = []

    def forward(t):
        seen.append(torch.compiler.is_compiling())
        return t * 2

    compiled = torch.compile(forward, backend="eager")
    _, ok = plain_stage.audit(lambda: Stash(None, (x * 2,)), lambda: Stash(None, (compiled(x.to_local()),)),
                              placement, 2, last=False)
    return ok, seen


def test_the_audit_runs_a_compiled_stages_plain_forward_eager():
    """The audit tells whether rows couple, not how a compiler rounds: a compiled forward (``trainer.compile``,
    whose bf16 kernels round otherwise than eager ones) runs eager on its plain side, as on the global one."""
    assert get_pool(2).run(_audit_of_a_compiled_plain_forward) == [(True, [False])] * 2


def _one_device_one_stage():
    """pp1 on rank 0 (the other ranks hold no stage): three clipped steps with the global clip forbidden."""
    from unittest import mock

    import sbp_core as sc
    from benchkit.pipeline_parity import build

    step, module = build(1, 1, 1, max_grad_norm=0.05, dtype=torch.float64)
    losses, norms, no_grads = [], [], True
    with mock.patch.object(sc, "clip_grad_norm_", side_effect=AssertionError("the global-tensor clip ran")):
        for i in range(3):
            loss = step.step(i)
            if module is not None:
                losses.append(float(loss))
                norms.append(float(step.grad_norm))
                no_grads = no_grads and all(p.grad is None for p in module.parameters())
    params = {n: q.full_tensor() for n, q in module.named_parameters()} if module is not None else None
    return losses, norms, no_grads, params


def test_one_device_one_stage_updates_from_the_leaves_as_one_device_training():
    """One device, one stage: the gradients stay on the stage's leaves and are clipped and stepped there (the
    global clip never runs, no parameter gets a global gradient); the losses, the clip's norm and the
    parameters after three clipped AdamW steps are those of a model that trains on its own (float64, the
    pipelines' float64 bars)."""
    from benchkit.pipeline_parity import ADAMW, CFG, global_batch
    from recipes.gpt2.model import GPT2LMHeadModel

    losses, norms, no_grads, params = get_pool(8).run(_one_device_one_stage)[0]
    assert no_grads and len(losses) == 3
    bar = TOLERANCE["float64"][0]
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(CFG).to(torch.float64)
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for i, (loss, norm) in enumerate(zip(losses, norms)):
        ids = global_batch(i)
        want = ref(ids, ids)[1]
        want.backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        assert abs(loss - want.item()) <= bar * abs(want.item()) and abs(norm - want_norm.item()) <= bar * norm
    for n, q in ref.named_parameters():
        assert (params[n] - q.detach()).abs().max() <= bar * q.detach().abs().max(), n


def _data_parallel_plain(dropout: float, rows_weigh_equally: bool):
    """dp2_pp2 for two steps: per rank ``(stage, replicas, audited, ran the second step plain, losses)``."""
    from dataclasses import replace

    from benchkit.pipeline_parity import CFG, build

    cfg = replace(CFG, embd_pdrop=dropout, resid_pdrop=dropout)
    step, _ = build(2, 1, 2, cfg=cfg, rows_weigh_equally=rows_weigh_equally)
    losses = [step.step(i) for i in range(2)]
    return step.stage, step._replicas, step._audited, step._local, losses


@pytest.mark.parametrize("dropout,rows_weigh_equally,plain", [
    (0.0, True, True),  # parity of this path: test_layout_matches_one_device[dp2_pp2]
    (0.1, True, False),  # the dispatched mask is drawn for the global shape: the audit sees it
    (0.0, False, False),  # a loss whose rows may weigh unequally: never plain
])
def test_data_parallel_stages_run_plain_only_when_the_audit_passes(dropout, rows_weigh_equally, plain):
    res = get_pool(8).run(_data_parallel_plain, dropout, rows_weigh_equally)
    for stage, replicas, audited, ran_plain, losses in res:
        if stage is None:
            continue
        assert replicas == (2 if rows_weigh_equally else 0)
        assert audited == plain and ran_plain == plain, (stage, audited, ran_plain)
    last = [losses for stage, _, _, _, losses in res if stage == 1]
    assert len(last) == 2 and all(x is not None for losses in last for x in losses)


def test_data_parallel_stages_with_a_micro_batch_dp_cannot_halve_match_one_device():
    """16 rows in 16 micro-batches: one row each, which dp2 cannot split evenly (plain replicas would weigh
    one row and none alike): the stages stay global and train as one device does."""
    res = get_pool(8).run(run_pipeline, "dp2_pp2", 2, "1f1b", 16, None, None, "float64")
    errs = compare(res, 2, dtype="float64")
    assert all(e <= bar for e, bar in zip(errs, TOLERANCE["float64"])), errs


def test_the_audit_leaves_the_dropout_stream_where_the_dispatched_run_left_it():
    """dp2_pp2 with dropout: the audited run (its plain forward is compared, then rejected) and the run never
    audited draw the same masks after the audit, so their losses agree bit for bit."""
    pool = get_pool(8)
    audited = [losses for stage, *_, losses in pool.run(_data_parallel_plain, 0.1, True) if stage == 1]
    never = [losses for stage, *_, losses in pool.run(_data_parallel_plain, 0.1, False) if stage == 1]
    assert audited and [[float(x) for x in a] for a in audited] == [[float(x) for x in n] for n in never]


def _audited_then_explained():
    import sbp_core as sc
    from benchkit.pipeline_parity import build

    step, _ = build(2, 1, 2)
    for i in range(2):
        step.step(i)
    audited, plain = step._audited, step._local
    with sc.explain() as ops:
        step.evaluate(step.batches, MICRO)
    return step.stage, audited, plain, step._local, len(ops)


def test_audited_data_parallel_stages_run_dispatched_under_explain():
    """dp2_pp2 after its audit runs plain; under ``sc.explain`` its stages run their ops as global tensors,
    so explain lists them."""
    for stage, audited, plain, explained_plain, n_ops in get_pool(8).run(_audited_then_explained):
        if stage is not None:
            assert audited and plain and not explained_plain and n_ops > 0, (audited, plain, explained_plain, n_ops)


class _Tokens:
    """A sample source (``toolkit.data.MicroBatches``) over a fixed token table: sample ``i`` is row ``i``."""

    def __init__(self):
        from benchkit.pipeline_parity import CFG, SEQ

        self.table = torch.randint(0, CFG.vocab_size, (64, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self):
        return len(self.table)

    def read(self, rows):
        return self.table[rows]

    def decode(self, raw):
        return raw

    def collate(self, samples):
        return {"input_ids": samples}


def _dp2_pp2_reading(read_ahead: int):
    """dp2_pp2, two steps, a thread per queue (as on GPUs), batches read ``read_ahead`` pieces ahead (0: in the
    step): per rank ``(stage, {data actor: queue}, the plan's gangs, losses)``."""
    from unittest import mock

    from benchkit.pipeline_parity import BATCH, MICRO, build
    from toolkit.data import GlobalBatchSampler, MicroBatches

    def data(d):
        return MicroBatches(_Tokens(), GlobalBatchSampler(64, BATCH, seed=1), accum=MICRO, n_shards=2, shard=d,
                            read_ahead=read_ahead)

    with mock.patch("runtime.executor.host_only", return_value=False):
        step, _ = build(2, 1, 2, data=data)
        losses = [step.step(i) for i in range(2)]
    me = torch.distributed.get_rank()
    queues = {a.name: a.queue for a in step.plan.actors if ".data@" in a.name and a.rank == me}
    return step.stage, queues, step.plan.lockstep, [None if x is None else float(x) for x in losses]


def test_a_read_ahead_joins_a_lockstep_gang_and_trains_as_reading_in_the_step():
    """The read-ahead's data actor is a compute actor: in dp2_pp2 the first stage's two ranks are a lockstep
    gang, which picks by role, and the step trains as it does with the data loaded in the step."""
    pool = get_pool(8)
    ahead, inline = pool.run(_dp2_pp2_reading, 2), pool.run(_dp2_pp2_reading, 0)
    assert ahead[0][2] == [(0, 1)]  # the first stage's ranks, ganged
    for (stage, queues, _, losses), (_, inline_queues, _, inline_losses) in zip(ahead, inline):
        if stage is None:
            continue
        assert set(queues.values()) == {"compute"} and set(inline_queues.values()) == {"data"}
        assert [x is None for x in losses] == [x is None for x in inline_losses]
        for a, b in zip(losses, inline_losses):
            assert a is None or abs(a - b) <= 1e-6 * abs(b), (losses, inline_losses)
    assert any(x is not None for *_, losses in ahead for x in losses)


class _CountedTokens(_Tokens):
    """``_Tokens`` that counts the micro-batches read."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def read(self, rows):
        self.reads += 1
        return super().read(rows)


def _reads_over_reported_and_quiet_steps(reports):
    """pp2, batches read 2 pieces ahead, steps reporting their loss or not (two plans): ``(micro-batches read,
    losses)`` of this rank's data actor."""
    from benchkit.pipeline_parity import BATCH, MICRO, build
    from toolkit.data import GlobalBatchSampler, MicroBatches

    sources = []

    def data(d):
        sources.append(_CountedTokens())
        return MicroBatches(sources[-1], GlobalBatchSampler(64, BATCH, seed=1), accum=MICRO, read_ahead=2)

    step, _ = build(1, 1, 2, data=data)
    losses = [step.step(i, report=r) for i, r in enumerate(reports)]
    step.batches.settle()
    return sum(s.reads for s in sources), [None if x is None else float(x) for x in losses]


def test_steps_that_report_and_steps_that_do_not_read_each_micro_batch_once():
    """The step's two plans (with the loss's trip to rank 0 and without) share each data actor's read-ahead:
    switching plans reads on from the same window, where a window per plan would load again what the other
    plan's had loaded, and load pieces that no step reads."""
    from benchkit.pipeline_parity import MICRO

    reports = (True, False, False, True, False, True)
    pool = get_pool(2)
    mixed, loud = pool.run(_reads_over_reported_and_quiet_steps, reports), pool.run(
        _reads_over_reported_and_quiet_steps, (True,) * len(reports))
    for (reads, losses), (_, loud_losses) in zip(mixed, loud):
        assert reads <= MICRO * len(reports) + 2, reads  # each piece once, and one window past the last
        assert losses[-1] == loud_losses[-1]  # the same steps, whichever plan ran them


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_held_micro_batches_follow_the_stash_quota(schedule):
    res = get_pool(8).run(run_pipeline, "pp4", 1, schedule)
    held, bub = schedule_report(res, 4, MICRO)
    if schedule == "1f1b":
        # Stage s holds at most pp - s micro-batches, and the quota is reached: that is 1F1B's warm-up.
        assert held == {0: 4, 1: 3, 2: 2, 3: 1}, held
    else:
        # GPipe's quota is every micro-batch: stage 0 holds more than 1F1B's quota (pp) lets it. Not
        # necessarily all MICRO: backward outranks forward, so a gradient back from stage 1 before
        # the last forward's data (a loaded machine) is taken first (7 of 8 seen under suite + CI).
        assert 4 < held[0] <= MICRO and all(h <= MICRO for h in held.values()), held
    assert set(bub) == {0, 1, 2, 3} and all(0.0 <= b < 1.0 for b in bub.values())


def test_timeline_counts_held_micro_batches_and_idle_time():
    ev = [("s0.F@0", 0.0, 1.0, 0), ("s0.F@0", 1.0, 2.0, 1), ("s0.B@0", 3.0, 4.0, 0), ("s0.B@0", 4.0, 5.0, 1),
          ("s1.F@1", 1.0, 2.0, 0), ("s1.B@1", 2.0, 3.0, 0), ("s1.F@1", 3.0, 4.0, 1), ("s1.B@1", 4.0, 5.0, 1)]
    assert peak_held([e for e in ev if "@0" in e[0]]) == 2
    assert peak_held([e for e in ev if "@1" in e[0]]) == 1
    b = bubble({0: [e for e in ev if "@0" in e[0]], 1: [e for e in ev if "@1" in e[0]]})
    assert b == {0: pytest.approx(0.2), 1: pytest.approx(0.2)}
    assert theory(2, 4) == pytest.approx(0.2)
    assert theory(4, 8, v=2) == pytest.approx(3 / 19)  # interleaving: (pp - 1) / (v m + pp - 1)


def test_a_weight_pass_is_busy_time_and_holds_its_micro_batch_until_it_ends():
    """Zero-bubble: the weight pass W (after B) is compute, and the activations stay held until it ends."""
    ev = [("s0.F@0", 0.0, 1.0, 0), ("s0.F@0", 1.0, 2.0, 1), ("s0.B@0", 2.0, 3.0, 0), ("s0.W@0", 3.0, 4.0, 0),
          ("s0.B@0", 4.0, 5.0, 1), ("s0.W@0", 6.0, 7.0, 1), ("s0.F@0", 5.0, 6.0, 2)]
    assert peak_held(ev) == 2  # micro-batch 2 starts after 0's W ended; 1's stays held until 7.0
    assert bubble({0: ev, 1: [("s1.F@1", 0.0, 7.0, 0)]}) == {0: pytest.approx(0.0), 1: pytest.approx(0.0)}


def test_bad_pipeline_input_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        PipelineConfig([object()] * 4, 2, BATCH, [ACT] * 3, (), (), ("ids",), ("ids",)).check()
    with pytest.raises(ValueError, match="pp_schedule 'zbx' is not one of"):
        PipelineConfig([], 2, BATCH, [], (), (), ("ids",), ("ids",), schedule="zbx").check()
    with pytest.raises(ValueError, match="zbv places two chunks per rank in a V: it needs pp_virtual=2, got 1"):
        PipelineConfig([object()] * 2, 2, BATCH, [ACT], (), (), ("ids",), ("ids",), schedule="zbv").check()
    with pytest.raises(ValueError, match="4 stages need acts, 3 boundaries"):
        PipelineConfig([object()] * 2, 2, BATCH, [ACT], (), (), ("ids",), ("ids",), virtual=2).check()
    with pytest.raises(ValueError, match=r"inputs/labels \['labels'\] are not fields of the batch \['ids'\]"):
        PipelineConfig([object()] * 2, 2, BATCH, [ACT], (), (), ("ids",), ("labels",)).check()
    with pytest.raises(ValueError, match="cannot be split uniformly into pp=3"):
        stage_ranges(4, 3)
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        stage_ranges(4, 2, [4, 0])
    with pytest.raises(ValueError, match="sum to 3"):
        stage_ranges(4, 2, [1, 2])
    assert [list(r) for r in stage_ranges(5, 2, [2, 3])] == [[0, 1], [2, 3, 4]]


def _joined(rank, world, port, timeout: float, init_timeout: float):
    """Join a fresh gloo world whose groups wait ``timeout`` s (``init_timeout`` s in a plan's first runs);
    returns ``benchkit.pipeline_parity``, which builds the pipelines."""
    import torch._dynamo  # noqa: F401  (as toolkit.launcher's ranks: imported before the timed waits, not in them)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from sbp_core import process_groups
    from benchkit import pipeline_parity as vp

    process_groups.set_timeout(timeout)
    process_groups.set_init_timeout(init_timeout)
    return vp


def _dies_mid_step(rank, world, port, out_dir):
    vp = _joined(rank, world, port, 10.0, 10.0)  # step 0 is the plan's first run
    start = time.monotonic()
    try:
        step, module = vp.build(1, 2, 2)
        if rank == 3:
            forward, calls = step.forward, []

            # Dies at its second forward of step 0, mid-step: an exit in a
            # later step would leave rank 0's wait for step 0's loss to time
            # out first whenever step 0 alone takes longer than the timeout
            # (a loaded machine), and rank 3 would then end with that error.
            def die(m, x, labels):
                calls.append(1)
                if len(calls) == 2:
                    os._exit(17)
                return forward(m, x, labels)

            step.forward = die
        for i in range(3):
            step.step(i)
        msg = "finished"
    except Exception as exc:  # noqa: BLE001  (what the rank ended with is the result)
        msg = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{msg}")
    os._exit(0)


def _spawn(target, world: int, out_dir) -> list:
    """``target(rank, world, port, out_dir)`` in ``world`` fresh processes (groups with this test's timeout),
    forked as the launcher's ranks are; the processes, joined (killed after 120 s)."""
    import socket

    from toolkit.child import host_rank_context

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = host_rank_context()
    procs = [ctx.Process(target=target, args=(r, world, port, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    return procs


def test_a_rank_that_dies_mid_step_ends_every_rank_with_an_error(tmp_path):
    procs = _spawn(_dies_mid_step, 4, tmp_path)
    assert all(p.exitcode is not None and p.exitcode >= 0 for p in procs), "a rank hung after its peer died"
    assert procs[3].exitcode == 17
    for r in range(3):
        secs, msg = (tmp_path / f"rank{r}").read_text().split("\n", 1)
        assert msg != "finished" and ("Failure" in msg or "Error" in msg), (r, msg)


SLOW_FORWARD_S, TIMEOUT_S = 0.4, 2.0  # MICRO slow forwards take longer than the timeout, one does not


def _runs_behind_a_slow_last_stage(rank, world, port, out_dir):
    """pp2: a training step and an evaluation whose last stage's forwards are slow; what each rank got."""
    vp = _joined(rank, world, port, TIMEOUT_S, TIMEOUT_S)  # a plan's first runs: the same bound
    try:
        step, _ = vp.build(1, 1, 2)
        step.step(0)  # decisions, first-call costs: out of the slow runs' margin
        if rank == 1:
            forward = step.forward

            def slow(m, x, labels):
                time.sleep(SLOW_FORWARD_S)
                return forward(m, x, labels)

            step.forward = slow
        trained = float(step.step(1))
        loss = step.evaluate(step.batches, MICRO)  # rank 0's; the last stage keeps its own as last_loss
        msg = repr((trained, loss if rank == 0 else step.last_loss))
    except Exception as exc:  # noqa: BLE001  (what the rank ended with is the result)
        msg = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(msg)
    os._exit(0)


def test_no_receive_on_rank_0_waits_for_a_whole_step_or_evaluation(tmp_path):
    """pp2, rank 0 on the first stage, the groups' timeout 2 s and the last stage's forwards 0.4 s each (8
    micro-batches): a training step and an evaluation both take longer than the timeout, and end with their
    losses, equal on both ranks, because rank 0 receives the step's loss once its own reduce ran and the
    evaluation's micro-batch by micro-batch."""
    assert MICRO * SLOW_FORWARD_S > TIMEOUT_S > 2 * SLOW_FORWARD_S
    procs = _spawn(_runs_behind_a_slow_last_stage, 2, tmp_path)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert got[0] == got[1] and min(eval(got[0])) > 0, got


LATE_S = 3.5  # the last stage's one slow forward: over SBP_TIMEOUT (2 s), under SBP_INIT_TIMEOUT


def _slow_first_and_third_step(rank, world, port, out_dir):
    """pp2, timeout 2 s, init timeout 60 s: the last stage's first forward of steps 0 and 2 takes ``LATE_S``
    (a stage compiling its forward; a hang later). What each rank got from steps 0, 1, 2 (the plan's first
    two runs wait under the init timeout, ``runtime.pipeline.step.FIRST_RUNS``)."""
    vp = _joined(rank, world, port, 2.0, 60.0)
    from sbp_core import process_groups

    got = []
    try:
        with process_groups.initialising():  # built as a Job is
            step, _ = vp.build(1, 1, 2)
        if rank == 1:
            forward, calls = step.forward, []

            def late(m, x, labels):
                calls.append(1)
                if len(calls) in (1, 2 * MICRO + 1):
                    time.sleep(LATE_S)
                return forward(m, x, labels)

            step.forward = late
        for i in range(3):
            got.append(f"{float(step.step(i)):.6f}")
    except Exception as exc:  # noqa: BLE001  (what the rank ended with is the result)
        got.append(f"{type(exc).__name__}: {exc}")
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("\n".join(got))
    os._exit(0)


def test_a_plans_first_runs_wait_under_the_init_timeout_and_later_runs_under_the_timeout(tmp_path):
    """A first step (compilation, set-up) may keep a peer waiting up to ``SBP_INIT_TIMEOUT``; the same wait in a
    later step ends every rank with an error after ``SBP_TIMEOUT``."""
    from runtime.pipeline.step import FIRST_RUNS

    assert FIRST_RUNS == 2  # step 2 is the plan's first run under SBP_TIMEOUT
    procs = _spawn(_slow_first_and_third_step, 2, tmp_path)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(2):
        got = (tmp_path / f"rank{r}").read_text().split("\n")
        assert len(got) == 3 and float(got[0]) > 0 and float(got[1]) > 0, (r, got)
        assert "Error" in got[2] or "Failure" in got[2], (r, got)
    assert "timeout 2 s" in (tmp_path / "rank0").read_text(), (tmp_path / "rank0").read_text()
