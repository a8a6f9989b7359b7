"""The slot manager: adapters copied into fixed slots (addresses never change), LRU eviction of
slots the batch does not use, the host cache bound, unloading, and over-full batches refused."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from tests.lora.adapters import cached_adapter
from vgraph.config import ModelConfig
from vgraph.lora import LoRAConfig, LoRARequest
from vgraph.lora.slots import LoRASlotManager
from vgraph.models.loader import load_model


@functools.lru_cache(maxsize=None)
def _request(i: int) -> LoRARequest:
    path = cached_adapter(tiny_checkpoint(arch="llama"), process_tmp_dir(), seed=20 + i, rank=4)
    return LoRARequest(f"a{i}", i, path)


def _manager(max_loras: int = 2, max_cpu_loras=None) -> LoRASlotManager:
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=8, max_num_tokens=64, max_cpu_loras=max_cpu_loras)
    model, _, _ = load_model(ModelConfig(tiny_checkpoint(arch="llama"), dtype="float32"), "cpu", lora_config=config)
    return LoRASlotManager(model, config, torch.float32)


def _slot_rows(manager: LoRASlotManager, slot: int) -> torch.Tensor:
    _, projection = manager.model.lora_projections()[0]
    return projection.lora_a[slot]


def test_slots_hold_each_adapters_weights_zero_padded():
    manager = _manager()
    assert manager.prepare([_request(1), None, _request(2), _request(1)]) == [0, -1, 1, 0]
    adapter = manager.add_adapter(_request(2))
    a_q = adapter.weights[(0, "q_proj")][0]
    rows = _slot_rows(manager, 1)
    assert torch.equal(rows[:4], a_q) and not rows[4:8].any()  # rank 4 of 8: zero-padded


def test_lru_slot_not_in_the_batch_is_evicted_and_addresses_stay():
    manager = _manager()
    buffers = {n: b.data_ptr() for n, b in manager.model.named_buffers()}
    manager.prepare([_request(1)])
    manager.prepare([_request(2)])
    manager.prepare([_request(1)])  # 1 is now the most recently used
    assert manager.prepare([_request(3)]) == [1]  # evicts 2, the least recently used
    assert manager.resident == {1: 0, 3: 1}
    assert manager.prepare([_request(2), _request(3)]) == [0, 1]  # 1 is not in the batch: evicted
    assert {n: b.data_ptr() for n, b in manager.model.named_buffers()} == buffers


def test_a_batch_over_the_slots_is_refused():
    manager = _manager()
    with pytest.raises(ValueError, match="uses 3 LoRA adapters, more than max_loras=2"):
        manager.prepare([_request(1), _request(2), _request(3)])


def test_host_cache_keeps_at_most_max_cpu_loras_beyond_the_slots():
    manager = _manager(max_loras=1, max_cpu_loras=2)
    for i in (1, 2, 3):
        manager.prepare([_request(i)])
    assert manager.cached == [2, 3] and manager.resident == {3: 0}


def test_remove_adapter_clears_its_slot():
    manager = _manager()
    manager.prepare([_request(1)])
    assert manager.remove_adapter(1) and not manager.remove_adapter(1)
    assert manager.resident == {} and manager.cached == [] and not _slot_rows(manager, 0).any()


def test_an_id_is_one_adapter():
    manager = _manager()
    manager.prepare([_request(1)])
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a1'"):
        manager.prepare([LoRARequest("other", 1, _request(2).lora_path)])


def test_lora_request_is_vllms():
    import vgraph
    request = vgraph.LoRARequest("sql", 3, "/adapters/sql")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("sql", 3, "/adapters/sql")
    assert (request.name, request.adapter_id, request.path) == ("sql", 3, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/p")


def test_token_slots_pad_with_minus_one():
    manager = _manager()
    model = manager.model
    model.set_lora_token_slots(torch.tensor([1, 0, -1], dtype=torch.int32))
    assert model.model.lora_token_slots[:5].tolist() == [1, 0, -1, -1, -1]
    with pytest.raises(ValueError, match="at most max_num_tokens=64"):
        model.set_lora_token_slots(torch.zeros(65, dtype=torch.int32))
