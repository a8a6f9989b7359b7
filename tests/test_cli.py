"""The command line as a user meets it: real subprocesses, exit codes, no tracebacks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

OPS = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "static_scaled_fp8_quant",
       "dynamic_per_token_scaled_fp8_quant", "fp8_gemm", "rms_norm_static_fp8_quant",
       "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_fp8_quant",
       "silu_and_mul_static_fp8_quant", "reshape_and_cache", "paged_attention",
       "paged_attention_decode_split_kv", "unified_attention", "lora_add"]


def vgraph(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "vgraph.cli", *args], capture_output=True,
                          text=True, timeout=300, env=full_env)


# Runs the CLI in-process and prints the modules it imported, for checks of what a path needs.
_WITH_MODULES = ("import json, sys\nfrom vgraph.cli import main\nrc = main(sys.argv[1:])\n"
                 "print('MODULES ' + json.dumps(sorted(sys.modules)))\nsys.exit(rc)")
# What a warm `generate` must not import: the server stack, transformers' model code (vgraph
# runs its own modules; transformers gives config and tokenizer), transformers' config modules
# and AutoTokenizer (the compile run recorded what they resolved: checkpoint_record), and
# Dynamo's frame wrapper (made by torch.compile, which a start that loads the captured graph
# never calls), and Triton (the ops import their CUDA kernels on first use: ops/kernels lazy).
_NOT_ON_THE_GENERATE_PATH = ("vgraph.server", "fastapi", "uvicorn", "starlette", "openai",
                             "transformers.modeling_utils", "transformers.models.llama",
                             "transformers.models.auto", "torch._dynamo", "torch._inductor", "triton")


def vgraph_modules(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    result = subprocess.run([sys.executable, "-c", _WITH_MODULES, *args], capture_output=True, text=True,
                            timeout=300, env=full_env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("MODULES ")]
    return result, set(json.loads(lines[-1][len("MODULES "):])) if lines else set()


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
    assert not (tmp_path / "demo-model-v1").exists(), "the demo model ships in the package: nothing is built"
    assert "demo model" in result.stderr, "the demo model is announced as such"


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be non-negative"),
    (["--model", "/nonexistent/model"], "is not a directory"),
    (["--max-tokens", "-1"], "max_tokens must be non-negative"),
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
    assert (tmp_path / "vec-isa.json").is_file() or sys.platform != "linux", "Inductor's ISA probes recorded"
    generated, modules = vgraph_modules("generate", "--prompt", "Hi", "--max-tokens", "4", "--device", "cpu",
                                        "--kv-cache-gib", "0.01", env=env)
    assert generated.returncode == 0, generated.stderr
    assert "captured graph: saved" in compiled.stdout and "runnables:      3 saved" in compiled.stdout
    assert "served by:      the full compile rung" in compiled.stdout
    assert "compile ladder: served by the runnables rung" in generated.stderr
    assert "Dynamo and Inductor not imported" in generated.stderr, "a fresh process loads runnables, traces nothing"
    assert "s after process start" in generated.stderr and "(loaded from the compile cache)" in generated.stderr
    assert modules and "vgraph.engine.llm_engine" in modules
    unwanted = [m for m in modules if m.startswith(_NOT_ON_THE_GENERATE_PATH)]
    assert not unwanted, f"a warm generate imported {unwanted}"
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
    (["serve", "--max-queue-len", "0"], "--max-queue-len must be at least 1"),
    (["serve", "--header-timeout", "0"], "header_timeout must be positive"),
    (["serve", "--port", "70000"], "--port must be at most 65535"),
])
def test_engine_flag_errors_exit_2_before_loading(tmp_path, args, message):
    result = vgraph(*args, env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------- the operator's first hour

def test_version_is_one_line():
    result = vgraph("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("vgraph 0.") and "torch " in result.stdout
    assert result.stdout.count("\n") == 1


def test_serve_on_a_port_in_use_exits_2_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = vgraph("serve", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                        env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"vgraph serve: error: port {port} on 127.0.0.1 is in use " \
                            "(another server is listening there); choose another --port\n"


@pytest.mark.parametrize("model,message", [
    ("/nonexistent/model", "model path '/nonexistent/model' is not a directory (nothing exists there)"),
    ("not a model id", "is neither a local directory nor a Hugging Face Hub id"),
    ("EMPTY_DIR", "has no config.json"),
])
def test_serve_with_a_bad_model_exits_2_before_listening(tmp_path, model, message):
    if model == "EMPTY_DIR":
        model = str(tmp_path / "empty")
        os.mkdir(model)
    result = vgraph("serve", model, "--host", "127.0.0.1", "--port", "0", env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vgraph serve: error: ") and message in lines[0], result.stderr
    assert "Uvicorn running" not in result.stderr and "listening on" not in result.stderr


def test_generate_takes_the_model_as_a_positional_and_logs_once(tmp_path):
    """demo-model-v1 by name is the built-in model; the CLI's logging prints each record once."""
    result = vgraph("generate", "demo-model-v1", "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos",
                    "--enforce-eager", "--device", "cpu", "--kv-cache-gib", "0.01", "--log-level", "info",
                    env={"VGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "[length, 4 tokens]" in result.stdout
    assert result.stderr.count("engine ready") == 1, result.stderr
    assert "no --model given" not in result.stderr


def _parse(*argv: str):
    from vgraph import cli
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv,level", [
    (["--log-level", "WARNING", "compile"], "WARNING"),
    (["compile", "--log-level", "debug"], "DEBUG"),
    (["--log-level", "ERROR", "serve", "--log-level", "INFO"], "INFO"),  # the later one wins
    (["ops", "list", "--log-level", "warning"], "WARNING"),
    (["cache", "list", "--log-level", "ERROR"], "ERROR"),
    (["compile"], None),  # unset: main takes $VGRAPH_LOGGING_LEVEL, else INFO
])
def test_global_options_before_or_after_the_command(argv, level):
    assert getattr(_parse(*argv), "log_level", None) == level


def test_log_level_default_comes_from_the_environment(monkeypatch):
    from vgraph import cli
    monkeypatch.setenv("VGRAPH_LOGGING_LEVEL", "warning")
    assert cli._log_level(_parse("compile")) == "WARNING"
    assert cli._log_level(_parse("compile", "--log-level", "DEBUG")) == "DEBUG"
    monkeypatch.setenv("VGRAPH_LOGGING_LEVEL", "chatty")
    with pytest.raises(cli.UserError, match="VGRAPH_LOGGING_LEVEL='chatty' is not a log level"):
        cli._log_level(_parse("compile"))


@pytest.mark.parametrize("command", ["generate", "compile", "serve"])
def test_model_positional_and_flag_are_one_setting(command, capsys):
    from vgraph import cli
    extra = ["--prompt", "x"] if command == "generate" else []
    args = _parse(command, "some/model", *extra)
    cli._merge_model(args)
    assert args.model == "some/model"
    assert cli.main([command, "a/model", "--model", "b/model", *extra]) == 2
    assert "two models given: 'a/model' and --model 'b/model'" in capsys.readouterr().err


def test_top_level_help_is_plain_and_names_every_command():
    from vgraph import cli
    text = cli.build_parser().format_help()
    assert "``" not in text and ":class:" not in text
    for command in ("serve", "generate", "compile", "cache", "ops", "doctor"):
        assert f" {command} " in text.split("positional arguments")[0], command


def _subparsers() -> dict:
    import argparse

    from vgraph import cli
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


# The cache command's parser is another change's: its positional action and its defaults
# are not held to this test yet.
_NOT_CHECKED = {("cache", "action")}
_DEFAULTS_NOT_CHECKED = {"cache"}


@pytest.mark.parametrize("command", ["ops", "generate", "compile", "doctor", "cache", "serve"])
def test_every_option_has_help_that_shows_its_default(command):
    import argparse
    parser = _subparsers()[command]
    parser.format_help()  # adds the deferred options
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or (command, action.dest) in _NOT_CHECKED:
            continue
        assert action.help and action.help is not argparse.SUPPRESS, f"{command} {action.option_strings}: no help"
        if action.option_strings and not action.required and command not in _DEFAULTS_NOT_CHECKED:
            assert "default" in action.help.lower(), f"{command} {action.option_strings}: default not shown"


def test_device_dependent_defaults_say_what_they_are_here():
    import torch
    parser = _subparsers()["serve"]
    parser.format_help()
    helps = {a.dest: a.help for a in parser._actions}
    here = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "full_and_piecewise" if here == "cuda" else "none"
    assert "full_and_piecewise on CUDA, none on CPU" in helps["cudagraph_mode"]
    assert f"on this machine ({here}): {mode}" in helps["cudagraph_mode"]
    assert f"on this machine ({here}, compiled, unquantized): {'on' if here == 'cuda' else 'off'}" \
        in helps["custom_ops"]
    assert f"on this machine: {here}" in helps["device"]
    assert helps["gpu_memory_utilization"].startswith("CUDA only") and helps["cpu_kv_cache_gib"].startswith("CPU only")


def test_the_listening_socket_gives_accepted_connections_tcp_nodelay():
    """asyncio turns Nagle off only on accepted sockets whose protocol is TCP: a listening
    socket made with protocol 0 left it on, and keep-alive responses waited ~40 ms for the
    client's delayed ACK."""
    import asyncio

    from vgraph import cli

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listening = cli._listen("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=listening)
        try:
            _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


# ---------------------------------------------------------------- a vLLM user's command line

_VLLM_LINE = ["serve", "some/model", "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser",
              "hermes", "-tp", "1", "--dtype", "half", "--disable-log-requests", "-O", '{"level": 0}',
              "--uvicorn-log-level", "warning", "--max-log-len", "100"]


def test_a_vllm_serve_command_line_parses_into_vgraph_settings():
    from vgraph import cli
    from vgraph.config import CompileLevel, EngineConfig
    args = _parse(*_VLLM_LINE)
    cli._merge_model(args)
    config = EngineConfig.from_kwargs(args.model, **cli._engine_kwargs(args))
    assert config.model.dtype == "float16" and config.cache.enable_prefix_caching
    assert config.parallel.tensor_parallel_size == 1 and config.compile.level is CompileLevel.NONE
    settings = cli._server_settings(args, args.model)
    assert (settings.log_requests, settings.max_log_len, settings.uvicorn_log_level) == (False, 100, "warning")
    assert settings.tool_call_parser == "hermes" and args.enable_auto_tool_choice


@pytest.mark.parametrize("flags,field,value", [
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-prefix-caching", "--enable-prefix-caching"], "enable_prefix_caching", True),  # the last one wins
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--num-gpu-blocks-override", "64"], "num_gpu_blocks", 64),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--dtype", "float"], "dtype", "float32"),
    (["-O0"], "level", "none"),
    (["-O3"], "level", "compiled"),
    (["-O", '{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2]}'], "cudagraph_mode", "full"),
    (["-O", '{"pass_config": {"enable_fusion": false}}'], "enable_fusion", False),
    (["--compilation-config", '{"custom_ops": ["none"]}'], "custom_ops", False),
    (["-O", '{"max_cudagraph_capture_size": 64}'], "max_capture_size", 64),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "fp8_e4m3"], "kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "auto"], "kv_cache_dtype", "auto"),
])
def test_vllm_spellings_set_vgraph_fields(flags, field, value):
    from vgraph import cli
    from vgraph.config import EngineConfig
    config = EngineConfig.from_kwargs("m", **cli._engine_kwargs(_parse("serve", *flags)))
    section = {"enable_prefix_caching": config.cache, "num_gpu_blocks": config.cache, "dtype": config.model,
               "kv_cache_dtype": config.cache,
               "enable_chunked_prefill": config.scheduler, "tensor_parallel_size": config.parallel}
    assert getattr(section.get(field, config.compile), field) == value


@pytest.mark.parametrize("flags,message", [
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype fp8_e5m2 is not supported: vgraph's fp8 KV cache is e4m3"),
    (["--generation-config", "/no/such/dir"], "generation_config '/no/such/dir' is neither vllm, auto nor a "
                                              "directory holding a generation_config.json"),
    (["-O", '{"use_inductor": true}'], "-O/--compilation-config: unknown key 'use_inductor'"),
    (["-O", "fast"], "-O/--compilation-config takes a level (0-3) or a JSON object"),
    (["-O", '{"pass_config": {"enable_noop": true}}'], "pass_config key 'enable_noop' is not one vgraph has"),
    (["-O3", "--enforce-eager"], "-O/--compilation-config sets level=compiled but --enforce-eager gives none"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_refused_vllm_flags_exit_2_with_one_line(flags, message, capsys):
    from vgraph import cli
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_accepted_vllm_flags_that_change_nothing_parse():
    args = _parse("serve", "--trust-remote-code", "--disable-log-stats", "--kv-cache-dtype", "auto",
                  "--generation-config", "vllm", "--response-role", "bot", "--root-path", "/llm")
    assert args.trust_remote_code and args.disable_log_stats
    assert (args.response_role, args.root_path) == ("bot", "/llm")


def test_a_bad_serve_argument_prints_serves_usage(capsys):
    from vgraph import cli
    for argv in (["serve", "--no-such-flag"], ["serve", "--dtype", "double"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: vgraph serve ") and "vgraph serve: error:" in err, err
