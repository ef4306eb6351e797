"""scripts/bench_build_memory.py end to end on gpt2-tiny over 2 ranks: every side builds, the table prints."""
import re

from scripts.bench_build_memory import SIDES, main


def test_every_side_builds_and_the_summary_prints(capsys):
    text = main(["--model", "gpt2-tiny", "--tp", "2", "--rounds", "1"])
    assert capsys.readouterr().out.strip() == text.strip()
    for side in SIDES:
        assert re.search(rf"^{re.escape(side)}\s+held\s+\d+\s+peak\s+\d+", text, re.M), f"no row for {side}"
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"build memory \(peak per rank\): ours \d+ MiB, DTensor \d+ MiB \(\d+\.\d\dx\), "
                        r"DTensor-meta \d+ MiB \(\d+\.\d\dx\)", last), last


def test_the_zero3_mode_builds_both_sides_and_its_summary_prints(capsys):
    from scripts.bench_build_memory import ZERO3_SIDES

    text = main(["--zero3", "--model", "gpt2-tiny", "--tp", "2", "--rounds", "1"])
    for side in ZERO3_SIDES:
        assert re.search(rf"^{re.escape(side)}\s+held\s+\d+\s+peak\s+\d+", text, re.M), f"no row for {side}"
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"build memory, ZeRO-3 \(peak per rank\): ours \d+ MiB, FSDP2-meta \d+ MiB \(\d+\.\d\dx\)",
                        last), last
