"""examples/user_pass.py runs through LLM on the demo model: its lifting passes, placed before
vgraph's, let the RMSNorm+quant fusion find every norm feeding a quantized projection."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_pass.py"


def test_example_main_fuses_every_site_with_its_passes_placed_before(capsys):
    spec = importlib.util.spec_from_file_location("user_pass_example_main", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    matches = example.main(["--positions", "before"])
    # 4 layers: 2L+1 norms, 4L quantized projections, 2L norm+quant sites fused; left at the end:
    # 2L fused norm+quants, 4L fp8 GEMMs, 2L quants of o_proj/down_proj inputs, the final norm
    assert matches["before"] == {"PlainRMSNormPass": 9, "PlainDynamicQuantPass": 16, "RMSNormQuantFusionPass": 8,
                                 "SiluMulFusionPass": 0, "AllReduceRMSNormFusionPass": 0, "NormLinearFusionPass": 0,
                                 "count_vgraph_ops": 33}
    assert "lifting passes before vgraph's" in capsys.readouterr().out
