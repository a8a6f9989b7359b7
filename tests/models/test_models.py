"""vgraph's Llama-family module against Hugging Face transformers on the same checkpoints (fp32).

The forward context is built by hand here (caches, block table, slots), the way the model
runner will build it, so these tests pin the model alone: prefill of a fresh sequence, and a
decode step that must read the prefix back from the paged cache.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.checkpoints import TINY_ARCHS, tiny_checkpoint
from vgraph.config import ModelConfig
from vgraph.models.llama import LlamaForCausalLM, check_supported
from vgraph.models.loader import iterate_weights, load_model
from vgraph.models.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context

ATOL = 1e-4
# On CUDA both sides use different GEMM/attention kernels (Triton may use TF32 dots), so
# logits agree less tightly; greedy tokens must still agree.
ATOL_BY_DEVICE = {"cpu": ATOL, "cuda": 2e-3}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]


@functools.lru_cache(maxsize=None)
def _models(arch: str, device: str = "cpu") -> tuple[LlamaForCausalLM, torch.nn.Module]:
    """(vgraph model, transformers model), both fp32 on ``device``, loaded once per arch."""
    path = tiny_checkpoint(arch=arch)
    model, _, _ = load_model(ModelConfig(path, dtype="float32"), device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, hf.to(device).eval()


def _hf_last_logits(hf: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(token_ids[None].to(hf.device)).logits[0, -1].float()


class PagedSequence:
    """One sequence in a paged KV cache, with its blocks deliberately out of order."""

    def __init__(self, model: LlamaForCausalLM, blocks: tuple[int, ...] = (5, 2, 7),
                 block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size
        self.device = model.lm_head.weight.device
        shape = (8, block_size, model.num_kv_heads, model.head_dim)
        nan = functools.partial(torch.full, shape, float("nan"), dtype=model.dtype,
                                device=self.device)
        self.caches = [(nan(), nan())
                       for _ in range(model.num_layers)]  # NaN: any read of an unwritten slot shows
        self.block_table = torch.tensor([blocks], dtype=torch.int32, device=self.device)
        self.num_cached = 0

    def step(self, token_ids: torch.Tensor, num_kv_splits: int = 1) -> torch.Tensor:
        """Runs the next ``len(token_ids)`` tokens; returns the last token's logits."""
        start, num_new = self.num_cached, token_ids.shape[0]
        token_ids = token_ids.to(self.device)
        positions = torch.arange(start, start + num_new, device=self.device)
        blocks = self.block_table[0].long()[positions // self.block_size]
        meta = AttentionMetadata(
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            block_table=self.block_table,
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([start + num_new], dtype=torch.int32, device=self.device),
            max_query_len=num_new, max_seq_len=start + num_new, num_kv_splits=num_kv_splits)
        ctx = ForwardContext(meta, self.caches, self.model.softmax_scale)
        with torch.no_grad(), set_forward_context(ctx):
            hidden = self.model(token_ids, positions)
            logits = self.model.compute_logits(hidden[-1:])
        self.num_cached += num_new
        return logits[0]


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(6, 512, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_matches_transformers(arch: str, device: str) -> None:
    model, hf = _models(arch, device)
    ids = _prompt(40)
    logits = PagedSequence(model).step(ids)
    expected = _hf_last_logits(hf, ids)
    assert logits.dtype == torch.float32 and logits.shape == (model.vocab_size,)
    torch.testing.assert_close(logits, expected, atol=ATOL_BY_DEVICE[device], rtol=0)
    assert logits.argmax() == expected.argmax()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decode_reads_cached_prefix(arch: str, num_kv_splits: int, device: str) -> None:
    model, hf = _models(arch, device)
    ids = _prompt(21, seed=2)
    seq = PagedSequence(model)
    seq.step(ids[:20])
    logits = seq.step(ids[20:], num_kv_splits=num_kv_splits)
    expected = _hf_last_logits(hf, ids)
    torch.testing.assert_close(logits, expected, atol=ATOL_BY_DEVICE[device], rtol=0)
    assert logits.argmax() == expected.argmax()


def test_greedy_decode_loop_matches_transformers() -> None:
    """Ten greedy tokens, one decode step each, crossing a block boundary (16)."""
    model, hf = _models("llama")
    ids = _prompt(12, seed=3)
    seq, step_ids, ours = PagedSequence(model), ids, []
    for _ in range(10):
        step_ids = seq.step(step_ids).argmax().reshape(1)
        ours.append(step_ids.item())
    theirs, context = [], ids
    for _ in range(10):
        next_id = _hf_last_logits(hf, context).argmax().reshape(1)
        theirs.append(next_id.item())
        context = torch.cat([context, next_id])
    assert ours == theirs


def test_attributes_follow_config() -> None:
    model, hf = _models("qwen3")
    assert (model.num_layers, model.num_heads, model.num_kv_heads) == (2, 4, 2)
    assert model.head_dim == 32 == hf.config.head_dim  # explicit, not hidden // heads
    assert model.softmax_scale == 32 ** -0.5
    assert model.vocab_size == 512


def test_fused_projections_hold_hf_weights_in_order() -> None:
    model, hf = _models("qwen2")
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    attn = theirs.self_attn
    torch.testing.assert_close(ours.self_attn.qkv_proj.weight, torch.cat(
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), atol=0, rtol=0)
    torch.testing.assert_close(ours.self_attn.qkv_proj.bias, torch.cat(
        [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]), atol=0, rtol=0)
    torch.testing.assert_close(ours.mlp.gate_up_proj.weight, torch.cat(
        [theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]), atol=0, rtol=0)
    assert ours.self_attn.o_proj.bias is None  # Qwen2: biases on q/k/v only


def _llama_config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4,
                                    max_position_embeddings=2048, rope_parameters=rope)


ROPES = [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rotary_tables_equal_transformers_bitwise(rope: dict) -> None:
    config = _llama_config(dict(rope))
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    if rope["rope_type"] != "default":
        expected_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        assert torch.equal(hf_rotary.inv_freq, expected_inv_freq)
    assert torch.equal(compute_inv_freq(rope_parameters(config), 32), hf_rotary.inv_freq)
    ours = RotaryEmbedding(32, 2048, rope_parameters(config))
    positions = torch.tensor([0, 1, 17, 255, 256, 1000, 2047])
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions[None])
    assert torch.equal(torch.cat([cos, cos], -1)[:, 0], hf_cos[0])
    assert torch.equal(torch.cat([sin, sin], -1)[:, 0], hf_sin[0])


def test_legacy_rope_scaling_config_is_understood() -> None:
    """config.json files from transformers 4 carry rope_scaling + rope_theta at top level."""
    legacy = type("Cfg", (), {"rope_theta": 1e4, "max_position_embeddings": 512,
                              "rope_scaling": {"type": "linear", "factor": 2.0}})()
    params = rope_parameters(legacy)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1e4
    assert rope_parameters(type("Cfg", (), {"rope_scaling": None})())["rope_type"] == "default"


def test_unsupported_rope_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        compute_inv_freq({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, 32)


def _mistral_config(**overrides) -> transformers.MistralConfig:
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.MistralConfig(**{**kwargs, **overrides})


def test_sliding_window_shorter_than_max_len_is_rejected() -> None:
    config = _mistral_config(sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window=128"):
        LlamaForCausalLM(config, torch.float32, "cpu")
    LlamaForCausalLM(config, torch.float32, "cpu", max_model_len=128)  # window covers it all
    # Qwen2 keeps a sliding_window value that is off unless use_sliding_window is set.
    check_supported(transformers.Qwen2Config(sliding_window=64, max_position_embeddings=512))
    with pytest.raises(ValueError, match="sliding_window=64"):
        check_supported(transformers.Qwen2Config(sliding_window=64, use_sliding_window=True,
                                                 max_window_layers=0,
                                                 max_position_embeddings=512))


def test_mistral_without_window_matches_transformers(tmp_path) -> None:
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(_mistral_config(sliding_window=None,
                                                         initializer_range=0.1)).eval()
    hf.save_pretrained(tmp_path)
    model, _, _ = load_model(ModelConfig(str(tmp_path), dtype="float32"), "cpu")
    ids = _prompt(30, seed=4)
    torch.testing.assert_close(PagedSequence(model).step(ids), _hf_last_logits(hf, ids),
                               atol=ATOL, rtol=0)


def test_load_weights_reports_missing_and_unexpected() -> None:
    path = tiny_checkpoint(arch="llama")
    model, _, _ = load_model(ModelConfig(path, dtype="float32"), "cpu")  # private: gets clobbered
    weights = [(n, t) for n, t in iterate_weights(path)
               if n != "model.layers.1.self_attn.k_proj.weight"]
    weights.append(("model.layers.9.mlp.extra.weight", torch.zeros(1)))
    with pytest.raises(ValueError) as err:
        model.load_weights(weights)
    assert "model.layers.1.self_attn.qkv_proj.weight[k]" in str(err.value)
    assert "model.layers.9.mlp.extra.weight" in str(err.value)
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in iterate_weights(path)]
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        model.load_weights(bad)
