"""The data-parallel routing rule (pure) and the engine that applies it, with fake replicas:
least outstanding sequences, prefix affinity, the imbalance bound, abort routing, replica
death."""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import pytest

from vgraph.engine.client import EngineDeadError, OutputCollector, QueueFullError
from vgraph.engine.dp_engine import DataParallelEngine, data_parallel
from vgraph.engine.dp_router import PrefixAffinityRouter, Route, RouterConfig, least_loaded, prefix_keys
from vgraph.engine.outputs import CompletionOutput, RequestOutput
from vgraph.engine.stats import EngineStats, StepOutput
from vgraph.lora import LoRARequest
from vgraph.sampling_params import SamplingParams

BLOCK = 4


def router(replicas: int = 2, imbalance: int = 2, **kwargs: Any) -> PrefixAffinityRouter:
    return PrefixAffinityRouter(RouterConfig(replicas, block_size=BLOCK, max_imbalance=imbalance, **kwargs))


def test_prefix_keys_chain_full_blocks_only():
    assert prefix_keys(list(range(3)), BLOCK, 8) == [] and prefix_keys(None, BLOCK, 8) == []
    a = prefix_keys(list(range(10)), BLOCK, 8)
    assert len(a) == 2  # 10 tokens: two full blocks of 4
    b = prefix_keys(list(range(8)) + [99, 98, 97, 96], BLOCK, 8)
    assert b[:2] == a and len(b) == 3
    assert prefix_keys([9, 1, 2, 3, 4, 5, 6, 7], BLOCK, 8)[1] != a[1], "a key depends on every block before it"
    assert len(prefix_keys(list(range(100)), BLOCK, 3)) == 3


def test_least_loaded_breaks_ties_by_lowest_index():
    assert least_loaded([3, 1, 1]) == 1
    assert least_loaded([0, 0]) == 0
    assert least_loaded([0, 5, 5], exclude=0) == 1


def test_without_a_prefix_the_least_loaded_replica_is_chosen():
    r = router(replicas=3)
    assert [r.route([], loads).replica for loads in ([0, 0, 0], [1, 0, 0], [1, 1, 0], [2, 1, 1])] == [0, 1, 2, 1]


def test_a_known_prefix_goes_to_its_owner_within_the_imbalance_bound():
    r = router(imbalance=2)
    keys = r.keys(list(range(12)))
    assert r.route(keys, [0, 0]) == Route(0, affine=False)
    # The owner (0) keeps the prefix while it is at most 2 sequences busier than the idlest.
    assert r.route(keys, [2, 0]).replica == 0 and r.route(keys, [2, 0]).affine
    spilled = r.route(keys, [3, 0])
    assert spilled.replica == 1 and not spilled.affine
    assert r.route(keys, [1, 0]).replica == 0, "a spill does not move the prefix's owner"


def test_the_deepest_shared_block_decides():
    r = router(imbalance=100)
    shared = list(range(8))
    r.route(r.keys(shared + [50, 51, 52, 53]), [0, 0])  # served by 0: owns blocks 1-3
    r.route(r.keys([7] * 4), [1, 0])  # another prefix, served by 1
    # Same first two blocks as the first prompt: replica 0 though 1 is less loaded.
    assert r.route(r.keys(shared + [60, 61, 62, 63]), [5, 0]).replica == 0
    # A prompt sharing nothing goes by load.
    assert r.route(r.keys([8, 8, 8, 8]), [5, 0]).replica == 1


def test_the_owner_table_is_bounded():
    r = router(imbalance=100, max_prefixes=4)
    for i in range(10):
        r.route(r.keys([i] * BLOCK), [0, 0])
    assert len(r._owners) == 4
    assert r.affine_replica(r.keys([0] * BLOCK)) is None, "the oldest prefixes are forgotten"


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        RouterConfig(0)
    with pytest.raises(ValueError, match="max_imbalance"):
        RouterConfig(2, max_imbalance=-1)
    with pytest.raises(ValueError, match="expected 2 loads"):
        router().route([], [0, 0, 0])


class FakeReplica:
    """The EngineClient interface, answering from a script: requests finish when told."""

    def __init__(self, queue_full: bool = False) -> None:
        self.on_step: Any = None
        self.on_fatal: Any = None
        self.error: Optional[BaseException] = None
        self.startup_error: Optional[BaseException] = None
        self.stats = EngineStats()
        self.ready = False
        self.queue_full = queue_full
        self.added: list[str] = []
        self.adapters: list[Any] = []  # the LoRA adapter of each submission, and each one loaded
        self.unloaded: list[int] = []
        self.aborted: list[str] = []
        self.collectors: dict[str, OutputCollector] = {}
        self.tokenizer = self.worker_tokenizer = self.grammar_compiler = None
        self.max_model_len, self.vocab_size, self.model_path, self.max_logprobs = 64, 100, "fake", 5
        self.eos_token_ids = frozenset({0})

    def start(self) -> None:
        self.ready = True

    async def wait_ready(self) -> None:
        pass

    async def shutdown(self, timeout: float = 30.0) -> None:
        pass

    async def add_requests(self, items: Any, lora_request: Any = None) -> OutputCollector:
        if self.queue_full:
            raise QueueFullError("full")
        collector = OutputCollector([rid for rid, _, _ in items])
        self.adapters.append(lora_request)
        for rid, _, _ in items:
            self.added.append(rid)
            self.collectors[rid] = collector
        return collector

    def abort(self, request_ids: Any) -> None:
        self.aborted.extend(request_ids)

    async def load_lora(self, lora_request: Any) -> None:
        self.adapters.append(("loaded", lora_request))

    def unload_lora(self, lora_int_id: int) -> None:
        self.unloaded.append(lora_int_id)

    def finish(self, rid: str) -> None:
        output = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1],
                               outputs=[CompletionOutput(0, "", [1], None, None, finish_reason="stop")],
                               finished=True)
        self.collectors[rid]._put(output)
        self.on_step(StepOutput([output], [], self.stats))

    def die(self, error: BaseException) -> None:
        self.error = error
        self.on_fatal(error)


def _ids(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def test_adapters_load_on_every_replica_and_travel_with_their_requests():
    async def run() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        engine = data_parallel(replicas, block_size=BLOCK)
        engine.start()
        lora = LoRARequest("sql", 1, "/adapters/sql")
        await engine.load_lora(lora)
        assert all(r.adapters == [("loaded", lora)] for r in replicas), "any replica may be routed its requests"
        await engine.add_requests([("a", _ids(2), SamplingParams(max_tokens=2))], lora)
        assert [r.adapters[-1] for r in replicas if r.added] == [lora]
        engine.unload_lora(1)
        assert all(r.unloaded == [1] for r in replicas)

    asyncio.run(run())


def test_the_engine_spreads_routes_aborts_and_releases():
    async def run() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        engine = data_parallel(replicas, block_size=BLOCK)
        steps: list[StepOutput] = []
        engine.on_step = steps.append
        engine.start()
        await engine.wait_ready()
        assert engine.max_model_len == 64 and engine.ready
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        await engine.add_requests([("a", _ids(2), greedy)])  # shorter than a block: by load
        await engine.add_requests([("b", _ids(2, 10), SamplingParams(max_tokens=4, n=3))])
        assert replicas[0].added == ["a"] and replicas[1].added == ["b"] and engine.loads == [1, 3]
        # A batch goes whole to one replica, all of its n sequences with it.
        await engine.add_requests([("c", _ids(8, 50), greedy), ("d", _ids(2), greedy)])
        assert replicas[0].added == ["a", "c", "d"] and engine.loads == [3, 3]
        engine.abort(["b", "c", "unknown"])
        assert replicas[1].aborted == ["b"] and replicas[0].aborted == ["c"] and engine.loads == [2, 0]
        replicas[0].finish("a")
        replicas[0].finish("d")
        assert engine.loads == [0, 0] and steps[-1].outputs[0].request_id == "d"
        # "c"'s prefix is owned by replica 0: a repeat goes there, and the next one too while
        # replica 0 is within the imbalance bound (8 sequences) of replica 1.
        await engine.add_requests([("e", _ids(8, 50) + [7], greedy)])
        await engine.add_requests([("f", _ids(8, 50) + [8], greedy)])
        assert replicas[0].added[-2:] == ["e", "f"] and engine.loads == [2, 0]
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_requests([("e", _ids(2), greedy)])

    asyncio.run(run())


def test_a_full_affine_replica_spills_to_another():
    async def run() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        engine = data_parallel(replicas, block_size=BLOCK)
        engine.start()
        await engine.wait_ready()
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        await engine.add_requests([("a", _ids(8), greedy)])
        replicas[0].queue_full = True
        await engine.add_requests([("b", _ids(8), greedy)])
        assert replicas[1].added == ["b"] and engine.loads == [1, 1]
        replicas[1].queue_full = True
        with pytest.raises(QueueFullError):
            await engine.add_requests([("c", _ids(2, 30), greedy)])
        assert engine.loads == [1, 1], "a refused submission is not counted"

    asyncio.run(run())


def test_one_replica_dying_fails_the_engine_once():
    async def run() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        engine = data_parallel(replicas, block_size=BLOCK)
        fatal: list[BaseException] = []
        engine.on_fatal = fatal.append
        engine.start()
        await engine.wait_ready()
        replicas[1].die(RuntimeError("boom"))
        replicas[0].die(RuntimeError("later"))
        assert [str(e) for e in fatal] == ["boom"] and not engine.ready
        assert engine.startup_error is None
        with pytest.raises(EngineDeadError, match="boom"):
            await engine.add_requests([("a", _ids(2), SamplingParams(max_tokens=1))])

    asyncio.run(run())


def test_replica_count_must_match_the_router():
    with pytest.raises(ValueError, match="configured for 3 replicas"):
        DataParallelEngine([FakeReplica()], PrefixAffinityRouter(RouterConfig(3)))
