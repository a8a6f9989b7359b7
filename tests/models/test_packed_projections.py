"""CPU float32 models run their projections over packed weights (vgraph/models/linear.py).

What must hold: every float32 projection is packed and its unpacked copy is gone (memory
does not double), a tied lm_head keeps sharing the embedding (on the row-major kernel; a small
one gets a packed copy, tied again on reload), the switch and other dtypes
leave F.linear in place, logits agree with the unpacked model and with transformers, and a
packed model can be loaded again in place.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.checkpoints import tiny_checkpoint
from tests.models.test_models import PagedSequence
from vgraph.config import ModelConfig
from vgraph.models import linear as linear_module
from vgraph.models.linear import Linear, PackedLinear, RowMajorLinear
from vgraph.models.loader import iterate_weights, load_model
from vgraph.ops import linear as linear_op


def _load(path: str, dtype: str = "float32"):
    model, _, _ = load_model(ModelConfig(path, dtype=dtype), "cpu")
    return model


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return PagedSequence(model).step(ids)


IDS = torch.arange(6, 40)


def test_untied_model_packs_every_projection_and_keeps_no_unpacked_copy():
    model = _load(tiny_checkpoint(arch="llama"))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * model.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert isinstance(model.lm_head, PackedLinear)
    assert not any(isinstance(m, Linear) for m in model.modules())
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("proj.weight") for n in names)
    assert all(p.weight_packed.shape[0] * 16 - p.out_features < 16 for p in packed)


def test_a_small_tied_lm_head_gets_a_packed_copy_tied_again_on_reload():
    """A small tied head is packed (a copy), and a reload ties it to the embedding again before
    packing the new values; logits match transformers."""
    path = tiny_checkpoint(arch="qwen2")
    model = _load(path)
    embedding = model.model.embed_tokens.weight
    assert type(model.lm_head) is PackedLinear and model.lm_head._tied_to[0] is embedding
    assert torch.equal(model.lm_head.weight, embedding)
    assert "lm_head.weight_packed" in dict(model.named_parameters())
    logits = _logits(model, IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(IDS[None]).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    model.load_weights(iterate_weights(path))
    assert type(model.lm_head) is PackedLinear and model.lm_head._tied_to[0] is model.model.embed_tokens.weight
    assert torch.equal(_logits(model, IDS), logits)


def test_a_large_tied_lm_head_keeps_sharing_the_embedding(monkeypatch):
    """Not packed (no copy of the embedding): the row-major form of the same kernel, over the
    embedding's own Parameter, through a reload too; logits still match transformers."""
    monkeypatch.setattr(linear_module, "PACKED_TIED_HEAD_BYTES", 0)  # every head is "large"
    path = tiny_checkpoint(arch="qwen2")
    model = _load(path)
    assert type(model.lm_head) is RowMajorLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    logits = _logits(model, IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(IDS[None]).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert logits.argmax() == expected.argmax()
    model.load_weights(iterate_weights(path))
    assert type(model.lm_head) is RowMajorLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(model, IDS), logits)


def test_logits_match_the_unpacked_model_and_transformers(monkeypatch):
    path = tiny_checkpoint(arch="llama")
    packed = _logits(_load(path), IDS)
    monkeypatch.setenv(linear_op.ENV_SWITCH, "torch")
    plain_model = _load(path)
    assert not any(isinstance(m, PackedLinear) for m in plain_model.modules())
    plain = _logits(plain_model, IDS)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(IDS[None]).logits[0, -1]
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=0)
    assert packed.argmax() == expected.argmax()


def test_a_packed_model_loads_again_in_place():
    path = tiny_checkpoint(arch="qwen2")  # qkv biases too
    model = _load(path)
    before = _logits(model, IDS)
    model.load_weights(iterate_weights(path))
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, PackedLinear)
    assert torch.equal(_logits(model, IDS), before)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_other_dtypes_are_not_packed(dtype):
    model = _load(tiny_checkpoint(arch="llama"), dtype=dtype)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
