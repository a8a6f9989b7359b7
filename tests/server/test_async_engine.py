"""``EngineClient`` over the thread transport (the engine on a thread of this process): same tokens
as the offline API, atomic submission, aborts, failures."""
from __future__ import annotations

import asyncio
import threading

import pytest

from vgraph import LLM, SamplingParams
from vgraph.engine.client import EngineClient, EngineDeadError, RequestTooLargeError
from vgraph.engine.transports import ThreadTransport
from vgraph.engine.stats import StepOutput
from vgraph.models.demo import DEMO_MODEL_NAME

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO_MODEL_NAME, enforce_eager=True, device="cpu", cpu_kv_cache_gib=0.02,
               max_num_seqs=8)


def _thread_client(factory, **kwargs) -> EngineClient:
    return EngineClient(ThreadTransport(factory), **kwargs)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def _all_free(llm: LLM) -> bool:
    return llm.engine.scheduler.kv_manager.pool.usage == 0 and not llm.engine.has_unfinished_requests()


def test_outputs_equal_the_offline_api(llm, monkeypatch):
    prompts = ["The quick brown fox", "Once upon a time", "Rain fell on the roof"]
    offline = [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    reports: list[StepOutput] = []
    stepping_threads: set[str] = set()
    step = llm.engine.step

    def recording_step() -> StepOutput:
        stepping_threads.add(threading.current_thread().name)
        return step()

    monkeypatch.setattr(llm.engine, "step", recording_step)

    async def main() -> list[str]:
        engine = _thread_client(lambda: llm.engine, on_step=reports.append)
        engine.start()
        await engine.wait_ready()

        async def one(i: int) -> str:
            last = None
            async for out in engine.generate(f"r{i}", prompts[i], GREEDY):
                last = out
            return last.outputs[0].text

        try:
            return await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            await engine.shutdown()

    assert _run(main()) == offline
    assert stepping_threads == {"vgraph-engine"}, "only the engine thread touches the engine"
    progress = [p for r in reports for p in r.timings]
    assert sum(p.num_new_tokens for p in progress) == 3 * 12
    assert sum(p.time_to_first_token is not None for p in progress) == 3
    assert sorted(reason for p in progress for reason in p.finish_reasons) == ["length"] * 3
    assert reports[-1].stats.num_running == 0 and _all_free(llm)


def test_a_bad_prompt_rejects_the_whole_batch_and_aborts_free_everything(llm):
    async def main() -> None:
        engine = _thread_client(lambda: llm.engine)
        engine.start()
        await engine.wait_ready()
        try:
            with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
                await engine.add_requests([("a", "fine", GREEDY), ("b", "", GREEDY)])
            collector = await engine.add_requests([("c", "long one", SamplingParams(max_tokens=200,
                                                                                    ignore_eos=True))])
            await collector.next()
            engine.abort(["c"])
            for _ in range(100):
                if engine.stats.kv_usage == 0 and engine.stats.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats.kv_usage == 0
        finally:
            await engine.shutdown()

    _run(main())
    assert _all_free(llm)


def test_the_queue_limit(llm):
    async def main() -> None:
        engine = _thread_client(lambda: llm.engine, max_queue_len=2)
        engine.start()
        await engine.wait_ready()
        try:
            with pytest.raises(RequestTooLargeError, match="could never be admitted"):  # 3 sequences > 2
                await engine.add_requests([(f"q{i}", "hi", GREEDY) for i in range(3)])
            with pytest.raises(RequestTooLargeError):  # sequences, not requests: n counts
                await engine.add_requests([("q", "hi", SamplingParams(n=3, max_tokens=2))])
            collector = await engine.add_requests([("q", "hi", GREEDY)])
            while not collector.finished:
                await collector.next()
        finally:
            await engine.shutdown()

    _run(main())


def test_a_failing_step_wakes_every_waiter_and_reports_once(llm, monkeypatch):
    fatal: list[BaseException] = []

    def broken_step() -> StepOutput:
        raise RuntimeError("boom")

    async def main() -> None:
        engine = _thread_client(lambda: llm.engine, on_fatal=fatal.append)
        engine.start()
        await engine.wait_ready()
        monkeypatch.setattr(llm.engine, "step", broken_step)
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in engine.generate("x", "hi", GREEDY):
                pass
        assert engine.error is not None and not engine.ready
        with pytest.raises(EngineDeadError):
            await engine.add_requests([("y", "hi", GREEDY)])
        await engine.shutdown()

    _run(main())
    assert len(fatal) == 1 and str(fatal[0]) == "boom"
    monkeypatch.undo()
    llm.engine.abort_request(["x"])


def test_a_failing_factory_is_the_startup_error():
    async def main() -> None:
        def factory():
            raise FileNotFoundError("no such model")

        engine = _thread_client(factory)
        engine.start()
        with pytest.raises(FileNotFoundError):
            await engine.wait_ready()
        assert isinstance(engine.startup_error, FileNotFoundError) and not engine.ready
        await engine.shutdown()

    _run(main())
