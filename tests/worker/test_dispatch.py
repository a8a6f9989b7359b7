"""The dispatcher and the padding it implies, without a model: bucket choice per batch shape,
capture sizes, the batch builder's padding, and that padded attention inputs compute exactly
what unpadded ones do."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vgraph.config import CacheConfig, CompileConfig, CudaGraphMode, SchedulerConfig
from vgraph.core.request import Request
from vgraph.core.scheduler import Scheduler
from vgraph.worker.runner_requests import RunnerRequests, RunnerStep
from vgraph.ops.forward_context import ForwardContext, set_forward_context
from vgraph.sampling_params import SamplingParams
from vgraph.worker.batch import BatchBuilder, FlatBatch
from vgraph.worker.cuda_graphs import DecodeBuffers
from vgraph.worker.dispatch import (BatchShape, Decision, Path, VerifyShape, capture_sizes, choose,
                                   default_capture_sizes)
from vgraph.core.outputs import ModelRunnerOutput

DEFAULT = capture_sizes(CompileConfig(), max_num_seqs=256, max_num_batched_tokens=8192)
BOTH = CudaGraphMode.FULL_AND_PIECEWISE
BLOCK = 4
BUILDER = BatchBuilder(BLOCK, torch.device("cpu"), num_kv_heads=2, max_model_len=64)


def decode(n: int) -> BatchShape:
    return BatchShape(n, n, True)


def mixed(tokens: int, seqs: int) -> BatchShape:
    return BatchShape(tokens, seqs, False)


# ---------------------------------------------------------------------------- capture sizes


def test_default_sizes_are_1_2_4_then_multiples_of_8_to_256():
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert DEFAULT.full == DEFAULT.piecewise == tuple(sizes)


def test_sizes_are_capped_by_the_token_budget_and_max_num_seqs():
    b = capture_sizes(CompileConfig(), max_num_seqs=12, max_num_batched_tokens=48)
    assert b.piecewise == (1, 2, 4, 8, 16, 24, 32, 40, 48)
    assert b.full == (1, 2, 4, 8, 16), "decode buckets stop at the first that holds 12 sequences"
    small = capture_sizes(CompileConfig(max_capture_size=16), max_num_seqs=256, max_num_batched_tokens=8192)
    assert small.piecewise == (1, 2, 4, 8, 16)


def test_sizes_can_be_overridden_and_are_validated():
    b = capture_sizes(CompileConfig(cudagraph_capture_sizes=[8, 3, 3, 1, 600]), 256, 512)
    assert b.piecewise == (1, 3, 8) and b.full == (1, 3, 8)
    with pytest.raises(ValueError, match="positive"):
        CompileConfig(cudagraph_capture_sizes=[0, 4])


def test_a_batch_of_one_has_a_bucket_of_its_own():
    """The compiled forward serves one row (traced size-oblivious), so one sequence replays a
    one-row graph and reaches the one-row GEMV on CUDA, not a padded two-row one."""
    b = capture_sizes(CompileConfig(cudagraph_capture_sizes=[1, 2, 4]), 256, 512)
    assert b.full == b.piecewise == (1, 2, 4)
    assert choose(decode(1), b, BOTH) == Decision(Path.FULL, 1, 1)


def test_mode_resolution():
    assert CompileConfig().resolved_graph_mode("cuda") is BOTH
    assert CompileConfig().resolved_graph_mode("cpu") is CudaGraphMode.NONE, "no graphs: no padding"
    assert CompileConfig(cudagraph_mode="full").resolved_graph_mode("cpu") is CudaGraphMode.FULL
    assert CompileConfig(level="none").resolved_graph_mode("cuda") is CudaGraphMode.NONE, "eager: no graphs"
    assert CompileConfig(cudagraph_mode="piecewise").resolved_graph_mode("cuda") is CudaGraphMode.PIECEWISE
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CompileConfig(cudagraph_mode="sometimes")


# ---------------------------------------------------------------------------- decisions


def test_decode_batch_of_5_runs_the_full_graph_of_8():
    assert choose(decode(5), DEFAULT, BOTH) == Decision(Path.FULL, 8, 5)


def test_mixed_batch_runs_piecewise_at_the_padded_token_count():
    d = choose(mixed(37, 4), DEFAULT, BOTH)
    assert d == Decision(Path.PIECEWISE, 40, 37) and d.padding == 3


def test_above_the_largest_bucket_runs_without_graphs_unpadded():
    assert choose(decode(300), DEFAULT, BOTH) == Decision(Path.NONE, 300, 300)
    assert choose(mixed(257, 2), DEFAULT, BOTH) == Decision(Path.NONE, 257, 257)


@pytest.mark.parametrize("mode, shape, expected", [
    (CudaGraphMode.PIECEWISE, decode(5), Decision(Path.PIECEWISE, 8, 5)),
    (CudaGraphMode.FULL, mixed(9, 2), Decision(Path.NONE, 9, 9)),
    (CudaGraphMode.FULL, decode(9), Decision(Path.FULL, 16, 9)),
    (CudaGraphMode.NONE, decode(5), Decision(Path.NONE, 5, 5)),
    (BOTH, BatchShape(0, 0, False), Decision(Path.NONE, 0, 0)),
])
def test_each_mode_offers_only_its_paths(mode, shape, expected):
    assert choose(shape, DEFAULT, mode) == expected


def test_without_graphs_nothing_is_padded():
    assert choose(decode(1), DEFAULT, CudaGraphMode.NONE) == Decision(Path.NONE, 1, 1)
    assert choose(mixed(5, 1), DEFAULT, CudaGraphMode.NONE) == Decision(Path.NONE, 5, 5)


def test_a_forward_that_serves_two_rows_or_more_pads_one_row_to_two():
    """While Dynamo's frame serves the forward (its trace guards on two rows or more), a batch
    of one takes the bucket of two on every path, and nothing else changes."""
    assert choose(decode(1), DEFAULT, BOTH, min_rows=2) == Decision(Path.FULL, 2, 1)
    assert choose(mixed(1, 1), DEFAULT, BOTH, min_rows=2) == Decision(Path.PIECEWISE, 2, 1)
    assert choose(decode(1), DEFAULT, CudaGraphMode.NONE, min_rows=2) == Decision(Path.NONE, 2, 1)
    assert choose(decode(5), DEFAULT, BOTH, min_rows=2) == choose(decode(5), DEFAULT, BOTH)
    assert choose(BatchShape(0, 0, False), DEFAULT, BOTH, min_rows=2) == Decision(Path.NONE, 0, 0)


def test_every_shape_the_scheduler_can_produce_has_a_path():
    sched = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=48)
    b = capture_sizes(CompileConfig(), sched.max_num_seqs, sched.max_num_batched_tokens)
    for n in range(1, sched.max_num_seqs + 1):
        assert choose(decode(n), b, BOTH).path is Path.FULL
    for tokens in range(1, sched.max_num_batched_tokens + 1):
        d = choose(mixed(tokens, 1), b, BOTH)
        assert d.path is Path.PIECEWISE and tokens <= d.bucket <= sched.max_num_batched_tokens


# ---------------------------------------------------------------------------- from real batches


def _scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     CacheConfig(block_size=BLOCK), num_blocks, max_model_len=64)


def _add(s: Scheduler, rid: str, prompt_len: int) -> None:
    s.add_request(Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=20, ignore_eos=True)))


def _step(s: Scheduler, copies: RunnerRequests) -> RunnerStep:
    """One scheduled step, applied to the runner's copies (as the runner does) and updated."""
    sched = s.schedule()
    step = copies.apply(sched.plan)
    s.update(sched, ModelRunnerOutput({x.request.request_id: 7 for x in sched.scheduled if x.produces_token}))
    return step


def test_pure_decode_is_judged_from_the_scheduler_output():
    s = _scheduler()
    for i, n in enumerate([5, 2, 9]):
        _add(s, str(i), n)
    copies = RunnerRequests()
    prefill = _step(s, copies)
    assert BatchShape.of_step(prefill) == mixed(16, 3)
    assert choose(BatchShape.of_step(prefill), DEFAULT, BOTH) == Decision(Path.PIECEWISE, 16, 16)
    step = _step(s, copies)
    assert BatchShape.of_step(step) == decode(3)
    assert choose(BatchShape.of_step(step), DEFAULT, BOTH) == Decision(Path.FULL, 4, 3)


# ---------------------------------------------------------------------------- padding layout


def _decode_sched(s: Scheduler, lengths: list[int]) -> RunnerStep:
    """A pure-decode step over real block tables (prompts of ``lengths`` tokens)."""
    for i, n in enumerate(lengths):
        _add(s, f"r{i}", n)
    copies = RunnerRequests()
    _step(s, copies)
    return copies.apply(s.schedule().plan)


def _build(step: RunnerStep, path: Path, bucket: int) -> FlatBatch:
    return BUILDER.build(step, Decision(path, bucket, step.num_batched_tokens))


def test_token_padding_appends_rows_outside_every_sequence():
    s = _scheduler()
    for i, n in enumerate([5, 2]):
        _add(s, str(i), n)
    sched = RunnerRequests().apply(s.schedule().plan)
    batch, padded = _build(sched, Path.NONE, 7), _build(sched, Path.PIECEWISE, 10)
    meta = padded.attn_metadata
    assert padded.num_tokens == 10 and padded.num_scheduled == 7 and padded.input_ids[7:].tolist() == [0, 0, 0]
    assert meta.slot_mapping[7:].tolist() == [-1, -1, -1] and meta.slot_mapping[:7].tolist() == \
        batch.attn_metadata.slot_mapping.tolist()
    assert meta.query_start_loc.tolist() == [0, 5, 7], "padding rows belong to no sequence"
    assert torch.equal(padded.sample_indices, batch.sample_indices)
    with pytest.raises(ValueError):
        _build(sched, Path.PIECEWISE, 3)


def test_full_padding_adds_empty_sequences_and_the_buffers_never_move():
    s = _scheduler()
    sched = _decode_sched(s, [5, 9, 2])
    batch = _build(sched, Path.FULL, 4)
    bufs = DecodeBuffers(max_seqs=8, max_blocks_per_seq=16, device=torch.device("cpu"))
    ptrs = [t.data_ptr() for t in (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.block_table,
                                   bufs.seq_lens, bufs.query_start_loc)]
    view = bufs.fill(batch)
    meta = view.attn_metadata
    assert view.input_ids.tolist() == [7, 7, 7, 0] and view.positions.tolist() == [5, 9, 2, 0]
    assert meta.seq_lens.tolist() == [6, 10, 3, 0], "the padding sequence is empty"
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4], "one row per sequence, padding included"
    assert meta.slot_mapping[3] == -1 and meta.max_query_len == 1 and meta.max_seq_len == 64
    # a smaller batch in the same bucket: the rows it no longer uses become padding again
    again = bufs.fill(_build(RunnerStep(sched.chunks[:1]), Path.FULL, 4))
    assert again is view, "the same views (the ones a graph was captured with) every time"
    assert meta.seq_lens[1:].tolist() == [0, 0, 0] and meta.slot_mapping[1:].tolist() == [-1, -1, -1]
    assert ptrs == [t.data_ptr() for t in (bufs.input_ids, bufs.positions, bufs.slot_mapping,
                                           bufs.block_table, bufs.seq_lens, bufs.query_start_loc)]


def test_a_full_batch_is_written_into_the_buffers_it_replays_from():
    """With the decode buffers given, the builder writes a FULL batch straight into them (one
    copy per array, no batch tensors of its own): the same values ``fill`` would copy, the
    same views, and ``fill`` then copies nothing."""
    s = _scheduler()
    sched = _decode_sched(s, [5, 9, 2])
    decision = Decision(Path.FULL, 4, sched.num_batched_tokens)
    copied = DecodeBuffers(max_seqs=8, max_blocks_per_seq=16, device=torch.device("cpu"))
    want = copied.fill(BUILDER.build(sched, decision))
    bufs = DecodeBuffers(max_seqs=8, max_blocks_per_seq=16, device=torch.device("cpu"))
    batch = BUILDER.build(sched, decision, bufs)
    assert batch.resident and batch.input_ids.data_ptr() == bufs.input_ids.data_ptr()
    view = bufs.fill(batch)
    assert view.input_ids is batch.input_ids and view.attn_metadata is batch.attn_metadata
    for got, expected in zip(bufs.tensors(), copied.tensors()):
        assert torch.equal(got, expected)
    assert (view.attn_metadata.max_seq_len, view.attn_metadata.num_kv_splits) == \
        (want.attn_metadata.max_seq_len, want.attn_metadata.num_kv_splits)
    assert batch.sample_indices.tolist() == [0, 1, 2] and batch.sample_indices.data_ptr() == bufs.row_indices.data_ptr()
    with torch.inference_mode():
        bufs.input_ids.fill_(-5)
    assert bufs.fill(batch) is view and bufs.input_ids[0] == -5, "a resident batch is not copied again"


def test_decode_buffers_reject_what_they_cannot_hold():
    s = _scheduler()
    sched = _decode_sched(s, [5, 9, 2])
    with pytest.raises(ValueError, match="width"):
        DecodeBuffers(max_seqs=8, max_blocks_per_seq=2, device=torch.device("cpu")).fill(_build(sched, Path.FULL, 4))
    with pytest.raises(ValueError, match="exceed"):
        DecodeBuffers(2, 16, torch.device("cpu")).fill(_build(sched, Path.FULL, 4))
    with pytest.raises(ValueError, match="not a FULL batch"):
        DecodeBuffers(8, 16, torch.device("cpu")).fill(_build(sched, Path.PIECEWISE, 4))


# ---------------------------------------------------------------------------- padded attention


def _attention(q, k, v, meta, caches):
    with set_forward_context(ForwardContext(meta, caches, 0.25)):
        return torch.ops.vgraph.unified_attention(q, k, v, 0)


def _caches(num_blocks=64, kv_heads=2, head_dim=16):
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    return [(torch.randn(shape), torch.randn(shape))]


@pytest.mark.parametrize("path", ["full", "piecewise"])
def test_padded_attention_equals_unpadded_and_writes_the_same_cache(path):
    s = _scheduler()
    sched = _decode_sched(s, [5, 9, 2])
    batch = _build(sched, Path.NONE, 3)
    n, bucket = batch.num_tokens, 8
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    plain_caches = _caches()
    padded_caches = [(kc.clone(), vc.clone()) for kc, vc in plain_caches]
    expected = _attention(q, k, v, batch.attn_metadata, plain_caches)
    if path == "full":
        bufs = DecodeBuffers(max_seqs=16, max_blocks_per_seq=16, device=torch.device("cpu"))
        meta = bufs.fill(_build(sched, Path.FULL, bucket)).attn_metadata
    else:
        meta = _build(sched, Path.PIECEWISE, bucket).attn_metadata
    pad = lambda t: torch.cat([t, torch.randn(bucket - n, *t.shape[1:])])  # noqa: E731
    out = _attention(pad(q), pad(k), pad(v), meta, padded_caches)
    torch.testing.assert_close(out[:n], expected, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(out[n:]) == 0, "padding rows produce zeros"
    for (a, b), (c, d) in zip(plain_caches, padded_caches):
        assert torch.equal(a, c) and torch.equal(b, d), "padding rows write nothing"


def test_decode_buffers_are_inference_tensors_like_every_runner_input():
    """Built outside inference mode (the runner's __init__), they must still be inference
    tensors: the compiled forward guards on it, and on Dynamo's frame an ordinary tensor
    would be a recompile, which raises during serving."""
    bufs = DecodeBuffers(max_seqs=4, max_blocks_per_seq=2, device=torch.device("cpu"))
    assert all(t.is_inference() for t in bufs.tensors())
    assert bufs.nbytes == sum(t.numel() * t.element_size() for t in bufs.tensors())


# ---------------------------------------------------------------------------- speculative verify batches

VERIFY = capture_sizes(CompileConfig(cudagraph_capture_sizes=[1, 2, 4, 8]), max_num_seqs=8,
                       max_num_batched_tokens=64, verify=VerifyShape(query_len=3, max_seqs=8, max_model_len=64))


def _verify_step(drafts: list[tuple[int, ...]]) -> RunnerStep:
    """Decodes of prompts 5, 9 and 2 tokens long, each followed by its guesses (the blocks the
    scheduler allocated hold them: 8, 12 and 4 slots)."""
    step = _decode_sched(_scheduler(), [5, 9, 2])
    return RunnerStep(tuple(replace(c, num_new_tokens=1 + len(d), draft_token_ids=d)
                            for c, d in zip(step.chunks, drafts)))


def test_verify_buckets_hold_k_plus_1_rows_a_sequence_within_the_budget():
    assert VERIFY.verify == (1, 2, 4, 8) and VERIFY.verify_query_len == 3 and VERIFY.verify_max_start == 61
    tight = capture_sizes(CompileConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16]), 16, 32,
                          verify=VerifyShape(query_len=5, max_seqs=2, max_model_len=64))
    assert tight.verify == (1, 2), "speculation stops above 2 sequences"
    assert capture_sizes(CompileConfig(cudagraph_capture_sizes=[1, 2, 4, 8]), 8, 20,
                         verify=VerifyShape(5, 8, 64)).verify == (1, 2, 4), "4 x 5 rows fit 20 tokens, 8 x 5 do not"


def test_a_decode_with_guesses_is_a_verify_batch():
    step = _verify_step([(11, 12), (13,), ()])
    shape = BatchShape.of_step(step)
    assert shape == BatchShape(6, 3, False, verify=True, max_start=9)
    d = choose(shape, VERIFY, BOTH)
    assert d == Decision(Path.FULL, 12, 6, query_len=3) and d.rows_per_chunk == 3, "4 sequences of 3 rows"
    assert choose(shape, DEFAULT, BOTH).path is Path.PIECEWISE, "no verify buckets without speculation"
    assert choose(shape, VERIFY, CudaGraphMode.PIECEWISE).path is Path.PIECEWISE
    near_the_end = capture_sizes(CompileConfig(cudagraph_capture_sizes=[1, 2, 4, 8]), 8, 64,
                                 verify=VerifyShape(3, 8, 11))
    assert choose(shape, near_the_end, BOTH).path is Path.PIECEWISE, "padded rows would pass the context's end"
    plain = BatchShape.of_step(_verify_step([(), (), ()]))
    assert plain.uniform_decode and choose(plain, VERIFY, BOTH) == Decision(Path.FULL, 4, 3)


def test_verify_padding_fills_each_sequence_to_k_plus_1_rows():
    step = _verify_step([(11, 12), (13,), ()])
    batch = BUILDER.build(step, Decision(Path.FULL, 12, 6, query_len=3))
    meta = batch.attn_metadata
    assert batch.input_ids.tolist() == [7, 11, 12, 7, 13, 0, 7, 0, 0, 0, 0, 0]
    assert batch.positions.tolist()[:9] == [5, 6, 7, 9, 10, 10, 2, 2, 2]
    assert meta.query_start_loc.tolist() == [0, 3, 6, 9, 12] and meta.max_query_len == 3
    assert meta.seq_lens.tolist() == [8, 12, 5, 0], "each sequence as if all k guesses were there"
    slots = meta.slot_mapping.tolist()
    assert [slots[i] for i in (5, 7, 8, 9, 10, 11)] == [-1] * 6, "padded rows write no KV"
    assert batch.sample_indices.tolist() == [0, 1, 2, 3, 4, 6], "only real rows are sampled"
    assert batch.num_scheduled == 9
    bufs = DecodeBuffers(max_seqs=8, max_blocks_per_seq=16, device=torch.device("cpu"), verify_query_len=3,
                         max_verify_seqs=4)
    view = bufs.fill(batch)
    assert view.attn_metadata.query_start_loc.tolist() == [0, 3, 6, 9, 12] and view.attn_metadata.max_query_len == 3
    assert bufs.fill(_build(_decode_sched(_scheduler(), [5, 9, 2]), Path.FULL, 4)).attn_metadata.max_query_len == 1


def test_padded_verify_attention_equals_unpadded_and_writes_the_same_cache():
    step = _verify_step([(11, 12), (13,), ()])
    plain = _build(step, Path.NONE, 6)
    n, real = plain.num_tokens, [0, 1, 2, 3, 4, 6]
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    plain_caches = _caches()
    padded_caches = [(kc.clone(), vc.clone()) for kc, vc in plain_caches]
    expected = _attention(q, k, v, plain.attn_metadata, plain_caches)
    bufs = DecodeBuffers(max_seqs=8, max_blocks_per_seq=16, device=torch.device("cpu"), verify_query_len=3,
                         max_verify_seqs=8)
    meta = bufs.fill(BUILDER.build(step, Decision(Path.FULL, 12, 6, query_len=3))).attn_metadata

    def pad(t):
        out = torch.randn(12, *t.shape[1:])
        out[real] = t
        return out

    out = _attention(pad(q), pad(k), pad(v), meta, padded_caches)
    torch.testing.assert_close(out[real], expected, rtol=1e-6, atol=1e-6)
    for (a, b), (c, d) in zip(plain_caches, padded_caches):
        assert torch.equal(a, c) and torch.equal(b, d), "padded rows write nothing"
