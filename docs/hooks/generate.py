"""MkDocs hooks (``hooks:`` in mkdocs.yml): the pages that are generated, not written.

At every build, before MkDocs reads the navigation:

- ``reference/cli.md``: every ``vgraph`` command and option, rendered from the argument parser
  itself (``vgraph.cli.build_parser``), so a flag, its type, its choices and its default can
  only be what the code accepts;
- ``performance/results.md``: the committed ``perf/results/*.json`` rendered by
  ``perf/report_docs.py``, and their plots under ``performance/plots/``;
- ``cache_dir.md`` and ``performance/perf-notes.md``: the top-level ``cache_dir.md`` and
  ``perf/README.md`` as they are in the repository (each file stays where it is and is the one
  copy; the site shows it).

And in the text of the pages (``on_page_markdown``), each ``<!-- generated: NAME -->`` marker
becomes the table ``NAME`` renders: ``request-ranges`` is ``vgraph.server.protocol.INT_RANGES``.

Generated files live only in the build: nothing is written into ``docs/``.
"""
from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

INCLUDED = {"cache_dir.md": ROOT / "cache_dir.md", "performance/perf-notes.md": ROOT / "perf" / "README.md"}


def on_files(files: Files, config) -> Files:
    generated = {"reference/cli.md": cli_reference(), "performance/results.md": performance_results()}
    generated.update({uri: path.read_text(encoding="utf-8") for uri, path in INCLUDED.items()})
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    for png in sorted((ROOT / "perf" / "results").glob("*.png")):
        files.append(File.generated(config, f"performance/plots/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    for name, render in MARKERS.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown


def request_ranges() -> str:
    """The range of every integer request field, from the table the server checks."""
    from vgraph.server.protocol import INT_RANGES
    rows = ["| field | minimum | maximum |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {low} | {high} |" for name, (low, high) in INT_RANGES.items()]
    return "\n".join(rows)


MARKERS = {"request-ranges": request_ranges}


def performance_results() -> str:
    if str(ROOT) not in sys.path:  # perf/ is a folder of the checkout, not an installed package
        sys.path.insert(0, str(ROOT))  # (at call time: MkDocs restores sys.path after loading hooks)
    from perf.report_docs import results_page
    return results_page(plot_prefix="plots/")


# --------------------------------------------------------------------------------- the CLI page

def cli_reference() -> str:
    """Markdown for every command of ``vgraph``, straight from its parser."""
    import vgraph.cli as cli

    # The help of device-dependent defaults adds what they come to "on this machine"; the site
    # is built on one machine and read on others, so it says the rule alone.
    here_notes, cli._here_notes = cli._here_notes, dict
    try:
        parser = cli.build_parser()
        commands = _subcommands(parser)
        for command in commands.values():
            command.format_help()  # adds the deferred options (the engine's and the server's)
    finally:
        cli._here_notes = here_notes
    lines = ["# Command-line reference", "",
             "Generated from vgraph's argument parser when this site is built: every option, its "
             "value, its choices and its default are the ones `vgraph` accepts. The engine options "
             "are the fields of the config dataclasses (`vgraph/config.py`), and each one is also an "
             "`LLM(...)` keyword of the same name (the option's dest, shown as `LLM keyword`).", "",
             "```text", _usage(parser), "```", ""]
    lines += _actions_table(parser, parser._actions, keyword=False)
    lines += ["Commands:", ""]
    lines += [f"- [`vgraph {name}`](#vgraph-{name}): {_help_of(parser, name)}" for name in commands]
    lines.append("")
    engine_groups: dict[str, tuple[argparse.ArgumentParser, list[argparse.Action]]] = {}
    for name, command in commands.items():
        about = _help_of(parser, name)
        lines += [f"## vgraph {name}", "", about[:1].upper() + about[1:] + ".", "", "```text", _usage(command), "```", ""]
        takes_engine_options = False
        for group in command._action_groups:
            actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            if (group.title or "").startswith("engine options"):  # the same on every command: listed once
                # ("engine options (ModelConfig), for both variants" on passes report: the same fields)
                engine_groups.setdefault(group.title.split(",")[0], (command, actions))
                takes_engine_options = True
                continue
            title = {"positional arguments": "Arguments", "options": "Options"}.get(group.title, group.title)
            lines += [f"### {title[0].upper() + title[1:]}", ""]
            lines += _actions_table(command, actions, keyword=False)
        if takes_engine_options:
            lines += [f"`vgraph {name}` also takes every [engine option](#engine-options).", ""]
    lines += ["## Engine options", "",
              "Taken by every command that builds an engine (`generate`, `compile`, `serve`, "
              "`passes report`); each is a field of a config dataclass in `vgraph/config.py` and an "
              "`LLM(...)` keyword of the same name.", ""]
    for title, (command, actions) in engine_groups.items():
        lines += [f"### {title[0].upper() + title[1:]}", ""]
        lines += _actions_table(command, actions, keyword=True)
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _usage(parser: argparse.ArgumentParser) -> str:
    """``PROG [OPTIONS] POSITIONALS``: argparse's own usage line lists every option, a
    screenful for ``serve``; the tables below list them instead."""
    positionals = " ".join(a.metavar or a.dest for a in parser._actions if not a.option_strings
                           and not isinstance(a, argparse._SubParsersAction))
    sub = " COMMAND ..." if _subcommands(parser) else ""
    return f"{parser.prog} [OPTIONS]{(' ' + positionals) if positionals else ''}{sub}"


def _actions_table(parser: argparse.ArgumentParser, actions, keyword: bool) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        value = _value_of(action)
        text = formatter._expand_help(action) if action.help else ""
        text = html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")
        if keyword and action.dest not in (argparse.SUPPRESS, None):
            text = text.rstrip(". ") + f". LLM keyword: `{action.dest}`."
        rows.append(f"| {names} | {value} | {text} |")
    if not rows:
        return []
    return ["| option | value | description |", "| --- | --- | --- |"] + rows + [""]


def _value_of(action: argparse.Action) -> str:
    if action.nargs == 0 or (not action.option_strings and action.choices is None):
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.nargs in ("+", "*"):
        return f"`{metavar} ...`"
    if isinstance(action, argparse._AppendAction):
        return f"`{metavar}` (repeatable)"
    return f"`{metavar}`"
