"""RankPool: reuse, collectives, error reporting and recovery on local gloo ranks."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from toolkit.rank_pool import RankError, RankPool, get_pool, launch

WORLD = 4


# Functions run on the workers must be module-level so they pickle by reference.

def rank_and_world():
    return dist.get_rank(), dist.get_world_size(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def pid():
    return os.getpid()


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def raise_value_error(tag):
    raise ValueError(f"bad value {tag} on rank {dist.get_rank()}")


def rank_one_raises_runtime_error():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke")
    return dist.get_rank()


def rank_one_skips_collective():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def sleep_forever():
    time.sleep(3600)


def die_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def add(x, y=0):
    return x + y + dist.get_rank()


@pytest.fixture(scope="module")
def pool():
    return get_pool(WORLD)


def test_rank_and_world_size(pool):
    assert pool.run(rank_and_world) == [(r, WORLD, r, WORLD) for r in range(WORLD)]


def test_args_and_kwargs(pool):
    assert pool.run(add, 10, y=5) == [15, 16, 17, 18]


def test_all_reduce(pool):
    assert pool.run(all_reduce_rank) == [10.0] * WORLD


def test_value_error_on_all_ranks_keeps_pool(pool):
    before = pool.run(pid)
    outcomes = pool.outcomes(raise_value_error, "x")
    assert [o.ok for o in outcomes] == [False] * WORLD
    assert {o.exc_type for o in outcomes} == {"ValueError"}
    assert outcomes[3].message == "bad value x on rank 3"
    assert "raise_value_error" in outcomes[3].traceback
    with pytest.raises(RankError, match="rank 2: ValueError: bad value y on rank 2"):
        pool.run(raise_value_error, "y")
    assert pool.run(pid) == before


# Tests that make the pool respawn its workers (a torch import per rank)
# use a 2-rank pool with a 3 s gloo timeout to stay quick.

@pytest.fixture(scope="module")
def pair():
    with RankPool(2, timeout=3.0) as p:
        yield p


def test_runtime_error_restarts_pool(pair):
    before = pair.run(pid)
    with pytest.raises(RankError) as info:
        pair.run(rank_one_raises_runtime_error)
    msg = str(info.value)
    assert "rank 1: RuntimeError: rank 1 broke" in msg and "Traceback" in msg
    assert "rank 0:" not in msg
    assert [o.ok for o in info.value.outcomes] == [True, False]
    after = pair.run(pid)
    assert set(after).isdisjoint(before)
    assert pair.run(all_reduce_rank) == [3.0, 3.0]


def test_skipped_collective_times_out_and_recovers(pair):
    pair.run(pid)  # workers up, so the timing below is the collective's alone
    start = time.monotonic()
    outcomes = pair.outcomes(rank_one_skips_collective)
    elapsed = time.monotonic() - start
    print(f"\nskipped collective reported after {elapsed:.1f} s (gloo timeout {pair.timeout:g} s)")
    assert elapsed < pair.timeout + 10.0
    assert outcomes[1].ok and outcomes[1].value == 1
    assert not outcomes[0].ok and outcomes[0].exc_type  # gloo's timeout error
    assert not pair.alive  # ranks disagreed: workers were dropped
    assert pair.run(all_reduce_rank) == [3.0, 3.0]


def test_hung_call_killed_by_call_timeout(pair):
    with pytest.raises(RankError, match=r"no answer within 1 s; ranks \[0, 1\] did not answer"):
        pair.run(sleep_forever, call_timeout=1.0)
    assert not pair.alive
    assert pair.run(all_reduce_rank) == [3.0, 3.0]


def test_dead_worker_reported_and_recovered(pair):
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)"):
        pair.run(die_on_rank_one)
    assert pair.run(all_reduce_rank) == [3.0, 3.0]


def test_close_leaves_no_processes(pair):
    pair.run(pid)
    procs = list(pair._procs)
    pair.close()
    assert not pair.alive and procs and all(not proc.is_alive() for proc in procs)


def test_unpicklable_function_rejected(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 0)


def test_many_small_calls(pool):
    pool.run(pid)  # make sure workers are up before timing
    start = time.monotonic()
    for i in range(200):
        assert pool.run(add, i) == [i, i + 1, i + 2, i + 3]
    print(f"\n200 calls on {WORLD} ranks: {time.monotonic() - start:.2f} s")


def test_launch_uses_shared_pool(pool):
    assert launch(add, WORLD, 1, y=1) == [2, 3, 4, 5]
    assert get_pool(WORLD) is pool



ORPHAN_SCRIPT = """
import os, sys
from toolkit.rank_pool import RankPool
if __name__ == "__main__":
    pids = RankPool(1, timeout=5.0).run(os.getpid)
    print(pids[0], flush=True)
    os._exit(0)  # skip atexit: workers must notice the parent is gone by themselves
"""


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the worker")
def test_workers_exit_when_parent_dies(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10.0
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(worker), f"worker {worker} outlived its parent"


def environment_and_timeouts():
    from sbp_core import process_groups

    with process_groups.initialising():
        init = process_groups.get_timeout()
    return os.environ.get("SBP_POOL_TEST"), process_groups.get_timeout(), init


def test_workers_take_the_parents_environment_as_it_is_when_the_pool_starts(monkeypatch):
    """A worker is forked by a server that imported sbp_core long before: the pool's environment and its
    timeouts are still the ones the pool starts with (as a spawned child's would be)."""
    monkeypatch.setenv("SBP_POOL_TEST", "first")
    monkeypatch.setenv("SBP_INIT_TIMEOUT", "77")
    with RankPool(2, timeout=9.0) as pool:
        assert pool.run(environment_and_timeouts) == [("first", 9.0, 77.0)] * 2
        monkeypatch.setenv("SBP_POOL_TEST", "second")
        assert pool.run(environment_and_timeouts) == [("first", 9.0, 77.0)] * 2  # started already
    with RankPool(2, timeout=9.0) as pool:
        assert pool.run(environment_and_timeouts)[0][0] == "second"


def test_importing_the_project_starts_no_thread():
    """What the pool's fork server imports leaves no thread behind (torch's own at import aside): a process
    forked from it would lack the threads and hang on their locks."""
    code = ("import os, torch\n"
            "before = len(os.listdir('/proc/self/task'))\n"
            "import importlib\n"
            "from toolkit.preload import MODULES\n"
            "assert all(importlib.import_module(name) for name in MODULES)\n"
            "print(before, len(os.listdir('/proc/self/task')))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert after == before, (before, after)


SHADOW_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])  # after start-up, as pytest's rootdir or a script's own directory is
sys.path.insert(1, sys.argv[2])
from toolkit.rank_pool import RankPool

def marker():
    import recipes.registry
    return getattr(recipes.registry, "MARKER", None)

if __name__ == "__main__":
    with RankPool(1, timeout=30.0) as pool:
        print(pool.run(marker)[0])
"""


def test_workers_import_the_modules_their_parent_would(tmp_path):
    """The fork server imports torch and the project before any worker exists; it must find them where the
    pool's owner would, on the owner's ``sys.path`` as it is then, not on the server's own start-up path."""
    shadow = tmp_path / "shadow"
    (shadow / "recipes").mkdir(parents=True)
    (shadow / "recipes" / "__init__.py").write_text("")
    (shadow / "recipes" / "registry.py").write_text("MARKER = 'the owner\\'s'\n")
    script = tmp_path / "owner.py"
    script.write_text(SHADOW_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(script), str(shadow), root], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["the", "owner's"], out.stdout
