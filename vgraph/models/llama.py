"""One decoder module for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

These architectures differ only in a handful of switches (biases on the q/k/v projections,
per-head q/k RMSNorm, tied embeddings, explicit head_dim, RoPE scaling), so one class reads
them from the Hugging Face config instead of keeping four near-copies in sync.

The module is plain torch calling ``torch.ops.vgraph`` ops so that Dynamo captures it as one
graph whose only opaque calls are the attention ops (the graph's split points). It runs on a
flat token batch — ``forward(input_ids [T], positions [T])`` — and reads KV caches and
attention metadata from the forward context, never from its arguments. Projections are fused
(one q|k|v GEMM, one gate|up GEMM) and loaded from the checkpoint's separate weights.

Two build switches: ``use_custom_ops=False`` writes RMSNorm, the fused add+RMSNorm and
SiLU-and-mul in plain torch (the ops' own references, so both modes compute the same thing)
for Inductor to generate the kernels — attention stays the ``unified_attention`` op either
way, since it is where the graph splits; ``quant_config`` makes the linear layers fp8
(see quantization.py).

Tensor parallelism (vgraph/distributed/): built with a ``TPGroup`` of N ranks, each module holds
its rank's shard (heads, MLP columns, vocabulary rows; sharding.py says which) and the model
calls a functional all-reduce after each row-parallel projection and the embedding, so the
residual add and RMSNorm that follow see the full sum, in the same form as at one rank.

Pipeline parallelism (vgraph/distributed/pipeline.py): built with a ``PPStage`` of P stages,
the module holds only its stage's decoder layers (the others are ``MissingLayer`` placeholders,
so parameter names stay the checkpoint's and other stages' weights are skipped at load), the
embedding only on the first stage and the final norm and lm_head only on the last. A stage's
forward keeps the two-tensor signature: the first stage reads token ids, a later one reads the
previous stage's ``[T, 2 * hidden]`` output (hidden state | residual stream) in their place; a
stage that is not last returns that pair the same way instead of the normed hidden state. Its
attention layers index the stage's own KV caches (0 .. its layer count - 1).

Multi-LoRA (vgraph/lora/): built with a ``LoRAConfig``, each of the four projections of a layer
gets a ``LoRAProjection`` beside it (stacked adapter slots, mapped onto the fused q|k|v and
gate|up output slices) whose ``vgraph::lora_add`` adds each row's adapter to the projection's
output, the row's slot read from the model's ``lora_token_slots`` buffer. Built without one,
none of this exists: the modules, the traced graph and its compile cache key are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph.*)
from vgraph.ops.activation import silu_and_mul_reference
from vgraph.ops.kernels.host import FP8_DTYPE
from vgraph.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from vgraph.ops.linear import packing_enabled

from ..distributed.collectives import all_gather_last_dim, all_reduce
from ..distributed.sharding import check_divisible, shard_for_rank, shard_lora, vocab_range, vocab_rows
from ..distributed.pipeline import stage_layers
from ..distributed.state import PPStage, TPGroup
from ..lora.adapter import LoRATargets
from ..lora.config import LoRAConfig
from ..lora.layers import LoRAProjection

from .linear import Linear, MergedLinear, empty_parameter, pack_linears, unpack_linears
from .quantization import Fp8Config, Fp8Linear, Fp8MergedLinear, fp8_linear_from
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


@dataclass(frozen=True)
class LayerOptions:
    """How layers are built: where, in which activation dtype, with which kernels and weights."""

    dtype: torch.dtype
    device: Any
    use_custom_ops: bool = True
    quant: Optional[Fp8Config] = None
    tp: TPGroup = field(default_factory=TPGroup)
    lora: Optional[LoRAConfig] = None  # None: no LoRA buffers, no LoRA op, the graph as without


def rotary_by_op(opts: LayerOptions) -> bool:
    """Whether q and k are rotated by ``vgraph::rotary_qk`` (one kernel a layer, launched with
    PDL: ops/rotary.py): with custom ops on CUDA. Elsewhere the plain-torch rotation, which
    Inductor fuses into one loop on CPU, where the op would be its reference, aten call by
    aten call."""
    return opts.use_custom_ops and torch.device(opts.device).type == "cuda"


def make_lora(opts: LayerOptions, in_features: int, slices: list[tuple[str, int]]) -> Optional[LoRAProjection]:
    """The adapter slots beside a projection (``slices``: HF module names and output sizes in
    the projection's output order), or None when the model is built without LoRA."""
    if opts.lora is None:
        return None
    return LoRAProjection(in_features, slices, opts.lora.max_loras, opts.lora.max_lora_rank,
                          opts.dtype, opts.device)


def make_linear(opts: LayerOptions, in_features: int, out_features: int | list[tuple[str, int]],
                bias: bool) -> nn.Module:
    """A projection; ``out_features`` as [(shard, size), ...] makes it a fused one.

    Layers of an fp8 checkpoint are fp8 from the start (their weights arrive as e4m3);
    layers quantized at load are built in high precision and converted after loading,
    because their weights arrive in high precision and need their amax first.
    """
    fp8 = opts.quant is not None and opts.quant.serialized
    static = fp8 and opts.quant.static_activations
    if isinstance(out_features, list):
        if fp8:
            return Fp8MergedLinear(in_features, out_features, bias, opts.dtype, opts.device,
                                   static, opts.use_custom_ops)
        return MergedLinear(in_features, out_features, bias, opts.dtype, opts.device, opts.use_custom_ops)
    if fp8:
        return Fp8Linear(in_features, out_features, bias, opts.dtype, opts.device, static,
                         opts.use_custom_ops)
    return Linear(in_features, out_features, bias, opts.dtype, opts.device, opts.use_custom_ops)


class Embedding(nn.Module):
    """The token embedding; under tensor parallelism, vocab-parallel: this rank's rows of the
    vocabulary, ids outside them looked up as row 0 and zeroed, and the ranks' rows summed."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: Any,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, self.tp)
        rows = vocab_rows(vocab_size, self.tp.world_size)
        self.weight = empty_parameter(rows, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: Tensor) -> Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(rows, self.tp)


class RMSNorm(nn.Module):
    """RMSNorm; with a residual it adds first (the fused form).

    ``use_custom_ops`` picks the vgraph ops or the same math in plain torch.
    """

    def __init__(self, size: int, eps: float, opts: LayerOptions) -> None:
        super().__init__()
        self.eps = eps
        self.use_custom_ops = opts.use_custom_ops
        self.weight = empty_parameter(size, dtype=opts.dtype, device=opts.device)

    def forward(self, x: Tensor,
                residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            if self.use_custom_ops:
                return torch.ops.vgraph.rms_norm(x, self.weight, self.eps)
            return rms_norm_reference(x, self.weight, self.eps)
        if self.use_custom_ops:
            return torch.ops.vgraph.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_reference(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, opts: LayerOptions) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = opts.tp
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = make_linear(opts, spec.hidden_size, [("q", self.q_size), ("k", self.kv_size),
                                                             ("v", self.kv_size)], spec.qkv_bias)
        self.o_proj = make_linear(opts, self.q_size, spec.hidden_size, spec.o_bias)
        self.qkv_lora = make_lora(opts, spec.hidden_size, [("q_proj", self.q_size), ("k_proj", self.kv_size),
                                                           ("v_proj", self.kv_size)])
        self.o_lora = make_lora(opts, self.q_size, [("o_proj", spec.hidden_size)])
        self.q_norm: Optional[RMSNorm] = None
        self.k_norm: Optional[RMSNorm] = None
        if spec.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, opts)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, opts)
        self.rotary_op = rotary_by_op(opts)
        # An fp8 KV cache's per-tensor scales (1.0 unless the checkpoint has them). Not read
        # by forward: the runner hands them to the attention op through the forward context,
        # as it does the caches. Buffers, so they live on the model's device from the start.
        self.k_scale = nn.Buffer(torch.ones((), dtype=torch.float32, device=opts.device), persistent=False)
        self.v_scale = nn.Buffer(torch.ones((), dtype=torch.float32, device=opts.device), persistent=False)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, lora_slots: Optional[Tensor] = None) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora(hidden, qkv, lora_slots)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = torch.ops.vgraph.rotary_qk(q, k, *rope) if self.rotary_op else apply_rotary(q, k, *rope)
        out = torch.ops.vgraph.unified_attention(q, k, v, self.layer_idx).reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if self.o_lora is not None:
            projected = self.o_lora(out, projected, lora_slots)
        return all_reduce(projected, self.tp)


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec, opts: LayerOptions) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.use_custom_ops = opts.use_custom_ops
        self.tp = opts.tp
        self.gate_up_proj = make_linear(opts, spec.hidden_size, [("gate", size), ("up", size)],
                                        spec.mlp_bias)
        self.down_proj = make_linear(opts, size, spec.hidden_size, spec.mlp_bias)
        self.gate_up_lora = make_lora(opts, spec.hidden_size, [("gate_proj", size), ("up_proj", size)])
        self.down_lora = make_lora(opts, size, [("down_proj", spec.hidden_size)])

    def forward(self, x: Tensor, lora_slots: Optional[Tensor] = None) -> Tensor:
        act = self._fused_activation(x) if self._fuses_projection() else self._activation(x, lora_slots)
        down = self.down_proj(act)
        if self.down_lora is not None:
            down = self.down_lora(act, down, lora_slots)
        return all_reduce(down, self.tp)

    def _fuses_projection(self) -> bool:
        """A plain [gate | up] projection on CUDA with no adapter runs with its activation as
        one op, which is one kernel where the GEMV takes the call (ops/dense_linear.py). Not
        when fp8 (the quant passes fuse the activation with the next layer's input quant)."""
        proj = self.gate_up_proj
        return self.gate_up_lora is None and type(proj) is MergedLinear and proj.custom_op and proj.weight.is_cuda

    def _fused_activation(self, x: Tensor) -> Tensor:
        return torch.ops.vgraph.linear_silu_and_mul(x, self.gate_up_proj.weight, self.gate_up_proj.bias)

    def _activation(self, x: Tensor, lora_slots: Optional[Tensor]) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_lora is not None:
            gate_up = self.gate_up_lora(x, gate_up, lora_slots)
        if self.use_custom_ops:
            return torch.ops.vgraph.silu_and_mul(gate_up)
        return silu_and_mul_reference(gate_up)


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args: Any) -> None:
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, opts: LayerOptions) -> None:
        """``layer_idx``: the layer's KV cache among this stage's (its global index with one stage)."""
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, opts)
        self.mlp = MLP(spec, opts)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, opts)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, opts)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, residual: Optional[Tensor],
                lora_slots: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Pre-norm block on a carried residual stream: the add rides in the next norm.
        ``lora_slots``: each row's adapter slot, when the model is built with LoRA."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, lora_slots)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora_slots), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding, opts: LayerOptions,
                 pp: Optional[PPStage] = None) -> None:
        super().__init__()
        self.pp = pp or PPStage()
        self.layer_range = stage_layers(spec.num_layers, self.pp.size)[self.pp.index]
        start = self.layer_range.start
        self.embed_tokens: Optional[Embedding] = None
        if self.pp.is_first:
            self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, opts.dtype, opts.device, opts.tp)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(DecoderLayer(spec, i - start, opts) if i in self.layer_range else MissingLayer()
                                    for i in range(spec.num_layers))
        self.norm: Optional[RMSNorm] = None
        if self.pp.is_last:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, opts)
        # Each row's LoRA slot (-1: none), filled in place before a forward (set_lora_token_slots
        # of the causal LM). A buffer, so the compiled graph reads it as an input at a fixed
        # address; its first T entries are sliced in the graph, so they carry the token
        # dimension like the activations (a row-wise tail piece gets the sampled rows' slots).
        slots = None
        if opts.lora is not None:
            slots = torch.full((opts.lora.max_num_tokens,), -1, dtype=torch.int32, device=opts.device)
        self.register_buffer("lora_token_slots", slots, persistent=False)

    @property
    def layout_name(self) -> str:
        """Its kind in the compile cache key: with LoRA, the slot buffer's length is a static
        shape of the graph; with pipeline stages, the stage and its layers (each stage traces
        another graph); otherwise the class name, as before either existed."""
        name = type(self).__name__
        if self.pp.size > 1:
            name += f"[stage={self.pp.index}/{self.pp.size},layers={self.layer_range.start}-{self.layer_range.stop}]"
        if self.lora_token_slots is not None:
            name += f"[lora_tokens={self.lora_token_slots.shape[0]}]"
        return name

    def own_layers(self) -> list[tuple[int, DecoderLayer]]:
        """(global index, layer) of the decoder layers this stage holds."""
        return [(i, self.layers[i]) for i in self.layer_range]

    def forward(self, inputs: Tensor, positions: Tensor) -> Tensor:
        """``inputs``: token ids [T] on the first stage, else the previous stage's [T, 2 * hidden]."""
        hidden, residual = self._stage_inputs(inputs)
        rope = self.rotary_emb(positions, hidden.dtype)  # gathered once, used by every layer
        lora_slots = None
        if self.lora_token_slots is not None:
            # A batch never exceeds the slots buffer: said to the compiler, so the slice's length
            # is the token count itself (not min(buffer, tokens)) and the tail can run on rows.
            torch._check(inputs.shape[0] <= self.lora_token_slots.shape[0])
            lora_slots = self.lora_token_slots[:inputs.shape[0]]
        for i in self.layer_range:
            hidden, residual = self.layers[i](rope, hidden, residual, lora_slots)
        if self.norm is None:  # not the last stage: hand on the hidden state and the residual stream
            return torch.cat([hidden, residual], dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _stage_inputs(self, inputs: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        if self.embed_tokens is not None:
            return self.embed_tokens(inputs), None
        hidden, residual = inputs.chunk(2, dim=-1)
        return hidden, residual


# HF projection name -> (our fused projection, shard) for weights stored separately in HF.
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # RoPE tables some old checkpoints saved
# An fp8 KV cache's scales as checkpoints name them, after "model.layers.N.": vLLM's and
# llm-compressor's current names, vLLM's attention-module ones, and compressed-tensors'
# older output scales of the K and V projections.
_KV_SCALE_NAMES = {
    "self_attn.k_scale": "k_scale", "self_attn.v_scale": "v_scale",
    "self_attn.attn.k_scale": "k_scale", "self_attn.attn.v_scale": "v_scale",
    "self_attn.k_proj.output_scale": "k_scale", "self_attn.v_proj.output_scale": "v_scale",
}
_LAYER_PREFIX = "model.layers."

Target = tuple[str, Optional[str]]  # (our parameter name, shard or None for the whole tensor)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM on a flat token batch.

    ``hf_config`` is the transformers config of the checkpoint; parameters are created
    uninitialized in ``dtype`` on ``device`` and filled by :meth:`load_weights`.
    ``max_model_len`` (default: the config's max_position_embeddings) bounds the RoPE table
    and decides whether a sliding window is a problem. ``use_custom_ops`` picks vgraph's ops
    or plain torch for norms and activations; ``quant_config`` makes the decoder's linear
    layers fp8. ``dtype`` stays the activation dtype (and the KV cache's) either way. ``tp``
    (default: one rank) builds this rank's shard: ``num_heads`` and ``num_kv_heads`` are then
    the rank's own (what its KV cache holds), ``vocab_size`` the model's. ``lora_config``
    adds LoRA adapter slots (one rank only, for now); ``set_lora_token_slots`` then says
    which slot each row of the next forward uses.
    """

    # Everything after the last attention (o_proj and its all-reduce, the residual add, the
    # norms, the MLP: per-token activation quantization included) works row by row, so the
    # compiler may run it on only the rows a step samples (vgraph/compiler/piece.py RowArgs).
    row_wise_tail = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: Optional[int] = None, use_custom_ops: bool = True,
                 quant_config: Optional[Fp8Config] = None, tp: Optional[TPGroup] = None,
                 lora_config: Optional[LoRAConfig] = None, pp: Optional[PPStage] = None) -> None:
        super().__init__()
        check_supported(hf_config, max_model_len)
        spec = arch_spec(hf_config)
        self.spec = spec
        self.tp = tp or TPGroup()
        n = self.tp.world_size
        self.lora_config = lora_config
        check_divisible(n, spec.num_heads, spec.num_kv_heads, spec.intermediate_size)
        local = replace(spec, num_heads=spec.num_heads // n, num_kv_heads=spec.num_kv_heads // n,
                        intermediate_size=spec.intermediate_size // n)
        self.pp = pp or PPStage()
        # Decoder layers of this stage: all of them with one stage (what its KV cache holds).
        self.num_layers = len(stage_layers(spec.num_layers, self.pp.size)[self.pp.index])
        self.num_heads = local.num_heads
        self.num_kv_heads, self.head_dim = local.num_kv_heads, spec.head_dim
        self.vocab_size, self.hidden_size = spec.vocab_size, spec.hidden_size
        self.softmax_scale = spec.head_dim ** -0.5
        self.dtype = dtype
        self.use_custom_ops = use_custom_ops
        self.quant_config = quant_config
        self._static_fp8 = quant_config is not None and quant_config.static_activations
        max_position = max(hf_config.max_position_embeddings, max_model_len or 0)
        rotary = RotaryEmbedding(spec.head_dim, max_position, rope_parameters(hf_config), device)
        opts = LayerOptions(dtype, device, use_custom_ops, quant_config, self.tp, lora_config)
        self.model = LlamaModel(local, rotary, opts, self.pp)
        # Only a stage that is not last hands on every row: the tail may run on sampled rows alone.
        self.row_wise_tail = self.pp.is_last
        # Never quantized: the output distribution is most sensitive to its precision.
        self.lm_head: Optional[Linear] = None
        if self.pp.is_last:
            self.lm_head = Linear(spec.hidden_size, vocab_rows(spec.vocab_size, n), False, dtype, device)
        # Tied embeddings share one tensor when one stage holds both; a last stage that is not the
        # first loads the embedding's checkpoint tensor into its own lm_head.
        self._shared_lm_head = spec.tie_word_embeddings and self.pp.size == 1
        if self._shared_lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight
        # CPU float32 projections run vgraph's packed GEMM (PackedLinear in models/linear.py), with the
        # ops switch on or off: it picks how norms and activations are written, not the GEMM.
        self._pack_projections = torch.device(device).type == "cpu" and dtype == torch.float32
        self.kv_scales_loaded = False  # whether the checkpoint had KV cache scales

    def kv_cache_scales(self) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (k_scale, v_scale) for an fp8 KV cache: one-element float32 tensors."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for _, layer in self.model.own_layers()]

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def lora_targets(self) -> LoRATargets:
        """The projections an adapter may target, with their full (in, out) shapes."""
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return LoRATargets(s.num_layers, {
            "q_proj": (s.hidden_size, q), "k_proj": (s.hidden_size, kv), "v_proj": (s.hidden_size, kv),
            "o_proj": (q, s.hidden_size), "gate_proj": (s.hidden_size, s.intermediate_size),
            "up_proj": (s.hidden_size, s.intermediate_size), "down_proj": (s.intermediate_size, s.hidden_size)})

    def lora_shard(self, module: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's part of an adapter's (A, B) on ``module``, cut as its base layer is."""
        return shard_lora(module, a, b, self.tp)

    def lora_projections(self) -> list[tuple[int, LoRAProjection]]:
        """(layer index, slots) of every adapted projection; empty without LoRA."""
        return [(i, module) for i, layer in self.model.own_layers()
                for module in (layer.self_attn.qkv_lora, layer.self_attn.o_lora, layer.mlp.gate_up_lora,
                               layer.mlp.down_lora) if module is not None]

    @torch.no_grad()
    def set_lora_token_slots(self, slots: Tensor) -> None:
        """Sets the next forward's LoRA slot of each row (-1: none); rows past ``slots`` (a
        padded bucket's) get -1. Copies in place: the buffer's address never changes."""
        buffer = self.model.lora_token_slots
        if buffer is None:
            raise RuntimeError("this model was built without LoRA (lora_config=None)")
        if slots.dim() != 1 or slots.shape[0] > buffer.shape[0]:
            raise ValueError(f"LoRA token slots must be 1-D with at most max_num_tokens="
                             f"{buffer.shape[0]} rows, got shape {tuple(slots.shape)}")
        buffer[:slots.shape[0]].copy_(slots)
        buffer[slots.shape[0]:].fill_(-1)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (only the rows the sampler needs). Under
        tensor parallelism every rank computes its vocabulary rows and gathers the others', so
        every rank holds the same full logits."""
        logits = self.lm_head(hidden_states)
        if self.tp.is_parallel:
            logits = all_gather_last_dim(logits, self.tp)[..., :self.vocab_size]
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copies HF-named checkpoint tensors into the (fused) parameters.

        Raises ValueError naming every unexpected checkpoint weight, every parameter (or
        fused shard) the checkpoint did not provide, and any shape mismatch. Afterwards fp8
        layers settle their scales, or high-precision layers are quantized (fp8 at load).
        """
        unpack_linears(self)  # a packed model (loaded before) takes weights in the plain layout
        params = dict(self.named_parameters())
        loaded: set[Target] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if self._on_other_stage(name) or self._load_kv_scale(name, tensor):
                continue
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
        self._process_after_loading()

    def _on_other_stage(self, hf_name: str) -> bool:
        """Whether a checkpoint weight belongs to another pipeline stage (never loaded here)."""
        if self.pp.size == 1:
            return False
        if hf_name.startswith(_LAYER_PREFIX):
            index = hf_name[len(_LAYER_PREFIX):].partition(".")[0]
            return index.isdigit() and int(index) not in self.model.layer_range
        if hf_name.startswith("model.embed_tokens."):
            return not self.pp.is_first and not (self.pp.is_last and self.spec.tie_word_embeddings)
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return not self.pp.is_last
        return False

    def _load_kv_scale(self, hf_name: str, tensor: Tensor) -> bool:
        """Copies a KV cache scale (``_KV_SCALE_NAMES``) into its layer; False for other names.
        Only per-tensor scales are supported: a per-head scale is an error naming it."""
        if not hf_name.startswith(_LAYER_PREFIX):
            return False
        index, _, rest = hf_name[len(_LAYER_PREFIX):].partition(".")
        if rest not in _KV_SCALE_NAMES or not index.isdigit() or int(index) >= len(self.model.layers):
            return False
        if tensor.numel() != 1 or not torch.isfinite(tensor).all() or float(tensor.reshape(())) <= 0:
            raise ValueError(f"KV cache scale {hf_name} must be one positive finite number (a per-tensor "
                             f"scale), got shape {tuple(tensor.shape)}")
        getattr(self.model.layers[int(index)].self_attn, _KV_SCALE_NAMES[rest]).fill_(float(tensor.reshape(())))
        self.kv_scales_loaded = True
        return True

    def _process_after_loading(self) -> None:
        if self.quant_config is not None and not self.quant_config.serialized:
            self._quantize_linears()
        for module in self.modules():
            if isinstance(module, Fp8Linear):
                module.finalize()
        if self._pack_projections and packing_enabled():
            pack_linears(self, tied={"lm_head"} if self._shared_lm_head else set())

    def _quantize_linears(self) -> None:
        """Swaps every decoder projection for its fp8 form (the lm_head stays as it is).

        Done after loading, with the whole model briefly in high precision, because a
        per-tensor scale needs the whole (fused) weight's amax.
        """
        for name, module in list(self.named_modules()):
            if isinstance(module, Linear) and name != "lm_head":
                parent, _, child = name.rpartition(".")
                setattr(self.get_submodule(parent), child,
                        fp8_linear_from(module, self.use_custom_ops))

    def _map_name(self, hf_name: str) -> Optional[Target]:
        """Our target for an HF weight name; None for weights deliberately skipped."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return None  # tied: the embedding is the output projection
        if hf_name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            return "lm_head.weight", None  # tied, on a last stage without the embedding
        if hf_name.endswith(".input_scale") and not self._static_fp8:
            return None  # calibration a dynamic-activation fp8 checkpoint may carry unused
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
        shards = getattr(module, "shards", None)  # MergedLinear / Fp8MergedLinear
        if shard is None and shards:
            return [(name, s) for s in shards]
        return [target]

    def _expected_targets(self) -> set[Target]:
        targets: set[Target] = set()
        for name, _ in self.named_parameters():
            targets.update(self._covered((name, None)))
        return targets

    def _copy_into(self, param: Tensor, target: Target, tensor: Tensor, hf_name: str) -> None:
        """Copies one checkpoint tensor into its parameter (or its shard's part of it).

        A one-element tensor fills a one-element slot whatever its shape (checkpoints store
        fp8 scales as scalars or as [1]); fp8 data must land in fp8 and nothing else there,
        since a cast would silently drop the scale.
        """
        name, shard = target
        tensor = shard_for_rank(name, shard, tensor, self.tp, self.vocab_size)
        dest = param.data
        if shard is not None:
            module_name, _, param_name = name.rpartition(".")
            dest = self.get_submodule(module_name).shard_view(param_name, shard)
        if dest.shape != tensor.shape and not dest.numel() == tensor.numel() == 1:
            raise ValueError(f"weight {hf_name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(dest.shape)} for {name}")
        if (dest.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
            raise ValueError(f"weight {hf_name} is {tensor.dtype} but {name} holds {dest.dtype}: "
                             "fp8 weights need their scales (and only fp8 layers have them)")
        dest.copy_(tensor.reshape(dest.shape))
