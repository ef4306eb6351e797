"""scripts/bench_gpu.py: exits 2 without a GPU unless asked for the CPU proxy, which runs and profiles every case."""
from __future__ import annotations

import re

import pytest
import torch

from .running import run_main, run_script


def _run(args, tmp_path):
    return run_script("bench_gpu.py", args, tmp_path, timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    out = _run([], tmp_path)
    assert out.returncode == 2 and "no CUDA device" in out.stdout, out.stdout + out.stderr


def test_the_host_only_proxy_runs_every_case_and_prints_the_summary(tmp_path, monkeypatch, capsys):
    """Every eager case, briefly (``trainer.compile`` runs in ``tests/cli/test_train_cli.py``), each way
    profiled for one step with its trace kept."""
    traces = tmp_path / "traces"
    code, stdout, stderr = run_main(
        "bench_gpu", ["--host-only", "--rounds", "2", "--steps", "1", "--warmup", "1", "--no-compile", "--profile", "1",
                      "--trace-dir", str(traces)], tmp_path, monkeypatch, capsys)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    cases = ("gpt2", "insightface", "wide_deep_512", "wide_deep_16384")
    for way in ("ours", "plain"):
        assert len(re.findall(rf"^  {way} +profile of 1 steps: ", stdout, re.M)) == 4, stdout
    assert sorted(p.name for p in traces.iterdir()) == sorted(f"{c}-{w}.json.gz" for c in cases
                                                              for w in ("ours", "plain"))
    last = stdout.strip().splitlines()[-1]
    x = r"\d+\.\d\dx"
    assert re.fullmatch(rf"gpu bench: gpt2 {x} eager, - compiled; insightface {x}; "
                        rf"wide_deep {x} \(512\), {x} \(16384\)", last), last


def test_a_case_that_raises_is_reported_and_the_next_cases_still_run(monkeypatch, capsys):
    import scripts.bench_gpu as bench_gpu

    def case(name, overrides, o, root):
        if name == "insightface":
            raise RuntimeError("CUDA error: out of memory")
        return {"ours": [1.0, 1.0], "plain": [1.1, 1.1]}, {}, 0

    threads = torch.get_num_threads()
    monkeypatch.setattr(bench_gpu, "_case", case)
    monkeypatch.setattr("toolkit.launcher.launch", lambda fn, o, n, device: fn(o))
    try:
        code = bench_gpu.main(["--host-only", "--no-compile"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    assert code == 1
    assert "RuntimeError: CUDA error: out of memory" in out.err  # the traceback
    lines = out.out.strip().splitlines()
    assert lines[-2] == "failed: insightface (tracebacks above)", lines
    assert lines[-1] == "gpu bench: gpt2 1.10x eager, - compiled; insightface -; wide_deep 1.10x (512), 1.10x (16384)"


def test_a_round_of_ours_ends_after_its_read_ahead_loads_and_each_case_leaves_a_summary(monkeypatch, capsys):
    """Our read-ahead's loads for later steps belong in ours' time, never in the plain loop's; and a run cut
    short still ends with a summary line of the cases that ran."""
    import scripts.bench_gpu as bench_gpu

    events, ticks = [], iter(range(1 << 20))

    class Way:
        def __init__(self, name):
            self.name = name

        def step(self, i):
            events.append((self.name, "step"))

        def settle(self):
            events.append((self.name, "settle"))

        def close(self):
            events.append((self.name, "close"))

    def clock():
        events.append(("clock",))
        return float(next(ticks))

    threads = torch.get_num_threads()
    monkeypatch.setattr(bench_gpu, "Ours", lambda cfg: Way("ours"))
    monkeypatch.setattr(bench_gpu, "Plain", lambda cfg, device, preload, compile: Way("plain"))
    monkeypatch.setattr(bench_gpu, "_clock", lambda device: clock)
    monkeypatch.setattr("toolkit.launcher.launch", lambda fn, o, n, device: fn(o))
    try:
        code = bench_gpu.main(["--host-only", "--no-compile", "--only", "gpt2,wide_deep_512", "--rounds", "2",
                               "--steps", "2", "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert events.count(("ours", "close")) == events.count(("plain", "close")) == 2  # after each case
    marks = [i for i, e in enumerate(events) if e == ("clock",)]
    assert len(marks) == 2 * 2 * 2 * 2  # a start and an end per way, round and case
    for start, end in zip(marks[::2], marks[1::2]):
        inside = events[start + 1:end]
        way = inside[0][0]
        assert inside == [(way, "step")] * 2 + [(way, "settle")], inside
    lines = capsys.readouterr().out.strip().splitlines()
    assert "gpu bench: gpt2 1.00x eager, - compiled; insightface -; wide_deep - (512), - (16384)" in lines
    assert lines[-1] == "gpu bench: gpt2 1.00x eager, - compiled; insightface -; wide_deep 1.00x (512), - (16384)"
