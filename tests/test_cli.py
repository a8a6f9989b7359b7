"""The command line as a user meets it: real subprocesses, exit codes, no tracebacks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

OPS = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "static_scaled_fp8_quant",
       "dynamic_per_token_scaled_fp8_quant", "fp8_gemm", "rms_norm_static_fp8_quant",
       "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_fp8_quant",
       "silu_and_mul_static_fp8_quant", "reshape_and_cache", "paged_attention",
       "paged_attention_decode_split_kv", "unified_attention"]


def vgraph(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "vgraph.cli", *args], capture_output=True,
                          text=True, timeout=300, env=full_env)


def test_ops_list_names_every_op():
    result = vgraph("ops", "list")
    assert result.returncode == 0, result.stderr
    for op in OPS:
        assert f"vgraph::{op}(" in result.stdout


def test_ops_check_passes_on_cpu():
    result = vgraph("ops", "check", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout and "interpreted" in result.stdout


def test_bad_arguments_exit_2_without_traceback():
    result = vgraph("ops", "frobnicate")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "invalid choice" in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda_is_a_clear_error():
    result = vgraph("ops", "check", "--device", "cuda")
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr and "Traceback" not in result.stderr


def test_generate_on_the_demo_model(tmp_path):
    result = vgraph("generate", "--prompt", "Hello", "--max-tokens", "8", "--ignore-eos",
                    "--device", "cpu", "--kv-cache-gib", "0.01", env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "[length, 8 tokens]" in result.stdout
    assert (tmp_path / "demo-model-v1" / "config.json").exists()
    assert "demo model" in result.stderr, "the demo model is announced as such"


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be non-negative"),
    (["--model", "/nonexistent/model"], "is not a directory"),
    (["--max-tokens", "0"], "max_tokens must be at least 1"),
    (["--pass", "no_such_module_for_vgraph:MyPass"], "--pass 'no_such_module_for_vgraph:MyPass': cannot import"),
    (["--block-size", "0"], "block_size must be at least 1"),
])
def test_generate_bad_input_exits_2_with_a_message(tmp_path, args, message):
    result = vgraph("generate", "--prompt", "Hello", "--device", "cpu", "--kv-cache-gib", "0.01",
                    "--enforce-eager", *args,
                    env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_compile_then_generate_loads_from_the_cache(tmp_path):
    env = {"VGRAPH_CACHE_DIR": str(tmp_path)}
    compiled = vgraph("compile", "--device", "cpu", "--kv-cache-gib", "0.01", env=env)
    assert compiled.returncode == 0, compiled.stderr
    assert "cache folder:" in compiled.stdout and "inductor:" in compiled.stdout
    assert " 0 compilations" not in compiled.stdout, "the first compile really compiles"
    listed = vgraph("cache", "list", env=env)
    assert listed.returncode == 0 and "1 entries" in listed.stdout
    generated = vgraph("generate", "--prompt", "Hi", "--max-tokens", "4", "--device", "cpu",
                       "--kv-cache-gib", "0.01", env=env)
    assert generated.returncode == 0, generated.stderr
    assert "captured graph: saved" in compiled.stdout
    assert "no Dynamo trace, no Inductor compilation" in generated.stderr, "a fresh process loads, traces nothing"
    cleared = vgraph("cache", "clear", env=env)
    assert cleared.returncode == 0 and "removed 1" in cleared.stdout


def test_parser_and_help_do_not_import_torch():
    """The engine flags come from vgraph.config (which imports torch): they are added only when
    an engine command is parsed, so ``vgraph --help`` and a mistyped command answer at once."""
    code = ("import sys; from vgraph.cli import build_parser; p = build_parser(); p.format_help()\n"
            "try:\n    p.parse_args(['frobnicate'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args,message", [
    (["compile", "--enforce-eager"], "--enforce-eager turns compilation off"),
    (["serve", "--max-logprobs", "-1"], "max_logprobs must be at least 0"),
    (["serve", "--cudagraph-mode", "sideways"], "invalid choice: 'sideways'"),
])
def test_engine_flag_errors_exit_2_before_loading(tmp_path, args, message):
    result = vgraph(*args, env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "demo-model-v1").exists(), "rejected before the demo model is built"
