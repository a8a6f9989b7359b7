"""Admission cannot leak: whatever fails between booking a submission and the engine accepting
it (the engine refusing it, the codec unable to carry it, the send failing, the engine dying,
the caller cancelled), the booking is released, only that submission fails, and the queue
length the server admits by returns to 0. ``EngineClient`` over both transports: the engine on
a thread and in its own process.

Once a server counted sixteen unsendable requests (``top_k`` >= 2**64, n=64) as waiting forever
and answered every later request with 503 "overloaded" while its engine was idle; these tests
re-run that sequence at the front, below the HTTP checks that now refuse such values.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from vgraph import LLM, SamplingParams
from vgraph.engine.client import STALLED_ADMISSION_S, EngineClient, EngineDeadError, QueueFullError
from vgraph.engine.core_process import CoreProcessConfig
from vgraph.engine.transports import ProcessTransport, ThreadTransport
from vgraph.models.demo import DEMO_MODEL_NAME

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
UNSENDABLE = SamplingParams(n=64, top_k=2**64, max_tokens=4)  # past what msgpack carries
ENGINE_KWARGS = {"enforce_eager": True, "device": "cpu", "cpu_kv_cache_gib": 0.02, "max_num_seqs": 8}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


async def _serves(front) -> None:
    """A normal request is admitted and finishes, and nothing stays booked."""
    collector = await front.add_requests([("normal", "The quick brown fox", GREEDY)])
    while not collector.finished:
        await collector.next()
    assert front.queue_length == 0 and front.admission_stall() is None


# ---------------------------------------------------------------------------- engine on a thread


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO_MODEL_NAME, **ENGINE_KWARGS)


def test_thread_front_releases_every_failed_booking(llm, monkeypatch):
    async def main() -> None:
        front = EngineClient(ThreadTransport(lambda: llm.engine), max_queue_len=1024)
        front.start()
        await front.wait_ready()
        try:
            # The engine refuses (a token id outside the vocabulary): 16 x 64 sequences.
            for i in range(16):
                with pytest.raises(ValueError, match="outside the vocabulary"):
                    await front.add_requests([(f"bad{i}", [10**9], SamplingParams(n=64, max_tokens=2))])
            assert front.queue_length == 0
            # Handing the submission to the engine thread fails.
            with monkeypatch.context() as patch:
                patch.setattr(front.transport, "send", _raise(RuntimeError("queue broken")))
                with pytest.raises(RuntimeError, match="queue broken"):
                    await front.add_requests([("lost", "hi", SamplingParams(n=64, max_tokens=2))])
            assert front.queue_length == 0
            # The caller is cancelled while the engine thread is busy adding.
            release = threading.Event()
            real_add = llm.engine.add_request
            with monkeypatch.context() as patch:
                patch.setattr(llm.engine, "add_request", lambda *a, **k: (release.wait(30), real_add(*a, **k))[1])
                task = asyncio.ensure_future(front.add_requests([("gone", "hi", SamplingParams(n=8, max_tokens=2))]))
                await asyncio.sleep(0.2)
                assert front.queue_length == 8
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert front.queue_length == 0
                release.set()
                await asyncio.sleep(0.2)
            await _serves(front)
        finally:
            await front.shutdown()

    _run(main())


def test_thread_front_engine_death_releases_waiting_bookings(llm, monkeypatch):
    async def main() -> None:
        front = EngineClient(ThreadTransport(lambda: llm.engine))
        front.start()
        await front.wait_ready()
        release = threading.Event()
        real_add = llm.engine.add_request
        monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: (release.wait(30), real_add(*a, **k))[1])
        task = asyncio.ensure_future(front.add_requests([("w", "hi", SamplingParams(n=4, max_tokens=2))]))
        await asyncio.sleep(0.2)
        assert front.queue_length == 4
        # What the engine thread posts when it fails:
        front._on_fatal(RuntimeError("boom"), EngineDeadError("the engine died"))
        with pytest.raises(EngineDeadError, match="the engine died"):
            await task
        assert front.queue_length == 0
        release.set()
        await front.shutdown()

    _run(main())
    monkeypatch.undo()
    llm.engine.abort_request(["w"])


# ---------------------------------------------------------------------------- engine in a process


def _core_front(max_queue_len=None) -> EngineClient:
    config = CoreProcessConfig(model=DEMO_MODEL_NAME, engine_kwargs=dict(ENGINE_KWARGS), log_level="WARNING",
                               num_threads=1)
    return EngineClient(ProcessTransport(config), max_queue_len=max_queue_len)


def test_process_front_releases_every_failed_booking(monkeypatch):
    """The wedge, re-run below HTTP: sixteen unsendable submissions of 64 sequences each are
    400-class errors for themselves alone, and the server still admits at a queue limit of 1024."""
    async def main() -> None:
        front = _core_front(max_queue_len=1024)
        front.start()
        await front.wait_ready()
        try:
            for i in range(16):
                with pytest.raises(ValueError, match="cannot be sent to the engine process"):
                    await front.add_requests([(f"u{i}", "hello", UNSENDABLE)])
                assert front.queue_length == 0
            import zmq
            with monkeypatch.context() as patch:
                patch.setattr(front.transport, "send", _raise(zmq.ZMQError(msg="socket broken")))
                with pytest.raises(zmq.ZMQError):
                    await front.add_requests([("s", "hello", SamplingParams(n=64, max_tokens=2))])
            assert front.queue_length == 0 and not front._unanswered and not front._collectors
            with pytest.raises(ValueError, match="stop_token_ids"):  # refused before the socket
                await front.add_requests([("v", "hello", SamplingParams(stop_token_ids=[10**6]))])
            assert front.queue_length == 0
            await _serves(front)
        finally:
            await front.shutdown()

    _run(main())


def test_process_front_stall_is_seen_and_death_releases_bookings():
    """A core that stops answering is what ``/health`` reports after a minute; once it dies,
    the waiting submission fails and its booking is released."""
    async def main() -> None:
        front = _core_front(max_queue_len=64)
        front.start()
        await front.wait_ready()
        try:
            os.kill(front.transport.process.pid, signal.SIGSTOP)
            task = asyncio.ensure_future(front.add_requests([("x", "hello", SamplingParams(n=32, max_tokens=2))]))
            await asyncio.sleep(0.3)
            assert front.queue_length == 32
            with pytest.raises(QueueFullError):
                await front.add_requests([("y", "hello", SamplingParams(n=40, max_tokens=2))])
            assert front.admission_stall() is None
            now = asyncio.get_running_loop().time() + STALLED_ADMISSION_S + 1  # monotonic, like the booking
            assert "waited" in front.admission_stall(now=now)
            os.kill(front.transport.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                await task
            assert front.queue_length == 0
        finally:
            await front.shutdown()

    _run(main())


def _raise(error: BaseException):
    def fail(*args, **kwargs):
        raise error
    return fail
