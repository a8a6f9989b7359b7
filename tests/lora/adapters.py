"""Random PEFT LoRA adapters on the tiny checkpoints, for the LoRA tests (no pytest here).

PEFT initializes B to zero (an untrained adapter changes nothing), so every A and B is
redrawn from a seeded generator: an adapter that moves the logits is the only useful oracle.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch
import transformers

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_path: str, out_dir: str | os.PathLike, seed: int, rank: int = 8, alpha: float = 16,
                 targets: tuple[str, ...] = ALL_MODULES, use_rslora: bool = False,
                 safe_serialization: bool = True) -> str:
    """Saves a PEFT LoRA adapter for ``base_path`` with random non-zero weights; returns its folder."""
    import peft
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(os.fspath(out_dir), safe_serialization=safe_serialization)
    return os.fspath(out_dir)


@functools.lru_cache(maxsize=None)
def cached_adapter(base_path: str, root: str, seed: int, rank: int = 8, alpha: float = 16,
                   targets: tuple[str, ...] = ALL_MODULES, use_rslora: bool = False) -> str:
    """``make_adapter`` once per process for the same arguments (tests share adapters)."""
    name = f"lora-{Path(base_path).name}-s{seed}-r{rank}-a{alpha}-{'-'.join(targets)}{'-rs' if use_rslora else ''}"
    return make_adapter(base_path, Path(root) / name, seed, rank, alpha, targets, use_rslora)


def peft_model(base_path: str, adapter_path: Optional[str]) -> torch.nn.Module:
    """transformers (+ PEFT with ``adapter_path``) in fp32, eval mode: the oracle."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_path is None:
        return base.eval()
    import peft
    return peft.PeftModel.from_pretrained(base, adapter_path).eval()


def edit_config(adapter_path: str, **fields) -> None:
    """Rewrites fields of the adapter's adapter_config.json (for the bad-adapter tests)."""
    path = Path(adapter_path) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
