"""``python -m perf run SUITE [--device cpu|cuda] [--quick]``: run a suite, write its results."""
from __future__ import annotations

import argparse
import sys

import torch

from .timing import machine_info, write_results

SUITES = ("ops", "offline")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a benchmark suite and write perf/results/<suite>-<device>.json")
    run.add_argument("suite", choices=SUITES)
    run.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("perf: --device cuda needs CUDA", file=sys.stderr)
        return 2
    from .suites import offline, ops
    suite = {"ops": ops, "offline": offline}[args.suite]
    result = suite.run(args.device, quick=args.quick)
    result["machine"] = machine_info(args.device)
    suffix = "-quick" if args.quick else ""
    path = write_results(f"{args.suite}-{args.device}{suffix}", result)
    print(suite.summarize(result))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
