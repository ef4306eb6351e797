"""Training entry point: ``python train.py recipe=gpt2 parallel=dp2_tp4_pp2``.

It becomes the Hydra entry point with the GPT-2 recipe. Until then it accepts
Hydra-style overrides (``key=value``), says the recipe is not implemented yet
and exits with status 0.
"""
import sys


def main(argv: list[str]) -> int:
    overrides = dict(a.split("=", 1) for a in argv if "=" in a)
    recipe = overrides.get("recipe", "gpt2")
    print(f"not yet: the {recipe} training recipe is not implemented; train.py will run it "
          f"through Hydra once it lands (overrides: {' '.join(argv) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
