"""The ops switch: norms, activations and fp8 quantization as vgraph ops or as plain torch.

Both modes compute the same math (plain-torch mode calls the ops' own references), so on CPU
their logits must be identical, and both must match transformers. What the switch changes is
the captured graph: with it off, no norm / activation / quant op is left for Inductor to treat
as opaque — only attention (the split point) and the GEMM (fp8, or the packed CPU float32
one) remain as vgraph ops.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers

from tests.checkpoints import TINY_ARCHS, tiny_checkpoint
from tests.models.test_fp8 import static_checkpoint
from tests.models.test_models import PagedSequence
from vgraph.config import ModelConfig
from vgraph.models.llama import LlamaForCausalLM
from vgraph.models.loader import load_model

ELEMENTWISE_OPS = {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "static_scaled_fp8_quant",
                   "dynamic_per_token_scaled_fp8_quant"}


@functools.lru_cache(maxsize=None)
def _model(path: str, custom_ops: bool, quantization: str | None = None) -> LlamaForCausalLM:
    model, _, _ = load_model(ModelConfig(path, dtype="float32", quantization=quantization), "cpu",
                             use_custom_ops=custom_ops)
    return model


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(6, 512, (length,), generator=torch.Generator().manual_seed(seed))


def _prefill_then_decode(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seq = PagedSequence(model)
    return seq.step(ids[:-1]), seq.step(ids[-1:])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_both_modes_give_identical_logits_and_match_transformers(arch: str) -> None:
    path = tiny_checkpoint(arch=arch)
    ids = _prompt(30, seed=5)
    with_ops = _prefill_then_decode(_model(path, True), ids)
    plain = _prefill_then_decode(_model(path, False), ids)
    for a, b in zip(with_ops, plain):
        assert torch.equal(a, b)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(plain[1], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_both_modes_give_identical_logits_for_fp8(scheme: str) -> None:
    path = tiny_checkpoint(arch="qwen2") if scheme == "dynamic" else static_checkpoint()
    ids = _prompt(30, seed=6)
    with_ops = _prefill_then_decode(_model(path, True, "fp8"), ids)
    plain = _prefill_then_decode(_model(path, False, "fp8"), ids)
    for a, b in zip(with_ops, plain):
        assert torch.equal(a, b)


def _captured_vgraph_ops(model: LlamaForCausalLM) -> tuple[set[str], torch.Tensor]:
    """The vgraph ops in Dynamo's graph of ``model.forward``, and the logits it computed."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    seq = PagedSequence(model)
    seq.model = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
    logits = seq.step(_prompt(12, seed=7))
    ops = {_vgraph_op_name(node.target) for gm in graphs for node in gm.graph.nodes
           if node.op == "call_function"}
    return ops - {None}, logits


def _vgraph_op_name(target: object) -> str | None:
    """"rms_norm" for torch.ops.vgraph.rms_norm (packet or overload); None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return name if namespace == "vgraph" else None
    return None


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_plain_mode_leaves_only_attention_and_the_gemm_as_ops(quantization: str | None) -> None:
    path = tiny_checkpoint(arch="qwen3")  # q/k norms too
    ops_on, logits_on = _captured_vgraph_ops(_model(path, True, quantization))
    ops_off, logits_off = _captured_vgraph_ops(_model(path, False, quantization))
    # The GEMM stays a vgraph op either way: fp8, or on CPU float32 the packed GEMM.
    gemm = {"fp8_gemm"} if quantization else {"packed_linear"}
    assert ops_off == {"unified_attention"} | gemm
    expected_on = {"unified_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul"} | gemm
    if quantization:
        expected_on.add("dynamic_per_token_scaled_fp8_quant")
    assert ops_on == expected_on
    assert torch.equal(logits_on, logits_off)


@pytest.mark.parametrize("level, device, quantized, expected", [
    ("compiled", "cpu", False, False),  # Inductor fuses the plain-torch norms into one loop
    ("compiled", "cpu", True, True),    # the fusion passes match the ops
    ("compiled", "cuda", False, True),  # Triton kernels
    ("none", "cpu", False, True),       # eager: one op call instead of several aten calls
])
def test_unset_custom_ops_resolve_by_device_and_quantization(level, device, quantized, expected):
    from vgraph.config import CompileConfig
    assert CompileConfig(level=level).resolved_custom_ops(device, quantized) is expected
    for explicit in (True, False):
        assert CompileConfig(level=level, custom_ops=explicit).resolved_custom_ops(device, quantized) is explicit


@pytest.mark.parametrize("fp8_checkpoint, expected", [(False, False), (True, True)])
def test_engine_resolves_the_switch_from_the_checkpoint(fp8_checkpoint, expected):
    """An fp8 checkpoint counts as quantized although the user asked for no quantization."""
    from vgraph import LLM
    from vgraph.config import CompileConfig
    path = static_checkpoint() if fp8_checkpoint else tiny_checkpoint(arch="llama")
    given = CompileConfig()
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks=32, compile_config=given)
    assert llm.engine.config.compile.custom_ops is expected
    assert given.custom_ops is None  # resolved on the engine's copy: reusable for another model
    ops = {type(m).__name__: getattr(m, "use_custom_ops", None) for m in llm.engine.runner.model.modules()}
    assert ops["RMSNorm"] is expected and ops["MLP"] is expected


@pytest.mark.parametrize("custom_ops", [True, False])
def test_without_custom_ops_the_passes_leave_plain_silu_to_inductor(custom_ops):
    """Lifting plain torch into ``vgraph::silu_and_mul`` would undo what custom_ops=False asked for."""
    from vgraph.compiler.build import build_pass_manager
    from vgraph.config import CompileConfig, EngineConfig
    manager = build_pass_manager(EngineConfig(ModelConfig("unused"), compile=CompileConfig(custom_ops=custom_ops)))
    silu = [p for p in manager.passes if type(p).__name__ == "SiluMulFusionPass"]
    assert len(silu) == 1 and silu[0].plain_torch is custom_ops and silu[0].quant


@pytest.mark.parametrize("device, custom_ops, expected", [("cuda", True, True), ("cuda:1", True, True),
                                                          ("cuda", False, False), ("cpu", True, False)])
def test_rope_is_one_op_with_custom_ops_on_cuda_only(device, custom_ops, expected):
    """On CPU the op would be its reference, several aten calls, where Inductor fuses the
    plain-torch rotation into one loop."""
    from vgraph.models.llama import LayerOptions, rotary_by_op
    assert rotary_by_op(LayerOptions(torch.float32, device, use_custom_ops=custom_ops)) is expected


def test_a_model_rotating_by_the_op_gives_the_plain_rotations_logits(monkeypatch):
    """What a CUDA model runs (the op), here on CPU with the op's reference: fp32 logits equal."""
    path = tiny_checkpoint(arch="llama")
    model = _model(path, True)
    ids = _prompt(9, seed=3)
    plain = _prefill_then_decode(model, ids)
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "rotary_op", True)
    by_op = _prefill_then_decode(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(by_op, plain))
