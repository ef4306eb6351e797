"""scripts/bench_context.py end to end over 2 ranks: cp2's loss equals one device's, the table prints."""
import re


def test_cp2_matches_one_device_and_the_summary_prints(capsys):
    from scripts.bench_context import main

    assert main(["--seq", "64", "--cp", "2", "--rounds", "1"]) == 0  # 1 when a loss differs from one device's
    text = capsys.readouterr().out.strip()
    for side in ("one", "cp2"):
        assert re.search(rf"^\s+{side}\s+\d+\.\d{{6}}\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\d$", text, re.M), text
    assert re.fullmatch(r"context: cp2 \d+\.\d\dx memory, \d+\.\dx time", text.splitlines()[-1]), text
