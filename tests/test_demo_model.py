"""The built-in demo model: shipped in the package, token-exact against transformers, writes Python.

It is the checkpoint examples/train_demo_model.py trained (a small Llama over the Python
standard library's source); the last test runs that script for a few steps end to end.
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vgraph
from tests.engine.hf_oracle import hf_greedy
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig
from vgraph.models import demo

REPO = Path(__file__).resolve().parents[1]
FIBONACCI = "def fibonacci(n):"
# Code and prose, a chat-rendered prompt, and one token: the prompts a demo user sends.
PROMPTS = [FIBONACCI, "import os\n\n\ndef read_config(path):\n", "class Stack:\n    def __init__(self):",
           "The quick brown fox", "<|user|>\nSay hi</s>\n<|assistant|>\n", "#"]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    """By name, as a user writes it, with the engine's default dtype (the checkpoint's)."""
    return LLM(demo.DEMO_MODEL_NAME, enforce_eager=True, device="cpu", cpu_kv_cache_gib=0.02)


def test_the_demo_name_resolves_to_the_shipped_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    path = Path(demo.demo_model_path(demo.DEMO_MODEL_NAME))
    assert path == demo.DEMO_MODEL_DIR and path.parent == Path(vgraph.__file__).parent / "models"
    assert not (tmp_path / "cache").exists(), "nothing is built or copied on first use"
    assert demo.demo_model_path("Qwen/Qwen2.5-0.5B-Instruct") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / demo.DEMO_MODEL_NAME).mkdir()
    assert demo.demo_model_path(demo.DEMO_MODEL_NAME) is None, "a local directory of that name wins"


def test_a_demo_directory_missing_files_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="lacks generation_config.json, model.safetensors.*package data"):
        demo.demo_model_dir()


def test_shipped_files_are_a_small_float32_llama_stored_in_half():
    """fp16 on disk (half the bytes) but float32 declared, so every default load runs fp32."""
    config = json.loads((demo.DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] < config["num_attention_heads"]
    with safe_open(demo.DEMO_MODEL_DIR / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert dtypes == {"F16"} and 1_000_000 < params < 10_000_000, (dtypes, params)
    size = sum(p.stat().st_size for p in demo.DEMO_MODEL_DIR.iterdir())
    assert size < 8 * 2**20, f"the shipped demo model is {size / 2**20:.1f} MiB"


def test_tokenizer_keeps_the_demo_special_tokens_and_chat_template(demo_llm):
    shipped, test_tokenizer = demo_llm.get_tokenizer(), demo.build_tokenizer()
    assert shipped.convert_ids_to_tokens(list(range(6))) == list(demo.SPECIAL_TOKENS)
    assert test_tokenizer.convert_ids_to_tokens(list(range(6))) == list(demo.SPECIAL_TOKENS)
    assert shipped.chat_template == demo.CHAT_TEMPLATE
    code = "    def __init__(self):\n        return None\n"
    assert len(shipped.encode(code)) * 2 < len(test_tokenizer.encode(code)), "trained on code: compact"


# The demo chat template before tools were added, verbatim: chats without tools must render
# exactly as it did, so prompts (and results recorded with them) stay the same.
PLAIN_TEMPLATE = ("{% for message in messages %}"
                  "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
                  "{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Say hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": ""}],
    [{"role": "developer", "content": "Answer in code."}, {"role": "user", "content": "def f():\n"}],
]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_without_tools_renders_as_the_plain_template_did(demo_llm, conversation, generation_prompt):
    tok = demo_llm.get_tokenizer()
    for tools in (None, []):
        assert tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                       tools=tools) == \
            tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                    chat_template=PLAIN_TEMPLATE)


def test_the_test_checkpoints_keep_the_plain_template():
    assert demo.PLAIN_CHAT_TEMPLATE == PLAIN_TEMPLATE
    assert demo.build_tokenizer().chat_template == PLAIN_TEMPLATE


def test_chat_template_renders_tools_hermes_style(demo_llm):
    """Tools join the system turn inside <tools>; the assistant's calls are <tool_call> JSON that
    the hermes parser reads back; a tool's result is a <tool_response> user turn."""
    from vgraph.engine.inputs import template_supports_tools
    from vgraph.server.tool_parsers import get_parser

    tok = demo_llm.get_tokenizer()
    assert template_supports_tools(tok.chat_template)
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tok.apply_chat_template(chat, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    system, user, assistant, tool, prompt = text.split("</s>\n")
    assert system.startswith("<|system|>\nBe brief.\n\n") and text.count("<|system|>") == 1
    assert "<tools>\n" + json.dumps(WEATHER_TOOL["function"], separators=(",", ":")) + "\n</tools>" in system
    assert user == "<|user|>\nWeather?" and prompt == "<|assistant|>\n"
    content, parsed = get_parser("hermes").parse(assistant.removeprefix("<|assistant|>\n"))
    assert not (content or "").strip()
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Oslo"}),
                                                                    ("get_weather", {"city": "Lima"})]
    assert tool == "<|user|>\n<tool_response>\nsunny\n</tool_response>"
    assert demo_llm.encode_chat(chat, tools=[WEATHER_TOOL]) == tok.encode(text, add_special_tokens=False)


def test_a_template_that_never_reads_tools_refuses_them(demo_llm):
    with pytest.raises(ValueError, match="never reads 'tools'"):
        demo_llm.encode_chat(CONVERSATIONS[0], chat_template=PLAIN_TEMPLATE, tools=[WEATHER_TOOL])


def test_engine_loads_the_demo_model_in_float32_by_default(demo_llm):
    assert demo_llm.engine.config.model.model == str(demo.DEMO_MODEL_DIR)
    assert demo_llm.engine.runner.model.dtype == torch.float32
    assert demo_llm.engine.runner.model.model.embed_tokens.weight.dtype == torch.float32


def _equal_to_transformers(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, text, out in zip(prompts, PROMPTS, outs):
        expected, _ = hf_greedy(str(demo.DEMO_MODEL_DIR), tuple(prompt), NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{text!r} diverged from transformers"


def test_greedy_tokens_equal_transformers_eager(demo_llm):
    _equal_to_transformers(demo_llm)


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_compiled():
    llm = LLM(demo.DEMO_MODEL_NAME, device="cpu", cpu_kv_cache_gib=0.02, compile_config=CompileConfig())
    _equal_to_transformers(llm)
    assert llm.engine.runner.compile_counters.recompiles == 0


def test_fibonacci_completion_reads_as_python(demo_llm):
    """The request of docs/getting-started.md: greedy with a presence penalty, so the same text every run. A
    top-level function body (4-space indent, not a method's 8), a check and a return, and
    every whole line it wrote parses."""
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=64)
    (out,) = demo_llm.generate([FIBONACCI], params, use_tqdm=False)
    text = out.outputs[0].text
    lines = (FIBONACCI + text).splitlines()
    body = [line for line in lines[1:] if line.strip()]
    assert body and body[0].startswith("    ") and not body[0].startswith("     "), text
    assert "\n    if " in text and "\n        return " in text, text
    complete = lines if text.endswith("\n") else lines[:-1]
    ast.parse("\n".join(complete))


def test_docs_show_the_completion_the_model_gives(demo_llm):
    """The curl of docs/getting-started.md (once the README's) asks for it; the block under it
    is what comes back, prompt first."""
    page = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    body = json.loads(re.search(r"-d '(\{[^']*def fibonacci[^']*\})'", page).group(1))
    shown = re.search(r"completion's `choices\[0\]\.text`.*?:\n\n```python\n(.*?)```", page, re.DOTALL).group(1)
    params = SamplingParams(temperature=body["temperature"], presence_penalty=body["presence_penalty"],
                            max_tokens=body["max_tokens"])
    (out,) = demo_llm.generate([body["prompt"]], params, use_tqdm=False)
    assert shown.rstrip() == (body["prompt"] + out.outputs[0].text).rstrip()


def test_training_script_runs_end_to_end(tmp_path):
    """A few steps on a slice of the stdlib with a toy model; the result loads in both runtimes."""
    out = tmp_path / "model"
    script = REPO / "examples" / "train_demo_model.py"
    result = subprocess.run([sys.executable, str(script), "--tiny", "--max-steps", "3", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["event"] for e in events] == ["data", "model", "step", "eval", "done"]
    done = events[-1]
    assert done["steps"] == 3 and math.isfinite(done["val_loss"]) and done["val_files"] >= 1
    assert done["python"] == sys.version.split()[0]
    assert json.loads((out / "training.json").read_text())["config"]["max_steps"] == 3
    evaluated = subprocess.run([sys.executable, str(script), "--eval-only", "--out", str(out)], capture_output=True,
                               text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert evaluated.returncode == 0, evaluated.stderr
    whole = json.loads(evaluated.stdout)
    assert whole["val_tokens"] > 0 and abs(whole["val_loss"] - done["val_loss"]) < 0.5, (whole, done)
    second = tmp_path / "second-stage"
    continued = subprocess.run([sys.executable, str(script), "--tiny", "--max-steps", "2", "--init-from", str(out),
                                "--line-start-fraction", "0.5", "--out", str(second)], capture_output=True, text=True,
                               timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert continued.returncode == 0, continued.stderr
    record = json.loads((second / "training.json").read_text())
    assert record["init_from"]["steps"] == 3 and record["steps"] == 2
    assert (second / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text(), "the tokenizer is kept"
    llm = LLM(str(out), enforce_eager=True, device="cpu", cpu_kv_cache_gib=0.01)
    prompt = llm.get_tokenizer().encode("def f(x):")
    (gen,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                         ignore_eos=True), use_tqdm=False)
    assert gen.outputs[0].token_ids == hf_greedy(str(out), tuple(prompt), 8)[0]
