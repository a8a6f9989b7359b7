"""A LoRA-enabled model against transformers + PEFT (fp32): one flat batch mixing three
adapters and base-model rows, eager and through torch.compile, with adapters swapped into
slots between calls and no recompile."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from tests.lora.adapters import ALL_MODULES, cached_adapter, peft_model
from vgraph.config import ModelConfig
from vgraph.lora import LoRAConfig, LoRARequest
from vgraph.lora.slots import LoRASlotManager
from vgraph.models.loader import load_model
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context

ATOL = 1e-4
BLOCK = 16
LENGTHS = (11, 7, 13, 9)  # one prompt per row group: adapters 1, 2, 3 and the base model
# Three adapters unlike each other: every projection at rank 8; q and v only at rank 4 (rsLoRA);
# the MLP only at the full rank 16.
ADAPTERS = (dict(seed=1, rank=8, alpha=16),
            dict(seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True),
            dict(seed=3, rank=16, alpha=32, targets=("gate_proj", "up_proj", "down_proj")))


@functools.lru_cache(maxsize=None)
def _adapters(arch: str) -> tuple[str, ...]:
    path = tiny_checkpoint(arch=arch)
    return tuple(cached_adapter(path, process_tmp_dir(), **{"targets": ALL_MODULES, **spec}) for spec in ADAPTERS)


def _requests(arch: str) -> list[LoRARequest]:
    return [LoRARequest(f"{arch}-{i}", i + 1, path) for i, path in enumerate(_adapters(arch))]


def _lora_model(arch: str, max_loras: int = 4):
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=16, max_num_tokens=256)
    model, _, _ = load_model(ModelConfig(tiny_checkpoint(arch=arch), dtype="float32"), "cpu", lora_config=config)
    return model, LoRASlotManager(model, config, torch.float32)


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(6, 500, (n,), generator=gen) for n in LENGTHS]


def _context(model, lengths) -> ForwardContext:
    """Prefill of every prompt in one flat batch, each sequence in blocks of its own."""
    blocks_per_seq = -(-max(lengths) // BLOCK)
    starts = torch.tensor([0, *lengths]).cumsum(0)
    slot_mapping = torch.cat([torch.arange(n) + i * blocks_per_seq * BLOCK for i, n in enumerate(lengths)])
    table = torch.arange(len(lengths) * blocks_per_seq, dtype=torch.int32).view(len(lengths), blocks_per_seq)
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_table=table, query_start_loc=starts.int(),
                             seq_lens=torch.tensor(lengths, dtype=torch.int32), max_query_len=max(lengths),
                             max_seq_len=max(lengths))
    shape = (table.numel(), BLOCK, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    return ForwardContext(meta, caches, model.softmax_scale)


def _batch_logits(model, forward, prompts, row_slots: list[int], output_rows=None) -> torch.Tensor:
    """Logits of every row of the flat batch (or of ``output_rows``, which the compiled
    row-wise tail then runs alone); ``row_slots[i]`` is prompt i's slot."""
    lengths = [p.shape[0] for p in prompts]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lengths])
    model.set_lora_token_slots(torch.cat([torch.full((n,), s, dtype=torch.int32)
                                          for n, s in zip(lengths, row_slots)]))
    ctx = _context(model, lengths)
    ctx.output_rows = output_rows
    with torch.no_grad(), set_forward_context(ctx):
        return model.compute_logits(forward(ids, positions))


@functools.lru_cache(maxsize=None)
def _oracle(arch: str, adapter: int | None, prompt_index: int) -> torch.Tensor:
    path = tiny_checkpoint(arch=arch)
    hf = peft_model(path, None if adapter is None else _adapters(arch)[adapter])
    with torch.no_grad():
        return hf(_prompts()[prompt_index][None]).logits[0].float()


def _check_rows(arch: str, logits: torch.Tensor, adapter_of_prompt: list[int | None]) -> None:
    rows = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    for i, adapter in enumerate(adapter_of_prompt):
        torch.testing.assert_close(logits[rows[i]:rows[i + 1]], _oracle(arch, adapter, i), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_matches_peft_eager(arch):
    model, slots = _lora_model(arch)
    requests = _requests(arch)
    row_slots = slots.prepare(requests + [None])
    assert row_slots[-1] == -1 and sorted(row_slots[:3]) == [0, 1, 2]
    logits = _batch_logits(model, model, _prompts(), row_slots)
    _check_rows(arch, logits, [0, 1, 2, None])


def test_adapters_change_the_logits():
    """Guards the oracle: a random adapter must move the logits well beyond the tolerance."""
    for adapter in range(3):
        assert (_oracle("llama", adapter, 0) - _oracle("llama", None, 0)).abs().max() > 100 * ATOL


def test_compiled_model_swaps_adapters_without_recompiling():
    """torch.compile over the whole forward; the batch's adapters change slots and slots
    change adapters between calls (one slot fewer than adapters: the LRU slot is reused)."""
    torch._dynamo.reset()
    model, slots = _lora_model("llama", max_loras=2)
    requests = _requests("llama")
    frames = torch._dynamo.utils.counters
    frames.clear()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=True)
    prompts = _prompts()
    first = slots.prepare([requests[0], requests[1], None, None])
    _check_rows("llama", _batch_logits(model, compiled, prompts, first), [0, 1, None, None])
    buffers = {name: buf.data_ptr() for name, buf in model.named_buffers()}
    second = slots.prepare([None, requests[2], requests[1], None])  # adapter 3 evicts adapter 1
    assert second[1] == first[0]
    _check_rows("llama", _batch_logits(model, compiled, prompts, second), [None, 2, 1, None])
    third = slots.prepare([requests[0], None, requests[2], requests[0]])
    _check_rows("llama", _batch_logits(model, compiled, prompts, third), [0, None, 2, 0])
    assert frames["stats"]["unique_graphs"] == 1
    assert {name: buf.data_ptr() for name, buf in model.named_buffers()} == buffers


def test_vgraph_compile_path_swaps_adapters_without_recompiling():
    """The project's compiled forward (the compile ladder: Dynamo, split at attention, Inductor
    pieces, the captured graph called directly) with adapters swapped between calls; the last
    call samples one row per prompt, so the row-wise tail piece runs on those rows and their
    slots alone."""
    from vgraph.compiler.build import build_forward
    from vgraph.config import EngineConfig
    from vgraph.models.loader import load_hf_config
    model, slots = _lora_model("llama", max_loras=2)
    path = tiny_checkpoint(arch="llama")
    forward = build_forward(model, EngineConfig(model=ModelConfig(path, dtype="float32"), device="cpu"),
                            load_hf_config(path), torch.device("cpu"))
    requests, prompts = _requests("llama"), _prompts()
    with torch.inference_mode():
        _check_rows("llama", _batch_logits(model, forward, prompts, slots.prepare(
            [requests[0], requests[1], None, None])), [0, 1, None, None])
        compiled = (forward.counters.graphs_seen, forward.counters.inductor_compilations)
        _check_rows("llama", _batch_logits(model, forward, prompts, slots.prepare(
            [None, requests[2], requests[1], None])), [None, 2, 1, None])
        last = torch.tensor(LENGTHS).cumsum(0) - 1
        sampled = _batch_logits(model, forward, prompts, slots.prepare(
            [requests[1], None, requests[2], requests[1]]), output_rows=last)
    assert (forward.counters.graphs_seen, forward.counters.inductor_compilations) == compiled == (1, compiled[1])
    for i, adapter in enumerate([1, None, 2, 1]):
        torch.testing.assert_close(sampled[i], _oracle("llama", adapter, i)[-1], atol=ATOL, rtol=0)


def test_without_lora_the_model_has_no_lora_state():
    """No buffer, module or cache-key change without LoRA: the graph and its cache entry are
    the plain model's."""
    from vgraph.compiler.cache_key import model_layout
    model, _, _ = load_model(ModelConfig(tiny_checkpoint(arch="llama"), dtype="float32"), "cpu")
    assert all("lora" not in name for name, _ in model.named_buffers())
    assert model.lora_projections() == [] and model.model.lora_token_slots is None
    assert not any("LoRA" in name or "lora" in name for name in model_layout(model))


def test_lora_sizes_enter_the_compile_cache_key():
    from vgraph.compiler.cache_key import model_layout
    layouts = [model_layout(_lora_model("llama", max_loras=n)[0]) for n in (2, 4)]
    assert layouts[0] != layouts[1]
    assert "LlamaModel[lora_tokens=256]" in layouts[0]
