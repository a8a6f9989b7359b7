"""Random PEFT LoRA adapters for a checkpoint: what the LoRA tests compare against
transformers + PEFT, and what the ``lora`` perf suite serves (nothing is downloaded).

PEFT initializes B to zero, so an untrained adapter changes nothing and costs nothing to skip:
every A and B is redrawn from a seeded generator instead.
"""
from __future__ import annotations

import os

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_path: str, out_dir: str | os.PathLike, seed: int, rank: int = 8, alpha: float = 16,
                 targets: tuple[str, ...] = ALL_MODULES, use_rslora: bool = False,
                 safe_serialization: bool = True, std: float = 0.1) -> str:
    """Saves a PEFT LoRA adapter for ``base_path`` with weights drawn N(0, ``std``); returns its folder."""
    import peft
    import torch
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(os.fspath(out_dir), safe_serialization=safe_serialization)
    return os.fspath(out_dir)
