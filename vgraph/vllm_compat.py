"""vLLM's spellings that have no field of their own here: ``-O``/``--compilation-config`` (a
level or a JSON object, mapped onto CompileConfig fields) and the flags vgraph accepts so that
a ``vllm serve`` command line runs unchanged, or refuses in one line saying why.

Flags that do name a vgraph setting are aliases on that setting's field instead (``aliases``
and ``positive`` in ``vgraph.config.cli``), so each setting keeps one flag and one default.
docs/vllm-compat.md lists every flag and what vgraph does with it. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Mapping

# vLLM's compilation levels (and its newer -O optimization levels): 0 runs eagerly, every
# other level compiles; vgraph has one way to compile (its piecewise Inductor backend).
LEVELS = {0: "none", 1: "compiled", 2: "compiled", 3: "compiled"}


def _level(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or value not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(map(str, LEVELS))}, got {value!r}")
    return {"level": LEVELS[value]}


def _custom_ops(value: Any) -> dict[str, Any]:
    """vLLM's list names ops one by one ("+rms_norm"); vgraph's ops go on or off together."""
    if value in (["all"], ["none"]):
        return {"custom_ops": value == ["all"]}
    raise ValueError(f"custom_ops must be [\"all\"] or [\"none\"] (vgraph turns its ops on or off together), "
                     f"got {value!r}")


_PASS_KEYS = {"enable_fusion": "enable_fusion", "enable_fi_allreduce_fusion": "enable_allreduce_fusion"}


def _pass_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"pass_config must be an object, got {value!r}")
    unknown = sorted(set(value) - set(_PASS_KEYS))
    if unknown:
        raise ValueError(f"pass_config key {unknown[0]!r} is not one vgraph has; it knows "
                         f"{', '.join(_PASS_KEYS)}")
    return {_PASS_KEYS[k]: v for k, v in value.items()}


def _to(field: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {field: convert(value)}


# vLLM's CompilationConfig key -> the CompileConfig fields it sets.
KEYS: Mapping[str, Callable[[Any], dict[str, Any]]] = {
    "level": _level,
    "mode": _level,
    "cudagraph_mode": _to("cudagraph_mode", lambda v: v.lower() if isinstance(v, str) else v),
    "cudagraph_capture_sizes": _to("cudagraph_capture_sizes"),
    "max_capture_size": _to("max_capture_size"),
    "max_cudagraph_capture_size": _to("max_capture_size"),
    "compile_sizes": _to("compile_sizes"),
    "splitting_ops": _to("splitting_ops"),
    "debug_dump_path": _to("dump_graphs_dir"),
    "custom_ops": _custom_ops,
    "pass_config": _pass_config,
}


def compilation_config(text: str) -> dict[str, Any]:
    """``-O`` / ``--compilation-config``: a level (``-O3``) or a JSON object of vLLM's
    CompilationConfig keys, as CompileConfig keywords. A key vgraph has no counterpart for is
    an error naming it: silently ignoring it would run something other than what was asked."""
    text = text.strip()
    if text.isdigit():
        return _level(int(text))
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"-O/--compilation-config takes a level (0-3) or a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"-O/--compilation-config takes a level (0-3) or a JSON object, got {text!r}")
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if key not in KEYS:
            raise ValueError(f"-O/--compilation-config: unknown key {key!r}; vgraph maps {', '.join(KEYS)}")
        try:
            fields.update(KEYS[key](item))
        except ValueError as exc:
            raise ValueError(f"-O/--compilation-config: {exc}") from None
    return fields


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The vLLM engine flags without a vgraph field: accepted, and checked by ``check``."""
    g = p.add_argument_group("vLLM compatibility (docs/vllm-compat.md)")
    g.add_argument("-O", "--compilation-config", default=None, metavar="LEVEL_OR_JSON",
                   help="vLLM's compilation config: a level (-O0 runs eagerly, -O1 to -O3 compile) or a JSON "
                        "object whose keys set the compile options above (level, cudagraph_mode, "
                        "cudagraph_capture_sizes, compile_sizes, splitting_ops, max_capture_size, "
                        "debug_dump_path, custom_ops, pass_config); default: none, the options' own defaults")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; vgraph never runs code from a checkpoint: it runs its own model "
                        "implementations, and a model it has none for is refused at load (off by default)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted; vgraph logs no periodic engine statistics, so there is nothing to turn off "
                        "(its statistics are on /metrics) (off by default)")


# The sampling settings a checkpoint's generation_config.json may recommend, as vLLM reads them.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_generation_config(source: str) -> None:
    """``--generation-config``: vllm, auto, or a directory with a generation_config.json."""
    if source in ("vllm", "auto") or (Path(source) / "generation_config.json").is_file():
        return
    raise ValueError(f"generation_config {source!r} is neither vllm, auto nor a directory holding a "
                     "generation_config.json")


def sampling_defaults(source: str, model_path: str) -> dict[str, Any]:
    """The sampling settings requests get when they do not send them: none for ``vllm``
    (vgraph's own defaults), the model's generation_config.json for ``auto`` (a checkpoint
    without one recommends nothing), that of the directory ``source`` otherwise."""
    if source == "vllm":
        return {}
    path = Path(model_path if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return {key: config[key] for key in SAMPLING_DEFAULT_KEYS if config.get(key) is not None}
