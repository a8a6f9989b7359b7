"""Checkpoints for tests and benchmarks (not the product): a static-fp8 Llama in the format
AutoFP8 / llm-compressor write, and the ~26M-parameter Llama the perf suites measure. Both
are deterministic for a seed and need no download; built with the demo model's tokenizer
and model writer (vgraph/models/demo.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..models.demo import SPECIAL_TOKENS, build_tiny_checkpoint, build_tokenizer, random_model, save_tokenizer_files

FP8_STATIC_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "static"}
_CALIBRATION_PROMPTS, _CALIBRATION_LEN = 4, 32


def build_tiny_fp8_static_checkpoint(path: str | os.PathLike, seed: int = 0,
                                     num_layers: int = 2, arch: str = "llama",
                                     **config_overrides: Any) -> str:
    """Writes a tiny ``arch`` checkpoint (the demo architectures: llama, qwen2, qwen3) in the
    static fp8 format of AutoFP8 / llm-compressor (see ``write_fp8_static_checkpoint``);
    ``config_overrides`` replace config fields. Same seed, same files. Returns the directory."""
    tokenizer = build_tokenizer()
    model = random_model(arch, tokenizer, seed, {"num_hidden_layers": num_layers, **config_overrides})
    return write_fp8_static_checkpoint(path, model, tokenizer, seed)


def write_fp8_static_checkpoint(path: str | os.PathLike, model: torch.nn.Module, tokenizer: Any,
                                seed: int = 0) -> str:
    """Writes the fp32 HF ``model`` as a static fp8 checkpoint, as AutoFP8 / llm-compressor do.

    Every decoder projection is stored as an e4m3 ``weight`` with a per-tensor
    ``weight_scale`` (amax / 448) and an ``input_scale`` calibrated the way those tools do:
    the amax of that projection's input over a few random prompts run through the
    high-precision model, / 448. Embeddings, norms and lm_head stay fp32; config.json
    carries ``quantization_config`` {"quant_method": "fp8", "activation_scheme": "static"}.
    Returns the directory.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    input_amax = _calibrate_input_amax(model, seed)
    tensors = _fp8_static_state_dict(model, input_amax)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # What model.save_pretrained records; dtype is that of the unquantized tensors.
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.float32
    model.config.save_pretrained(out)
    _add_quantization_config(out / "config.json", FP8_STATIC_QUANTIZATION_CONFIG)
    save_tokenizer_files(out, tokenizer)
    return str(out)


def _quantized_projections(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The decoder's linear layers by module name (the lm_head is not among them)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"}


@torch.no_grad()
def _calibrate_input_amax(model: torch.nn.Module, seed: int) -> dict[str, float]:
    """max |input| of every decoder projection over a few seeded random prompts."""
    amax: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return hook

    handles = [m.register_forward_pre_hook(record(n))
               for n, m in _quantized_projections(model).items()]
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(len(SPECIAL_TOKENS), model.config.vocab_size,
                        (_CALIBRATION_PROMPTS, _CALIBRATION_LEN), generator=gen)
    try:
        model.eval()(ids)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def _fp8_static_state_dict(model: torch.nn.Module,
                           input_amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """The model's tensors with every decoder projection as (e4m3 weight, weight_scale, input_scale)."""
    from vgraph.models.quantization import quantize_weight
    from vgraph.ops.kernels.host import FP8_MAX

    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the embedding's, as save_pretrained leaves it out
    for name, module in _quantized_projections(model).items():
        q, scale = quantize_weight(module.weight)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale.reshape(())
        tensors[f"{name}.input_scale"] = torch.tensor(input_amax[name] / FP8_MAX, dtype=torch.float32)
    return tensors


def _add_quantization_config(config_file: Path, quantization_config: dict[str, Any]) -> None:
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["quantization_config"] = dict(quantization_config)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_perf_checkpoint(path: str | os.PathLike, seed: int = 0) -> str:
    """A ~26M-parameter Llama-shaped checkpoint (hidden 512, 8 layers, 8 heads, GQA 4 kv heads,
    intermediate 1408) with the demo tokenizer: big enough that GEMMs, not Python, dominate."""
    return build_tiny_checkpoint(path, "llama", seed, hidden_size=512, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=4,
                                 intermediate_size=1408, max_position_embeddings=4096,
                                 initializer_range=0.02)
