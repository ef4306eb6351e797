"""``python -m scripts.reproduce list | all | <figure> [options]``: reproduce a paper figure on this machine.

    python -m scripts.reproduce list                    # the figures and what each shows
    python -m scripts.reproduce fig12 --classes 10000,100000
    python -m scripts.reproduce all --out reproduce     # every figure with its small defaults
    python -m scripts.reproduce all --quick             # smoke-sized runs (each figure's QUICK defaults)

``--out`` (default ``reproduce``) receives ``<figure>.csv``, ``.txt``,
``.png`` and ``.log`` (the benchmark scripts' own output). Options after a
figure's name are that figure's (``python -m scripts.reproduce fig12 -h``);
``--quick`` changes a figure's defaults to its ``QUICK`` ones (options
given explicitly still win).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from . import FIGURES, load
from .bench import BenchRunner
from .machine import Machine
from .writer import write


def run_figure(name: str, args) -> str:
    """Measure figure ``name`` with ``args``, write its files into ``args.out``; the printed report."""
    module = load(name)
    machine = Machine.now()
    os.makedirs(args.out, exist_ok=True)
    bench = BenchRunner(os.path.join(args.out, f"{name}.log"))
    result = module.reproduce(args, bench)
    result.commands = bench.commands + list(result.commands)
    return write(result, args.out, machine.finish())


def _parser() -> tuple:
    ap = argparse.ArgumentParser(prog="python -m scripts.reproduce", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default="reproduce", help="directory for <figure>.csv/.txt/.png/.log")
    common.add_argument("--quick", action="store_true", help="smoke-sized defaults (seconds to a minute or two)")
    sub = ap.add_subparsers(dest="figure", required=True, metavar="{list,all," + ",".join(FIGURES) + "}")
    sub.add_parser("list", help="the figures and what each reproduces")
    sub.add_parser("all", parents=[common], help="every figure with its default arguments, in turn")
    figures = {}
    for name in FIGURES:
        module = load(name)
        figures[name] = sub.add_parser(name, parents=[common], help=module.TITLE,
                                       description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(figures[name])
    return ap, figures


def parse(argv=None) -> tuple:
    """``(args, figure parsers)`` of a command line; ``--quick`` applies the figures' ``QUICK`` defaults."""
    ap, figures = _parser()
    args = ap.parse_args(argv)
    if getattr(args, "quick", False):  # parse again with the smaller defaults; explicit options still win
        for name in FIGURES if args.figure == "all" else [args.figure]:
            figures[name].set_defaults(**load(name).QUICK)
        args = ap.parse_args(argv)
    return args, figures


def main(argv=None) -> int:
    args, figures = parse(argv)
    if args.figure == "list":
        for name in FIGURES:
            print(f"{name:6s} {load(name).TITLE}")
        return 0
    if args.figure != "all":
        try:
            run_figure(args.figure, args)
        except ValueError as err:  # bad input: the message names the value and the valid choices
            print(f"python -m scripts.reproduce {args.figure}: {err}", file=sys.stderr)
            return 2
        return 0
    failed = []
    for name, parser in figures.items():
        try:
            run_figure(name, parser.parse_args(["--out", args.out] + (["--quick"] if args.quick else [])))
        except Exception:  # noqa: BLE001  (one figure's failure must not lose the others)
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)} (the others' files are in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
