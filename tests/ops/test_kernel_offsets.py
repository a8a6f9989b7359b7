"""int64 offsets: a product that can pass 2^31 elements must be computed in int64.

Two checks, both without a GPU:
- Static, over every Triton function in ops/kernels: each product with a "wide" factor (the
  cache's block stride, the block table's or a token tensor's row stride, a row width) has
  an int64 other side (cast with ``.to(tl.int64)``, or computed from such a value), and no
  ``tl.program_id(0)`` is multiplied before a cast. Int32 arithmetic wraps silently.
- Dynamic, under the interpreter: the attention kernels read, and the cache write writes,
  blocks whose element offsets lie past 2^31 in a 4 GiB fp16 cache made with
  ``torch.empty`` (address space only: the pages of untouched blocks are never committed).
  A wrapped offset addresses memory before the cache and crashes the process, so the check
  runs in a child process and a crash fails the test instead of the session.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vgraph.ops.kernels.common import INTERPRETED

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIR = REPO / "ops" / "kernels"
# Factors whose product with an index can pass 2^31 elements.
WIDE = {"stride_cb", "stride_bt", "stride_qt", "stride_ot", "stride_kt", "stride_vt",
        "n_cols", "d", "num_q_heads"}


def _is_int64(node: ast.AST, names: set[str]) -> bool:
    """Whether an expression is int64 by construction: a cast, or arithmetic over one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        return bool(node.args) and ast.unparse(node.args[0]) == "tl.int64"
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.BinOp):
        return _is_int64(node.left, names) or _is_int64(node.right, names)
    if isinstance(node, ast.Subscript):
        return _is_int64(node.value, names)
    return False


def _int64_names(fn: ast.FunctionDef) -> set[str]:
    """Names all of whose assignments in ``fn`` are int64 (to a fixed point)."""
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
                else:  # tuple targets, loop variables: not int64 by construction
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            assigned.setdefault(name.id, []).append(ast.Constant(0))
        elif isinstance(node, (ast.For, ast.AugAssign)) and isinstance(node.target, ast.Name):
            assigned.setdefault(node.target.id, []).append(ast.Constant(0))
    names: set[str] = set()
    while True:
        more = {n for n, values in assigned.items()
                if n not in names and all(_is_int64(v, names) for v in values)}
        if not more:
            return names
        names |= more


def _is_program_id_0(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.program_id"
            and ast.unparse(node.args[0]) == "0")


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list)


def check_offsets(source: str) -> tuple[list[str], set[str]]:
    """(violations, wide factors seen) over the Triton functions in ``source``."""
    violations, seen = [], set()
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and _is_jit(fn)):
            continue
        names = _int64_names(fn)
        for node in ast.walk(fn):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            for factor, other in ((node.left, node.right), (node.right, node.left)):
                wide = isinstance(factor, ast.Name) and factor.id in WIDE
                if wide:
                    seen.add(factor.id)
                if (wide and not _is_int64(other, names)) or _is_program_id_0(factor):
                    violations.append(f"{fn.name}:{node.lineno}: {ast.unparse(node)}")
    return violations, seen


@pytest.mark.parametrize("path", sorted(KERNEL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_wide_products_are_int64(path: Path):
    violations, _ = check_offsets(path.read_text())
    assert not violations, "int32 products that can pass 2^31:\n" + "\n".join(violations)


def test_the_check_sees_every_kind_of_wide_product():
    """Guards against a vacuous pass (a renamed stride the check no longer recognizes)."""
    seen = {p.name: check_offsets(p.read_text())[1] for p in KERNEL_DIR.glob("*.py")}
    assert {"stride_cb", "stride_bt", "stride_qt", "stride_ot", "num_q_heads"} <= seen["attention.py"]
    assert {"stride_cb", "stride_kt", "stride_vt"} <= seen["kv_cache.py"]
    assert "n_cols" in seen["norm.py"] and "n_cols" in seen["fp8.py"] and "d" in seen["activation.py"]


def test_the_check_flags_int32_products():
    source = textwrap.dedent('''
        @triton.jit
        def kernel(table_ptr, stride_cb, n_cols):
            phys = tl.load(table_ptr)
            bad = phys * stride_cb
            good = tl.load(table_ptr).to(tl.int64) * stride_cb
            row = tl.program_id(0)
            also_bad = row * n_cols
            flat = tl.program_id(0) * 128
            wide = tl.program_id(0).to(tl.int64)
            fine = (wide + 1) * n_cols
    ''')
    violations, _ = check_offsets(source)
    assert [v.split(":")[1] for v in violations] == ["5", "8", "9"]


# The child process: builds the 4 GiB cache, writes and reads blocks past 2^31 elements.
_CHILD = r'''
import sys
import torch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops.attention import paged_attention_reference
from vgraph.ops.kernels.attention import (paged_attention_decode_split_kv_triton,
                                          paged_attention_triton)
from vgraph.ops.kernels.kv_cache import reshape_and_cache_triton

BS, HEADS, DIM = 16, 1, 64
num_blocks = 2 ** 31 // (BS * HEADS * DIM) + 64
try:
    cache = torch.empty((num_blocks, BS, HEADS, DIM), dtype=torch.float16)  # K and V share it
except RuntimeError as e:
    print(f"cannot reserve a 4 GiB cache: {e}")
    sys.exit(77)
high = list(range(num_blocks - 40, num_blocks - 35))  # element offsets > 2^31
assert high[0] * BS * HEADS * DIM >= 2 ** 31
table = torch.tensor([high, [3, 7, 0, 0, 0]], dtype=torch.int32)
seq_lens = torch.tensor([70, 20], dtype=torch.int32)

# The cache write: every token of both sequences through the kernel, then read back. The
# slots are int32 (the op accepts them): a slot fits, its block's element offset does not.
slots = torch.cat([table[i, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS
                   for i, n in enumerate(seq_lens.tolist())])
kv = torch.randn(len(slots), HEADS, DIM).half()
reshape_and_cache_triton(kv, kv, cache, cache, slots.int())
assert torch.equal(cache[slots // BS, slots % BS], kv), "cache write at offsets past 2^31"

q = torch.randn(10, 4, DIM).half()
qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
ref = paged_attention_reference(q, cache, cache, table, qsl, seq_lens, 5, 0.125)
assert_close_rel(paged_attention_triton(q, cache, cache, table, qsl, seq_lens, 5, 0.125), ref)
qd = q[[4, 9]]
ref_d = paged_attention_reference(qd, cache, cache, table, torch.tensor([0, 1, 2], dtype=torch.int32),
                                  seq_lens, 1, 0.125)
assert_close_rel(paged_attention_decode_split_kv_triton(qd, cache, cache, table, seq_lens, 0.125, 3),
                 ref_d)
print("ok")
'''


@pytest.mark.skipif(not INTERPRETED, reason="the 4 GiB cache is address space on the CPU only")
@pytest.mark.skipif(sys.platform != "linux", reason="relies on Linux overcommit for torch.empty")
def test_offsets_past_2_31_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, (
        f"exit {done.returncode} (negative: killed by that signal; -11 = an offset wrapped "
        f"past 2^31 and read outside the cache)\n{done.stdout}\n{done.stderr[-3000:]}")
    assert done.stdout.strip().endswith("ok")
