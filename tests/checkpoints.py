"""Shared tiny checkpoints for tests (plain functions; no pytest dependency).

Building a checkpoint costs about a second (HF model init + tokenizer training), and many
tests want the same few, so each (directory, arch) is built once per process. With no
directory given they go in one process-wide temp dir that is removed at exit.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from vgraph.models.demo import build_tiny_checkpoint

TINY_ARCHS = ("llama", "qwen2", "qwen3")
# Also buildable, for tests that name it (not in every TINY_ARCHS sweep: Mistral without a window
# runs Llama's layers, which the sweeps already cover).
EXTRA_ARCHS = ("mistral",)


@functools.lru_cache(maxsize=1)
def process_tmp_dir() -> str:
    """One temp dir for the whole test process, cleaned up at interpreter exit."""
    path = tempfile.mkdtemp(prefix="vgraph-test-checkpoints-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def _build(root: str, arch: str) -> str:
    return build_tiny_checkpoint(Path(root) / f"tiny-{arch}", arch, seed=0)


def tiny_checkpoint(tmp_dir: Optional[str | os.PathLike] = None, arch: str = "llama") -> str:
    """Path of the tiny ``arch`` checkpoint ("llama", "qwen2", "qwen3", "mistral") under ``tmp_dir``
    (default: the process temp dir), built on first request. Treat it as read-only."""
    if arch not in TINY_ARCHS + EXTRA_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS + EXTRA_ARCHS)}")
    root = os.fspath(tmp_dir) if tmp_dir is not None else process_tmp_dir()
    return _build(os.path.abspath(root), arch)


# A Qwen2.5-style (Hermes) chat template with tool support, written for the tests: tools listed
# in the system turn, assistant calls as <tool_call> JSON, tool results as <tool_response> turns.
HERMES_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, answer <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=None)
def _build_tool_chat(root: str) -> str:
    from transformers import AutoTokenizer

    # Tool schemas in the prompt are long in a 512-token vocabulary: room for 2048 positions.
    out = build_tiny_checkpoint(Path(root) / "tiny-llama-tools", "llama", seed=0, max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = HERMES_TOOL_TEMPLATE
    tokenizer.save_pretrained(out)
    return str(out)


def tool_chat_checkpoint(tmp_dir: Optional[str | os.PathLike] = None) -> str:
    """A tiny llama checkpoint (2048 positions) with a Qwen2.5-style tool-capable chat template
    (read-only)."""
    root = os.fspath(tmp_dir) if tmp_dir is not None else process_tmp_dir()
    return _build_tool_chat(os.path.abspath(root))
