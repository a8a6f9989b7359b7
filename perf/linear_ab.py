"""``python -m perf.linear_ab [--base REV] [--threads N] [--rows 1,16,64,512]
[--shapes qwen0.5b|llama-24m] [--cold]``: the packed CPU
GEMM of this checkout against ``ops/csrc/linear_cpu.cpp`` at git revision REV, in one process.

Why a separate tool: a kernel change must win per shape, at decode and prefill row counts, on
this machine, and two builds timed in turns in one process cancel most of the noise of a shared
machine (the perf suites time one build per run). Both are built with the project's flags
(``native_build.FLAGS``) into a temporary directory; every output is checked against
``F.linear`` first. Shapes: a Qwen2.5-0.5B-shaped model's projections (fused qkv, o, gate_up,
down) and its 32000-row head, or the served CPU perf model's (``llama-24m``); ``--cold`` cycles
through copies of each weight so that every call reads it from DRAM, as a decode step does. Prints median microseconds per call and GFLOP/s.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vgraph.ops.linear import pack_weight
from vgraph.ops.native_build import CSRC, FLAGS, compiler

SHAPES = {"qwen0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864), (32000, 896)],
          "llama-24m": [(1024, 512), (512, 512), (2816, 512), (512, 1408)]}  # the served CPU perf model
COLD_BYTES = 256 << 20  # --cold: weights cycled through per shape, 8x this machine's 32 MiB L3
ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]


def build(source: str, directory: Path, name: str) -> ctypes._CFuncPtr:
    src, lib = directory / f"{name}.cpp", directory / f"{name}.so"
    src.write_text(source, encoding="utf-8")
    subprocess.run([compiler(), *FLAGS, str(src), "-o", str(lib)], check=True)
    function = ctypes.CDLL(str(lib)).vgraph_linear
    function.argtypes, function.restype = ARGTYPES, None
    return function


def compare(kernels: dict, m: int, n: int, k: int, threads: int, cold: bool = False) -> dict[str, float]:
    """Median seconds per call of each kernel on one shape, timed in alternating order.
    ``cold``: each call takes the next of enough copies of the weight to overflow the last-level
    cache (``COLD_BYTES``), so it streams from DRAM as a decode step's weights do."""
    w, x, y = torch.randn(n, k), torch.randn(m, k), torch.empty(m, n)
    packed, ref = pack_weight(w), F.linear(x, w)
    copies = [packed] + [packed.clone() for _ in range(-(-COLD_BYTES // packed.nbytes) - 1 if cold else 0)]
    turn = iter(range(1 << 62))
    calls = {name: (lambda f=f: f(x.data_ptr(), k, m, k, copies[next(turn) % len(copies)].data_ptr(), n, None,
                                  y.data_ptr(), n, threads))
             for name, f in kernels.items()}
    for name, call in calls.items():
        call()
        torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-4, msg=f"{name} disagrees with F.linear")
    samples: dict[str, list[float]] = {name: [] for name in calls}
    reps = max(5, min(31, int(4e9 / (2 * m * n * k))))
    for rep in range(max(reps, 2 * len(copies)) if cold else reps):
        for name in (list(calls) if rep % 2 == 0 else list(calls)[::-1]):
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline kernel")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,4,16,64,128,512")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen0.5b")
    parser.add_argument("--cold", action="store_true", help="weights from DRAM, as in a decode step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = subprocess.run(["git", "show", f"{args.base}:ops/csrc/linear_cpu.cpp"], check=True,
                          capture_output=True, text=True, cwd=CSRC).stdout
    with tempfile.TemporaryDirectory(prefix="vgraph-linear-ab-") as tmp:
        kernels = {"base": build(base, Path(tmp), "base"),
                   "new": build((CSRC / "linear_cpu.cpp").read_text(encoding="utf-8"), Path(tmp), "new")}
        print(f"threads {args.threads}; base = {args.base}, new = this checkout")
        for m in (int(v) for v in args.rows.split(",")):
            for n, k in SHAPES[args.shapes]:
                t = compare(kernels, m, n, k, args.threads, args.cold)
                flops = 2 * m * n * k
                print(f"M={m:4d} N={n:5d} K={k:5d}  base {t['base'] * 1e6:9.0f} us {flops / t['base'] / 1e9:6.1f} GF/s"
                      f"  new {t['new'] * 1e6:9.0f} us {flops / t['new'] / 1e9:6.1f} GF/s  x{t['base'] / t['new']:.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
