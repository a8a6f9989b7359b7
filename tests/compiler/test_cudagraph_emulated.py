"""The CUDA-graph capture and replay code on CPU, with CUDA graphs emulated.

A CUDA graph replay re-runs the captured kernels on the captured addresses: exactly the
captured Python body run again, reading whatever the persistent buffers hold by then. Here
``piecewise_graphs.new_graph`` / ``piecewise_graphs.record`` are replaced by a graph whose replay calls
the body, so everything around the graphs (persistent decode buffers filled in place,
per-piece staging and output buffers, which inputs are copied and which are read in place,
capture order, graph counts, dispatch to graphs) runs for real and is checked against
transformers and against the eager model. What the emulation cannot check, the CUDA-only
part (kernels recorded on the capture stream, the memory pool), is in test_cudagraph_gpu.py.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.compiler.graph_scenarios import (GPU_MAX_SEQS, GPU_NEW_PROMPT, assert_logprobs_close, gpu_llm_kwargs,
                                           gpu_prompts, replay_equals_eager)
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.compiler import piecewise_graphs
from vgraph.compiler.capture_safety import CaptureRegion, CaptureSafetyError
from vgraph.config import CompileConfig, CudaGraphMode
from vgraph.worker.runner_requests import RunnerStep
from vgraph.worker.cuda_graphs import FullGraphs, capture_buffer_bytes
from vgraph.worker.dispatch import Decision, Path
from vgraph.worker.dummy import DummySource

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
MAX_SEQS = 40  # decode buckets 1..64: 64 is the first that holds 40 sequences
BATCH_SIZES = [1, 3, 7, 8, 9, 16, 25, 33]
NEW_TOKENS = 5


class EmulatedGraph:
    """A CUDA graph on CPU: ``replay`` runs the captured body again, under the capture-safety
    check (vgraph/compiler/capture_safety.py), as every capture and replay here does."""

    def __init__(self) -> None:
        self.body: Optional[Callable[[], None]] = None
        self.region: Optional[CaptureRegion] = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def _record(graph: EmulatedGraph, pool: object, body: Callable[[], object], region: CaptureRegion) -> None:
    """A capture runs the body's Python once, recording its kernels: here it runs checked (its
    kernels execute for real, writing only the graph's buffers); so does every replay."""
    graph.region = region
    graph.body = region.checked(body)
    region.checked(body)()


def _emulated_llm(mode: CudaGraphMode, max_seqs: int = MAX_SEQS, **kwargs):
    """An engine whose graphs are captured on CPU (the runner captures only on CUDA, so the
    test calls the capture the runner would make there); ``kwargs`` replace this file's
    ``LLM`` arguments."""
    args = dict(dtype="float32", num_gpu_blocks=256, max_num_seqs=max_seqs, max_num_batched_tokens=512,
                compile_config=CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES))
    llm = LLM(tiny_checkpoint(arch="llama"), device="cpu", **{**args, **kwargs})
    runner = llm.engine.runner
    report = runner.graphs.capture(None, DummySource(runner.num_blocks, runner.spec.block_size, llm.engine.max_model_len, max_seqs))
    return llm, report


@pytest.fixture(scope="module")
def emulation():
    patch = pytest.MonkeyPatch()
    patch.setattr(piecewise_graphs, "new_graph", EmulatedGraph)
    patch.setattr(piecewise_graphs, "record", _record)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def emulated(emulation):
    return _emulated_llm(CudaGraphMode.FULL_AND_PIECEWISE)


@pytest.fixture(scope="module")
def prompts(emulated) -> list[list[int]]:
    return random_prompts([3, 17, 5, 30, 9, 1, 12, 40, 8, 21, 2] * 3, emulated[0].engine.vocab_size, seed=11)


def _piece_token_counts(sizes) -> set[int]:
    # every capture size is a token bucket (the compiled forward serves one row too)
    return set(sizes)


def test_graph_counts(emulated):
    llm, report = emulated
    buckets, counters = llm.engine.runner.graphs.buckets, llm.engine.runner.compile_counters
    assert buckets.full == (1, 2, 4, 8, 16, 32, 64) and buckets.piecewise == tuple(sorted(_piece_token_counts(SIZES)))
    assert report.full_graphs == len(buckets.full)
    assert report.piecewise_graphs == counters.compiled_pieces * len(_piece_token_counts(SIZES))
    assert report.piecewise_buckets == len(buckets.piecewise)


def _buffer_pointers(runner) -> list[int]:
    bufs = runner.graphs.decode_buffers
    ptrs = [t.data_ptr() for t in (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.block_table,
                                   bufs.seq_lens, bufs.query_start_loc, runner.graphs.full_graphs.hidden)]
    for _, pieces in runner.graphs.piecewise_graphs._pieces.values():
        for entry in pieces.graphs.values():
            ptrs += [t.data_ptr() for t in entry.inputs + entry.outputs if isinstance(t, torch.Tensor)]
    return ptrs


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_tokens_with_graphs_equal_transformers(emulated, prompts, batch_size):
    llm, _ = emulated
    runner = llm.engine.runner
    before = _buffer_pointers(runner)
    bucket = next(b for b in llm.engine.runner.graphs.buckets.full if b >= batch_size)
    replays = runner.graphs.full_graphs.graphs[(bucket, 1)].replays
    runner.graphs.dispatch_counts.clear()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch_size]], params, use_tqdm=False)
    path = tiny_checkpoint(arch="llama")
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0]
    assert runner.graphs.full_graphs.graphs[(bucket, 1)].replays - replays == NEW_TOKENS - 1, "decode steps replayed"
    assert runner.graphs.piecewise_graphs.misses == 0
    assert _buffer_pointers(runner) == before, "no buffer was reallocated between replays"
    assert llm.engine.runner.compile_counters.recompiles == 0


@pytest.mark.parametrize("kind", ["full", "piecewise"])
def test_replay_equals_the_eager_forward_on_the_same_inputs(emulated, prompts, kind):
    replay_equals_eager(emulated[0], prompts, kind, new_prompt=7, tol=1e-5)


@pytest.fixture(scope="module")
def gpu_configured(emulation):
    """The engine of test_cudagraph_gpu.py, on CPU with emulated graphs."""
    mode = CudaGraphMode.FULL_AND_PIECEWISE
    return _emulated_llm(mode, GPU_MAX_SEQS, **gpu_llm_kwargs("float32", mode.value))


@pytest.mark.parametrize("kind, bucket", [("full", 8), ("piecewise", 32)])
def test_the_gpu_replay_test_runs_on_its_path_and_replays(gpu_configured, kind, bucket):
    """test_cudagraph_gpu.py's replay scenario, exactly: the batch it builds must take the
    path it asserts (a 45-token mixed batch once fell past its largest bucket, 40)."""
    replay_equals_eager(gpu_configured[0], gpu_prompts(), kind, new_prompt=GPU_NEW_PROMPT, tol=1e-5,
                        expected_bucket=bucket)


def _captured_buffer_bytes(runner) -> int:
    """What the capture keeps allocated outside the graph pool: each distinct storage of the
    staged inputs, the piece outputs, the attention outputs and the FULL graphs' buffers."""
    graphs, storages = runner.graphs, {}
    tensors = list(graphs.decode_buffers.tensors()) + [graphs.full_graphs.hidden]
    tensors += list(graphs.piecewise_graphs._attention_outputs._shared.values())
    for _, pieces in graphs.piecewise_graphs._pieces.values():
        for entry in pieces.graphs.values():
            tensors += [entry.inputs[i] for i in entry.copied] + list(entry.outputs)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_the_buffer_estimate_is_within_15_percent_of_what_capture_allocates(emulated):
    """The part of the CUDA-graph memory estimate the emulation can measure: the persistent
    buffers (the pool's activations and the graphs' own memory need a GPU)."""
    llm, _ = emulated
    runner = llm.engine.runner
    estimate = capture_buffer_bytes(runner.model, runner.graphs.buckets, CudaGraphMode.FULL_AND_PIECEWISE,
                                    llm.engine.max_model_len, runner.spec.block_size)
    measured = _captured_buffer_bytes(runner)
    assert abs(estimate - measured) <= 0.15 * measured, (estimate, measured)


def test_pieces_read_each_layers_attention_output_in_place(emulated, prompts):
    """The attention op writes into its layer's persistent buffer, which the next piece's
    graph reads where it lies: replays stage only the forward's own inputs (input ids and
    positions), never an attention output (one copy per layer per step otherwise)."""
    llm, _ = emulated
    graphs = llm.engine.runner.graphs
    pieces = graphs.piecewise_graphs
    staged = [t for _, p in pieces._pieces.values() for t in p._staging._shared.values()]
    assert [t.dtype for t in staged] == [torch.int64, torch.int64], "input ids and positions only"
    layers = llm.engine.runner.model.num_layers
    buffers = {t.data_ptr() for t in pieces._attention_outputs._shared.values()}
    read = {e.inputs[i].data_ptr() for _, p in pieces._pieces.values() for e in p.graphs.values() for i in e.copied}
    assert len(buffers) == layers and buffers <= read
    graphs.dispatch_counts.clear()
    copies = pieces.staged_copies
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:3]] * 2, params, use_tqdm=False)
    forwards = sum(n for (path, _), n in graphs.dispatch_counts.items() if path is Path.PIECEWISE)
    assert forwards > 0 and pieces.staged_copies - copies == 2 * forwards


def test_every_graph_is_recorded_under_the_capture_safety_check(emulated):
    graphs = emulated[0].engine.runner.graphs
    pieces = [e.graph for _, p in graphs.piecewise_graphs._pieces.values() for e in p.graphs.values()]
    recorded = list(graphs.full_graphs.graphs.values()) + pieces
    assert len(recorded) == emulated[1].full_graphs + emulated[1].piecewise_graphs
    assert all(g.region is not None and g.region.device == torch.device("cpu") for g in recorded)
    kv = graphs.kv_caches[0][0]
    assert all(kv.untyped_storage()._cdata in g.region.owned_keys for g in graphs.full_graphs.graphs.values())


@pytest.mark.parametrize("per_call, refused", [
    ("input_ids", "a compiled piece reads a torch.int64 tensor"),
    ("attention metadata", "vgraph::unified_attention \\(forward context\\) reads a torch.int64 tensor"),
])
def test_a_full_body_over_the_batchs_own_tensors_is_refused(emulated, per_call, refused):
    """The mistake the check exists for: a FULL body reading the capture batch's tensors
    instead of the persistent decode buffers replays that batch forever on CUDA."""
    graphs = emulated[0].engine.runner.graphs
    with torch.inference_mode():
        batch = graphs.builder.build(RunnerStep(), Decision(Path.FULL, 8, 0))
        inputs = graphs.decode_buffers.fill(batch)
        ids = batch.input_ids if per_call == "input_ids" else inputs.input_ids
        meta = batch.attn_metadata if per_call == "attention metadata" else inputs.attn_metadata
        full = FullGraphs(None, graphs.decode_buffers.max_rows)
        with pytest.raises(CaptureSafetyError, match=f"{refused} .* the graph does not own"):
            full.capture((8, 1), lambda: graphs._forward_inputs(ids, inputs.positions, meta, None), graphs._persistent())


def _paths_of_greedy_run_equal_to_transformers(llm, prompts) -> set:
    """Generates greedily from ``prompts``, checks every token against transformers, and
    returns the dispatch paths the run took."""
    graphs = llm.engine.runner.graphs
    graphs.dispatch_counts.clear()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    path = tiny_checkpoint(arch="llama")
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0]
    return {p for p, _ in graphs.dispatch_counts}


@pytest.mark.parametrize("mode", [CudaGraphMode.FULL, CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE])
def test_each_mode_captures_its_graphs_and_generates_the_same_tokens(emulation, prompts, mode):
    llm, report = _emulated_llm(mode)
    engine = llm.engine
    pieces = engine.runner.compile_counters.compiled_pieces * len(_piece_token_counts(SIZES))
    assert report.full_graphs == (len(engine.runner.graphs.buckets.full) if mode.has_full else 0)
    assert report.piecewise_graphs == (pieces if mode.has_piecewise else 0)
    paths = _paths_of_greedy_run_equal_to_transformers(llm, prompts[:6])
    assert paths == ({Path.FULL} if mode.has_full else set()) | ({Path.PIECEWISE} if mode.has_piecewise else {Path.NONE})
    assert engine.runner.compile_counters.recompiles == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_graphs_through_dynamos_frame_never_recompile(emulation, prompts, monkeypatch, overlap):
    """On CPU the forward is usually the captured graph called directly, with no Dynamo frame
    and so no guards; a GPU keeps Dynamo's frame when ``adopt_capture`` declines (the direct
    call differed), and there any input the trace did not see (another dtype, a non-inference
    tensor, a view at another storage offset) is a recompile, which raises. Here the frame is
    kept on purpose, and capture, FULL and PIECEWISE replays, prefill and decode steps, serial
    and overlapped, must all run on the one trace. The trace guards on two rows or more (a fake
    tensor's stride computation, ``compiled_forward.py``), so the buckets of one are not
    captured and a one-row batch replays the bucket of two."""
    from vgraph.compiler.backend import VgraphBackend
    from vgraph.compiler.compiled_forward import CompiledForward
    monkeypatch.setattr(VgraphBackend, "adopt_capture", lambda self, *args: None)
    torch._dynamo.reset()  # this engine's trace the only entry, as in a server's one-engine process
    llm, report = _emulated_llm(CudaGraphMode.FULL_AND_PIECEWISE, async_scheduling=overlap,
                                compile_config=CompileConfig(cudagraph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
                                                             cudagraph_capture_sizes=SIZES, use_cache=False))
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs.forward_fn.forward, CompiledForward), "Dynamo's frame serves"
    assert graphs.min_rows == 2
    assert (1, 1) not in graphs.full_graphs.graphs and (2, 1) in graphs.full_graphs.graphs
    assert report.full_graphs == len(graphs.buckets.full) - 1
    assert _paths_of_greedy_run_equal_to_transformers(llm, prompts[:7]) == {Path.FULL, Path.PIECEWISE}
    assert _paths_of_greedy_run_equal_to_transformers(llm, prompts[:1]) == {Path.FULL, Path.PIECEWISE}
    assert (Path.FULL, 1) not in graphs.dispatch_counts and (Path.FULL, 2) in graphs.dispatch_counts
    assert llm.engine.runner.compile_counters.recompiles == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_one_sequence_through_dynamos_frame_without_graphs(prompts, monkeypatch, overlap):
    """Graphs off (the CPU default) and Dynamo's frame serving: a step of one row is padded to
    two (the NONE path), so one sequence decoding alone runs on the one trace too."""
    from vgraph.compiler.backend import VgraphBackend
    from vgraph.compiler.compiled_forward import CompiledForward
    monkeypatch.setattr(VgraphBackend, "adopt_capture", lambda self, *args: None)
    torch._dynamo.reset()
    llm = LLM(tiny_checkpoint(arch="llama"), device="cpu", dtype="float32", async_scheduling=overlap,
              compile_config=CompileConfig(use_cache=False))
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs.forward_fn.forward, CompiledForward), "Dynamo's frame serves"
    assert _paths_of_greedy_run_equal_to_transformers(llm, prompts[:1]) == {Path.NONE}
    assert (Path.NONE, 2) in graphs.dispatch_counts and (Path.NONE, 1) not in graphs.dispatch_counts
    assert llm.engine.runner.compile_counters.recompiles == 0


# ------------------------------------------------------------------------------ unit level


def test_piece_buffers_keep_strides_and_share_leading_rows():
    bufs = piecewise_graphs._Buffers()
    q = torch.randn(8, 3, 4, 2)[:, 0]  # a strided view, as q/k/v split from one projection are
    big = bufs.like("q", q)
    assert big.shape == q.shape and big.stride() == q.stride()
    small = bufs.like("q", torch.randn(5, 3, 4, 2)[:, 0])
    assert small.data_ptr() == big.data_ptr() and small.shape == (5, 4, 2) and small.stride() == q.stride()
    assert bufs.like("q", torch.randn(5, 4, 2)).data_ptr() != big.data_ptr(), "other strides: its own"
    expanded = bufs.like("e", torch.zeros(1, 4).expand(3, 4))
    expanded.copy_(torch.ones(3, 4))  # an overlapping layout would refuse the copy


def test_piece_graph_reads_weights_in_place_and_copies_per_call_inputs(monkeypatch):
    monkeypatch.setattr(piecewise_graphs, "new_graph", EmulatedGraph)
    monkeypatch.setattr(piecewise_graphs, "record", _record)
    weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    table = torch.randn(4)  # a buffer: not a Parameter, but the same object on every call
    fn = lambda w, x, t, n: [x @ w + t, x * n]  # noqa: E731
    graphs = piecewise_graphs.PieceGraphs()
    graphs.warm_up(3, fn, (weight, torch.randn(3, 4), table, 3))
    outs = graphs.capture(3, fn, (weight, torch.randn(3, 4), table, 3), pool=None, produced=set())
    entry = graphs.graphs[3]
    assert entry.in_place == (0, 2) and entry.copied == (1,)
    x = torch.randn(3, 4)
    replayed = graphs.replay(3, (weight, x, table, 3))
    assert replayed is outs, "the persistent output views"
    torch.testing.assert_close(replayed[0], x @ weight + table)
    torch.testing.assert_close(replayed[1], x * 3)
    assert graphs.replay(3, (torch.nn.Parameter(weight.clone()), x, table, 3)) is None, "a new weight: no replay"
    assert graphs.replay(4, (weight, torch.randn(4, 4), table, 4)) is None, "no graph for 4 tokens"


def _run_of(tokens: list[int], logprobs: list[dict[int, float]]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_logprob_comparison_allows_parting_only_at_a_near_tie():
    """The bf16 comparison of test_cudagraph_gpu.py (graph_scenarios.assert_logprobs_close)."""
    a = _run_of([5, 7, 9], [{5: -0.5, 6: -1.5}, {7: -0.70, 8: -0.72}, {9: -0.1}])
    tie = _run_of([5, 8, 1], [{5: -0.52, 6: -1.4}, {8: -0.69, 7: -0.71}, {1: -0.1}])
    assert_logprobs_close([a], [tie], atol=0.05)  # parts at step 1, a near tie: stops there
    with pytest.raises(AssertionError, match="step 0: token 5 logprob"):
        assert_logprobs_close([a], [_run_of([5, 7, 9], [{5: -0.7}, {7: -0.7}, {9: -0.1}])], atol=0.05)
    with pytest.raises(AssertionError, match="step 1: tokens 7 vs 8 differ without a near tie"):
        assert_logprobs_close([a], [_run_of([5, 8, 9], [{5: -0.5}, {8: -0.1, 7: -2.0}, {9: -0.1}])], atol=0.05)


def test_lora_adapters_run_inside_the_captured_graphs(emulation):
    """Adapters loaded and swapped after capture run inside the FULL and PIECEWISE graphs (the
    slot buffers and the per-row slots are graph inputs at fixed addresses; padding rows take
    no adapter), and mixed batches still equal transformers + PEFT."""
    from tests.lora.test_lora_engine import TOKENS, _loras, _oracle, _prompts
    llm, report = _emulated_llm(CudaGraphMode.FULL_AND_PIECEWISE, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        assert report.full_graphs and report.piecewise_graphs
        prompts = _prompts()[:6]
        assignment = [1, 0, 2, 3, 1, 0]
        loras = [None if a == 0 else _loras()[a - 1] for a in assignment]
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == [_oracle(a, tuple(p)) for a, p in zip(assignment, prompts)]
        assert llm.engine.runner.compile_counters.recompiles == 0
    finally:
        llm.close()
