"""Host overhead of one engine step: the time a decode step spends outside the model's and the
sampler's compute, phase by phase, at batch 1 / 8 / 32 / 256 on the demo model.

On a GPU these phases run in series with the device (``LLM.step`` is schedule -> execute,
waiting for the tokens -> update), so every millisecond here is a millisecond the device waits.
The suite measures them on the host itself, by timing each phase's function during real decode
steps (``LLM.step``: the engine's step and the output processor's share):

- ``schedule``: ``Scheduler.schedule`` (its step plan included);
- ``runner_requests``: ``RunnerRequests.apply`` (the runner's copies updated from the plan);
- ``batch_build``: ``ForwardRunner.build`` (the flat, padded batch and its metadata);
- ``grammar_masks``: filling structured-output masks (none here: no grammar);
- ``sampling_metadata``: ``SamplingMetadata.from_requests`` (the per-row sampling tensors);
- ``scheduler_update``: ``Scheduler.update`` (tokens folded into the requests, stops);
- ``output_processing``: ``OutputProcessor.process`` (detokenizing, stop strings, outputs);
- ``sampling_sync_and_rest``: the rest of the runner's step outside the forward and sampler
  (the sampled ids' ``.tolist()``, logits slicing) plus the engine's delta building;
- ``forward`` and ``sampler``: the compute, reported but not host overhead.

Host overhead = step wall time - forward - sampler. Every batch size runs the same number of
decode steps after its prefill; medians over the steps. Greedy, ``ignore_eos``, prompts of
16 tokens, the default (compiled) mode at the default thread count, the serial loop
(``async_scheduling=False``: in the overlapped one the phases run beside the forward).

Then the overlap (``overlap`` rows): decode steps of the serial and the overlapped loop, timed
in turns at each batch size, once on the CPU as it is (its forward computes on the engine's
thread at launch: nothing overlaps, and this decides the CPU default) and once on an emulated
device (vgraph/testing/emulated_device.py: each launched step also occupies a device queue for
``DEVICE_MS``, and reading its ids waits for it, as on a GPU), where the serial step costs
about device + host and the overlapped one about max(device, host).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from typing import Any, Iterator

SIZES = (1, 8, 32, 256)
PROMPT_LEN = 16
HOST_PHASES = ("schedule", "runner_requests", "batch_build", "grammar_masks", "sampling_metadata", "scheduler_update",
               "output_processing", "sampling_sync_and_rest")
TARGET_MS = {1: 0.3, 256: 3.0}  # issue 33's targets for host time per step on this CPU
OVERLAP_SIZES = (1, 32, 256)
DEVICE_MS = 3.0  # the emulated device's time per forward


@contextlib.contextmanager
def _timed(owner: Any, name: str, phase: str, sink: dict[str, float]) -> Iterator[None]:
    """Wraps ``owner.name`` so each call adds its wall time to ``sink[phase]``."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink[phase] += time.perf_counter() - start

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _instrumented(llm: Any, sink: dict[str, float]) -> contextlib.ExitStack:
    from vgraph.core.scheduler import Scheduler
    from vgraph.engine.output_processor import OutputProcessor
    from vgraph.engine import llm_engine as engine_module
    from vgraph.worker.runner_requests import RunnerRequests
    from vgraph.worker.cuda_graphs import ForwardRunner
    from vgraph.worker.sampler import Sampler, SamplingMetadata
    stack = contextlib.ExitStack()
    targets: list[tuple[Any, str, str]] = [
        (Scheduler, "schedule", "schedule"), (RunnerRequests, "apply", "runner_requests"),
        (ForwardRunner, "build", "batch_build"), (engine_module, "fill_masks", "grammar_masks"), (ForwardRunner, "run", "forward"),
        (llm.engine.runner.model, "compute_logits", "forward"), (SamplingMetadata, "from_requests", "sampling_metadata"),
        (Sampler, "__call__", "sampler"), (Scheduler, "update", "scheduler_update"),
        (OutputProcessor, "process", "output_processing")]
    for owner, name, phase in targets:
        stack.enter_context(_timed(owner, name, phase, sink))
    return stack


def measure(llm: Any, size: int, steps: int) -> dict[str, float]:
    """Median milliseconds per decode step of ``size`` sequences, per phase."""
    from vgraph import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(size):
        llm.add_request(f"b{size}-{i}", [10 + (i * 7 + j) % 3000 for j in range(PROMPT_LEN)], params)
    while llm.engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                  for r in llm.engine.scheduler.running):
        llm.step()  # prefill (and the first tokens), not measured
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        sink: dict[str, float] = defaultdict(float)
        with _instrumented(llm, sink):
            start = time.perf_counter()
            llm.step()
            wall = time.perf_counter() - start
        named = sum(sink[p] for p in HOST_PHASES if p != "sampling_sync_and_rest")
        sink["sampling_sync_and_rest"] = wall - named - sink["forward"] - sink["sampler"]
        sink["wall"], sink["host"] = wall, wall - sink["forward"] - sink["sampler"]
        for phase, seconds in sink.items():
            samples[phase].append(seconds * 1e3)
    while llm.has_unfinished_requests():
        llm.step()
    return {phase: statistics.median(values) for phase, values in samples.items()}


def decode_ms(llm: Any, size: int, steps: int) -> float:
    """Wall milliseconds per decode step of ``size`` sequences (median over ``steps``)."""
    from vgraph import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + 6, ignore_eos=True)
    for i in range(size):
        llm.add_request(f"o{size}-{i}-{time.monotonic_ns()}", [10 + (i * 7 + j) % 3000 for j in range(PROMPT_LEN)],
                        params)
    for _ in range(3):
        llm.step()  # prefill and the first decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    while llm.has_unfinished_requests():
        llm.step()
    return statistics.median(times) * 1e3


def measure_overlap(engines: dict[str, Any], sizes: tuple[int, ...], steps: int, rounds: int) -> list[dict]:
    """Serial and overlapped, in turns, on the CPU as it is and on the emulated device."""
    from vgraph.testing.emulated_device import emulated_device
    rows = []
    for size in sizes:
        for device_ms in (0.0, DEVICE_MS):
            times: dict[str, list[float]] = defaultdict(list)
            for _ in range(rounds):
                for name, llm in engines.items():
                    with (emulated_device(llm.engine.runner, device_ms / 1e3) if device_ms
                          else contextlib.nullcontext()):
                        times[name].append(decode_ms(llm, size, steps))
            best = {name: min(values) for name, values in times.items()}
            rows.append({"batch": size, "emulated_device_ms": device_ms, "serial_ms": round(best["serial"], 3),
                         "overlapped_ms": round(best["overlapped"], 3),
                         "speedup": round(best["serial"] / best["overlapped"], 3)})
    return rows


def run(device: str, quick: bool = False) -> dict:
    import os

    from vgraph import LLM
    sizes = SIZES[:2] if quick else SIZES
    steps = 8 if quick else 30
    engines = {name: LLM("demo-model-v1", device=device, max_num_seqs=max(sizes), max_model_len=256,
                         cpu_kv_cache_gib=0.5, async_scheduling=name == "overlapped")
               for name in ("serial", "overlapped")}
    rows = []
    for size in sizes:
        phases = measure(engines["serial"], size, steps)
        rows.append({"batch": size, **{k: round(v, 4) for k, v in phases.items()}})
    overlap = measure_overlap(engines, OVERLAP_SIZES[:2] if quick else OVERLAP_SIZES, steps, 1 if quick else 3)
    return {"suite": "host-overhead", "config": {"device": device, "model": "demo-model-v1 (compiled)",
                                                 "prompt_len": PROMPT_LEN, "decode_steps": steps,
                                                 "load_average": os.getloadavg(), "targets_ms": TARGET_MS,
                                                 "emulated_device_ms": DEVICE_MS},
            "rows": rows, "overlap": overlap}


def summarize(result: dict) -> str:
    header = "batch   wall  forward sampler   host | " + " ".join(f"{p[:10]:>10}" for p in HOST_PHASES)
    lines = [header]
    for r in result["rows"]:
        lines.append(f"{r['batch']:>5} {r['wall']:6.2f} {r['forward']:8.2f} {r['sampler']:7.2f} {r['host']:6.2f} | "
                     + " ".join(f"{r.get(p, 0.0):10.3f}" for p in HOST_PHASES))
    lines.append(f"(ms per decode step, medians; load average {result['config']['load_average']})")
    lines.append("batch  device_ms  serial_ms  overlapped_ms  speedup")
    for r in result.get("overlap", []):
        lines.append(f"{r['batch']:>5} {r['emulated_device_ms']:10.1f} {r['serial_ms']:10.3f} "
                     f"{r['overlapped_ms']:14.3f} {r['speedup']:8.3f}")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    figures = {f"host ms/step, batch {r['batch']}": r["host"] for r in result["rows"]}
    for r in result.get("overlap", []):
        where = f"emulated {r['emulated_device_ms']:g} ms device" if r["emulated_device_ms"] else "cpu"
        figures[f"overlapped/serial speedup, batch {r['batch']}, {where}"] = r["speedup"]
    return figures
