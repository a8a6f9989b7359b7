"""``vgraph doctor``: does the CUDA path work on this machine? One command, about a minute.

The first person with a GPU should not have to read the test suite to find out. It checks,
in order, and says what failed:

1. the device: name, compute capability, memory, torch and triton versions;
2. every Triton kernel against its plain-torch reference (``vgraph ops check``);
3. a tiny model with CUDA graphs captured (FULL and PIECEWISE): the capture report (graph
   count, time, graph memory against what was reserved for it), and greedy tokens with
   graphs equal to the same model run eagerly, over batch sizes that cross several buckets.

Without CUDA it says so and exits 1: nothing here can be checked on a CPU (the CPU twin of
these checks is the test suite). ``check_graphs`` itself runs on any device, so the same code
path is tested on CPU, where the buckets run the compiled forward at padded sizes.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

CAPTURE_SIZES = [1, 2, 4, 8, 16]
BATCH_SIZES = [1, 3, 8, 13]
NEW_TOKENS = 8


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str


def device_facts(device: torch.device) -> Finding:
    import triton
    props = torch.cuda.get_device_properties(device)
    major, minor = torch.cuda.get_device_capability(device)
    return Finding("device", True, f"{props.name}, sm{major}{minor}, {props.total_memory / 2**30:.1f} GiB, "
                                   f"{props.multi_processor_count} SMs; torch {torch.__version__}, "
                                   f"triton {triton.__version__}, CUDA {torch.version.cuda}")


def check_kernels(device: torch.device) -> list[Finding]:
    from vgraph.ops.selfcheck import run_checks
    findings = []
    for r in run_checks(device.type):
        dtype = str(r.dtype).removeprefix("torch.")
        findings.append(Finding(f"kernel {r.op} ({dtype})", r.ok,
                                f"max rel err {r.max_rel_error:.3g} (tolerance {r.tolerance:.3g})"))
    return findings


def check_graphs(device: torch.device, workdir: str) -> list[Finding]:
    """A tiny fp32 Llama with every graph kind, against the same model run eagerly."""
    from vgraph import LLM, SamplingParams
    from vgraph.config import CompileConfig
    from vgraph.models.demo import build_tiny_checkpoint

    path = build_tiny_checkpoint(f"{workdir}/tiny-llama", "llama", seed=0)
    common = dict(dtype="float32", device=device.type, num_gpu_blocks=512, max_num_seqs=16,
                  max_num_batched_tokens=256)
    start = time.perf_counter()
    graphs = LLM(path, compile_config=CompileConfig(cudagraph_mode="full_and_piecewise",
                                                    cudagraph_capture_sizes=CAPTURE_SIZES), **common)
    built = time.perf_counter() - start
    eager = LLM(path, enforce_eager=True, **common)
    report = graphs.engine.runner.startup.capture
    findings = [Finding("capture", device.type != "cuda" or report.full_graphs > 0,
                        f"{report.full_graphs} FULL + {report.piecewise_graphs} PIECEWISE graphs in "
                        f"{report.seconds:.2f} s (engine built in {built:.1f} s); graph memory "
                        f"{report.memory_bytes / 2**20:.1f} MiB")]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for n in BATCH_SIZES:
        prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 3 + 5 * i))} for i in range(n)]
        with_graphs = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
        plain = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for a, b in zip(with_graphs, plain))
        findings.append(Finding(f"greedy tokens, {n} requests", same == n,
                                f"{same}/{n} equal to the eager model"))
    counters = graphs.engine.runner.compile_counters
    findings.append(Finding("no recompile", counters.recompiles == 0, f"{counters.recompiles} recompiles"))
    return findings


def run(device: torch.device, print_line: Callable[[str], None] = print) -> int:
    """Runs every check on ``device`` and prints one line each; 0 when all pass."""
    if device.type != "cuda" or not torch.cuda.is_available():
        print_line("vgraph doctor: no CUDA device on this machine: the CUDA path cannot be checked here "
                   "(the test suite checks its CPU twin: bash scripts/test.sh)")
        return 1
    findings: list[Finding] = [device_facts(device)]
    findings += _guarded("kernels", lambda: check_kernels(device))
    with tempfile.TemporaryDirectory(prefix="vgraph-doctor-") as workdir:
        findings += _guarded("CUDA graphs", lambda: check_graphs(device, workdir))
    return report(findings, print_line)


def _guarded(name: str, check: Callable[[], list[Finding]]) -> list[Finding]:
    """A check that raises is one failed finding with the error, and the next check still runs."""
    try:
        return check()
    except Exception as exc:  # the doctor reports every failure; it never stops at the first
        return [Finding(name, False, f"{type(exc).__name__}: {exc}")]


def report(findings: Sequence[Finding], print_line: Callable[[str], None] = print) -> int:
    for f in findings:
        print_line(f"{'ok  ' if f.ok else 'FAIL'}  {f.check}: {f.detail}")
    failed = [f for f in findings if not f.ok]
    print_line(f"{len(findings) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
