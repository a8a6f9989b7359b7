"""Loads a Hugging Face checkpoint directory (or hub id) into vgraph's model modules.

Only safetensors checkpoints are read (single file or sharded with an index), which lets
weights stream tensor by tensor straight into the model's preallocated parameters without
materializing a second copy of the model. The hub is touched only for ids that are not local
directories, so everything works offline given a local path.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from vgraph.config import ModelConfig, resolve_dtype

from ..distributed.state import pp_stage, tp_group
from ..lora.config import LoRAConfig
from .checkpoint_record import (CheckpointRecords, ModelConfigView, config_view, record_tokenizer,
                                recorded_tokenizer)
from .quantization import Fp8Config, Fp8Linear, Fp8MergedLinear, quantize_weight, resolve_quantization
from .registry import get_model_class

logger = logging.getLogger("vgraph")

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# What a hub download fetches: config, weights, tokenizer and generation defaults only.
HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", SAFETENSORS_INDEX,
    "tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.tiktoken",
    "tokenizer.model", "chat_template*",
]


@dataclass(frozen=True)
class LoadStats:
    weights_bytes: int  # parameter bytes in the loaded dtype (what the weights occupy)
    load_seconds: float  # config read + model build + weight copy


def format_bytes(num_bytes: int) -> str:
    """Human-readable size in MiB below 1 GiB, else GiB."""
    if num_bytes < 2**30:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**30:.2f} GiB"


class ModelLoadError(RuntimeError):
    """The model named by the user cannot be found, fetched or read (a truncated weight file,
    a config.json that is not JSON); the message names the file and says what to do. The CLI
    prints it as one line and exits 2."""


def resolve_model_path(name_or_path: str, revision: Optional[str] = None) -> str:
    """A local directory as is; anything else is a hub id fetched (or found in the HF cache).

    Raises RuntimeError with a plain explanation when the id cannot be fetched (offline,
    unknown repo, network error), since the raw hub exceptions do not say what to do instead.
    """
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if expanded.startswith(("/", "./", "../")) or os.path.exists(expanded):
        raise ModelLoadError(f"model path {name_or_path!r} is not a directory")
    return _snapshot_download(name_or_path, revision)


def _snapshot_download(repo_id: str, revision: Optional[str]) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as exc:  # hub errors have many types (offline, 404, auth, network, bad id)
        raise ModelLoadError(
            f"could not fetch model {repo_id!r} from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}); check the model id and network access, or pass a "
            "local directory path containing config.json and *.safetensors, which works "
            "offline") from exc


def _read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; ModelLoadError naming it when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON (a half-written copy)
        raise ModelLoadError(f"cannot read {path}: {exc}; the checkpoint is damaged or incomplete") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object; the checkpoint is damaged")
    return data


def load_hf_config(path: str, records: Optional[CheckpointRecords] = None) -> ModelConfigView:
    """The checkpoint's transformers config, as a read-only view of its fields, after checking
    the architecture is one vgraph runs.

    The architecture check reads config.json directly first, so an unsupported model gets
    vgraph's error (naming what is supported) rather than a transformers one. The view comes
    from the checkpoint record when a start before recorded it (``checkpoint_record``: no
    transformers config import), else from AutoConfig.
    """
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    get_model_class(_read_json(config_file).get("architectures"))
    records = CheckpointRecords.default() if records is None else records
    return config_view(Path(path), lambda: _auto_config(path, config_file), records)


def _auto_config(path: str, config_file: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # valid JSON that transformers rejects
        raise ModelLoadError(f"cannot load {config_file} ({type(exc).__name__}: {_first_line(exc)})") from None


def safetensors_files(path: str) -> list[Path]:
    """The weight files: the index's shards, else model.safetensors, else any *.safetensors."""
    root = Path(path)
    if (root / SAFETENSORS_INDEX).is_file():
        weight_map = _read_json(root / SAFETENSORS_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{root / SAFETENSORS_INDEX} has no weight_map; the checkpoint is damaged")
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{root / SAFETENSORS_INDEX} lists weight files that are not in {path}: "
                                    f"{', '.join(missing)}")
        return files
    if (root / SAFETENSORS_FILE).is_file():
        return [root / SAFETENSORS_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (other weight formats "
                                "are not supported)")
    return files


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, CPU tensor) one at a time, so peak extra memory is one tensor.

    A file safetensors cannot read (truncated by an interrupted copy or download, or not
    safetensors at all) is a ModelLoadError naming it."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    yield name, tensor
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read weights from {file} ({exc}); the file is truncated or "
                                 "damaged: copy or download it again") from None


def checkpoint_dtype(hf_config: Any) -> Optional[torch.dtype]:
    """The dtype the checkpoint declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def load_model(model_config: ModelConfig, device: torch.device | str, use_custom_ops: bool = True,
               lora_config: Optional[LoRAConfig] = None) -> tuple[nn.Module, Any, LoadStats]:
    """Builds the model for ``model_config.model`` on ``device`` and loads its weights.

    With ``model_config.load_format == "dummy"`` no weights are read: the parameters are
    filled in place with seeded random values (see :func:`init_dummy_weights`), so only
    config.json is needed. ``use_custom_ops=False`` builds norms and activations in plain torch (for Inductor to
    generate). Under tensor parallelism (``tp_group()`` of more than one rank) the model holds this
    rank's shard, cut from each checkpoint tensor as it streams in. Quantization follows ``model_config.quantization`` unless the checkpoint is
    itself fp8, which then decides (see quantization.resolve_quantization); an unsupported
    value raises ValueError before anything is built. ``lora_config`` builds the model with
    LoRA adapter slots (vgraph/lora); without it the model is exactly the plain one.
    """
    start = time.perf_counter()
    path = resolve_model_path(model_config.model, model_config.revision)
    hf_config = load_hf_config(path)
    model_cls = get_model_class(hf_config.architectures)
    quant = resolve_quantization(model_config.quantization, hf_config)
    dtype = resolve_dtype(model_config.dtype, checkpoint_dtype(hf_config))
    extra = {"lora_config": lora_config} if lora_config is not None else {}  # LoRA: see vgraph/lora
    if pp_stage().size > 1:  # pipeline parallelism: this stage's layers only (vgraph/distributed/pipeline.py)
        extra["pp"] = pp_stage()
    model = model_cls(hf_config, dtype, device, max_model_len=model_config.max_model_len,
                      use_custom_ops=use_custom_ops, quant_config=quant, tp=tp_group(), **extra)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iterate_weights(path))
    model.eval()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    stats = LoadStats(weights_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                      load_seconds=time.perf_counter() - start)
    dummy = ", dummy random weights" if model_config.load_format == "dummy" else ""
    tp, pp = tp_group(), pp_stage()
    shard = f", rank {tp.rank} of {tp.world_size}" if tp.is_parallel else ""
    if pp.size > 1:
        shard += f", stage {pp.index} of {pp.size} (layers %d-%d)" % _layer_span(model)
    logger.info("Loaded model %s (%s, %s%s%s%s): %s of weights in %.2f s", model_config.model,
                hf_config.architectures[0], str(dtype).removeprefix("torch."), _describe(quant),
                dummy, shard, format_bytes(stats.weights_bytes), stats.load_seconds)
    return model, hf_config, stats


def _layer_span(model: nn.Module) -> tuple[int, int]:
    """First and last decoder layer a pipeline stage holds."""
    layers = model.model.layer_range
    return layers.start, layers.stop - 1


DUMMY_STD = 0.02  # transformers' default initializer_range
DUMMY_FP8_INPUT_SCALE = 8.0 / 448  # static fp8: activations up to |8| fit the e4m3 range


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fills every parameter in place, on its device, with seeded random values: norm
    weights ~ N(1, 0.02), everything else (embeddings, projections, biases) ~ N(0, 0.02).

    For speed only the shapes and dtypes matter; the values are kept small and sane so a
    forward stays finite. fp8 layers of a checkpoint stored in fp8 get a random weight
    quantized per shard with its own ``weight_scale`` (amax / 448) and, for static
    activations, ``input_scale`` = 8 / 448; a model quantized at load (``quantization="fp8"``
    on a high-precision config) is filled in high precision and then quantized as after a
    real load. The fused fp8 layers then settle their scales (``finalize``).
    """
    first = next(model.parameters())
    gen = torch.Generator(device=first.device).manual_seed(seed)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    own = {id(p) for m in fp8_layers for p in (m.weight, m.weight_scale, m.input_scale) if p is not None}
    for name, param in model.named_parameters():
        if id(param) in own:
            continue
        mean = 1.0 if name.endswith("norm.weight") else 0.0
        param.data.normal_(mean, DUMMY_STD, generator=gen)
    for layer in fp8_layers:
        _init_dummy_fp8(layer, gen)
    model._process_after_loading()


def _init_dummy_fp8(layer: Fp8Linear, gen: torch.Generator) -> None:
    """Random e4m3 weight (per shard for a fused layer, as a checkpoint stores it) and scales."""
    shards = list(layer.shards.items()) if isinstance(layer, Fp8MergedLinear) else [(None, (0, layer.out_features))]
    for index, (_, (start, size)) in enumerate(shards):
        weight = torch.empty(size, layer.in_features, dtype=torch.float32, device=layer.weight.device)
        weight.normal_(0.0, DUMMY_STD, generator=gen)
        q, scale = quantize_weight(weight)
        layer.weight.data.narrow(0, start, size).copy_(q)
        layer.weight_scale.data.narrow(0, index, 1).copy_(scale)
        del weight, q
    if layer.input_scale is not None:
        layer.input_scale.data.fill_(DUMMY_FP8_INPUT_SCALE)


def _describe(quant: Optional[Fp8Config]) -> str:
    if quant is None:
        return ""
    activations = "static" if quant.static_activations else "dynamic per-token"
    source = "checkpoint" if quant.serialized else "quantized at load"
    return f", fp8 weights ({source}), {activations} activation scales"


# transformers imports its classes lazily, and two threads doing that first import at once can
# see a half-initialized module ("cannot import name 'AutoTokenizer'"): the clients of
# data-parallel engine-core processes load their tokenizers on worker threads, together.
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(path: str, revision: Optional[str] = None) -> Any:
    """The checkpoint's tokenizer via transformers (a local dir or a hub id); one load at a time
    per process (see ``_TOKENIZER_LOCK``)."""
    with _TOKENIZER_LOCK:
        return _load_tokenizer(path, revision)


def _load_tokenizer(path: str, revision: Optional[str]) -> Any:
    local = Path(resolve_model_path(path, revision))
    records = CheckpointRecords.default()
    try:
        tokenizer = recorded_tokenizer(local, records)
        if tokenizer is None:
            tokenizer = _auto_tokenizer(local)
            record_tokenizer(local, tokenizer, records)
        return tokenizer
    except Exception as exc:  # transformers raises many types for missing or damaged files
        raise ModelLoadError(f"cannot load the tokenizer from {local} ({type(exc).__name__}: "
                             f"{_first_line(exc)}); check its tokenizer files") from None


def _auto_tokenizer(local: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local))


def _first_line(exc: Exception) -> str:
    """Transformers' messages run to paragraphs; the CLI prints one line."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def load_generation_config(path: str) -> set[int]:
    """The end-of-sequence token ids generation stops at.

    config.json's ``eos_token_id`` (an int or a list) is the fallback; generation_config.json,
    when present and naming eos ids, overrides it, as transformers' generate() does (Llama 3
    instruct, for one, lists several stop ids only there).
    """
    root = Path(path)
    eos: set[int] = set()
    if (root / "config.json").is_file():
        eos = _as_id_set(_read_json(root / "config.json").get("eos_token_id"))
    if (root / "generation_config.json").is_file():
        eos = _as_id_set(_read_json(root / "generation_config.json").get("eos_token_id")) or eos
    return eos
