"""The model's row-wise tail (everything after the last attention) runs on the sampled rows
alone in a step with prefills: the piece gets only those rows, the sampled hidden states
equal the whole-batch forward's, greedy tokens equal the eager engine's (chunked prefills
with no sampled row included), and a warm start keeps doing it."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from tests.compiler import tiny_engine
from tests.compiler.tiny_engine import cold_start, piece_runners
from vgraph import LLM, SamplingParams
from vgraph.compiler.piece import PieceRunner, RowArgs, find_row_args

# The shared prompts plus a 150-token one, which runs in three chunks of at most 64 rows: the
# first two sample no row.
PROMPTS = tiny_engine.PROMPTS + [[(11 * i) % 500 + 6 for i in range(150)]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tail(llm: LLM) -> PieceRunner:
    return piece_runners(llm)[-1]


def _tokens(llm: LLM) -> list[list[int]]:
    return tiny_engine.tokens(llm, PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    llm, root = cold_start(tmp_path_factory, "row-wise-tail")
    return {"llm": llm, "root": root}


def test_only_the_tail_piece_is_row_wise(cold):
    runners = piece_runners(cold["llm"])
    assert [r.row_args is not None for r in runners] == [False] * (len(runners) - 1) + [True]
    assert runners[-1].row_args.tensors and runners[-1].row_args.ints  # attention output, residual; token count


def test_tail_runs_on_the_sampled_rows_and_matches_the_whole_batch(cold, monkeypatch):
    llm = cold["llm"]
    engine, tail = llm.engine, _tail(llm)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PARAMS)
    step = engine.runner.requests.apply(engine.scheduler.schedule().plan)  # as the runner's execute does
    graphs = engine.runner.graphs
    try:
        with torch.inference_mode():
            batch, decision = graphs.build(step)
            assert batch.output_rows is not None and batch.output_rows.tolist() == batch.sample_indices.tolist()
            assert batch.num_scheduled == 41 and batch.output_rows.tolist() == [4, 39, 40]
            calls = []
            monkeypatch.setattr(tail, "dynamic", _recording(tail.dynamic, calls))
            pruned = graphs.run(batch, decision).clone()
            whole = graphs.run(replace(batch, output_rows=None), decision).clone()
        assert calls == [3, 41]  # the attention output's rows reaching the tail's code
        assert pruned.shape == (3, whole.shape[1])
        torch.testing.assert_close(batch.sampled_hidden(pruned), batch.sampled_hidden(whole), rtol=1e-6, atol=1e-6)
    finally:
        engine.abort_request([f"r{i}" for i in range(3)])


def _recording(fn, calls: list):
    def call(*args):
        calls.append(next(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 3))
        return fn(*args)
    return call


def test_greedy_tokens_equal_the_eager_engine(cold):
    eager = tiny_engine.engine(enforce_eager=True)
    assert _tokens(cold["llm"]) == _tokens(eager)


def test_prompt_logprob_requests_run_every_row(cold):
    """A request that scores its prompt needs every row's hidden state: no pruning then."""
    engine = cold["llm"].engine
    engine.add_request("lp", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    try:
        batch, _ = engine.runner.graphs.build(engine.runner.requests.apply(engine.scheduler.schedule().plan))
        assert batch.output_rows is None
    finally:
        engine.abort_request(["lp"])


def test_a_warm_start_keeps_the_row_wise_tail(cold, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    shutil.copytree(cold["root"], root)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(root))
    warm = tiny_engine.engine()
    assert warm.engine.runner.compile_counters.runnable_loads > 0
    assert _tail(warm).row_args == _tail(cold["llm"]).row_args
    assert _tokens(warm) == _tokens(cold["llm"])


def _symbolic(shape: tuple[int, ...], mode: FakeTensorMode) -> torch.Tensor:
    dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (len(shape) - 1)
    return mode.from_tensor(torch.empty(shape), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def test_find_row_args_takes_only_arguments_it_can_gather():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = _symbolic((8, 4, 16), mode)
    other = _symbolic((8, 64), mode)  # its own symbol
    tokens = x.shape[0]
    symbol = tokens.node.expr
    with mode:
        residual = x.new_empty(tokens, 64)
        weight = torch.empty(64, 64)
        rope = x.new_empty(tokens, 1, 32)
    assert find_row_args([x, tokens, weight, residual, rope], symbol) == RowArgs((0, 3, 4), (1,))
    assert find_row_args([weight], symbol) is None  # nothing to gather
    for bad in (residual[:, :32],           # not contiguous: the compiled code checks strides
                residual.t(),                # the token dim is not dim 0
                other,                       # another symbol
                tokens * 2,                  # an expression of the token count
                x.new_empty(tokens, tokens)):  # the token count in another dim
        assert find_row_args([x, tokens, bad], symbol) is None
