"""Pass specs (module:Class, file.py:Class, before:/after:), positions, and the run order the
engine builds from them; no compilation."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vgraph import cli
from vgraph.compiler.build import build_pass_manager
from vgraph.config import CompileConfig, EngineConfig, ModelConfig
from vgraph.passes import (PassSpecError, PlacedPass, RMSNormQuantFusionPass, SiluMulFusionPass, arrange,
                           load_pass, position_of)
from vgraph.passes.loading import FILE_MODULE_PREFIX

PASS_FILE = '''
from collections import Counter
from vgraph.passes import VgraphPass


class FileLift(VgraphPass):
    """A pass defined in a file that is on no sys.path."""

    position = "before"

    def apply(self, graph):
        return Counter(nothing=0)


def count(graph):
    return 0


count.uuid = lambda: "count/1"
'''


@pytest.fixture
def pass_file(tmp_path) -> Path:
    path = tmp_path / "my passes.py"  # a space: the module name must still be valid
    path.write_text(PASS_FILE)
    return path


def test_module_specs_load_classes_instances_and_positions():
    p = load_pass("vgraph.passes:RMSNormQuantFusionPass")
    assert isinstance(p, RMSNormQuantFusionPass) and position_of(p) == "after"
    placed = load_pass("before:vgraph.passes:SiluMulFusionPass")
    assert isinstance(placed, PlacedPass) and isinstance(placed.pass_, SiluMulFusionPass)
    assert position_of(placed) == "before"
    assert position_of(load_pass("after:vgraph.passes:SiluMulFusionPass")) == "after"


def test_file_specs_load_once_with_a_source_so_the_uuid_exists(pass_file):
    first = load_pass(f"{pass_file}:FileLift")
    again = load_pass(f"{pass_file}:FileLift")
    assert type(first) is type(again), "the file is imported once per process"
    assert type(first).__module__.startswith(FILE_MODULE_PREFIX + ".my_passes_")
    assert type(first).__module__ in sys.modules
    assert first.uuid() is not None, "the source is readable, so the pass is versioned"
    assert position_of(first) == "before", "the class's own position attribute"
    fn = load_pass(f"after:{pass_file}:count")
    assert position_of(fn) == "after" and fn.pass_.uuid() == "count/1"


@pytest.mark.parametrize("spec,reason", [
    ("no_colon", "expected MODULE:NAME"),
    ("before:", "expected MODULE:NAME"),
    ("no_such_module_for_vgraph:X", "cannot import 'no_such_module_for_vgraph'"),
    ("vgraph.passes:Missing", "has no attribute 'Missing'"),
    ("/no/such/file.py:X", "no such file"),
])
def test_bad_specs_say_why_in_one_line(spec, reason):
    with pytest.raises(PassSpecError, match=reason) as caught:
        load_pass(spec)
    assert "\n" not in str(caught.value) and isinstance(caught.value, ValueError)


def test_a_file_that_fails_to_import_is_a_spec_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PassSpecError, match="importing .* failed .*RuntimeError: boom"):
        load_pass(f"{bad}:X")


def test_bad_positions_are_refused():
    class Odd:
        position = "middle"

        def __call__(self, graph):
            return 0

        def uuid(self):
            return "odd"

    with pytest.raises(ValueError, match="position must be one of before, after"):
        position_of(Odd())
    with pytest.raises(ValueError, match="position"):
        PlacedPass(Odd(), "sideways")


def test_arrange_puts_before_passes_first_and_keeps_order_within_groups(pass_file):
    own = [RMSNormQuantFusionPass(), SiluMulFusionPass()]
    late = load_pass("vgraph.passes:SiluMulFusionPass")
    early_obj = RMSNormQuantFusionPass(static=False)
    order = arrange(own, [late, PlacedPass(early_obj, "before"), f"{pass_file}:FileLift"])
    assert order[0] is early_obj and type(order[1]).__name__ == "FileLift"
    assert order[2:4] == own and order[4] is late


def test_compile_config_loads_specs_and_the_engine_orders_them(pass_file):
    config = CompileConfig(passes=["vgraph.passes:SiluMulFusionPass", f"before:{pass_file}:count"])
    assert isinstance(config.passes[0], SiluMulFusionPass) and config.passes[1].position == "before"
    engine = EngineConfig(ModelConfig("m"), compile=config)
    manager = build_pass_manager(engine)
    assert list(manager.match_counts()) == ["count", "RMSNormQuantFusionPass", "SiluMulFusionPass",
                                            "AllReduceRMSNormFusionPass", "NormLinearFusionPass", "SiluMulFusionPass#2"]
    with pytest.raises(ValueError, match="no_such_module_for_vgraph"):
        CompileConfig(passes=["no_such_module_for_vgraph:X"])


def test_cli_pass_flag_takes_positions_and_files(pass_file):
    placed = cli._load_pass(f"before:{pass_file}:count")
    assert isinstance(placed, PlacedPass) and placed.position == "before"
    with pytest.raises(cli.UserError, match=r"--pass '/no/such.py:X': no such file"):
        cli._load_pass("/no/such.py:X")


def test_cli_passes_report_rejects_an_empty_study(capsys):
    assert cli.main(["passes", "report", "--no-default-passes", "--device", "cpu"]) == 2
    assert "leaves no pass to study" in capsys.readouterr().err


def test_graph_dump_and_compile_flags_exist_on_every_engine_command():
    for command in ("generate", "compile", "serve"):
        parser = cli.build_parser()
        args = parser.parse_args([command, *(["--prompt", "x"] if command == "generate" else []),
                                  "--dump-graphs-dir", "/tmp/d", "--no-compile-cache"])
        assert args.dump_graphs_dir == "/tmp/d" and args.use_cache is False


def test_position_is_read_from_callable_passes_too():
    def fn(graph: torch.fx.Graph) -> int:
        return 0

    fn.uuid = lambda: "fn"
    fn.position = "before"
    assert position_of(fn) == "before"
    assert arrange(["own"], [fn]) == [fn, "own"]


def test_passes_report_options_have_help_with_defaults():
    import argparse
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["passes"]
    sub.format_help()  # adds the deferred options
    dests = {a.dest for a in sub._actions}
    assert {"default_passes", "tokens", "repeats", "out", "passes", "custom_ops"} <= dests
    assert not dests & {"use_cache", "enable_fusion", "dump_graphs_dir", "level"}, "the report sets these itself"
    for action in sub._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert action.help and "default" in action.help.lower(), action.option_strings
