"""ReadAhead: the batches a step reads, loaded ahead on worker threads, are ``MicroBatches.load``'s."""
from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
import threading
from unittest import mock

import pytest
import torch

from runtime.executor import run
from runtime.plan import ActorSpec, Plan
from toolkit.data import GlobalBatchSampler, MicroBatches, ReadAhead

N = 64


class Rows:
    """Sample ``i`` is ``[i, -i]``; counts the reads running at once, and can fail or wait in ``decode``."""

    def __init__(self, fail_at=None, barrier=None):
        self.fail_at, self.barrier = fail_at, barrier
        self.reading = self.most_reading = self.reads = 0
        self.lock = threading.Lock()

    def __len__(self):
        return N

    def __getstate__(self):
        return {**self.__dict__, "lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, lock=threading.Lock())

    def read(self, rows):
        with self.lock:
            self.reading += 1
            self.reads += 1
            self.most_reading = max(self.most_reading, self.reading)
        threading.Event().wait(0.002)  # a read long enough for a second one to overlap it, if one could
        with self.lock:
            self.reading -= 1
        return torch.as_tensor(rows, dtype=torch.int64).clone()

    def decode(self, rows):
        if self.fail_at is not None and self.fail_at in rows.tolist():
            raise RuntimeError(f"row {self.fail_at} is corrupt")
        if self.barrier is not None:
            self.barrier.wait()  # passes only when two decodes run at once
        return torch.stack([rows, -rows], 1)

    def collate(self, samples):
        return {"x": samples}


def _batches(source, accum=2, read_ahead=None):
    return MicroBatches(source, GlobalBatchSampler(N, 8, seed=3), accum=accum, n_shards=2, shard=1,
                        read_ahead=read_ahead)


def _want(batches, q):
    return batches.load(q // batches.accum, q % batches.accum)["x"]


@pytest.mark.parametrize("order", [list(range(12)), [5, 6, 7, 0, 1, 2, 30, 3, 4, 4, 11]])
def test_any_order_of_pieces_gets_the_loaded_batches(order):
    batches = _batches(Rows())
    ahead = ReadAhead(batches, pieces=3, workers=2)
    try:
        for q in order:
            assert torch.equal(ahead.get(q)["x"], _want(batches, q))
            assert len(ahead._loading) <= 3  # the window: q + 1 .. q + 3 still loading or loaded
    finally:
        ahead.close()


def test_reads_one_at_a_time_and_decodes_at_once():
    source = Rows(barrier=threading.Barrier(2, timeout=20))
    ahead = ReadAhead(_batches(source), pieces=3, workers=3)
    try:
        ahead.get(0)  # each decode passes the barrier only with another one: only if decoded at once
        ahead.get(2)
    finally:
        ahead.close()
    # Reads take the lock in any order: 0 and 2 may pass the barrier together while 1 still waits for its
    # partner's read, so two reads are all that the two gets guarantee.
    assert source.most_reading == 1 and source.reads >= 2


def test_a_load_fails_at_the_get_of_its_piece():
    batches = _batches(Rows())
    bad = int(batches.rows(3)[0])  # piece 3's first row
    ahead = ReadAhead(_batches(Rows(fail_at=bad)), pieces=2, workers=2)
    try:
        for q in range(3):  # piece 3 is loading (and failing) meanwhile
            assert torch.equal(ahead.get(q)["x"], _want(batches, q))
        with pytest.raises(RuntimeError, match=f"row {bad} is corrupt"):
            ahead.get(3)
    finally:
        ahead.close()


class _GatedAfterFirst(Rows):
    """``Rows`` whose pieces after piece 0 (of ``_batches``' sampler) decode only once ``gate`` is set."""

    def __init__(self, gate, fail_at=None):
        super().__init__(fail_at=fail_at)
        self.gate, self.first = gate, _batches(Rows()).rows(0).tolist()

    def decode(self, rows):
        if rows.tolist() != self.first:
            self.gate.wait(20)
        return super().decode(rows)


def test_settle_returns_once_every_piece_in_the_window_is_loaded_or_failed():
    """What a bench waits for before it times another loop: nothing of the read-ahead runs after it."""
    plain = _batches(Rows())
    bad = int(plain.rows(2)[0])
    gate = threading.Event()
    ahead = ReadAhead(_batches(_GatedAfterFirst(gate, fail_at=bad)), pieces=3, workers=2)
    try:
        assert torch.equal(ahead.get(0)["x"], _want(plain, 0))
        loading = list(ahead._loading.values())
        assert len(loading) == 3 and not any(f.done() for f in loading)
        threading.Timer(0.2, gate.set).start()
        ahead.settle()
        assert all(f.done() for f in loading)
        assert torch.equal(ahead.get(1)["x"], _want(plain, 1))
        with pytest.raises(RuntimeError, match=f"row {bad} is corrupt"):  # a failed load still fails its get
            ahead.get(2)
    finally:
        gate.set()
        ahead.close()


def test_micro_batches_settle_and_close_the_read_aheads_their_stages_made():
    gate = threading.Event()
    batches = _batches(_GatedAfterFirst(gate), read_ahead=2)
    ahead = batches.stages()[0].action.ahead
    try:
        assert torch.equal(ahead.get(0)["x"], _want(_batches(Rows()), 0))
        loading = list(ahead._loading.values())
        assert len(loading) == 2 and not any(f.done() for f in loading)
        threading.Timer(0.2, gate.set).start()
        batches.for_step(5).settle()  # a step's copy knows the same read-aheads
        assert all(f.done() for f in loading)
    finally:
        gate.set()
        ahead.close()
    made = _batches(Rows(), read_ahead=2)
    other = made.stages()[0].action.ahead
    assert len(made._aheads) == 1 and len(pickle.loads(pickle.dumps(made))._aheads) == 0  # not another process's
    other.get(0)
    assert other._pool is not None and other._loading
    made.for_step(3).close()  # a job's end: its read-aheads load nothing more
    assert other._pool is None and not other._loading


def test_the_actor_pipeline_reads_ahead_what_load_reads():
    accum, steps = 2, 3
    source = Rows()
    batches = _batches(source, accum, read_ahead=3)
    batches.step = 4
    stages = batches.stages(quota=2)
    assert [s.name for s in stages] == ["data.read"]  # whole batches: no decode or collate actors
    plan = Plan(stages + [ActorSpec("step", lambda k, b: b["x"], inputs=(stages[-1].name,))])
    seen = run(plan, accum * steps, timeout=30).outputs["step"]
    plain = _batches(Rows(), accum)
    want = [plain.load(4 + k // accum, k % accum)["x"] for k in range(accum * steps)]
    assert all(torch.equal(a, b) for a, b in zip(seen, want)) and len(seen) == len(want)
    batches.step = 7  # the next run reads on from where this one's window is
    seen = run(plan, accum, timeout=30).outputs["step"]
    assert all(torch.equal(seen[k], plain.load(7, k)["x"]) for k in range(accum))
    assert source.reads <= accum * (steps + 1) + 3 + 3  # each piece once, plus one window at most per run
    stages[0].action.ahead.close()


def test_read_ahead_is_on_only_for_an_accelerator_unless_asked():
    assert [s.name for s in _batches(Rows()).stages()] == ["data.read", "data.decode", "data.collate"]
    assert [s.name for s in _batches(Rows(), read_ahead=0).stages()] == ["data.read", "data.decode", "data.collate"]
    batches = _batches(Rows(), read_ahead=2)
    first, second = batches.stages(), batches.stages()
    assert [s.name for s in first] == ["data.read"] and first[0].action.ahead is not second[0].action.ahead
    assert first[0].action.ahead.pieces == 2 and first[0].action.ahead.workers == 1
    copy = pickle.loads(pickle.dumps(batches))  # for a worker process: the threads are the actors'
    assert copy.read_ahead == 2 and torch.equal(copy.load(1, 1)["x"], _want(batches, 3))
    for stages in (first, second):
        stages[0].action.ahead.close()
    with pytest.raises(ValueError, match="read_ahead must be None .* got -1"):
        _batches(Rows(), read_ahead=-1)
    with pytest.raises(ValueError, match="pieces must be a positive int, got 0"):
        ReadAhead(_batches(Rows()), pieces=0, workers=1)


def test_a_read_ahead_hands_batches_to_the_step_on_its_thread_and_the_run_replays():
    """On an accelerator (a thread per queue) the read-ahead's actor is a compute actor: a step that only
    reads and computes runs on one thread, recorded once and replayed, and reads ``load``'s batches."""
    batches = _batches(Rows(), read_ahead=2)
    stages = batches.stages()
    assert [(s.name, s.queue) for s in stages] == [("data.read", "compute")]
    plan = Plan(stages + [ActorSpec("step", lambda k, b: b["x"], inputs=(stages[-1].name,))])
    plain = _batches(Rows())
    with mock.patch("runtime.executor.host_only", return_value=False):
        for step in range(3):
            batches.step = step
            seen = run(plan, 2, timeout=30).outputs["step"]
            assert [s.tolist() for s in seen] == [plain.load(step, k)["x"].tolist() for k in range(2)]
    assert plan.__dict__["_prepared"].schedules  # one thread: recorded on the first run, replayed after
    stages[0].action.ahead.close()


@pytest.mark.cuda
def test_on_cuda_the_read_ahead_copies_the_batches_to_the_device():
    batches = _batches(Rows())
    stages = batches.stages(device=torch.device("cuda", 0))
    ahead = stages[0].action.ahead
    assert [(s.name, s.queue) for s in stages] == [("data.read", "compute")]  # no copy actor
    got = ahead.get(5)["x"]
    assert ahead.device == torch.device("cuda", 0) and got.is_cuda and torch.equal(got.cpu(), _want(batches, 5))
    plan = Plan(stages + [ActorSpec("step", lambda k, b: b["x"], inputs=(stages[-1].name,))])
    seen = run(plan, 4, timeout=60).outputs["step"]
    assert all(s.is_cuda and torch.equal(s.cpu(), _want(batches, k)) for k, s in enumerate(seen))
    ahead.close()


def test_a_dropped_read_ahead_ends_its_threads():
    import gc

    def alive():  # another test's closed read-ahead may still be finishing a load: count only this one's
        return {t for t in threading.enumerate() if t.name.startswith("sbp-read-ahead")}

    before = alive()
    stages = _batches(Rows(), read_ahead=2).stages()
    stages[0].action(0)
    mine = alive() - before
    assert mine
    del stages
    gc.collect()
    for _ in range(100):
        if not any(t.is_alive() for t in mine):
            break
        threading.Event().wait(0.05)
    assert not any(t.is_alive() for t in mine)


def test_a_load_stuck_in_io_does_not_keep_the_process_from_ending(tmp_path):
    """The workers are daemon threads: a process whose load never returns still exits (a failed rank ends)."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import threading, torch\n"
        "from toolkit.data import GlobalBatchSampler, MicroBatches, ReadAhead\n"
        "class Stuck:\n"
        "    def __len__(self): return 8\n"
        "    def read(self, rows): threading.Event().wait()\n"
        "ahead = ReadAhead(MicroBatches(Stuck(), GlobalBatchSampler(8, 2)), pieces=2, workers=2)\n"
        "threading.Thread(target=ahead.get, args=(0,), daemon=True).start()\n"
        "threading.Event().wait(0.5)\n"
        "print('leaving')\n")
    root = str(pathlib.Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, str(script)], cwd=root, env={**os.environ, "PYTHONPATH": root},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "leaving" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("mine, parents, ranks, threads", [
    (64, 64, 8, 4),   # the host's 64 cores shared by 8 ranks: 8 a rank, at most 4 threads
    (16, 16, 8, 1),   # a container's 16 cores shared by 8 ranks: 2 a rank, one for the step
    (8, 64, 8, 4),    # bound to 8 cores of its own: its share already, not divided again
    (3, 64, 8, 2),
    (2, 2, 1, 1),
])
def test_read_ahead_threads_are_a_ranks_share_of_the_cores(mine, parents, ranks, threads, monkeypatch):
    from toolkit.data import batches

    me = os.getpid()
    monkeypatch.setattr(batches.os, "sched_getaffinity",
                        lambda pid: set(range(mine if pid in (0, me) else parents)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert batches.read_ahead_threads() == threads
