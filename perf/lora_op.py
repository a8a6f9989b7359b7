"""``python -m perf.lora_op [--threads N] [--rounds R]``: the cost of ``vgraph::lora_add`` on a
decode step, beside the base projections it rides on, on the perf model's layer shapes (hidden
512, q 512 | k 256 | v 256, intermediate 1408, 8 layers; ``build_perf_checkpoint``).

Why: the issue's target is a decode step of 32 rows over 4 rank-16 adapters at <= 1.3x the base
step on CPU; this isolates what LoRA adds per layer, and picks the CPU kernel among rows
sorted and grouped by slot (the op's CPU kernel), each row's A/B gathered into batched
matmuls (the reference), and every slot applied densely, masked to each row's own (no host
sync). Also times loading a PEFT folder into a free slot of the perf model (from disk, and
from the host cache), and a whole eager decode step (forward
and logits, 256 tokens of context per row) of the perf model with LoRA against without.
Writes ``perf/results/lora-op-cpu.json`` (with ``--threads N``: ``lora-op-cpu-tN.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import tempfile

import torch

import vgraph.ops  # noqa: F401
from vgraph.config import ModelConfig
from vgraph.lora.config import LoRAConfig
from vgraph.lora.layers import LoRAProjection
from vgraph.lora.request import LoRARequest
from vgraph.lora.slots import LoRASlotManager
from vgraph.models.loader import load_model
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from vgraph.testing.checkpoints import build_perf_checkpoint

from .timing import machine_info, write_results
from vgraph.ops.linear import pack_weight
from vgraph.ops.lora import lora_add_dense, lora_add_grouped, lora_add_reference

HIDDEN, Q, KV, INTER, LAYERS = 512, 512, 256, 1408, 8
# (name, in, slices): the four adapted projections of a layer.
PROJECTIONS = [("qkv", HIDDEN, [("q_proj", Q), ("k_proj", KV), ("v_proj", KV)]), ("o", Q, [("o_proj", HIDDEN)]),
               ("gate_up", HIDDEN, [("gate_proj", INTER), ("up_proj", INTER)]), ("down", INTER, [("down_proj", HIDDEN)])]


def _median_us(fn, rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _layer_inputs(batch: int, adapters: int, rank: int, gen: torch.Generator):
    token_slots = (torch.arange(batch) % adapters)[torch.randperm(batch, generator=gen)].to(torch.int32)
    layers = []
    for _, in_features, slices in PROJECTIONS:
        out = sum(size for _, size in slices)
        weight = torch.randn(out, in_features, generator=gen) * 0.02
        lora_a = torch.randn(adapters, len(slices) * rank, in_features, generator=gen) * 0.02
        lora_b = [torch.randn(adapters, size, rank, generator=gen) * 0.02 for _, size in slices]
        layers.append((torch.randn(batch, in_features, generator=gen), pack_weight(weight), out, lora_a, lora_b))
    return token_slots, layers


def measure(batch: int, adapters: int, rank: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    token_slots, layers = _layer_inputs(batch, adapters, rank, gen)
    bases = [torch.ops.vgraph.packed_linear(x, packed, None, out) for x, packed, out, _, _ in layers]
    variants = {"grouped by slot (CPU kernel)": lora_add_grouped, "dense masked": lora_add_dense,
                "gather-bmm (reference)": lora_add_reference}
    for fn in variants.values():  # every variant computes the same thing
        for (x, _, _, a, b), base in zip(layers, bases):
            torch.testing.assert_close(fn(base, x, a, b, token_slots), lora_add_reference(base, x, a, b, token_slots),
                                       atol=1e-4, rtol=1e-4)
    base_us = _median_us(lambda: [torch.ops.vgraph.packed_linear(x, p, None, o) for x, p, o, _, _ in layers], rounds)
    lora_us = {name: _median_us(lambda fn=fn: [fn(base, x, a, b, token_slots) for (x, _, _, a, b), base
                                               in zip(layers, bases)], rounds) for name, fn in variants.items()}
    return {"batch": batch, "adapters": adapters, "rank": rank,
            "per_layer_us": {"base projections (packed GEMMs)": round(base_us, 1),
                             **{k: round(v, 1) for k, v in lora_us.items()}},
            "per_step_ms_all_layers": {"base projections": round(base_us * LAYERS / 1e3, 3),
                                       **{k: round(v * LAYERS / 1e3, 3) for k, v in lora_us.items()}}}


def measure_slot_load(rank: int, rounds: int) -> float:
    """Milliseconds to copy one rank-``rank`` adapter into a slot of all 8 layers' projections."""
    projections = [LoRAProjection(in_features, slices, 4, 16, torch.float32, "cpu")
                   for _ in range(LAYERS) for _, in_features, slices in PROJECTIONS]
    weights = [{name: (torch.randn(rank, p.in_features), torch.randn(size, rank)) for name, size in slices}
               for p, (_, _, slices) in zip(projections, PROJECTIONS * LAYERS)]
    return _median_us(lambda: [p.load_slot(1, w) for p, w in zip(projections, weights)], rounds) / 1e3


CONTEXT, BLOCK = 256, 128  # decode rows' cached context; the CPU KV block size


def _decode_context(model, batch: int) -> ForwardContext:
    """A decode step of ``batch`` sequences with CONTEXT tokens cached each, blocks of their own."""
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    table = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    meta = AttentionMetadata(slot_mapping=table[:, 0].long() * BLOCK + CONTEXT % BLOCK + BLOCK * (CONTEXT // BLOCK),
                             block_table=table, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             seq_lens=torch.full((batch,), CONTEXT + 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=CONTEXT + 1)
    shape = (table.numel(), BLOCK, model.num_kv_heads, model.head_dim)
    caches = [(torch.randn(shape) * 0.1, torch.randn(shape) * 0.1) for _ in range(model.num_layers)]
    return ForwardContext(meta, caches, model.softmax_scale)


def _fill_random_adapters(model, adapters: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _, projection in model.lora_projections():
        for slot in range(adapters):
            projection.load_slot(slot, {name: (torch.randn(rank, projection.in_features, generator=gen) * 0.02,
                                               torch.randn(b.shape[1], rank, generator=gen) * 0.02)
                                        for name, b in zip(projection.slice_names, projection.lora_b())})


def _write_peft_folder(path: Path, model, rank: int, seed: int) -> str:
    """A PEFT-format LoRA folder (every projection, random weights) for ``model``, written
    directly (no peft import: perf needs only the runtime)."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    targets = model.lora_targets()
    tensors = {}
    for layer in range(targets.num_layers):
        for module, (in_features, out_features) in targets.shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets.shapes),
        "bias": "none"}))
    return str(path)


def measure_adapter_load(model, rank: int, rounds: int) -> dict:
    """Milliseconds from a PEFT folder on disk to an adapter in a free slot (read, checked,
    scaled, copied), and for one already in the host cache (the copy only)."""
    root = Path(tempfile.mkdtemp(prefix="vgraph-perf-adapters-"))
    folders = [_write_peft_folder(root / f"a{i}", model, rank, i) for i in range(rounds)]
    cold, warm = [], []
    for i, folder in enumerate(folders):
        manager = LoRASlotManager(model, model.lora_config, torch.float32)
        request = LoRARequest(f"a{i}", i + 1, folder)
        start = time.perf_counter()
        manager.prepare([request])
        cold.append((time.perf_counter() - start) * 1e3)
        manager.remove_adapter(request.lora_int_id)
        manager.add_adapter(request)
        start = time.perf_counter()
        manager.prepare([request])
        warm.append((time.perf_counter() - start) * 1e3)
    return {"rank": rank, "from_disk_ms": round(statistics.median(cold), 3),
            "from_host_cache_ms": round(statistics.median(warm), 3)}


def measure_step(batch: int, adapters: int, rank: int, rounds: int) -> dict:
    """Eager decode step (forward + logits) of the perf model without LoRA, and with LoRA
    enabled over ``adapters`` slots in use, timed in turns."""
    path = build_perf_checkpoint(Path(tempfile.mkdtemp(prefix="vgraph-perf-lora-")) / "perf", seed=0)
    base, _, _ = load_model(ModelConfig(path, dtype="float32"), "cpu")
    lora, _, _ = load_model(ModelConfig(path, dtype="float32"), "cpu",
                            lora_config=LoRAConfig(max_loras=adapters, max_lora_rank=rank, max_num_tokens=batch))
    _fill_random_adapters(lora, adapters, rank)
    lora.set_lora_token_slots((torch.arange(batch) % adapters).to(torch.int32))
    ids = torch.randint(6, 500, (batch,), generator=torch.Generator().manual_seed(2))
    positions = torch.full((batch,), CONTEXT)

    def step(model):
        ctx = _decode_context(model, batch)
        return lambda: _run(model, ctx, ids, positions)
    steps = {"base": step(base), "lora": step(lora)}
    times = {name: [] for name in steps}
    for _ in range(rounds):  # in turns, so both see the same machine
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(values[3:]) for name, values in times.items()}
    return {"batch": batch, "adapters": adapters, "rank": rank, "context": CONTEXT,
            "step_ms": {k: round(v, 3) for k, v in medians.items()},
            "ratio": round(medians["lora"] / medians["base"], 3),
            "adapter_load_into_free_slot": measure_adapter_load(lora, rank, 10)}


def _run(model, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with set_forward_context(ctx):
        return model.compute_logits(model(ids, positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # a shared machine: say how quiet it was
    with torch.inference_mode():
        results = [measure(32, 4, 16, args.rounds), measure(1, 1, 16, args.rounds), measure(256, 4, 16, args.rounds)]
        load_ms = measure_slot_load(16, args.rounds)
        step = measure_step(32, 4, 16, max(args.rounds // 2, 10))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                         text=True).stdout.strip() or None
    record = {"command": "python -m perf.lora_op" + (f" --threads {args.threads}" if args.threads else ""),
              "config": {**machine_info("cpu"), "git": git, "threads": torch.get_num_threads(),
                         "load_average_1min_before": round(load_before, 2), "load_average_1min_after":
                         round(os.getloadavg()[0], 2)},
              "shapes": {"hidden": HIDDEN, "q": Q, "kv": KV, "intermediate": INTER, "layers": LAYERS},
              "results": results, "slot_load_ms_rank16_all_layers": round(load_ms, 3),
              "eager_decode_step": step}
    write_results(f"lora-op-cpu-t{args.threads}" if args.threads else "lora-op-cpu", record)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
