"""The engine-core process: the split of work across the boundary, and the processes' lifecycle.

The rest of tests/server runs against servers with the engine out of process (the default);
this module checks what only the split has: detokenization and stop strings on the server
side giving exactly the in-process outputs, the messages' encodings, aborts crossing the
boundary, the engine process dying (clients get a clean 503, the server exits non-zero) and
the server process dying (the engine process follows it). Each server's processes must be
gone by PID when it is closed (``ServerProcess.check_no_orphans``).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph import LLM, PoolingParams, SamplingParams
from vgraph.config import EngineConfig
from vgraph.engine.core_codec import (EngineFacts, OutputDelta, SequenceDelta, decode_delta, decode_error,
                                      decode_params, encode_delta, encode_error, encode_params, pack, unpack)
from vgraph.engine.core_process import encode_step
from vgraph.engine.inputs import InputError
from vgraph.engine.llm_engine import LLMEngine
from vgraph.engine.output_processor import OutputProcessor
from vgraph.engine.stats import EngineStats
from vgraph.models.demo import DEMO_MODEL_NAME, build_tiny_checkpoint
from vgraph.models.loader import ModelLoadError
from vgraph.structured.params import StructuredOutputsParams

LONG_CONTEXT = 8192


# ---------------------------------------------------------------------------- in one process


def test_params_and_outputs_survive_the_encoding():
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    params = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop=["\n", "END"], stop_token_ids=[7],
                            logprobs=2, prompt_logprobs=1, max_tokens=None, structured_outputs=spec)
    assert decode_params(unpack(pack(encode_params(params)))) == params
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert decode_params(unpack(pack(encode_params(choice)))) == choice
    pooling = PoolingParams(pooling_type="mean", normalize=False)
    assert decode_params(unpack(pack(encode_params(pooling)))) == pooling
    delta = OutputDelta("r", [SequenceDelta(1, [5, 9], [{9: -0.25, 3: -1.5}, {1: -2.0}], "stop", 9)], 4,
                        [None, {4: -0.125, 2: -3.0}])
    back = decode_delta(unpack(pack(encode_delta(delta))))
    assert back == delta and list(back.sequences[0].new_logprobs[0]) == [9, 3], "int keys, in order"
    embedding = OutputDelta("e", embedding=[0.1, -2.5e-8])
    assert decode_delta(unpack(pack(encode_delta(embedding)))) == embedding
    facts = EngineFacts("m", "t", 512, 1000, 5, [2], EngineStats(num_running=3, kv_usage=0.5))
    assert EngineFacts.decode(unpack(pack([facts.encode()]))[0]) == facts


def test_errors_keep_the_types_the_server_maps():
    assert type(decode_error(encode_error(ValueError("bad")))) is ValueError
    assert str(decode_error(encode_error(ValueError("bad")))) == "bad"
    assert isinstance(decode_error(encode_error(ModelLoadError("gone"))), ModelLoadError)
    refused = decode_error(encode_error(InputError("prompt (3 tokens) + max_tokens (9) exceeds", "max_tokens")))
    assert isinstance(refused, ValueError) and refused.param == "max_tokens", "bad input keeps its field"

    class Odd(Exception):
        pass

    assert str(decode_error(encode_error(Odd("x")))) == "Odd: x"


def _run_split(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list:
    """Runs requests the way the two processes do, in this one: the engine without text, the
    deltas through the encoding, the server's OutputProcessor, its stops back to the engine."""
    frontend = OutputProcessor(engine.tokenizer)
    finals = {}
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode(prompt)
        engine.add_request(str(i), ids, decode_params(unpack(pack(encode_params(params)))))
        frontend.add(str(i), prompt, ids, params)
    while engine.has_unfinished_requests():
        _, deltas, _, _ = unpack(pack(encode_step(engine.step())))
        outputs, finishes = frontend.process([decode_delta(d) for d in deltas])
        engine.finish_sequences(finishes)
        finals.update((o.request_id, o) for o in outputs if o.finished)
    assert engine.scheduler.block_pool.usage == 0, "stopped sequences freed their blocks"
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_server_side_detokenization_and_stop_strings_equal_the_engine_s(overlap):
    """Stop strings found after the engine ran ahead still give the in-process outputs: text,
    token ids, logprobs, finish and stop reasons, for every sequence of an n > 1 request; the
    split engine's loop serial or overlapped (the in-process one serial)."""
    kwargs = dict(enforce_eager=True, device="cpu", cpu_kv_cache_gib=0.02, max_num_seqs=8)
    in_process = LLM(DEMO_MODEL_NAME, **kwargs)
    split = LLMEngine(EngineConfig.from_kwargs(DEMO_MODEL_NAME, async_scheduling=overlap, **kwargs))
    prompts = ["def add(a, b):", "import os\n", "class Point:"]
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, stop=[")", "\n\n", "self"], logprobs=1)
    expected = in_process.generate(prompts, params, use_tqdm=False)
    got = _run_split(split, prompts, params)
    reasons = [c.finish_reason for o in expected for c in o.outputs]
    assert "stop" in reasons, "the test exercises stop strings"
    for want, have in zip(expected, got):
        assert have.prompt == want.prompt and have.prompt_token_ids == want.prompt_token_ids
        for w, h in zip(want.outputs, have.outputs):
            assert (h.text, h.token_ids, h.finish_reason, h.stop_reason) == (
                w.text, w.token_ids, w.finish_reason, w.stop_reason)
            assert h.logprobs == w.logprobs and h.cumulative_logprob == pytest.approx(w.cumulative_logprob)


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """8,192 positions: a stream outlives the test's actions however fast the machine is."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("long-model"), max_position_embeddings=LONG_CONTEXT)


def _stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except httpx.TransportError:  # the server was killed mid-stream (one test does that)
        events.append("cut")
    finally:
        started.set()


def _start_stream(url: str, body: dict) -> tuple[threading.Thread, list]:
    events: list = []
    started = threading.Event()
    thread = threading.Thread(target=_stream, args=(url, body, events, started))
    thread.start()
    assert started.wait(60)
    return thread, events


@pytest.fixture(scope="module")
def split_server(long_model):
    proc = ServerProcess(*EAGER_ARGS, "--model", long_model)
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def test_an_overlapped_engine_process_serves_the_in_process_tokens(long_model):
    """``--async-scheduling`` in a real engine-core process: completions (n > 1, seeded, logprobs,
    a stop string) equal the serial in-process engine's."""
    body = {"model": long_model, "prompt": "def add(a, b):", "max_tokens": 24, "n": 2, "temperature": 0.8,
            "seed": 7, "logprobs": 1, "stop": ["\n\n"]}
    expected = LLM(long_model, enforce_eager=True, device="cpu").generate(
        body["prompt"], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, logprobs=1, stop=["\n\n"]),
        use_tqdm=False)[0]
    proc = ServerProcess(*EAGER_ARGS, "--async-scheduling", "--model", long_model)
    try:
        choices = httpx.post(proc.wait_ready().url + "/v1/completions", json=body, timeout=120).json()["choices"]
        assert "overlapped scheduling" in proc.log()
    finally:
        proc.close()
    assert [(c["text"], c["finish_reason"]) for c in sorted(choices, key=lambda c: c["index"])] == [
        (o.text, o.finish_reason) for o in expected.outputs]


def test_a_client_disconnect_aborts_in_the_engine_process_and_frees_its_blocks(split_server):
    before = split_server.metrics()["vgraph:request_success_total{finished_reason=abort}"]
    body = {"prompt": "A long story", "max_tokens": LONG_CONTEXT - 64, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", split_server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        running = split_server.metrics()
        assert running["vgraph:num_requests_running{engine=0}"] == 1 and running["vgraph:kv_cache_usage_perc{engine=0}"] > 0
    metrics = split_server.wait_idle()
    assert metrics["vgraph:request_success_total{finished_reason=abort}"] == before + 1
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0


def test_the_engine_process_exits_when_the_server_process_is_killed(split_server):
    engine = split_server.engine_pid()
    assert engine in split_server.children
    thread, events = _start_stream(split_server.url, {"prompt": "x", "max_tokens": LONG_CONTEXT - 64,
                                                      "ignore_eos": True})
    split_server.proc.send_signal(signal.SIGKILL)
    split_server.proc.wait(30)
    thread.join(30)
    assert events[-1] == "cut"
    split_server.check_no_orphans()  # the engine process (and the resource tracker) followed


def test_killing_the_engine_process_mid_stream_gives_clean_errors_and_a_nonzero_exit(long_model):
    proc = ServerProcess(*EAGER_ARGS, "--model", long_model)
    try:
        proc.wait_ready()
        body = {"prompt": "A long story", "max_tokens": LONG_CONTEXT - 64, "ignore_eos": True}
        thread, events = _start_stream(proc.url, body)
        plain: dict = {}
        waiter = threading.Thread(target=lambda: plain.update(response=proc.post("/v1/completions", body)))
        waiter.start()
        deadline = time.monotonic() + 30
        while proc.metrics()["vgraph:num_requests_running{engine=0}"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.engine_pid(), signal.SIGKILL)
        thread.join(30)
        waiter.join(30)
        health = httpx.get(proc.url + "/health", timeout=5)
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "engine_dead" and "SIGKILL" in error["message"]
        assert all("choices" in e for e in events[:-2]) and len(events) > 3
        response = plain["response"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(30) == 1, proc.log()
        proc.check_no_orphans()
    finally:
        proc.close()


def test_an_engine_that_fails_to_start_is_reported_by_the_server_in_one_line(tmp_path):
    """The core process builds the engine; its failure (a damaged checkpoint) reaches the CLI
    with its type and message: one line and exit 2, as with the engine in process."""
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    proc = ServerProcess("--model", str(tmp_path), "--enforce-eager", "--device", "cpu")
    try:
        assert proc.proc.wait(120) == 2
        log = proc.log()
        assert "vgraph serve: error: cannot read" in log and "config.json" in log and "damaged" in log
        assert "Traceback" not in log and "engine-core process stopped (code 1)" in log
    finally:
        proc.close()
