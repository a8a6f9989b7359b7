"""The fp8 (e4m3) KV cache: quantizing writes, dequantizing attention, on every path.

Tolerances, and why:
- Round trip (write, then read ``cached * scale``): e4m3 keeps 3 mantissa bits, so a value in
  the normal range rounds to within half a step, 2^-4 of its magnitude; below 2^-6 x scale
  (subnormals) the step is 2^-9 x scale, so the error is at most 2^-10 x scale there.
  Beyond 448 x scale the cache saturates at +-448 x scale.
- Every implementation against the reference over the same fp8 cache: the dtype tolerances
  of ``tests/ops/tolerances.py`` (they read the same quantized numbers; only the arithmetic
  order differs), and the Triton cache write is bit-exact.
- The fp8 attention against the unquantized cache's: within 8% of the output's scale.
  Per element the K/V rounding is up to 6.25% (2^-4); attention averages it over keys, and
  the measured worst case on these batches is 5.4% (five seeds, fp32/bf16/fp16 queries).
"""
from __future__ import annotations

import pytest
import torch

import vgraph.ops.attention  # noqa: F401  (registers torch.ops.vgraph.paged_attention*)
import vgraph.ops.kv_cache  # noqa: F401  (registers torch.ops.vgraph.reshape_and_cache)
from tests.ops.test_attention import BOUNDARY_16, DEVICES, MIXED, PAD, make_batch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops import cpu_attention_native
from vgraph.ops.attention import paged_attention_decode_split_kv_reference, paged_attention_reference
from vgraph.ops.cpu_attention import paged_attention_cpu
from vgraph.ops.kernels.attention import paged_attention_decode_split_kv_triton, paged_attention_triton
from vgraph.ops.kernels.kv_cache import reshape_and_cache_triton
from vgraph.ops.kv_cache import FP8_KV_DTYPE, dequantize_kv, quantize_kv, reshape_and_cache_reference

K_SCALE, V_SCALE = 0.015, 0.0125  # randn (|x| < 5.5) then spans most of e4m3's +-448
FP8_VS_UNQUANTIZED = 0.08


def _scales(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], device=device), torch.tensor([V_SCALE], device=device))


def _write_case(num_tokens: int, dtype: torch.dtype, num_padding: int = 2):
    """K/V of ``dtype``, fp8 caches of NaN, distinct slots, some -1."""
    key = torch.randn(num_tokens, 2, 64).to(dtype)
    value = torch.randn(num_tokens, 2, 64).to(dtype)
    k_cache = torch.full((4, 16, 2, 64), float("nan")).to(FP8_KV_DTYPE)
    slots = torch.randperm(64)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return key, value, k_cache, k_cache.clone(), slots.long()


def _cached_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache.flatten(0, 1)[slots[slots >= 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_within_half_an_e4m3_step(dtype):
    key, value, k_cache, v_cache, slots = _write_case(24, dtype)
    k_scale, v_scale = _scales()
    torch.ops.vgraph.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for x, cache, scale in ((key, k_cache, K_SCALE), (value, v_cache, V_SCALE)):
        x = x[slots >= 0].float()
        back = dequantize_kv(_cached_rows(cache, slots), torch.tensor([scale]), torch.float32)
        bound = torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, scale * 2.0 ** -10))
        assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert k_cache.flatten(0, 1)[untouched].float().isnan().all(), "padding rows write nothing"


def test_out_of_range_values_saturate_instead_of_becoming_nan():
    key, value, k_cache, v_cache, slots = _write_case(4, torch.float32, num_padding=0)
    key[0, 0, 0], key[1, 0, 0] = 1e6, -1e6
    reshape_and_cache_reference(key, value, k_cache, v_cache, slots, *_scales())
    rows = _cached_rows(k_cache, slots).float()
    assert rows[0, 0, 0] == 448 and rows[1, 0, 0] == -448 and rows.isfinite().all()


def test_scales_default_to_one():
    key, value, k_cache, v_cache, slots = _write_case(6, torch.float32)
    reshape_and_cache_reference(key, value, k_cache, v_cache, slots)
    expected = quantize_kv(key[slots >= 0], None)
    assert torch.equal(_cached_rows(k_cache, slots).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_write_matches_reference_bit_for_bit(kernel_device: str, dtype):
    key, value, k_cache, v_cache, slots = _write_case(12, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots, *_scales())
    k_dev, v_dev = k_cache.to(kernel_device), v_cache.to(kernel_device)
    reshape_and_cache_triton(key.to(kernel_device), value.to(kernel_device), k_dev, v_dev,
                             slots.to(kernel_device), *_scales(kernel_device))
    assert torch.equal(k_dev.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_dev.cpu().view(torch.uint8), v_ref.view(torch.uint8))


def _fp8_batch(specs: list, dtype: torch.dtype, kv_heads: int = 2, group: int = 2, head_dim: int = 64):
    """A paged batch (``make_batch``: shuffled blocks, NaN in every unwritten slot) whose
    caches are quantized at the test scales, and its unquantized fp32 twin."""
    b = make_batch(specs, kv_heads, group, head_dim, 16, torch.float32, extra_rows=1)
    exact = b.attention_args()
    k_scale, v_scale = _scales()
    quantized = [b.q.to(dtype), quantize_kv(b.k_cache, k_scale), quantize_kv(b.v_cache, v_scale), *exact[3:]]
    return quantized, exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_reads_the_cache_times_its_scale(dtype):
    args, exact = _fp8_batch(MIXED, dtype)
    out = paged_attention_reference(*args, *_scales())
    dequantized = [args[0].float(), dequantize_kv(args[1], _scales()[0], torch.float32),
                   dequantize_kv(args[2], _scales()[1], torch.float32), *args[3:]]
    assert_close_rel(out, paged_attention_reference(*dequantized).to(dtype), dtype)
    err = (out.float() - paged_attention_reference(*exact)).abs().max()
    assert err <= FP8_VS_UNQUANTIZED * paged_attention_reference(*exact).abs().max()


@pytest.mark.parametrize("native_kernel", [True, False], ids=["cpp", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [MIXED, BOUNDARY_16], ids=["mixed", "boundaries"])
def test_cpu_kernels_match_reference(dtype, specs, native_kernel):
    """Both CPU routes: the C++ kernels (decode and prefill segments) and SDPA."""
    args, _ = _fp8_batch(specs, dtype)
    ref = paged_attention_reference(*args, *_scales())
    if native_kernel:
        assert cpu_attention_native.supports(args[0], args[1]) and cpu_attention_native.enabled()
    out = paged_attention_cpu(*args, native_kernel=native_kernel, kv_scales=_scales())
    assert_close_rel(out, ref, dtype)
    assert_close_rel(torch.ops.vgraph.paged_attention(*args, *_scales()), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(kernel_device: str, dtype):
    args, _ = _fp8_batch(MIXED, dtype)
    ref = paged_attention_reference(*args, *_scales())
    dev = [a.to(kernel_device) if isinstance(a, torch.Tensor) else a for a in args]
    k_scale, v_scale = _scales(kernel_device)
    assert_close_rel(paged_attention_triton(*dev, k_scale=k_scale, v_scale=v_scale), ref, dtype)


def _decode_args(dtype: torch.dtype) -> list:
    """One query row per sequence (a padding one among them) over an fp8 cache."""
    args, _ = _fp8_batch([(40, 1), PAD, (3, 1), (70, 1)], dtype, kv_heads=1, group=4)
    q, k_cache, v_cache, block_table, _, seq_lens = args[:6]
    return [q[:4], k_cache, v_cache, block_table, seq_lens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode_matches_reference(kernel_device: str, dtype):
    args = _decode_args(dtype)
    scale = args[0].shape[-1] ** -0.5
    ref = paged_attention_decode_split_kv_reference(*args, scale, 3, *_scales())
    assert_close_rel(torch.ops.vgraph.paged_attention_decode_split_kv(*args, scale, 3, *_scales()), ref, dtype)
    k_scale, v_scale = _scales(kernel_device)
    out = paged_attention_decode_split_kv_triton(*[t.to(kernel_device) for t in args], scale, 3,
                                                 k_scale=k_scale, v_scale=v_scale)
    assert_close_rel(out, ref, dtype)


# opcheck's test_schema perturbs every tensor input with a multiply, which torch has no CPU
# kernel for in float8_e4m3fn; the other checks (fake tensor, autograd registration, AOT
# dispatch) run as for the other ops.
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_fp8_caches(device: str):
    key, value, k_cache, v_cache, slots = _write_case(7, torch.bfloat16)
    k_cache.zero_(), v_cache.zero_()  # opcheck compares outputs: NaN never equals itself
    scales = list(_scales(device))
    torch.library.opcheck(torch.ops.vgraph.reshape_and_cache.default,
                          [t.to(device) for t in (key, value, k_cache, v_cache, slots)] + scales,
                          test_utils=OPCHECK_UTILS)
    args, _ = _fp8_batch([(0, 3), (4, 1), PAD], torch.bfloat16, kv_heads=1, group=4)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.vgraph.paged_attention.default, args + scales, test_utils=OPCHECK_UTILS)


def test_unquantized_inputs_must_match_an_unquantized_cache():
    key, value, k_cache, v_cache, slots = _write_case(3, torch.float32)
    with pytest.raises(ValueError, match="must equal the cache dtype"):
        reshape_and_cache_reference(key.half(), value.half(), k_cache.float(), v_cache.float(), slots)
    with pytest.raises(ValueError, match="one-element float32 tensor"):
        reshape_and_cache_reference(key, value, k_cache, v_cache, slots, torch.ones(2), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_ops_match_the_cpu_ops_over_one_fp8_cache(dtype):
    """What the engine runs on CUDA (the ops' Triton kernels) against the same ops on CPU: the
    cache write bit for bit, attention and split-KV decode within the dtype's tolerance."""
    key, value, k_cache, v_cache, slots = _write_case(12, dtype)
    k_gpu, v_gpu = k_cache.cuda(), v_cache.cuda()
    torch.ops.vgraph.reshape_and_cache(key, value, k_cache, v_cache, slots, *_scales())
    torch.ops.vgraph.reshape_and_cache(key.cuda(), value.cuda(), k_gpu, v_gpu, slots.cuda(), *_scales("cuda"))
    assert torch.equal(k_gpu.cpu().view(torch.uint8), k_cache.view(torch.uint8))
    assert torch.equal(v_gpu.cpu().view(torch.uint8), v_cache.view(torch.uint8))
    args, _ = _fp8_batch(MIXED, dtype)
    on_gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    assert_close_rel(torch.ops.vgraph.paged_attention(*on_gpu, *_scales("cuda")),
                     torch.ops.vgraph.paged_attention(*args, *_scales()), dtype)
    decode = _decode_args(dtype)
    scale = decode[0].shape[-1] ** -0.5
    assert_close_rel(torch.ops.vgraph.paged_attention_decode_split_kv(*[t.cuda() for t in decode], scale, 4,
                                                                      *_scales("cuda")),
                     torch.ops.vgraph.paged_attention_decode_split_kv(*decode, scale, 4, *_scales()), dtype)
