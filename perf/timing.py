"""Interleaved timing of several variants of one computation, and the results-file format."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).parent / "results"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], inner: int, device: str) -> float:
    """Seconds per call, over ``inner`` back-to-back calls (CUDA events on GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def time_variants(variants: dict[str, Callable[[], object]], device: str, reps: int = 15,
                  warmup: int = 3, target_seconds: float = 0.02) -> dict[str, dict]:
    """Times each variant ``reps`` times, rotating the order each round so drift hits all alike.

    Returns per variant: the raw samples (seconds per call) and their median.
    """
    inner = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        _sync(device)
        once = max(_time_once(fn, 1, device), 1e-7)
        inner[name] = max(1, min(1000, int(target_seconds / once)))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            samples[name].append(_time_once(variants[name], inner[name], device))
    return {name: {"median_s": statistics.median(s), "samples_s": s} for name, s in samples.items()}


def machine_info(device: str) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "device": device,
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)
    return path
