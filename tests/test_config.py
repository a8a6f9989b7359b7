"""The engine configuration and the two ways users reach it: CLI flags and ``LLM`` keywords.

Every setting has one default, in vgraph/config.py; the CLI options and the LLM keywords are
derived from the fields. These tests hold the three together: each field is a flag of every
engine command and a keyword of LLM, with the dataclass default, and each flag sets its field.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest
import torch

from vgraph import cli, cli_options
from vgraph.spec.config import SpeculativeConfig
from vgraph.config import (CPU_BLOCK_SIZE, CPU_STEP_TOKENS, FIELD_SECTION, GPU_BLOCK_SIZE, GPU_STEP_TOKENS,
                           SECTIONS, CacheConfig, CompileConfig, CompileLevel, CudaGraphMode, EngineConfig,
                           ModelConfig, SchedulerConfig)
from vgraph.engine import llm as llm_module

COMMANDS = {"generate": ["generate", "--prompt", "Hi"], "compile": ["compile"], "serve": ["serve"]}
MODEL = "some/model"


@dataclasses.dataclass
class NoopPass:
    """A user pass as a class: ``--pass tests.test_config:NoopPass`` instantiates it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "noop"


def count_nodes(graph: torch.fx.Graph) -> None:
    """A user pass as a function."""


count_nodes.uuid = lambda: "count_nodes"  # type: ignore[attr-defined]
NOT_A_PASS = 3

# One case per field (a new field fails test_every_field_has_a_case until it gets one):
# the flags given and the value the field then holds.
CASES: dict[str, list[tuple[list[str], Any]]] = {
    "model": [(["--model", "other/model"], "other/model")],
    "dtype": [(["--dtype", "bfloat16"], "bfloat16")],
    "max_model_len": [(["--max-model-len", "128"], 128)],
    "quantization": [(["--quantization", "fp8"], "fp8")],
    "seed": [(["--seed", "7"], 7)],
    "tokenizer": [(["--tokenizer", "some/tokenizer"], "some/tokenizer")],
    "revision": [(["--revision", "v2"], "v2")],
    "load_format": [(["--load-format", "dummy"], "dummy")],
    "pooling_type": [(["--pooling-type", "mean"], "mean")],
    "pooling_normalize": [(["--no-pooling-normalize"], False)],
    "block_size": [(["--block-size", "32"], 32)],
    "enable_prefix_caching": [(["--no-prefix-caching"], False)],
    "gpu_memory_utilization": [(["--gpu-memory-utilization", "0.5"], 0.5)],
    "num_gpu_blocks": [(["--num-gpu-blocks", "64"], 64)],
    "cpu_kv_cache_gib": [(["--kv-cache-gib", "0.25"], 0.25)],
    "kv_cache_dtype": [(["--kv-cache-dtype", "fp8"], "fp8"), (["--kv-cache-dtype", "fp8_e4m3"], "fp8")],
    "max_num_seqs": [(["--max-num-seqs", "8"], 8)],
    "max_num_batched_tokens": [(["--max-num-batched-tokens", "512"], 512)],
    "enable_chunked_prefill": [(["--no-chunked-prefill"], False)],
    "long_prefill_token_threshold": [(["--long-prefill-token-threshold", "64"], 64)],
    "kv_cache_prefault": [(["--kv-cache-prefault"], True), (["--no-kv-cache-prefault"], False)],
    "speculative_config": [(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                            SpeculativeConfig(num_speculative_tokens=2))],
    "async_scheduling": [(["--async-scheduling"], True), (["--no-async-scheduling"], False)],
    "level": [(["--enforce-eager"], CompileLevel.NONE)],
    "splitting_ops": [(["--splitting-ops", "a::b", "c::d"], ["a::b", "c::d"])],
    "compile_sizes": [(["--compile-sizes", "4", "8"], [4, 8])],
    "enable_fusion": [(["--no-fusion"], False)],
    "enable_allreduce_fusion": [(["--no-allreduce-fusion"], False)],
    "passes": [(["--pass", "tests.test_config:NoopPass", "--pass", "tests.test_config:count_nodes"],
                [NoopPass(), count_nodes])],
    "custom_ops": [(["--custom-ops"], True), (["--no-custom-ops"], False)],
    "dump_graphs_dir": [(["--dump-graphs-dir", "/tmp/graphs"], "/tmp/graphs")],
    "use_cache": [(["--no-compile-cache"], False)],
    "cudagraph_mode": [(["--cudagraph-mode", "full"], CudaGraphMode.FULL)],
    "cudagraph_capture_sizes": [(["--cudagraph-capture-sizes", "1", "2", "8"], [1, 2, 8])],
    "max_capture_size": [(["--max-capture-size", "64"], 64)],
    "tensor_parallel_size": [(["--tensor-parallel-size", "2"], 2)],
    "pipeline_parallel_size": [(["--pipeline-parallel-size", "2"], 2), (["-pp", "3"], 3)],
    "distributed_backend": [(["--distributed-backend", "gloo"], "gloo")],
    "distributed_executor_backend": [(["--distributed-executor-backend", "mp"], "mp")],
    "placement_group_strategy": [(["--placement-group-strategy", "SPREAD"], "SPREAD")],
    "enable_lora": [(["--enable-lora"], True)],
    "max_loras": [(["--max-loras", "4"], 4)],
    "max_lora_rank": [(["--max-lora-rank", "64"], 64)],
    "max_cpu_loras": [(["--max-cpu-loras", "8"], 8)],
    "device": [(["--device", "cpu"], "cpu")],
    "max_logprobs": [(["--max-logprobs", "5"], 5)],
}
FLAG_CASES = [(name, flags, value) for name, cases in CASES.items() for flags, value in cases]


def _parse(command: str, flags: list[str]) -> Any:
    return cli.build_parser().parse_args(COMMANDS[command] + flags)


def _config_from_cli(command: str, flags: list[str]) -> EngineConfig:
    """What the command would build (the model as ``_model_path`` takes it, demo model aside)."""
    args = _parse(command, flags)
    return EngineConfig.from_kwargs(args.model or MODEL, **cli._engine_kwargs(args))


def _value(config: EngineConfig, name: str) -> Any:
    section = FIELD_SECTION.get(name, "model")
    return getattr(config if section == "engine" else getattr(config, section), name)


# ---------------------------------------------------------------- one default, three spellings

def test_every_field_has_a_case():
    assert set(CASES) == set(FIELD_SECTION) | {"model"}


@pytest.mark.parametrize("command", COMMANDS)
def test_no_engine_flags_give_the_dataclass_defaults(command):
    args = _parse(command, [])
    assert args.model is None, "no --model: the demo model"
    assert _config_from_cli(command, []) == EngineConfig.from_kwargs(MODEL)
    for name, section in FIELD_SECTION.items():
        field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        assert getattr(args, name) == default, f"--{name}: the CLI default differs from the dataclass's"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name,flags,value", FLAG_CASES, ids=[" ".join(c[1][:2]) for c in FLAG_CASES])
def test_each_flag_sets_its_field(command, name, flags, value):
    config = _config_from_cli(command, flags)
    assert _value(config, name) == value
    if name != "model":  # everything else as LLM(model, name=value) has it
        assert config == EngineConfig.from_kwargs(MODEL, **{name: value})


def _command_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    parser.format_help()  # adds the deferred engine options
    return parser


@pytest.mark.parametrize("command", COMMANDS)
def test_option_dests_are_unique(command):
    """Two options writing one dest would silently shadow each other (serve's own flags and the
    engine's share a namespace)."""
    dests = [a.dest for a in _command_parser(command)._actions if a.dest != "help"]
    assert len(dests) == len(set(dests)), sorted(d for d in dests if dests.count(d) > 1)


def test_cudagraph_mode_choices_come_from_the_enum(capsys):
    option = next(a for a in _command_parser("serve")._actions if a.dest == "cudagraph_mode")
    assert list(option.choices) == [m.value for m in CudaGraphMode]
    with pytest.raises(SystemExit):
        _parse("generate", ["--cudagraph-mode", "sideways"])
    assert "invalid choice: 'sideways'" in capsys.readouterr().err


def test_pass_specs_load_classes_and_functions():
    assert cli._load_pass("tests.test_config:NoopPass") == NoopPass()
    assert cli._load_pass("tests.test_config:count_nodes") is count_nodes


@pytest.mark.parametrize("spec,message", [
    ("no_colon", "expected MODULE:NAME"),
    (":NoopPass", "expected MODULE:NAME"),
    ("no_such_module_for_vgraph:X", "cannot import 'no_such_module_for_vgraph'"),
    ("tests.test_config:Missing", "has no attribute 'Missing'"),
    ("tests.test_config:NOT_A_PASS", "int is not callable"),
])
def test_bad_pass_specs_are_user_errors(spec, message):
    with pytest.raises(cli.UserError, match=message) as caught:
        cli._load_pass(spec)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- LLM keywords

class _RecordingEngine:
    """Stands in for LLMEngine: LLM.__init__ is tested without loading a model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None  # what LLM's OutputProcessor is given


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(llm_module, "LLMEngine", _RecordingEngine)
    return lambda **kwargs: llm_module.LLM(MODEL, **kwargs).engine.config


def test_llm_defaults_are_the_dataclass_defaults(recording):
    assert recording() == EngineConfig(model=ModelConfig(model=MODEL))
    named = [p for p in inspect.signature(llm_module.LLM.__init__).parameters.values()
             if p.kind is not p.VAR_KEYWORD]
    assert [p.name for p in named] == ["self", "model", "compile_config", "enforce_eager"], \
        "engine settings come through **kwargs, so their defaults live in vgraph.config only"


@pytest.mark.parametrize("name,value", [(n, v) for n, cases in CASES.items() if n != "model" for _, v in cases])
def test_each_llm_keyword_sets_its_field(recording, name, value):
    config = recording(**{name: value})
    assert _value(config, name) == value
    assert config == EngineConfig.from_kwargs(MODEL, **{name: value})


def test_unknown_llm_keyword_is_a_type_error_naming_it(recording):
    with pytest.raises(TypeError, match="'max_num_seq'"):
        recording(max_num_seq=4)


def test_enforce_eager_and_compile_config_leave_the_given_config_alone(recording):
    given = CompileConfig(compile_sizes=[4], cudagraph_mode="full")
    config = recording(compile_config=given, enforce_eager=True, max_capture_size=32)
    assert config.compile == dataclasses.replace(given, level=CompileLevel.NONE, max_capture_size=32)
    assert given.level is CompileLevel.COMPILED and given.max_capture_size == 256
    assert recording(level="none") == recording(enforce_eager=True)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("make,message", [
    (lambda: CompileConfig(cudagraph_mode="sideways"),
     "unknown cudagraph_mode 'sideways'; choose one of none, piecewise, full, full_and_piecewise"),
    (lambda: CompileConfig(level="jit"), "choose one of none, compiled"),
    (lambda: EngineConfig.from_kwargs(MODEL, device="tpu"), "choose one of auto, cpu, cuda"),
    (lambda: EngineConfig.from_kwargs(MODEL, load_format="npz"), "choose one of auto, dummy"),
    (lambda: EngineConfig.from_kwargs(MODEL, quantization="int4"), "choose one of fp8"),
    (lambda: CacheConfig(block_size=0), "block_size must be at least 1"),
    (lambda: CacheConfig(num_gpu_blocks=-4), "num_gpu_blocks must be at least 1"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (lambda: CacheConfig(cpu_kv_cache_gib=-1.0), "cpu_kv_cache_gib must be positive"),
    (lambda: CacheConfig(kv_cache_dtype="fp8_e5m2"), "fp8_e5m2 is not supported: vgraph's fp8 KV cache is e4m3"),
    (lambda: EngineConfig.from_kwargs(MODEL, kv_cache_dtype="int8"), "choose one of auto, fp8, fp8_e4m3"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be at least 1"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-1), "max_num_batched_tokens must be at least 1"),
    (lambda: ModelConfig(model=MODEL, max_model_len=0), "max_model_len must be at least 1"),
    (lambda: CompileConfig(compile_sizes=[8, -1]), "compile_sizes must be positive"),
    (lambda: CompileConfig(cudagraph_capture_sizes=[0]), "cudagraph_capture_sizes must be positive"),
    (lambda: CompileConfig(max_capture_size=0), "max_capture_size must be >= 1"),
    (lambda: EngineConfig.from_kwargs(MODEL, max_logprobs=-1), "max_logprobs must be at least 0"),
])
def test_bad_values_are_value_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_enums_from_strings():
    assert CudaGraphMode("full_and_piecewise") is CudaGraphMode.FULL_AND_PIECEWISE
    assert CompileLevel("none") is CompileLevel.NONE
    config = CompileConfig(level="none", cudagraph_mode="piecewise")
    assert config.level is CompileLevel.NONE and config.cudagraph_mode is CudaGraphMode.PIECEWISE
    assert not config.compiled
    assert [(m.has_full, m.has_piecewise) for m in CudaGraphMode] == [
        (False, False), (False, True), (True, False), (True, True)]


def test_configs_are_frozen():
    config = EngineConfig.from_kwargs(MODEL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.compile.level = CompileLevel.NONE  # type: ignore[misc]


# ---------------------------------------------------------------- resolution

def _resolve(config: EngineConfig, quantized: bool = False, positions: int = 512) -> EngineConfig:
    return config.resolved(model_path="/models/local", max_position_embeddings=positions, quantized=quantized)


@pytest.mark.parametrize("kwargs,quantized,expected", [
    # device given, compile level, quantized -> device, custom_ops, cudagraph_mode
    ({"device": "cpu"}, False, ("cpu", False, CudaGraphMode.NONE)),
    ({"device": "cpu"}, True, ("cpu", True, CudaGraphMode.NONE)),
    ({"device": "cpu", "enforce_eager": True}, False, ("cpu", True, CudaGraphMode.NONE)),
    ({"device": "cpu", "cudagraph_mode": "full"}, False, ("cpu", False, CudaGraphMode.FULL)),
    ({"device": "cpu", "custom_ops": True}, False, ("cpu", True, CudaGraphMode.NONE)),
    ({"device": "cuda"}, False, ("cuda", True, CudaGraphMode.FULL_AND_PIECEWISE)),
    ({"device": "cuda", "enforce_eager": True, "cudagraph_mode": "full"}, False, ("cuda", True, CudaGraphMode.NONE)),
    ({"device": "cuda:1", "custom_ops": False}, False, ("cuda:1", False, CudaGraphMode.FULL_AND_PIECEWISE)),
])
def test_resolved_decides_every_open_choice(kwargs, quantized, expected):
    config = EngineConfig.from_kwargs(MODEL, **kwargs)
    before = dataclasses.replace(config)
    resolved = _resolve(config, quantized)
    assert (resolved.device, resolved.compile.custom_ops, resolved.compile.cudagraph_mode) == expected
    assert resolved.model.model == "/models/local" and resolved.max_model_len == 512
    assert resolved.is_resolved and not config.is_resolved
    assert config == before and config.model.model == MODEL, "the caller's config is left as given"


def test_resolved_auto_device_and_max_model_len():
    resolved = _resolve(EngineConfig.from_kwargs(MODEL, max_model_len=100))
    assert resolved.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolved.torch_device == torch.device(resolved.device)
    assert resolved.max_model_len == 100
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 64"):
        _resolve(EngineConfig.from_kwargs(MODEL, max_model_len=100), positions=64)


@pytest.mark.parametrize("kwargs,positions,expected", [
    ({"device": "cpu"}, 4096, CPU_STEP_TOKENS),  # cache-sized steps on CPU
    ({"device": "cuda"}, 4096, GPU_STEP_TOKENS),
    ({"device": "cpu", "max_num_batched_tokens": 2048}, 4096, 2048),  # given: kept
    ({"device": "cpu", "enable_chunked_prefill": False}, 4096, 4096),  # a whole prompt per step
    ({"device": "cuda", "enable_chunked_prefill": False}, 1024, GPU_STEP_TOKENS),
])
def test_the_step_token_budget_is_decided_for_the_device(kwargs, positions, expected):
    config = EngineConfig.from_kwargs(MODEL, **kwargs)
    resolved = _resolve(config, positions=positions)
    assert resolved.scheduler.max_num_batched_tokens == expected
    assert config.scheduler.max_num_batched_tokens == kwargs.get("max_num_batched_tokens")


@pytest.mark.parametrize("kwargs,expected", [
    ({"device": "cpu"}, CPU_BLOCK_SIZE),  # long contiguous runs for the CPU decode attention
    ({"device": "cuda"}, GPU_BLOCK_SIZE),
    ({"device": "cpu", "block_size": 16}, 16),  # given: kept
])
def test_the_kv_block_size_is_decided_for_the_device(kwargs, expected):
    config = EngineConfig.from_kwargs(MODEL, **kwargs)
    resolved = _resolve(config)
    assert resolved.cache.block_size == expected and resolved.is_resolved
    assert config.cache.block_size == kwargs.get("block_size") and not config.is_resolved


def test_unresolved_config_refuses_resolved_only_reads():
    config = EngineConfig.from_kwargs(MODEL)
    with pytest.raises(ValueError, match="not resolved"):
        config.torch_device
    with pytest.raises(ValueError, match="not resolved"):
        config.max_model_len


def test_resolved_config_does_not_share_the_callers_lists():
    sizes, passes = [1, 2], []
    given = EngineConfig(ModelConfig("m"), compile=CompileConfig(cudagraph_capture_sizes=sizes, passes=passes))
    resolved = given.resolved(model_path="/m", max_position_embeddings=64, quantized=False)
    sizes.append(4)
    passes.append(object())
    assert resolved.compile.cudagraph_capture_sizes == [1, 2] and resolved.compile.passes == []


# ---------------------------------------------------------------- server settings as serve flags

def _server_fields() -> list[dataclasses.Field]:
    from vgraph.server.state import ServerSettings
    return [f for f in dataclasses.fields(ServerSettings) if "help" in f.metadata]


def test_server_settings_with_help_exist():
    names = {f.name for f in _server_fields()}
    assert {"max_queue_len", "max_body_bytes"} <= names, "the fields the CLI used to spell out by hand"


@pytest.mark.parametrize("field", _server_fields(), ids=lambda f: f.name)
def test_every_server_setting_with_help_is_a_serve_flag_with_its_default(field):
    """A field added to ServerSettings with help metadata is a flag at once, defaulted and
    documented from the field: nothing in the CLI to update."""
    option = next((a for a in _command_parser("serve")._actions if a.dest == field.name), None)
    assert option is not None, f"ServerSettings.{field.name} has help but no serve flag"
    assert field.metadata.get("flag", "--" + field.name.replace("_", "-")) in option.option_strings
    assert option.default == cli_options.field_default(field) == getattr(_parse("serve", []), field.name)
    assert field.metadata["help"].replace("%", "%%") in option.help


def _flag_value(option: argparse.Action, field: dataclasses.Field) -> tuple[list[str], Any]:
    """Flags that set ``field`` to something other than its default, and that value."""
    flag = option.option_strings[0]
    if option.nargs == 0:  # a boolean: the flag flips it
        return [flag], option.const if option.const is not None else not field.default
    if option.choices:  # a choice: the last one (a flag's default is never the only choice)
        return [flag, str(option.choices[-1])], option.choices[-1]
    converted = {int: 7, float: 2.5}.get(option.type)
    if converted is None:
        pytest.skip(f"{field.name}: no sample value for type {option.type}")
    return [flag, str(converted)], converted


@pytest.mark.parametrize("field", _server_fields(), ids=lambda f: f.name)
def test_each_serve_flag_sets_its_server_setting(field):
    option = next(a for a in _command_parser("serve")._actions if a.dest == field.name)
    flags, value = _flag_value(option, field)
    settings = cli._server_settings(_parse("serve", flags), None)
    assert getattr(settings, field.name) == value
    others = {f.name: getattr(settings, f.name) for f in _server_fields() if f.name != field.name}
    assert others == {f.name: cli_options.field_default(f) for f in _server_fields() if f.name != field.name}


def test_hand_written_server_settings():
    args = _parse("serve", ["my/model", "--served-model-name", "a", "b", "--api-key", "k",
                            "--chat-template", "{{ messages }}"])
    cli._merge_model(args)
    settings = cli._server_settings(args, args.model)
    assert settings.served_model_names == ["a", "b"] and settings.api_key == "k"
    assert settings.chat_template == "{{ messages }}"
    assert cli._server_settings(_parse("serve", []), None).served_model_names == ["demo-model-v1"]
