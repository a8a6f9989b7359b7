"""reshape_and_cache: the Triton scatter vs the plain-torch reference, and the op's contract."""
from __future__ import annotations

import pytest
import torch

import vgraph.ops.kv_cache  # noqa: F401  (registers torch.ops.vgraph.reshape_and_cache)
from vgraph.ops.kernels.kv_cache import reshape_and_cache_triton
from vgraph.ops.kv_cache import reshape_and_cache_reference


def _case(num_tokens: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype, num_padding: int):
    """Random K/V, caches of random bytes, and distinct random slots with some -1 padding."""
    key = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return key, value, k_cache, v_cache, slots.long()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_reference_lands_slots_exactly_and_skips_padding():
    key, value, k_cache, v_cache, slots = _case(12, 4, 16, 2, 64, torch.float32, num_padding=3)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_cache, v_cache, slots)
    written = torch.zeros(4 * 16, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 16, s % 16], key[t])
            assert torch.equal(v_cache[s // 16, s % 16], value[t])
            written[s] = True
    untouched = ~written.view(4, 16)
    assert torch.equal(_bytes(k_cache[untouched]), _bytes(k_before[untouched]))
    assert torch.equal(_bytes(v_cache[untouched]), _bytes(v_before[untouched]))


@pytest.mark.parametrize("dtype,kv_heads,head_dim,block_size", [
    (torch.float32, 2, 64, 16),
    (torch.bfloat16, 1, 80, 32),
    (torch.float16, 3, 128, 16),
])
def test_triton_matches_reference(kernel_device: str, dtype, kv_heads, head_dim, block_size):
    key, value, k_cache, v_cache, slots = _case(10, 3, block_size, kv_heads, head_dim, dtype,
                                                num_padding=2)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.to(kernel_device), v_cache.to(kernel_device)
    reshape_and_cache_triton(key.to(kernel_device), value.to(kernel_device), k_dev, v_dev,
                             slots.to(kernel_device))
    assert torch.equal(_bytes(k_dev.cpu()), _bytes(k_ref))
    assert torch.equal(_bytes(v_dev.cpu()), _bytes(v_ref))


def test_triton_reads_strided_key_views(kernel_device: str):
    """K/V sliced out of a fused QKV tensor (non-contiguous) are written without a copy."""
    qkv = torch.randn(6, 4 + 2 + 2, 64)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([3, -1, 17, 0, 31, 5])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.to(kernel_device), v_cache.to(kernel_device)
    reshape_and_cache_triton(key.to(kernel_device), value.to(kernel_device), k_dev, v_dev,
                             slots.to(kernel_device))
    assert torch.equal(k_dev.cpu(), k_ref) and torch.equal(v_dev.cpu(), v_ref)


def test_triton_all_padding_leaves_cache_bytes_untouched(kernel_device: str):
    key, value, k_cache, v_cache, _ = _case(5, 2, 16, 2, 80, torch.bfloat16, num_padding=0)
    slots = torch.full((5,), -1, dtype=torch.long)
    k_dev, v_dev = k_cache.to(kernel_device), v_cache.to(kernel_device)
    reshape_and_cache_triton(key.to(kernel_device), value.to(kernel_device), k_dev, v_dev,
                             slots.to(kernel_device))
    assert torch.equal(_bytes(k_dev.cpu()), _bytes(k_cache))
    assert torch.equal(_bytes(v_dev.cpu()), _bytes(v_cache))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_opcheck(device: str):
    key, value, k_cache, v_cache, slots = _case(7, 3, 16, 2, 64, torch.float32, num_padding=2)
    args = [t.to(device) for t in (key, value, k_cache, v_cache, slots)]
    torch.library.opcheck(torch.ops.vgraph.reshape_and_cache.default, args)


def test_op_writes_in_place():
    key, value, k_cache, v_cache, slots = _case(4, 2, 16, 1, 64, torch.float16, num_padding=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots)
    assert torch.ops.vgraph.reshape_and_cache(key, value, k_cache, v_cache, slots) is None
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(key=a["key"].double()), "dtype"),
    (lambda a: a.update(value=a["value"][:, :, :32]), "key and value"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), "slot_mapping"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int64"),
    (lambda a: a.update(v_cache=a["v_cache"][:1]), "v_cache"),
    (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), "fit cache rows"),
])
def test_bad_inputs_raise_value_error(change, message):
    key, value, k_cache, v_cache, slots = _case(4, 2, 16, 2, 64, torch.float32, num_padding=0)
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    change(args)
    with pytest.raises(ValueError, match=message):
        torch.ops.vgraph.reshape_and_cache(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cpu_kernel_is_bit_identical_to_the_reference(dtype, slot_dtype, monkeypatch):
    """The C++ row copy (ops/csrc/kv_cache_cpu.cpp) on strided q/k/v-split views, padding too."""
    from vgraph.ops import kv_cache
    assert kv_cache._NATIVE.load() is not None, kv_cache._NATIVE.unavailable
    heads, dim, block, blocks = 2, 64, 16, 6
    qkv = torch.randn(11, (4 + 2 * heads) * dim).to(dtype)
    key = qkv[:, 4 * dim:(4 + heads) * dim].view(11, heads, dim).contiguous()  # as after RoPE
    value = qkv[:, (4 + heads) * dim:].view(11, heads, dim)  # rows 512 apart
    calls = []
    monkeypatch.setattr(kv_cache, "reshape_and_cache_reference",
                        lambda *a: calls.append(a) or reshape_and_cache_reference(*a))
    slots = torch.randperm(blocks * block)[:11].to(slot_dtype)
    slots[[2, 7]] = -1
    caches = [torch.full((blocks, block, heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    torch.ops.vgraph.reshape_and_cache(key, value, caches[0], caches[1], slots)
    assert not calls  # the C++ copy ran, not the torch fallback
    reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


def test_cpu_kernel_rejects_a_slot_outside_the_cache():
    key = torch.randn(3, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="token 1 is outside"):
        torch.ops.vgraph.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([0, 8, 1]))
