"""The executors: which one runs the ranks, and the Ray executor on a local two-node Ray cluster.

Without Ray: the choice (uni / mp / ray) as the configuration resolves it, the error when Ray is
missing, and the in-flight bookkeeping every executor shares (steps submitted ahead, control
commands between them), on ranks that are threads echoing their commands.

On Ray (``ray.cluster_utils.Cluster``: a head and a second node of one CPU each, so the two
ranks land on two nodes): TP=2 over Ray, compiled, gives greedy tokens equal to one rank and to
transformers (fp32) with prefix caching and preemption, and never recompiles; the actors get
the engine's VGRAPH_* variables and its priority; the startup log names each rank's node; ``vgraph serve`` over Ray runs its engine in the engine-core process
(eager) and answers the same tokens; a killed actor is named and fails the engine, and neither
actors nor the placement group are left behind. One cluster serves the module, and one engine
runs at a time (the cluster has a CPU per rank): tests run in file order, the in-process engine
ends in the killed-actor test before the server starts.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Optional

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.distributed.processes import pid_alive
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.config import EngineConfig, ParallelConfig
from vgraph.core.step_plan import StepPlan
from vgraph.distributed.executor import RankExecutor, WorkerFailed
from vgraph.distributed import executors
from vgraph.distributed.executors import choose_executor_backend
from vgraph.distributed.worker import SHUTDOWN

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 5, 16, 17, 40, 100]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks=128, max_model_len=256)
ENV_MARK = "VGRAPH_TEST_RAY_ENV_MARK"


# ---------------------------------------------------------------------- the choice, without Ray

@pytest.mark.parametrize("given,tp,device,env,devices,has_ray,chosen", [
    (None, 1, "cpu", {}, 0, True, "uni"),
    (None, 1, "cpu", {"RAY_ADDRESS": "10.0.0.1:6379"}, 0, True, "uni"),  # one rank never needs a cluster
    (None, 2, "cpu", {}, 0, True, "mp"),
    (None, 2, "cpu", {"RAY_ADDRESS": "10.0.0.1:6379"}, 0, True, "ray"),
    (None, 2, "cpu", {"RAY_ADDRESS": "10.0.0.1:6379"}, 0, False, "ray"),  # asked for: the error names the extra
    (None, 2, "cuda", {}, 2, True, "mp"),
    (None, 4, "cuda", {}, 2, True, "ray"),  # more ranks than this machine's GPUs: the world spans nodes
    (None, 4, "cuda", {}, 2, False, "mp"),  # ... without Ray, the config refuses the size as before
    ("mp", 2, "cpu", {"RAY_ADDRESS": "10.0.0.1:6379"}, 0, True, "mp"),
    ("ray", 1, "cpu", {}, 0, True, "ray"),
    ("mp", 1, "cpu", {}, 0, True, "mp"),
])
def test_the_executor_is_chosen_once(monkeypatch, given, tp, device, env, devices, has_ray, chosen):
    monkeypatch.setattr(executors, "ray_installed", lambda: has_ray)
    parallel = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=given)
    assert choose_executor_backend(parallel, device, env, local_devices=devices) == chosen


def test_executor_options_are_checked_and_resolved(monkeypatch):
    with pytest.raises(ValueError, match="'uni' runs one rank in the engine's process, but the world has 2"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="unsupported distributed_executor_backend 'slurm'"):
        ParallelConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="unsupported placement_group_strategy 'FILL'"):
        ParallelConfig(placement_group_strategy="FILL")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = EngineConfig.from_kwargs("m", device="cpu", tensor_parallel_size=2, placement_group_strategy="SPREAD")
    resolved = config.resolved(model_path="m", max_position_embeddings=64, quantized=False)
    assert resolved.is_resolved and resolved.parallel.distributed_executor_backend == "mp"
    assert config.parallel.distributed_executor_backend is None, "the caller's config is left as given"
    assert resolved.parallel.placement_group_strategy == "SPREAD"
    # Ray's ranks use the cluster's GPUs: this machine's count does not bound them.
    cluster = EngineConfig.from_kwargs("m", device="cuda", tensor_parallel_size=8, distributed_executor_backend="ray")
    resolved = cluster.resolved(model_path="m", max_position_embeddings=64, quantized=False)
    assert (resolved.parallel.distributed_executor_backend, resolved.parallel.distributed_backend) == ("ray", "nccl")


def test_a_missing_ray_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` now fails as if not installed
    with pytest.raises(ValueError, match=re.escape("pip install 'vgraph[ray]'")):
        LLM(tiny_checkpoint(arch="llama"), tensor_parallel_size=2, distributed_executor_backend="ray",
            enforce_eager=True, **ENGINE)


def test_the_cli_reports_a_missing_ray_in_one_line(monkeypatch, capsys):
    from vgraph.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(["generate", "--model", tiny_checkpoint(arch="llama"), "--prompt", "hi", "--device", "cpu",
                 "-tp", "2", "--distributed-executor-backend", "ray", "--enforce-eager"])
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "pip install 'vgraph[ray]'" in err and "Traceback" not in err


# ---------------------------------------------------------------------- steps in flight, without Ray

class _EchoRanks(RankExecutor):
    """Two ranks that are threads answering every command with itself: the bookkeeping of
    ``submit`` / ``collect`` and of control commands between them, without a model."""

    def __init__(self) -> None:
        config = EngineConfig.from_kwargs("m", device="cpu", tensor_parallel_size=2,
                                          distributed_executor_backend="mp")
        super().__init__(config.resolved(model_path="m", max_position_embeddings=64, quantized=False))
        pairs = [Pipe() for _ in range(self.world_size)]
        self._conns = [engine_end for engine_end, _ in pairs]
        self._threads = [threading.Thread(target=_echo, args=(rank, rank_end), daemon=True)
                         for rank, (_, rank_end) in enumerate(pairs)]
        for t in self._threads:
            t.start()

    def _wait(self, pending: list[Connection]) -> list[Connection]:
        return [c for c in wait(pending) if c in pending]

    def _died(self, rank: int) -> WorkerFailed:
        return WorkerFailed(rank, f"echo rank {rank} died")

    def _find_dead(self) -> Optional[WorkerFailed]:
        return None

    def _label(self, rank: int) -> str:
        return f"echo rank {rank}"

    def _wait_stopped(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _stop_ranks(self) -> None:
        for c in self._conns:
            c.close()


def _echo(rank: int, conn: Connection) -> None:
    while True:
        command, payload = conn.recv()
        conn.send(("ok", (rank, command, payload)))
        if command == SHUTDOWN:
            return


def test_steps_in_flight_come_back_in_order_around_control_commands():
    ranks = _EchoRanks()
    first, empty, second = StepPlan(chunks=["a"]), StepPlan(), StepPlan(chunks=["b"])
    ranks.submit(first)
    ranks.submit(empty)  # nothing to run: never sent, still collected in its turn
    ranks.submit(second, "masks")
    assert ranks.steps_in_flight == 3
    # A control command waits behind the steps sent before it, and leaves their results queued.
    assert ranks.collect_compile_counters() == [(0, "counters", None), (1, "counters", None)]
    assert ranks.collect() == (0, "step", (first, None))
    assert ranks.collect().sampled == {}
    assert ranks.collect() == (0, "step", (second, "masks"))
    with pytest.raises(RuntimeError, match="without a submitted step"):
        ranks.collect()
    assert ranks.execute(first) == (0, "step", (first, None))
    ranks.close()
    assert ranks.closed and not any(t.is_alive() for t in ranks._threads)


def test_rank_connections_send_at_once():
    """The engine <-> actor connections are TCP: Nagle's algorithm would hold a large plan's body
    (sent after its header) for the header's delayed ACK, ~40 ms a prefill step."""
    import socket
    from multiprocessing.connection import Client, Listener

    from vgraph.distributed.ray_executor import no_delay

    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        accepted: list[Connection] = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()))
        thread.start()
        conn = no_delay(Client(listener.address, authkey=b"k"))
        thread.join()
        for c in (conn, no_delay(accepted[0])):
            with socket.socket(fileno=os.dup(c.fileno())) as sock:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            c.close()


# ---------------------------------------------------------------------- a two-node Ray cluster

@pytest.fixture(scope="module")
def cluster():
    """A head and one more node, one CPU each; RAY_ADDRESS names it (for the engines and the
    server's engine process), and this process stays connected to inspect it."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = nodes.address
    ray.init(address=nodes.address, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()
        nodes.shutdown()
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before


def _free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


@pytest.fixture(scope="module")
def ray_llm(cluster):
    """TP=2 over Ray, compiled; its chosen executor is Ray because RAY_ADDRESS is set. The
    killed-actor test ends it (close is then a no-op)."""
    os.environ[ENV_MARK] = "carried"  # the actors get the engine's VGRAPH_* variables
    try:
        llm = LLM(tiny_checkpoint(arch="llama"), tensor_parallel_size=2, **ENGINE)
    finally:
        del os.environ[ENV_MARK]
    yield llm
    llm.close()


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank():
    with LLM(tiny_checkpoint(arch="llama"), enforce_eager=True, **ENGINE) as llm:
        yield llm


def test_ranks_run_as_actors_on_two_nodes(ray_llm, cluster, caplog):
    runner = ray_llm.engine.runner
    assert type(runner).__name__ == "RayExecutor"
    assert ray_llm.engine.config.parallel.distributed_executor_backend == "ray"
    nodes = runner.node_ids
    assert len(nodes) == 2 and len(set(nodes)) == 2, "one rank per node"
    assert {n["NodeID"] for n in cluster.nodes() if n["Alive"]} == set(nodes)
    assert _free_cpus(cluster) == 0.0, "each rank holds its bundle's CPU"
    for pid in runner.pids:  # the cluster is this machine's: the actors' processes can be read
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert f"{ENV_MARK}=carried".encode() in environ
        if os.geteuid() == 0:  # raising a priority needs the privilege
            assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0), \
                "the actor kept Ray's worker niceness"


def test_greedy_tokens_equal_one_rank_and_transformers(ray_llm, one_rank):
    path = tiny_checkpoint(arch="llama")
    prompts = random_prompts(LENGTHS, ray_llm.engine.vocab_size, seed=7)
    got = _tokens(ray_llm, prompts)
    assert got == _tokens(one_rank, prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0], f"{len(prompt)}-token prompt diverged"


def test_prefix_caching_and_preemption_equal_one_rank(ray_llm, one_rank):
    engine = ray_llm.engine
    shared = random_prompts([64], engine.vocab_size, seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9], engine.vocab_size, seed=22)]
    hits = engine.scheduler.block_pool.prefix_cache_hits
    assert _tokens(ray_llm, prompts[:1]) == _tokens(one_rank, prompts[:1])
    assert _tokens(ray_llm, prompts[1:]) == _tokens(one_rank, prompts[1:])
    assert engine.scheduler.block_pool.prefix_cache_hits > hits, "the shared prefix should be served from cache"
    # 12 x (150 + 60) tokens overflow the 128-block (2048-token) caches: the newest are preempted.
    long = random_prompts([150] * 12, engine.vocab_size, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    assert _tokens(ray_llm, long, params) == _tokens(one_rank, long, params)
    assert engine.scheduler.num_preemptions > before, "the workload should preempt"


def test_compiled_ranks_never_recompile(ray_llm, one_rank):
    for n, seed in ((1, 1), (3, 2), (8, 3)):
        prompts = random_prompts([3 + 11 * i for i in range(n)], ray_llm.engine.vocab_size, seed=seed)
        assert _tokens(ray_llm, prompts) == _tokens(one_rank, prompts)
    for rank, c in enumerate(ray_llm.engine.runner.collect_compile_counters()):
        assert c is not None and c.recompiles == 0, f"rank {rank} recompiled"


def test_a_killed_actor_is_named_and_nothing_is_left(ray_llm, cluster):
    engine = ray_llm.engine
    runner = engine.runner
    pids, node = list(runner.pids), runner.node_ids[1]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([20] * 4, engine.vocab_size, seed=3)):
        engine.add_request(f"doomed-{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    cluster.kill(runner.actors[1])
    with pytest.raises(WorkerFailed, match=rf"Ray worker rank 1 \(node [\d.]+, node id {node[:12]}, "
                                           rf"pid {pids[1]}\) died") as info:
        for _ in range(50):  # the next step sees it (a bounded loop: never hang the suite)
            engine.step()
    assert info.value.rank == 1
    with pytest.raises(WorkerFailed, match="has stopped"):
        engine.step()
    engine.abort_all()
    _wait_until(lambda: not any(pid_alive(p) for p in pids), "an actor outlived the failure")
    _wait_until(lambda: _free_cpus(cluster) == 2.0, "the placement group was not removed")


def test_serve_over_ray_runs_the_engine_process_and_leaves_nothing(cluster, one_rank):
    from tests.server.conftest import ServerProcess

    assert _free_cpus(cluster) == 2.0, "the in-process engine must be gone before the server starts"
    server = ServerProcess("--model", tiny_checkpoint(arch="llama"), "--tensor-parallel-size", "2",
                           "--distributed-executor-backend", "ray", "--placement-group-strategy", "SPREAD",
                           "--enforce-eager", "--num-gpu-blocks", "128", "--max-model-len", "256", "--dtype", "float32")
    try:
        server.wait_ready()
        log = server.log()
        assert len(re.findall(r"ray: rank \d on node [\d.]+ \(node id \w+\), pid \d+, device cpu", log)) == 2, log
        pids = [int(p) for p in re.search(r"tensor parallelism: 2 ranks \(pids (\d+), (\d+)\) on 2 Ray node",
                                          log).groups()]
        prompts = random_prompts([5, 30], one_rank.engine.vocab_size, seed=5)
        expected = one_rank.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        model = server.client().models.list().data[0].id
        for prompt, want in zip(prompts, expected):
            body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            reply = server.post("/v1/completions", body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want.outputs[0].text
    finally:
        server.close()
    _wait_until(lambda: not any(pid_alive(p) for p in pids), "an actor outlived the server")
    _wait_until(lambda: _free_cpus(cluster) == 2.0, "the server's placement group was not removed")


def _wait_until(check, message: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_ranks_the_cluster_cannot_place_are_refused_in_one_line(cluster, monkeypatch):
    """STRICT_PACK puts both ranks on one node, and no node has two CPUs: refused after the
    placement timeout, with nothing left reserved."""
    monkeypatch.setenv("VGRAPH_RAY_PLACEMENT_TIMEOUT_S", "3")
    with pytest.raises(ValueError, match=r"could not place 2 ranks of \{'CPU': 1.0\} with strategy STRICT_PACK "
                                         r"within 3 s"):
        LLM(tiny_checkpoint(arch="llama"), tensor_parallel_size=2, placement_group_strategy="STRICT_PACK",
            enforce_eager=True, **ENGINE)
    _wait_until(lambda: _free_cpus(cluster) == 2.0, "the refused placement group was left reserved")
