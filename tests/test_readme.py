"""The README's offline Python example runs as written (on the demo model it names), and so
does the same example on the docs' Offline inference page."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
OFFLINE_PAGE = REPO / "docs" / "offline.md"


def _python_block(path: Path, section: str) -> str:
    """The first ```python block after the heading that starts with ``section``."""
    text = "\n" + path.read_text(encoding="utf-8")
    start = text.index("\n" + section)
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start)
    assert match is not None, f"no python block after {section!r} in {path.name}"
    return match.group(1)


@pytest.mark.parametrize("path,section", [(README, "## Offline inference"), (OFFLINE_PAGE, "# Offline inference")],
                         ids=["README", "docs-offline"])
def test_offline_snippet_runs_on_the_demo_model(capsys, path, section):
    code = _python_block(path, section)
    call = 'LLM("demo-model-v1",'
    assert code.count(call) == 1, "the snippet runs the demo model, so it works with nothing downloaded"
    # Eager only to keep CI fast; the compiled default runs in the CLI and engine tests.
    exec(compile(code.replace(call, call + " enforce_eager=True,"), str(path), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 4, lines  # one line per prompt, then the chat reply
    assert all(line.endswith(("stop", "length")) for line in lines[:3]), lines
