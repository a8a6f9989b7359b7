"""The LoRA tests' adapters (made by ``vgraph.testing.lora_adapters``, shared per process)
and their oracle, transformers + PEFT (no pytest here)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch
import transformers

from vgraph.testing.lora_adapters import ALL_MODULES, make_adapter  # noqa: F401  (the tests import them from here)


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
