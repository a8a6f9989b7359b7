"""One decoder module for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

These architectures differ only in a handful of switches (biases on the q/k/v projections,
per-head q/k RMSNorm, tied embeddings, explicit head_dim, RoPE scaling), so one class reads
them from the Hugging Face config instead of keeping four near-copies in sync.

The module is plain torch calling ``torch.ops.vgraph`` ops so that Dynamo captures it as one
graph whose only opaque calls are the attention ops (the graph's split points). It runs on a
flat token batch — ``forward(input_ids [T], positions [T])`` — and reads KV caches and
attention metadata from the forward context, never from its arguments. Projections are fused
(one q|k|v GEMM, one gate|up GEMM) and loaded from the checkpoint's separate weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph.*)

from .rotary import RotaryEmbedding, apply_rotary, rope_parameters


@dataclass(frozen=True)
class ArchSpec:
    """The per-architecture switches, read once from the HF config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool


def _sliding_window(hf_config: Any) -> Optional[int]:
    """The attention window the config actually uses, or None for full attention.

    Qwen2/Qwen3 carry a ``sliding_window`` value that is inactive unless
    ``use_sliding_window`` is set (then ``layer_types`` marks the sliding layers); Mistral
    applies ``sliding_window`` to every layer whenever it is set.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    return window


def check_supported(hf_config: Any, max_model_len: Optional[int] = None) -> None:
    """Raises ValueError for config features this module does not implement."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: vgraph's Llama-family model uses SiLU")
    window = _sliding_window(hf_config)
    max_len = max_model_len or hf_config.max_position_embeddings
    if window is not None and window < max_len:
        raise ValueError(
            f"sliding-window attention (sliding_window={window}) is not supported and the "
            f"window is shorter than the maximum sequence length {max_len}; pass "
            f"max_model_len <= {window} to run it with full attention")


def arch_spec(hf_config: Any) -> ArchSpec:
    """Reads the switches; bias rules follow each architecture's transformers module."""
    model_type = getattr(hf_config, "model_type", "llama")
    heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    qwen2 = model_type == "qwen2"
    return ArchSpec(
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=True if qwen2 else attention_bias,  # Qwen2 always has q/k/v biases
        o_bias=False if qwen2 else attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def _empty(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    # Uninitialized: every weight is overwritten by load_weights, and random init of a
    # multi-GB model would cost seconds for nothing.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with uninitialized parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: Any) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked on the output dim, run as one GEMM.

    ``shards`` names each part and its output size in order; the loader copies each HF
    weight into its row range.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool,
                 dtype: torch.dtype, device: Any) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias, dtype, device)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards:
            self.shards[name] = (start, size)
            start += size


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = _empty(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm via the vgraph ops; with a residual it adds first (the fused form)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(size, dtype=dtype, device=device)

    def forward(self, x: Tensor,
                residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return torch.ops.vgraph.rms_norm(x, self.weight, self.eps)
        return torch.ops.vgraph.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, [("q", self.q_size), ("k", self.kv_size),
                                                        ("v", self.kv_size)],
                                     spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype, device)
        self.q_norm: Optional[RMSNorm] = None
        self.k_norm: Optional[RMSNorm] = None
        if spec.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor) -> Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        out = torch.ops.vgraph.unified_attention(q, k, v, self.layer_idx)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, [("gate", size), ("up", size)],
                                         spec.mlp_bias, dtype, device)
        self.down_proj = Linear(size, spec.hidden_size, spec.mlp_bias, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(torch.ops.vgraph.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, dtype, device)
        self.mlp = MLP(spec, dtype, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor,
                residual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Pre-norm block on a carried residual stream: the add rides in the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: Any) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions, hidden.dtype)  # gathered once, used by every layer
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF projection name -> (our fused projection, shard) for weights stored separately in HF.
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # RoPE tables some old checkpoints saved

Target = tuple[str, Optional[str]]  # (our parameter name, shard or None for the whole tensor)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM on a flat token batch.

    ``hf_config`` is the transformers config of the checkpoint; parameters are created
    uninitialized in ``dtype`` on ``device`` and filled by :meth:`load_weights`.
    ``max_model_len`` (default: the config's max_position_embeddings) bounds the RoPE table
    and decides whether a sliding window is a problem.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: Optional[int] = None) -> None:
        super().__init__()
        check_supported(hf_config, max_model_len)
        spec = arch_spec(hf_config)
        self.spec = spec
        self.num_layers, self.num_heads = spec.num_layers, spec.num_heads
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.vocab_size, self.hidden_size = spec.vocab_size, spec.hidden_size
        self.softmax_scale = spec.head_dim ** -0.5
        self.dtype = dtype
        max_position = max(hf_config.max_position_embeddings, max_model_len or 0)
        rotary = RotaryEmbedding(spec.head_dim, max_position, rope_parameters(hf_config), device)
        self.model = LlamaModel(spec, rotary, dtype, device)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (only the rows the sampler needs)."""
        return self.lm_head(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copies HF-named checkpoint tensors into the (fused) parameters.

        Raises ValueError naming every unexpected checkpoint weight, every parameter (or
        fused shard) the checkpoint did not provide, and any shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[Target] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target = self._map_name(name)
            if target is None:
                continue
            if target[0] not in params:
                unexpected.append(name)
                continue
            self._copy_into(params[target[0]], target, tensor, name)
            loaded.update(self._covered(target))
        missing = sorted(f"{p}[{s}]" if s else p for p, s in self._expected_targets() - loaded)
        if unexpected or missing:
            raise ValueError(f"checkpoint does not match {type(self).__name__}: unexpected "
                             f"weights {sorted(unexpected)}; missing weights {missing}")

    def _map_name(self, hf_name: str) -> Optional[Target]:
        """Our target for an HF weight name; None for weights deliberately skipped."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return None  # tied: the embedding is the output projection
        parts = hf_name.split(".")
        for i, part in enumerate(parts):
            if part in _STACKED:
                fused, shard = _STACKED[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return hf_name, None

    def _covered(self, target: Target) -> list[Target]:
        """What a copy fills: one shard, or every shard of a fused parameter loaded whole."""
        name, shard = target
        module = self.get_submodule(name.rpartition(".")[0])
        if shard is None and isinstance(module, MergedLinear):
            return [(name, s) for s in module.shards]
        return [target]

    def _expected_targets(self) -> set[Target]:
        targets: set[Target] = set()
        for name, _ in self.named_parameters():
            targets.update(self._covered((name, None)))
        return targets

    def _copy_into(self, param: Tensor, target: Target, tensor: Tensor, hf_name: str) -> None:
        dest = param.data
        if target[1] is not None:
            module = self.get_submodule(target[0].rpartition(".")[0])
            start, size = module.shards[target[1]]
            dest = dest.narrow(0, start, size)
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {hf_name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(dest.shape)} for {target[0]}")
        dest.copy_(tensor)
