"""PassManager: order, counts, dumps, user passes, and the uuid that keys Inductor's cache."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vgraph.passes.base as base
from vgraph.passes import (CallablePass, PassManager, RMSNormQuantFusionPass, SiluMulFusionPass,
                           VgraphPass, default_passes)

from . import EPS, V, GraphRecorder, apply, assert_outputs_match, scale, trace


def block(x, w, s):
    """One norm+quant site and one plain SwiGLU+quant site."""
    h = V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s).float()
    d = h.shape[-1] // 2
    return V.static_scaled_fp8_quant(F.silu(h[..., :d]) * h[..., d:], s)


def block_graph() -> torch.fx.GraphModule:
    return trace(block, torch.randn(3, 16), torch.randn(16), scale())


class CountMuls(VgraphPass):
    """A user pass in the VgraphPass style: counts aten.mul nodes, changes nothing."""

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def config(self):
        return {"minimum": self.minimum}

    def apply(self, graph):
        muls = sum(1 for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor)
        return {"mul": muls if muls >= self.minimum else 0}


# ------------------------------------------------------------------ running and counting


def test_runs_passes_in_order_and_counts():
    recorder = GraphRecorder()
    manager = PassManager(default_passes() + [recorder])
    for _ in range(2):
        apply(manager, block_graph())
    assert manager.graphs_seen == 2 and recorder.calls == 2
    assert manager.last_match_counts == {"RMSNormQuantFusionPass": 1, "SiluMulFusionPass": 2,
                                         "AllReduceRMSNormFusionPass": 0, "NormLinearFusionPass": 0,
                                         "GraphRecorder": 0}
    assert manager.match_counts() == {"RMSNormQuantFusionPass": 2, "SiluMulFusionPass": 4,
                                      "AllReduceRMSNormFusionPass": 0, "NormLinearFusionPass": 0,
                                         "GraphRecorder": 0}
    # the recorder runs last and sees only fused ops
    assert recorder.counts[V.rms_norm_static_fp8_quant.default] == 1
    assert recorder.counts[V.silu_and_mul_static_fp8_quant.default] == 1
    assert recorder.counts[V.static_scaled_fp8_quant.default] == 0
    assert "RMSNormQuantFusionPass=2" in manager.summary()
    manager.reset_counts()
    assert manager.match_counts()["SiluMulFusionPass"] == 0 and manager.graphs_seen == 0


def test_add_appends_and_names_duplicates():
    manager = PassManager([RMSNormQuantFusionPass()]).add(RMSNormQuantFusionPass(static=False))
    manager.add(CountMuls())
    assert list(manager.match_counts()) == ["RMSNormQuantFusionPass", "RMSNormQuantFusionPass#2",
                                            "CountMuls"]
    apply(manager, block_graph())
    assert manager.last_match_counts == {"RMSNormQuantFusionPass": 1,
                                         "RMSNormQuantFusionPass#2": 0, "CountMuls": 1}


def test_dump_dir(tmp_path):
    manager = PassManager(default_passes(), dump_dir=tmp_path / "dumps")
    apply(manager, block_graph())
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert names == ["graph001_01_RMSNormQuantFusionPass_after.py",
                     "graph001_01_RMSNormQuantFusionPass_before.py",
                     "graph001_02_SiluMulFusionPass_after.py",
                     "graph001_02_SiluMulFusionPass_before.py",
                     "graph001_03_AllReduceRMSNormFusionPass_after.py",
                     "graph001_03_AllReduceRMSNormFusionPass_before.py",
                     "graph001_04_NormLinearFusionPass_after.py",
                     "graph001_04_NormLinearFusionPass_before.py"]
    before = (tmp_path / "dumps" / names[1]).read_text()
    after = (tmp_path / "dumps" / names[0]).read_text()
    assert "vgraph.rms_norm.default" in before and "rms_norm_static_fp8_quant" not in before
    assert "vgraph.rms_norm_static_fp8_quant.default" in after and "# matches: 1" in after


# ------------------------------------------------------------------ user passes


def test_user_callable_reporting_by_return_value_or_attribute():
    def count_placeholders(graph):
        return sum(1 for n in graph.nodes if n.op == "placeholder")

    count_placeholders.uuid = lambda: "count_placeholders/1"

    class Attr:
        matched_count = 0

        def __call__(self, graph):
            self.matched_count = 7

        def uuid(self):
            return "attr/1"

    manager = PassManager([count_placeholders, Attr()])
    apply(manager, block_graph())
    assert manager.last_match_counts == {"count_placeholders": 3, "Attr": 7}
    assert isinstance(manager.passes[0], CallablePass)


def test_user_pass_without_uuid_is_refused():
    with pytest.raises(TypeError, match="uuid"):
        PassManager([lambda graph: None])


def test_broken_graph_names_the_pass():
    def breaker(graph):
        calls = [n for n in graph.nodes if n.op == "call_function"]
        with graph.inserting_before(calls[0]):  # reads a value before it is computed
            graph.call_function(torch.ops.aten.neg.default, (calls[-1],))

    breaker.uuid = lambda: "breaker/1"
    with pytest.raises(RuntimeError, match="pass breaker left an invalid FX graph"):
        apply(PassManager([breaker]), block_graph())


# ------------------------------------------------------------------ uuid


def test_uuid_is_stable_across_constructions():
    assert PassManager(default_passes()).uuid() == PassManager(default_passes()).uuid()
    assert RMSNormQuantFusionPass().uuid() == RMSNormQuantFusionPass().uuid()


def test_uuid_changes_when_a_pass_is_added():
    manager = PassManager(default_passes())
    before = manager.uuid()
    manager.add(CountMuls())
    assert manager.uuid() != before
    assert PassManager([RMSNormQuantFusionPass()]).uuid() != PassManager(default_passes()).uuid()


def test_uuid_changes_with_pass_config():
    assert RMSNormQuantFusionPass(static=False).uuid() != RMSNormQuantFusionPass().uuid()
    assert SiluMulFusionPass(quant=False).uuid() != SiluMulFusionPass().uuid()
    assert CountMuls(minimum=2).uuid() != CountMuls().uuid()
    assert (PassManager([RMSNormQuantFusionPass(dynamic=False), SiluMulFusionPass()]).uuid()
            != PassManager(default_passes()).uuid())


def test_uuid_depends_on_order_and_user_uuid_but_not_dump_dir(tmp_path):
    a, b = RMSNormQuantFusionPass(), SiluMulFusionPass()
    assert PassManager([a, b]).uuid() != PassManager([b, a]).uuid()
    assert PassManager([a, b], dump_dir=tmp_path).uuid() == PassManager([a, b]).uuid()
    recorder = GraphRecorder()
    first = PassManager([recorder]).uuid()
    recorder.uuid = lambda: "tests.passes.GraphRecorder/2"
    assert PassManager([recorder]).uuid() != first


def test_uuid_changes_with_pass_source(monkeypatch):
    before = RMSNormQuantFusionPass().uuid()
    real = base.source_of
    monkeypatch.setattr(base, "source_of", lambda m: real(m) + "\n# edited")
    assert RMSNormQuantFusionPass().uuid() != before


def test_no_source_means_no_uuid(monkeypatch):
    """Without source the pass cannot be versioned: uuid None, so Inductor skips its cache."""
    monkeypatch.setattr(base, "source_of", lambda m: None)
    assert RMSNormQuantFusionPass().uuid() is None

    def no_uuid_yet(graph):
        return None

    no_uuid_yet.uuid = lambda: None
    assert PassManager([SiluMulFusionPass(), no_uuid_yet]).uuid() is None


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "user_pass.py"
    spec = importlib.util.spec_from_file_location("user_pass_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def plain_block(x, w1, w2):
    """Plain-torch norm -> plain dynamic quant, twice: what the demo model compiles to with
    custom ops off and fp8 on (the residual add feeding the second norm is read twice)."""
    from vgraph.ops.fp8 import dynamic_per_token_scaled_fp8_quant_reference as quant
    from vgraph.ops.norm import rms_norm_reference as norm
    q1, s1 = quant(norm(x, w1, EPS))
    r = x + q1.float() * s1
    q2, s2 = quant(norm(r, w2, EPS))
    return q2, s2, r


def test_example_lifting_passes_feed_vgraph_fusion_only_when_placed_before():
    """examples/user_pass.py: lifted to vgraph's ops before vgraph's passes, every norm+quant
    fuses; after them, nothing does, though the lifts match the same sites."""
    example = _example()
    x, w1, w2 = torch.randn(4, 32), torch.randn(32), torch.randn(32)
    for lifts_first, fused in ((True, 2), (False, 0)):
        lifts = [example.PlainRMSNormPass(), example.PlainDynamicQuantPass()]
        order = [*lifts, *default_passes()] if lifts_first else [*default_passes(), *lifts]
        manager = PassManager(order)
        gm = apply(manager, trace(plain_block, x, w1, w2))
        counts = manager.match_counts()
        assert counts["PlainRMSNormPass"] == 2 and counts["PlainDynamicQuantPass"] == 2
        assert counts["RMSNormQuantFusionPass"] == fused
        assert_outputs_match(gm(x, w1, w2), plain_block(x, w1, w2))


# ------------------------------------------------------------------ history and labels


def test_history_records_each_pass_per_labelled_graph(tmp_path):
    manager = PassManager(default_passes(), dump_dir=tmp_path)
    with manager.labelled(piece=2, size="dynamic"):
        apply(manager, block_graph())
    apply(manager, block_graph())  # unlabelled: the plain dump names
    first, second = manager.history
    assert first.labels == {"piece": "2", "size": "dynamic"} and second.labels == {}
    norm, silu, all_reduce, norm_linear = first.steps
    assert norm_linear.name == "NormLinearFusionPass" and norm_linear.matches == 0
    assert all_reduce.name == "AllReduceRMSNormFusionPass" and all_reduce.matches == 0
    assert (norm.name, norm.matches, norm.patterns) == ("RMSNormQuantFusionPass", 1, {"rms_norm_static_fp8_quant": 1})
    assert norm.removed == {"vgraph.rms_norm.default": 1, "vgraph.static_scaled_fp8_quant.default": 1}
    assert norm.added == {"vgraph.rms_norm_static_fp8_quant.default": 1}
    assert norm.ops_before["vgraph.rms_norm.default"] == 1 and "vgraph.rms_norm.default" not in norm.ops_after
    assert silu.patterns == {"silu_and_mul": 1, "silu_and_mul_static_fp8_quant": 1}
    assert silu.added == {"vgraph.silu_and_mul_static_fp8_quant.default": 1}
    assert sum(silu.ops_after.values()) < sum(silu.ops_before.values())
    assert norm.dumps == ("graph001_piece-2_size-dynamic_01_RMSNormQuantFusionPass_before.py",
                          "graph001_piece-2_size-dynamic_01_RMSNormQuantFusionPass_after.py")
    assert all((tmp_path / name).is_file() for name in norm.dumps)
    assert (tmp_path / "graph002_01_RMSNormQuantFusionPass_before.py").is_file()
    assert "# graph 1 (piece 2, size dynamic), before pass 1" in (tmp_path / norm.dumps[0]).read_text()
    assert manager.labels == {}, "labels end with their block"
    manager.reset_counts()
    assert manager.history == []
