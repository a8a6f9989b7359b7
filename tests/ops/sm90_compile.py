"""Compiles the Triton kernels' launches for sm_90 (H100/H200) without a GPU and reports what
ptxas says about each: registers per thread, spill bytes, shared memory.

Why: the interpreter checks the kernels' arithmetic but not that they compile, nor what they
cost in registers; Triton's compiler and the ptxas it ships run without a device. Each case
runs a launcher with its kernels recorded (tests/ops/launches.py), then compiles every
recorded launch with the same specialization a real launch would get.

    python -m tests.ops.sm90_compile          # a table; exit 1 on a spill or a shared-memory overflow
    python -m tests.ops.sm90_compile --json   # one JSON list (used by test_kernel_compile.py)

TRITON_INTERPRET must be off: interpreted kernels cannot be compiled.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tests.ops.launches import Launch, as_jit_function, recording
from vgraph.ops import dense_linear
from vgraph.ops.kernels import activation, attention, fp8, gemv, kv_cache, lora, norm, rotary

ARCH = 90
TARGET = GPUTarget("cuda", ARCH, 32)
SHARED_LIMIT = 227 * 1024  # per block on sm_90


@dataclass
class Usage:
    case: str
    kernel: str
    grid: tuple
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    loads_before_wait: int = 0  # PDL variants: global loads the PTX issues before griddepcontrol.wait


# The kernels that load part of their weight before waiting on the kernel before them (a weight
# is never written by a step's kernels: ops/kernels/gemv.py). Any other kernel may read what
# the kernel before it wrote, so its PTX must not load before the wait.
PREFETCHING = {"_gemv_kernel", "_gemv_silu_mul_kernel"}


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) from ``ptxas -v``, as Triton invokes it."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(ARCH).path, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name=sm_{ARCH}a", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


def compile_launch(case: str, name: str, kernel: Any, launch: Launch, require: str = "") -> Usage:
    """Compiles one recorded launch the way ``JITFunction.run`` would on an sm_90 device;
    ``require``: text its PTX must contain."""
    jit = as_jit_function(kernel)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, launch.kwargs, bound,
                                                           specialization, options)
    compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    if require and require not in compiled.asm["ptx"]:
        raise AssertionError(f"{case} {name}: no {require!r} in the PTX")
    ptx = compiled.asm["ptx"]
    regs, spills = _ptxas_usage(ptx)
    early = ptx.split("griddepcontrol.wait", 1)[0].count("ld.global") if "griddepcontrol.wait" in ptx else 0
    return Usage(case, name, launch.grid, regs, spills, compiled.metadata.shared,
                 options.num_warps, early)


def _attention_case(group: int, query_len: int, head_dim: int, dtype: torch.dtype,
                    splits: int = 1, fp8_cache: bool = False) -> Callable[[], None]:
    """A launch over a cache of ``dtype``, or of e4m3 (``fp8_cache``, with its scales)."""
    kv_heads, seqs = 8, 2
    q = torch.empty(seqs * query_len, kv_heads * group, head_dim, dtype=dtype)
    cache = torch.empty(64, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn if fp8_cache else dtype)
    table = torch.empty(seqs, 64, dtype=torch.int32)
    lens = torch.full((seqs,), query_len, dtype=torch.int32)
    starts = torch.arange(seqs + 1, dtype=torch.int32) * query_len
    scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) if fp8_cache else {}
    if splits > 1:
        return lambda: attention.paged_attention_decode_split_kv_triton(q, cache, cache, table, lens,
                                                                        0.1, splits, **scales)
    return lambda: attention.paged_attention_triton(q, cache, cache, table, starts, lens, query_len, 0.1,
                                                    **scales)


def _row_cases(width: int) -> list[tuple[str, Any, list[str], Callable[[], None]]]:
    x, w, s = (torch.empty(2, width, dtype=torch.bfloat16), torch.empty(width, dtype=torch.bfloat16),
               torch.ones(1))
    rms = ["_rms_norm_kernel"]
    return [
        (f"rms_norm w{width}", norm, rms, lambda: norm.rms_norm_triton(x, w, 1e-6)),
        (f"add+rms_norm+static fp8 w{width}", norm, rms,
         lambda: norm.rms_norm_triton(x, w, 1e-6, residual=x, quant=norm.QUANT_STATIC, scale=s)),
        (f"rms_norm+dynamic fp8 w{width}", norm, rms,
         lambda: norm.rms_norm_triton(x, w, 1e-6, quant=norm.QUANT_DYNAMIC)),
        (f"dynamic fp8 w{width}", fp8, ["_dynamic_per_token_quant_kernel"],
         lambda: fp8.dynamic_per_token_scaled_fp8_quant_triton(x)),
        (f"static fp8 w{width}", fp8, ["_static_quant_kernel"],
         lambda: fp8.static_scaled_fp8_quant_triton(x, s)),
    ]


def _lora_cases() -> list[tuple[str, Any, list[str], Callable[[], None]]]:
    """LoRA shrink and expand at the 8B shape's q|k|v slices (4096 in; 4096, 1024, 1024 out),
    4 slots, ranks 16 and 64, bf16."""
    cases = []
    for rank in (16, 64):
        x, slots = torch.empty(4, 4096, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32)
        a = torch.empty(4, 3 * rank, 4096, dtype=torch.bfloat16)
        b = [torch.empty(4, n, rank, dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
        base, shrunk = torch.empty(4, 6144, dtype=torch.bfloat16), torch.empty(4, 3 * rank, dtype=torch.float32)
        cases += [(f"lora shrink r{rank}", lora, ["_shrink_kernel"],
                   lambda x=x, a=a, slots=slots: lora.lora_shrink_triton(x, a, slots)),
                  (f"lora expand r{rank}", lora, ["_expand_kernel"],
                   lambda base=base, shrunk=shrunk, b=b, slots=slots: lora.lora_expand_triton(base, shrunk, b, slots))]
    return cases


def cases() -> list[tuple[str, Any, list[str], Callable[[], None]]]:
    """(label, module, kernel names, launcher call): the shapes the host code chooses for
    decode and prefill attention, split-KV, and row kernels below and above ROW_CHUNK."""
    unified = ["_paged_attention_kernel"]
    split = ["_split_kv_stage1_kernel", "_split_kv_stage2_kernel"]
    bf16 = torch.bfloat16
    out = [
        (f"attention g{g} q{q} d{d} {str(dt)[6:]}", attention, unified, _attention_case(g, q, d, dt))
        for g, q, d, dt in [(1, 1, 128, bf16), (4, 1, 128, bf16), (8, 1, 64, bf16), (4, 1, 256, bf16),
                            (1, 2048, 128, bf16), (4, 2048, 128, bf16), (7, 2048, 80, bf16),
                            (4, 2048, 64, bf16), (4, 2048, 256, bf16), (4, 2048, 128, torch.float16),
                            (4, 2048, 128, torch.float32), (4, 2048, 256, torch.float32),
                            (8, 1, 128, torch.float32)]
    ]
    out += [(f"split-KV g{g} d{d} {str(dt)[6:]}", attention, split,
             _attention_case(g, 1, d, dt, splits=8))
            for g, d, dt in [(1, 128, bf16), (4, 128, bf16), (8, 64, bf16), (4, 256, bf16),
                             (4, 128, torch.float32), (4, 256, torch.float32)]]
    out += [(f"{kind} g4 q{q} d{d} {str(dt)[6:]} over fp8 KV", attention, names,
             _attention_case(4, q, d, dt, splits, fp8_cache=True))
            for kind, names, q, splits in [("attention", unified, 1, 1), ("attention", unified, 2048, 1),
                                           ("split-KV", split, 1, 8)]
            for d, dt in [(128, bf16), (256, bf16), (128, torch.float16), (128, torch.float32)]]
    for width in (4096, 8192, 16384):
        out += _row_cases(width)
    x = torch.empty(2, 2 * 14336, dtype=bf16)
    out.append(("silu_and_mul+static fp8", activation, ["_silu_and_mul_kernel"],
                lambda: activation.silu_and_mul_triton(x, scale=torch.ones(1))))
    kv, cache = torch.empty(2, 8, 128, dtype=bf16), torch.empty(4, 16, 8, 128, dtype=bf16)
    out.append(("reshape_and_cache", kv_cache, ["_reshape_and_cache_kernel"],
                lambda: kv_cache.reshape_and_cache_triton(kv, kv, cache, cache,
                                                          torch.zeros(2, dtype=torch.long))))
    for tokens, q_heads, k_heads, dim in [(1, 32, 8, 128), (1, 14, 2, 64), (2048, 32, 8, 128)]:
        q, k = torch.empty(tokens, q_heads, dim, dtype=bf16), torch.empty(tokens, k_heads, dim, dtype=bf16)
        angles = torch.empty(tokens, dim // 2, dtype=bf16)
        out.append((f"rotary_qk t{tokens} h{q_heads}/{k_heads} d{dim}", rotary, ["_rotary_qk_kernel"],
                    lambda q=q, k=k, angles=angles: rotary.rotary_qk_triton(q, k, angles, angles)))
    out += _lora_cases()
    out += _gemv_cases()
    fp8_cache = torch.empty(4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    out.append(("reshape_and_cache into fp8", kv_cache, ["_reshape_and_cache_kernel"],
                lambda: kv_cache.reshape_and_cache_triton(kv, kv, fp8_cache, fp8_cache, torch.zeros(2, dtype=torch.long),
                                                          torch.ones(1), torch.ones(1))))
    return out


def _gemv_cases() -> list[tuple[str, Any, list[str], Callable[[], None]]]:
    """Every branch of ``gemv.config_for``: the 8B- and 0.5B-shaped projections it was chosen on."""
    bf16, out = torch.bfloat16, []
    for n, k, bias in [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False), (4096, 14336, False),
                       (1152, 896, True)]:
        for rows in (1, 2):
            x, w = torch.empty(rows, k, dtype=bf16), torch.empty(n, k, dtype=bf16)
            b = torch.empty(n, dtype=bf16) if bias else None
            out.append((f"gemv {rows}x{n}x{k}", gemv, ["_gemv_kernel"], lambda x=x, w=w, b=b: gemv.gemv_triton(x, w, b)))
    for n, k in [(28672, 4096), (9728, 896)]:
        for rows in (1, 2):
            x, w = torch.empty(rows, k, dtype=bf16), torch.empty(n, k, dtype=bf16)
            out.append((f"gemv+silu {rows}x{n}x{k}", gemv, ["_gemv_silu_mul_kernel"],
                        lambda x=x, w=w: gemv.gemv_silu_mul_triton(x, w)))
    # The RMSNorm prologue (passes/norm_linear.py): the two sites of a layer, with and without
    # the residual add, at the row counts whose calls take the kernel (dense_linear.takes_gemv).
    for n, k, silu_mul, residual in [(6144, 4096, False, True), (28672, 4096, True, True), (1152, 896, False, False),
                                     (9728, 896, True, True)]:
        for rows in (1, 2):
            x, w = torch.empty(rows, k, dtype=bf16), torch.empty(n, k, dtype=bf16)
            if not dense_linear.takes_gemv(x, w):
                continue
            norm = gemv.NormPrologue(torch.empty(k, dtype=bf16), 1e-6, torch.empty(rows, k, dtype=bf16) if residual else None)
            out.append((f"norm+gemv{'+silu' if silu_mul else ''} {rows}x{n}x{k}", gemv,
                        ["_gemv_silu_mul_kernel" if silu_mul else "_gemv_kernel"],
                        lambda x=x, w=w, norm=norm, silu_mul=silu_mul: gemv.rms_norm_gemv_triton(x, norm, w, None, silu_mul)))
    return out


def run_all() -> list[Usage]:
    """Every case's launches, then each PDL-capable kernel's first launch again with
    programmatic dependent launch on (``common.pdl_launch``: what VGRAPH_PDL=1 gives on sm_90),
    whose PTX must wait on the kernel before it."""
    usages, first = [], {}
    for label, module, names, call in cases():
        with recording(module, *names) as recorders:
            call()
        for name, recorder in recorders.items():
            usages += [compile_launch(label, name, recorder.kernel, launch) for launch in recorder.launches]
            if recorder.launches and "USE_PDL" in recorder.launches[0].kwargs:
                first.setdefault(name, (label, recorder.kernel, recorder.launches[0]))
    for name, (label, kernel, launch) in first.items():
        pdl = Launch(launch.grid, launch.args, {**launch.kwargs, "USE_PDL": True, "launch_pdl": True})
        usages.append(compile_launch(f"{label} [pdl]", name, kernel, pdl, require="griddepcontrol.wait"))
    return usages


def problems(usages: list[Usage]) -> list[str]:
    found = [f"{u.case} {u.kernel}: {u.spill_bytes} spill bytes, {u.shared_bytes} shared"
             for u in usages if u.spill_bytes or u.shared_bytes > SHARED_LIMIT]
    for u in usages:
        if not u.case.endswith("[pdl]"):
            continue
        if u.kernel in PREFETCHING and not u.loads_before_wait:
            found.append(f"{u.case} {u.kernel}: no weight load before griddepcontrol.wait")
        if u.kernel not in PREFETCHING and u.loads_before_wait:
            found.append(f"{u.case} {u.kernel}: {u.loads_before_wait} loads before griddepcontrol.wait")
    return found


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    usages = run_all()
    if "--json" in sys.argv:
        print(json.dumps([asdict(u) for u in usages]))
    else:
        for u in usages:
            print(f"{u.case:36s} {u.kernel:32s} warps {u.num_warps}  regs {u.registers:3d}  "
                  f"spill {u.spill_bytes:5d} B  shared {u.shared_bytes:6d} B"
                  + (f"  loads before the wait {u.loads_before_wait}" if u.case.endswith("[pdl]") else ""))
    return 1 if problems(usages) else 0


if __name__ == "__main__":
    sys.exit(main())
