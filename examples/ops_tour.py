"""A tour of vgraph's op library, usable on any model without the runtime.

    python examples/ops_tour.py

Runs the fused RMSNorm + fp8 quant op next to the unfused pair it replaces and shows that
they agree exactly (the fused op computes what the sequence computes, only in one pass).
"""
import torch

import vgraph.ops  # noqa: F401  registers torch.ops.vgraph.*

vg = torch.ops.vgraph
x = torch.randn(4, 4096)
weight = torch.ones(4096)
scale = torch.tensor([0.02])

fused = vg.rms_norm_static_fp8_quant(x, weight, scale, 1e-6)
unfused = vg.static_scaled_fp8_quant(vg.rms_norm(x, weight, 1e-6), scale)
print("fused dtype:", fused.dtype, "| identical to unfused:", torch.equal(fused.float(), unfused.float()))
print("schema:", vg.rms_norm_static_fp8_quant.default._schema)
