"""The README's offline Python example runs as written (on the demo model it names)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_block(section: str) -> str:
    """The first ```python block after the heading that starts with ``section``."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n" + section)
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start)
    assert match is not None, f"no python block after {section!r}"
    return match.group(1)


def test_offline_snippet_runs_on_the_demo_model(capsys):
    code = _python_block("## Offline inference")
    call = 'LLM("demo-model-v1",'
    assert code.count(call) == 1, "the snippet runs the demo model, so it works with nothing downloaded"
    # Eager only to keep CI fast; the compiled default runs in the CLI and engine tests.
    exec(compile(code.replace(call, call + " enforce_eager=True,"), str(README), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 4, lines  # one line per prompt, then the chat reply
    assert all(line.endswith(("stop", "length")) for line in lines[:3]), lines
