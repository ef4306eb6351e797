"""scripts/bench_init_memory.py end to end over 2 ranks: every side loads the file's values, the table prints."""
import re

import pytest

pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("torch.distributed.checkpoint"), "HuggingFaceStorageReader"):
    pytest.skip("this torch's DCP has no HuggingFaceStorageReader (the DCP side)", allow_module_level=True)


@pytest.mark.parametrize("mode", [[], ["--zero3"]], ids=["tp", "zero3"])
def test_every_side_loads_the_files_values_and_the_summary_prints(mode, capsys):
    from scripts.bench_init_memory import SIDES, main

    text = main(["--tp", "2", "--rounds", "1", "--layers", "1", "--hidden", "512", *mode])  # exits if values differ
    assert capsys.readouterr().out.strip() == text.strip()
    for side in SIDES:
        assert re.search(rf"^{re.escape(side)}\s+held\s+\d+\s+peak\s+\d+", text, re.M), f"no row for {side}"
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"init memory(, ZeRO-3)? \(peak per rank\): ours \d+ MiB, from_pretrained \d+ MiB \(\d+\.\d\dx\), "
                        r"DCP \d+ MiB \(\d+\.\d\dx\)", last), last
