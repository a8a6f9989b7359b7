"""``python -m perf run SUITE [--device cpu|cuda] [--quick] [--threads N]``: run a suite, write its results.

On CPU a suite runs at torch's default thread count (every core), as a user runs vgraph: that is
the headline. Unless ``--threads`` is given, the same suite then runs again in a child process
at one thread and its result lands under ``"threads_1"`` in the same file, the extra column
(``--no-threads-1`` skips it). One thread shows the kernels without the thread team, and stays
readable on a machine where another process holds a core (see ``contention_probe``)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .timing import RESULTS_DIR, machine_info, write_results

SUITES = ("ops", "offline", "startup", "compile", "serving", "serving-dp", "serving-engine-process", "decode",
          "hardening", "fusion-study", "structured", "cpu-peers", "tensor-parallel", "pipeline-parallel",
          "host-overhead", "lora", "e2e", "ray-executor", "serving-vllm", "busy-neighbour", "spec-decode",
          "spec-verify")


def module_name(suite: str) -> str:
    """A suite's module: its name with "-" as "_" (``fusion-study`` -> suites/fusion_study.py)."""
    return suite.replace("-", "_")


def contention_probe() -> dict:
    """Milliseconds per small GEMM (16x512 @ 512x1536, a decode-step linear of the perf model)
    at 1 thread and at torch's thread count. On a shared machine, another busy process makes
    every OpenMP barrier wait for a descheduled thread: the multi-thread time then jumps by
    10-40x while the 1-thread time stays put, and timings at that thread count mean little."""
    x, w = torch.randn(16, 512), torch.randn(1536, 512)
    threads = torch.get_num_threads()
    out = {}
    for n in sorted({1, threads, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(100):
            torch.nn.functional.linear(x, w)
        out[f"{n}_threads_ms"] = (time.perf_counter() - start) * 10
    torch.set_num_threads(threads)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a benchmark suite and write perf/results/<suite>-<device>.json")
    run.add_argument("suite", choices=SUITES)
    run.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    run.add_argument("--threads", type=int, default=None,
                     help="torch (OpenMP) threads for this process and its children (default: torch's, "
                          "one per core; then a second run at 1 thread is added as an extra column)")
    run.add_argument("--no-threads-1", action="store_true",
                     help="skip the extra run at --threads 1 that a default-thread CPU run adds")
    run.add_argument("--output", type=Path, default=None, help=argparse.SUPPRESS)  # the threads-1 child
    replot = sub.add_parser("plot", help="redraw perf/results/*.png from the results files already there")
    replot.add_argument("names", nargs="*", help="results names, e.g. offline-cpu (default: every results file)")
    args = parser.parse_args(argv)
    if args.command == "plot":
        return replot_results(args.names)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for suites that start subprocesses
    if args.device == "cuda" and not torch.cuda.is_available():
        print("perf: --device cuda needs CUDA", file=sys.stderr)
        return 2
    import importlib
    suite = importlib.import_module(f".suites.{module_name(args.suite)}", __package__)
    result = run_suite(suite, args.device, args.quick)
    if args.output is not None:  # the threads-1 child: its parent files the result
        args.output.write_text(json.dumps(result, default=str))
        return 0
    print(suite.summarize(result))
    if wants_threads_1(args, suite):
        result["threads_1"] = run_threads_1(args)
        print(f"\n--- the same suite at --threads 1 ---\n{suite.summarize(result['threads_1'])}")
        print(threads_table(suite, result))
    suffix = "-quick" if args.quick else ""
    path = write_results(f"{args.suite}-{args.device}{suffix}", result)
    print(f"results: {path}")
    plot_path = save_plot(suite, result, path)
    if plot_path is not None:
        print(f"plot: {plot_path}")
    return 0


def run_suite(suite, device: str, quick: bool) -> dict:
    """One run of a suite, with the machine, the thread count and the contention probe."""
    probe_before = contention_probe() if device == "cpu" else None
    result = suite.run(device, quick=quick)
    result["machine"] = machine_info(device)
    result["machine"]["torch_num_threads"] = torch.get_num_threads()
    if probe_before is not None:
        result["machine"]["contention_probe_before_after"] = [probe_before, contention_probe()]
    return result


def wants_threads_1(args: argparse.Namespace, suite) -> bool:
    """A default-thread CPU run gets the threads-1 child, unless the suite measures one thread
    itself (``THREADS_1_BUILT_IN``: startup times each start both ways; cpu-peers keeps a
    ``--threads 1`` run beside the all-cores one in its file)."""
    return (args.device == "cpu" and args.threads is None and not args.no_threads_1
            and torch.get_num_threads() > 1 and not getattr(suite, "THREADS_1_BUILT_IN", False))


def run_threads_1(args: argparse.Namespace) -> dict:
    """The suite again in a child at one thread (OpenMP's team size is fixed per process)."""
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-threads-1-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "perf", "run", args.suite, "--device", "cpu", "--threads", "1",
               "--output", str(out)] + (["--quick"] if args.quick else [])
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())


def threads_table(suite, result: dict) -> str:
    """The suite's headline figures side by side: default threads, and the threads-1 column."""
    if not hasattr(suite, "headline_figures"):
        return ""
    many, one = suite.headline_figures(result), suite.headline_figures(result["threads_1"])
    threads = result["machine"]["torch_num_threads"]
    width = max(len(name) for name in many) + 2
    lines = [f"{'figure':<{width}}{f'{threads} threads':>14}{'1 thread':>14}"]
    lines += [f"{name:<{width}}{value:>14.3f}{one.get(name, float('nan')):>14.3f}" for name, value in many.items()]
    return "\n".join(lines)


def save_plot(suite, result: dict, results_path: Path) -> Path | None:
    """Draws the suite's figure next to its results file (same name, .png).

    A suite opts in by defining ``plot(result) -> matplotlib Figure``. Plotting is drawn from the
    results dict alone, so ``python -m perf plot`` can redraw any committed file later.
    """
    if not hasattr(suite, "plot"):
        return None
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt
    fig = suite.plot(result)
    png = results_path.with_suffix(".png")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def replot_results(names: list[str]) -> int:
    import importlib
    import json
    paths = [RESULTS_DIR / f"{n}.json" for n in names] if names else sorted(RESULTS_DIR.glob("*.json"))
    for path in paths:
        if not path.is_file():
            print(f"perf: no results file {path}", file=sys.stderr)
            return 2
        result = json.loads(path.read_text())
        suite = importlib.import_module(f".suites.{module_name(result['suite'])}", __package__)
        png = save_plot(suite, result, path)
        print(f"{path.name}: {png if png else 'no plot for this suite'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
