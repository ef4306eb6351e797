"""Search a parallel plan for a model on a cluster and print it, without training.

    python scripts/search_plan.py --cluster configs/cluster/v100_4x8.yaml model=gpt2-medium \\
        model.vocab_size=50304 trainer.precision=bf16 trainer.global_batch_size=256 [--budget 150] [--out plan.json]

Positional arguments are ``train.py``'s config overrides (recipe, model, data,
trainer...). Runs the same search as ``train.py parallel=auto``
(``toolkit.search.auto``: Metropolis-Hastings over dp/tp/pp, ZeRO,
micro-batch size, sequence parallel and per-op layouts, priced by the
execution simulator on the cluster file) and prints the plan's
``dpX_tpY_ppZ`` name, its predicted step time and peak memory per device,
the seeds it started from, the parameter layouts and the per-op SBP table.
The plan file (``--out``, and the cache ``train.py parallel=auto`` reads
with the same cluster, devices and search settings) holds the strategy.
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="this_machine", help="configs/cluster/<name>.yaml or a path")
    ap.add_argument("--devices", type=int, default=None, help="devices to use (default: the cluster's)")
    ap.add_argument("--budget", type=int, default=None, help="search proposals (default parallel.search.budget)")
    ap.add_argument("--beta", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the plan file here")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt2-medium")
    o = ap.parse_args()

    from recipes.registry import get
    from toolkit.search.auto import plan_path, search_plan, write_plan
    from toolkit.search.cluster_file import load_cluster
    from toolkit.search.report import describe
    from toolkit.search.stage_spec import mesh_plan
    from toolkit.config import compose

    extra = [f"parallel.search.cluster={o.cluster}"]
    for key in ("devices", "budget", "beta", "seed"):
        if getattr(o, key) is not None:
            extra.append(f"parallel.search.{key}={getattr(o, key)}")
    cfg = compose(["parallel=auto", "logger=none"] + list(o.overrides) + extra, run_dir="/tmp/search_plan")
    recipe = get(cfg.recipe.name)
    t0 = time.time()
    result, model = search_plan(cfg, recipe)
    cluster = load_cluster(o.cluster)
    best = result.best
    print(f"searched {result.evaluated} plans in {time.time() - t0:.0f} s ({model.rehearsals} stage rehearsals; "
          f"accepted {result.accepted}, rejected {result.rejected}, invalid {result.invalid})")
    for p in result.seeds:
        print(f"seed {p.strategy.describe()}: predicted {p.step_seconds:.4g} s, "
              f"{p.peak_memory / 2**30:.3g} GiB{'' if p.fits else ' (does not fit)'}")
    print(describe(best, mesh_plan(recipe, model.cfg, best.strategy), model.shapes, model.micro_batches(best.strategy)))
    path, _ = plan_path(cfg, recipe)
    for target in [path] + ([o.out] if o.out else []):
        write_plan(target, result, model, cluster)
        print(f"plan file: {target}")
    print(f"best: {best.strategy.name} predicted step {best.step_seconds:.4g} s, peak memory "
          f"{best.peak_memory / 2**30:.3g} GiB per device on {cluster.name}")


if __name__ == "__main__":
    main()
