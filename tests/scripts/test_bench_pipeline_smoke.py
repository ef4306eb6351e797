"""scripts/bench_pipeline.py end to end on a tiny GPT-2: the table and the summary line print (no timing checks)."""
import re

import pytest

from scripts.bench_pipeline import VARIANTS, main

TINY = ["--layers", "2", "--embd", "32", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "4",
        "--micro", "2", "--steps", "1", "--warmup", "0"]


def test_bench_pipeline_prints_table_and_summary(capsys):
    text = main(TINY)
    assert capsys.readouterr().out.strip() == text.strip()
    for name in VARIANTS:
        assert re.search(rf"^{re.escape(name)}\s+\d+\s+\d+", text, re.M), f"no table row for {name}"
    assert "loss per step agrees" in text
    assert re.search(r"bubble s0 [\d.]+, s1 [\d.]+", text)
    assert re.search(r"^paired, .*: 1f1b vs 1F1B \d+\.\d\dx \(90% interval \d+\.\d\d-\d+\.\d\d\); "
                     r"gpipe vs GPipe \d+\.\d\dx", text, re.M)
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"vs Schedule1F1B: \d+\.\d\dx throughput, \d+\.\d\dx peak memory; "
                        r"vs ScheduleGPipe: \d+\.\d\dx, \d+\.\d\dx", last), last


@pytest.mark.parametrize("virtual,layers", [(2, 4), (3, 12)])
def test_bench_pipeline_schedules_against_torch_s(capsys, virtual, layers):
    """--schedules: interleaved, zb, zb2 (--virtual stages per rank) and zbv against torch's classes on the same
    split; the losses agree."""
    from benchkit.pipeline_peers import SCHEDULE_VARIANTS

    text = main([*TINY[:-6], "--layers", str(layers), "--micro", "2", "--steps", "1", "--warmup", "0", "--schedules",
                 "--virtual", str(virtual)])
    assert f"for v={virtual})" in text
    for name in SCHEDULE_VARIANTS:
        assert re.search(rf"^{re.escape(name)}\s+\d+\s+\d+", text, re.M), f"no table row for {name}"
    worst = float(re.search(r"max rel diff ([\d.e+-]+)", text).group(1))
    assert worst < 1e-5, text
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"schedules: interleaved \d+\.\d\dx thr \d+\.\d\dx mem; zb \d+\.\d\dx thr \d+\.\d\dx mem; "
                        r"zb2 \d+\.\d\dx thr \d+\.\d\dx mem; zbv \d+\.\d\dx thr \d+\.\d\dx mem \(vs torch\)", last), last


def test_bench_pipeline_refuses_options_that_do_not_fit(capsys):
    from benchkit.pipeline_peers import parse

    with pytest.raises(SystemExit):
        parse(["--virtual", "3"])
    assert "add --schedules" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--schedules", "--virtual", "3"])  # 8 layers do not make 6 stages
    assert "--layers 8" in capsys.readouterr().err
