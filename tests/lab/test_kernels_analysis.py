"""The report's pieces that need no compilation: reading Inductor's output code, and turning
the pass manager's history into match totals (per distinct graph vs per piece instance)."""
from __future__ import annotations

from vgraph.lab.analysis import changed_ops, kernel_totals, match_totals
from vgraph.lab.kernels import fused_ops, parse_kernels

OUTPUT_CODE = '''
cpp_fused_add_mean_mul_pow_rsqrt_0 = async_compile.cpp_pybinding(['const float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0) {}
\'\'\')
cpp_fused_clone_1 = async_compile.cpp_pybinding(['const float*'], r\'\'\'\'\'\')
triton_red_fused_abs_amax_2 = async_compile.triton('triton_red_fused_abs_amax_2', \'\'\'\'\'\')
def call(args):
    buf0 = torch.ops.vgraph.fp8_gemm.default(arg0_1, arg1_1)
    buf1 = torch.ops.vgraph.fp8_gemm.default(buf0, arg1_1)
    buf2 = torch.ops.vgraph.rms_norm.default(buf1, arg2_1, 1e-06)
    buf3 = torch.ops.aten.view.default(buf2, [4])
    extern_kernels.mm(buf2, arg3_1, out=buf4)
    cpp_fused_add_mean_mul_pow_rsqrt_0(buf4)
'''


def test_parse_kernels_reads_generated_kernels_and_opaque_calls():
    summary = parse_kernels(OUTPUT_CODE)
    assert summary.generated == ["cpp_fused_add_mean_mul_pow_rsqrt_0", "cpp_fused_clone_1",
                                 "triton_red_fused_abs_amax_2"]
    assert summary.fused == ["cpp_fused_add_mean_mul_pow_rsqrt_0", "triton_red_fused_abs_amax_2"]
    assert summary.custom_ops == {"vgraph.fp8_gemm": 2, "vgraph.rms_norm": 1}, "aten calls are not custom ops"
    assert summary.extern == {"mm": 1}
    assert fused_ops("cpp_fused_add_mean_mul_pow_rsqrt_0") == ["add", "mean", "mul", "pow", "rsqrt"]
    assert fused_ops("cpp_clone_3") == []


def _row(piece, size, instances, matches, patterns):
    return {"piece": piece, "size": size, "instances": instances,
            "steps": [{"pass": "P", "matches": matches, "patterns": patterns}]}


def test_match_totals_count_distinct_graphs_and_weight_piece_instances():
    rows = [_row(0, "dynamic", [0], 1, {"a": 1}),
            _row(2, "dynamic", [2, 4, 6], 2, {"a": 1, "b": 1}),  # one graph, three layers
            _row(2, "8", [2, 4, 6], 2, {"a": 1, "b": 1})]         # a compile size: work, not sites
    totals = match_totals(rows, ["P", "Q"])
    assert totals["per_pass"]["P"] == {"distinct_graphs": 5, "piece_instances": 7,
                                       "by_size": {"dynamic": 3, "8": 2}}
    assert totals["per_pass"]["Q"]["distinct_graphs"] == 0
    assert totals["per_pattern"]["P"] == {"a": {"distinct_graphs": 3, "piece_instances": 4},
                                          "b": {"distinct_graphs": 2, "piece_instances": 3}}


def test_changed_ops_and_kernel_totals():
    assert changed_ops({"a": 1, "b": 2}, {"b": 2, "c": 1}) == {"a": [1, 0], "c": [0, 1]}
    summary = {"generated_count": 2, "fused_count": 1, "custom_ops": {"vgraph.x": 3}, "extern": {}}
    rows = [{"size": "dynamic", "instances": [2, 4], "without": summary, "with": None},
            {"size": "8", "instances": [2, 4], "without": summary, "with": None}]
    assert kernel_totals(rows, "without") == {"generated_per_forward": 4, "fused_per_forward": 2,
                                              "custom_op_calls_per_forward": 6, "extern_calls_per_forward": 0}
    assert kernel_totals(rows, "with")["generated_per_forward"] == 0
