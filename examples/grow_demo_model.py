"""Grows the demo model into a larger one that starts out computing the same function, for a
target/draft pair: train the grown model further (examples/train_demo_model.py --init-from)
and it becomes a bigger model of its own whose guesses the demo model, as its draft, often
gets right, as a distilled draft would.

Growth keeps the function exactly: every demo layer's MLP is widened to
``--intermediate-size`` with the new neurons' ``down_proj`` columns zero, and ``--extra-layers``
new decoder layers follow each demo layer with ``o_proj`` and ``down_proj`` zero (the residual
passes through them unchanged). The other new weights are random (seeded), so training moves
the new parts at once. The result: an ordinary Llama checkpoint with the demo's tokenizer,
fp16 weights declaring float32 (as the demo's), and a ``training.json`` saying how it was made.

    python examples/grow_demo_model.py --out /tmp/demo-grown
    python examples/train_demo_model.py --init-from /tmp/demo-grown --out /tmp/demo-big \\
        --max-steps 120 --batch-size 4 --lr 3e-4 --warmup-steps 10 --threads 2 --line-start-fraction 0.5
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from vgraph.models.demo import demo_model_dir, quiet_progress_bars

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def grow(demo: Path, intermediate_size: int, extra_layers: int, seed: int) -> torch.nn.Module:
    """The grown model, its demo parts copied in and its new outputs zero."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    small = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    config = small.config.__class__.from_dict(small.config.to_dict())
    config.intermediate_size = intermediate_size
    config.num_hidden_layers = small.config.num_hidden_layers * (1 + extra_layers)
    torch.manual_seed(seed)
    big = LlamaForCausalLM(config)
    with torch.no_grad():
        big.model.embed_tokens.weight.copy_(small.model.embed_tokens.weight)
        big.model.norm.weight.copy_(small.model.norm.weight)
        for index, layer in enumerate(big.model.layers):
            if index % (1 + extra_layers) == 0:
                _copy_layer(small.model.layers[index // (1 + extra_layers)], layer)
            else:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return big


def _copy_layer(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """A demo layer into a wider one: attention and norms as they are, the MLP's first neurons
    as the demo's and the new ones silent (their down_proj columns zero)."""
    width = source.mlp.gate_proj.weight.shape[0]
    target.self_attn.load_state_dict(source.self_attn.state_dict())
    target.input_layernorm.load_state_dict(source.input_layernorm.state_dict())
    target.post_attention_layernorm.load_state_dict(source.post_attention_layernorm.state_dict())
    target.mlp.gate_proj.weight[:width].copy_(source.mlp.gate_proj.weight)
    target.mlp.up_proj.weight[:width].copy_(source.mlp.up_proj.weight)
    target.mlp.down_proj.weight.zero_()
    target.mlp.down_proj.weight[:, :width].copy_(source.mlp.down_proj.weight)


def save(model: torch.nn.Module, demo: Path, out: Path, info: dict) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():
        model.save_pretrained(out)
    weights = out / "model.safetensors"
    save_file({k: v.to(torch.float16) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        shutil.copy(demo / name, out / name)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--intermediate-size", type=int, default=4096)
    parser.add_argument("--extra-layers", type=int, default=2, help="new layers after each demo layer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    demo = Path(demo_model_dir())
    model = grow(demo, args.intermediate_size, args.extra_layers, args.seed)
    info = {"grown_from": "demo-model-v1", "intermediate_size": args.intermediate_size,
            "extra_layers_per_demo_layer": args.extra_layers, "seed": args.seed,
            "parameters": sum(p.numel() for p in model.parameters())}
    save(model, demo, args.out, info)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
