"""The Ray executor: one actor per rank on a Ray cluster's nodes, for models beyond one machine.

Ray places and supervises the ranks; it does not carry the steps. The executor makes a
placement group of one bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` on CUDA; PACK or
SPREAD over the nodes), starts one ``RankActor`` in each bundle with the engine's environment
(``VGRAPH_*`` and the other variables named in ``ENV_PREFIXES``), and every actor then runs the
very loop a local rank process runs (``worker.run_rank`` driving ``worker.RankWorker``) over a
TCP connection that the engine opens to it (Nagle off: see ``no_delay``). Why not a Ray call
per step: a remote call costs about half a millisecond of driver and actor time per rank on this
machine, several times a pickled message on a socket, and the steps are the hot path; so the
per-step cost equals the ``mp`` executor's (``perf/suites/ray_executor.py`` measures both). The
actors also take back the engine's scheduling priority from Ray's worker niceness.

Ranks meet in torch.distributed at the rank-0 actor's node address and a port free there (gloo
on CPU, NCCL on CUDA, where each actor sees only its own GPU, as ``cuda:0``). The engine watches
each rank's connection and, when a rank is silent, its long-running ``serve`` call: a dead actor
closes its connection at once, a lost node ends the call (Ray declares the node dead); either
way the rank is named (rank, node, pid), every actor is killed, the placement group removed and
the engine fails with ``WorkerFailed``, as with a dead local rank. ``close`` does the same
without the error.

Ray is optional: imported only when this executor is chosen, with an error naming the extra
(``pip install 'vgraph[ray]'``) when it is missing.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Optional

from ..config import EngineConfig
from .executor import RankExecutor, WorkerFailed, collective_timeout_s
from .executors import RAY_ADDRESS_ENV
from .worker import WorkerArgs, run_rank

logger = logging.getLogger("vgraph")

# Environment variables every actor gets from the engine's process (Ray starts actors with the
# node's environment, not the driver's): vgraph's own settings, and the libraries' it drives.
ENV_PREFIXES = ("VGRAPH_", "HF_", "TRANSFORMERS_", "TORCHINDUCTOR_", "TRITON_", "NCCL_", "GLOO_")
PLACEMENT_TIMEOUT_ENV = "VGRAPH_RAY_PLACEMENT_TIMEOUT_S"
DEFAULT_PLACEMENT_TIMEOUT_S = 120.0
_POLL_S = 1.0  # how long a silent wait lasts before the executor asks Ray whether the ranks live
_GRACE_S = 5.0


class RayUnavailable(ValueError):
    """The ray executor was chosen where Ray is not installed (a setup error, not a bug)."""


class PlacementFailed(ValueError):
    """The cluster cannot hold the ranks as asked (too few CPUs or GPUs, or a strict strategy
    its nodes cannot meet): the request's error, said in one line."""


def import_ray() -> Any:
    """The ``ray`` module, or ``RayUnavailable`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("the ray executor (--distributed-executor-backend ray, or RAY_ADDRESS set) needs "
                             "Ray, which is not installed: pip install 'vgraph[ray]'") from None
    return ray


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's actor runs, as it reports itself."""

    node_ip: str
    node_id: str
    pid: int
    gpu_ids: tuple[str, ...]
    listen_port: int  # the engine connects here to send the rank its commands
    rendezvous_port: Optional[int]  # rank 0: a port free on its node for torch.distributed
    niceness: int  # the actor's scheduling niceness, after trying to match the engine's


class RankActor:
    """One rank in a Ray actor (``ray.remote`` wraps this class when the executor starts): it
    listens for the engine's connection, then serves it with the same loop as a local rank."""

    def __init__(self) -> None:
        self._listener: Optional[Listener] = None

    def place(self, authkey: bytes, rendezvous: bool, niceness: int) -> RankPlace:
        """Opens the engine's listening socket, takes the engine's scheduling priority when it
        may, and says where this actor is."""
        import ray

        self._listener = Listener(("0.0.0.0", 0), authkey=authkey)
        context = ray.get_runtime_context()
        return RankPlace(ray.util.get_node_ip_address(), context.get_node_id(), os.getpid(),
                         tuple(str(g) for g in ray.get_gpu_ids()), self._listener.address[1],
                         _free_port() if rendezvous else None, _match_niceness(niceness))

    def serve(self, args: WorkerArgs) -> int:
        """Runs the rank until the engine says SHUTDOWN or the rank fails (its exit code)."""
        if self._listener is None:
            raise RuntimeError("RankActor.serve before place")
        conn = self._listener.accept()
        self._listener.close()
        return run_rank(args, no_delay(conn))


def _match_niceness(wanted: int) -> int:
    """Ray starts its workers at niceness 15 (its ``worker_niceness``), below every ordinary
    process: on a busy machine a rank then loses the CPU to them, and its step slows while the
    other ranks wait for it in each collective. The actor takes the engine's niceness back
    when the OS allows it (raising priority needs CAP_SYS_NICE); the niceness it runs at is
    returned either way."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current > wanted:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
    return os.getpriority(os.PRIO_PROCESS, 0)


def no_delay(conn: Connection) -> Connection:
    """Turns Nagle's algorithm off on a TCP connection. A message over 16 KiB (a prefill's plan)
    goes out as two writes, header then body; with Nagle the body waits for the header's ACK,
    which the receiver may delay by tens of milliseconds."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _free_port() -> int:
    """A TCP port free on every interface of this node now (the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayExecutor(RankExecutor):
    """Runs ``config.parallel.world_size`` ranks as Ray actors (see the module's docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._ray = import_ray()
        self._owns_connection = _connect(self._ray)
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._places: list[Optional[RankPlace]] = [None] * self.world_size
        self._serving: list[Any] = []  # each rank's ``serve`` call (its ObjectRef)
        try:
            self._launch(config)
        except BaseException:
            self._stop_ranks()
            raise
        self._start()
        self._log_placement(config)

    @property
    def node_ids(self) -> list[str]:
        """The Ray node id of each rank's actor, by rank."""
        return [p.node_id if p is not None else "" for p in self._places]

    @property
    def actors(self) -> list[Any]:
        """Each rank's actor handle, by rank (empty once stopped): for tools that ask Ray about them."""
        return list(self._actors)

    # ------------------------------------------------------------------ startup

    def _launch(self, config: EngineConfig) -> None:
        """Placement group, actors, their places, then each rank's loop and its connection."""
        cuda = config.torch_device.type == "cuda"
        self._placement_group = self._reserve(cuda, config.parallel.placement_group_strategy)
        self._actors = [self._actor(rank, cuda) for rank in range(self.world_size)]
        authkey = secrets.token_bytes(32)
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        self._places = self._get([a.place.remote(authkey, rank == 0, niceness) for rank, a in enumerate(self._actors)])
        places: list[RankPlace] = list(self._places)
        _warn_if_deprioritized(places, niceness)
        init_method = f"tcp://{places[0].node_ip}:{places[0].rendezvous_port}"
        threads = self._threads(places)
        level = logging.getLogger("vgraph").getEffectiveLevel()
        timeout = collective_timeout_s()
        self._serving = [actor.serve.remote(WorkerArgs(config, rank, self.world_size, init_method, threads[rank],
                                                       timeout, level, device_index=0 if cuda else None))
                         for rank, actor in enumerate(self._actors)]
        self._conns = [self._connect_rank(rank, place, authkey) for rank, place in enumerate(places)]

    def _reserve(self, cuda: bool, strategy: str) -> Any:
        """A placement group of one bundle per rank, ready (or an error saying what is missing)."""
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 1.0, **({"GPU": 1.0} if cuda else {})}
        group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S))
        ready, _ = self._ray.wait([group.ready()], timeout=timeout)
        if not ready:
            self._ray.util.remove_placement_group(group)
            raise PlacementFailed(f"the Ray cluster could not place {self.world_size} ranks of {bundle} with strategy "
                               f"{strategy} within {timeout:.0f} s (${PLACEMENT_TIMEOUT_ENV}); the cluster has "
                               f"{self._ray.cluster_resources()}")
        return group

    def _actor(self, rank: int, cuda: bool) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=rank)
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
        return self._ray.remote(RankActor).options(
            num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0, scheduling_strategy=strategy,
            runtime_env={"env_vars": env}, name=None).remote()

    def _threads(self, places: list[RankPlace]) -> list[int]:
        """torch threads per rank: its node's CPUs shared evenly by the ranks on that node."""
        cpus = {n["NodeID"]: n.get("Resources", {}).get("CPU", 1.0) for n in self._ray.nodes() if n.get("Alive")}
        ranks_on = Counter(p.node_id for p in places)
        return [max(1, int(cpus.get(p.node_id, 1.0)) // ranks_on[p.node_id]) for p in places]

    def _connect_rank(self, rank: int, place: RankPlace, authkey: bytes) -> Connection:
        """The engine's connection to a rank (its actor accepts it in ``serve``)."""
        try:
            return no_delay(Client((place.node_ip, place.listen_port), authkey=authkey))
        except (OSError, EOFError):
            raise self._died(rank) from None

    def _get(self, refs: list[Any]) -> list[Any]:
        """Results of one call per rank; a rank whose call fails is named, and stops them all."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001  (any Ray error: the actor or its node is gone)
                raise WorkerFailed(rank, f"{self._label(rank)} failed to start: {_first_line(exc)}") from None
        return results

    def _log_placement(self, config: EngineConfig) -> None:
        """Where every rank runs: the multi-node user's first question when something is slow."""
        device = "cuda" if config.torch_device.type == "cuda" else "cpu"
        for rank, place in enumerate(self._places):
            if place is None:
                continue
            gpu = f"cuda:0 (GPU {', '.join(place.gpu_ids)} of its node)" if device == "cuda" else "cpu"
            logger.info("ray: rank %d on node %s (node id %s), pid %d, device %s, niceness %d", rank,
                        place.node_ip, place.node_id[:12], place.pid, gpu, place.niceness)
        nodes = len({p.node_id for p in self._places if p is not None})
        logger.info("tensor parallelism: %d ranks (pids %s) on %d Ray node(s), %s backend, placement %s",
                    self.world_size, ", ".join(map(str, self.pids)), nodes, config.parallel.distributed_backend,
                    config.parallel.placement_group_strategy)

    # ------------------------------------------------------------------ RankExecutor's questions

    def _wait(self, pending: list[Connection]) -> list[Connection]:
        while True:
            ready = wait(pending, timeout=_POLL_S)
            if ready:
                return ready
            failure = self._find_dead()
            if failure is not None:
                raise failure

    def _died(self, rank: int) -> WorkerFailed:
        """Why a rank's connection closed: Ray's word on its ``serve`` call, when it has one."""
        how = "its connection closed"
        if rank < len(self._serving):
            ready, _ = self._ray.wait([self._serving[rank]], timeout=_GRACE_S)
            if ready:
                try:
                    how = f"it stopped with exit code {self._ray.get(ready[0])}"
                except Exception as exc:  # noqa: BLE001  (RayActorError and kin: the actor or node died)
                    how = _first_line(exc)
        return WorkerFailed(rank, f"{self._label(rank)} died ({how}); the engine stopped every rank")

    def _find_dead(self) -> Optional[WorkerFailed]:
        ended, _ = self._ray.wait(list(self._serving), num_returns=1, timeout=0) if self._serving else ([], [])
        if not ended:
            return None
        return self._died(self._serving.index(ended[0]))

    def _label(self, rank: int) -> str:
        place = self._places[rank] if rank < len(self._places) else None
        if place is None:
            return f"Ray worker rank {rank}"
        return f"Ray worker rank {rank} (node {place.node_ip}, node id {place.node_id[:12]}, pid {place.pid})"

    def _wait_stopped(self, timeout: float) -> None:
        if self._serving:
            self._ray.wait(list(self._serving), num_returns=len(self._serving), timeout=timeout)

    def _stop_ranks(self) -> None:
        """Kills every actor, removes the placement group and leaves the cluster (if this
        executor joined it); safe to call more than once, and after Ray itself shut down."""
        ray = self._ray
        for conn in self._conns:
            conn.close()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._actors = []
        if self._placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._owns_connection:
            self._owns_connection = False
            _disconnect(ray)


def _warn_if_deprioritized(places: list[RankPlace], niceness: int) -> None:
    """Says so when ranks run below the engine's priority (Ray's worker niceness kept)."""
    low = [rank for rank, p in enumerate(places) if p.niceness > niceness]
    if low:
        logger.warning("ray: rank(s) %s run at niceness %d (Ray's worker_niceness), below the engine's %d: on a "
                       "busy node their steps slow down; start Ray with RAY_worker_niceness=%d in the environment "
                       "of `ray start`, or let the actors raise their priority (CAP_SYS_NICE)",
                       ", ".join(map(str, low)), places[low[0]].niceness, niceness, niceness)


# ---------------------------------------------------------------------- the cluster connection

_connections = 0  # executors alive on a Ray connection that this module opened


def _connect(ray: Any) -> bool:
    """Joins the cluster unless this process already has: ``$RAY_ADDRESS`` (``ray start``'s
    cluster), else a local one started here. True when this executor counts as a user of a
    connection that this module opened (and must let go of it when done)."""
    global _connections
    if ray.is_initialized():
        if _connections == 0:
            return False  # the application's own connection: never ours to end
    else:
        address = os.environ.get(RAY_ADDRESS_ENV)
        started = time.perf_counter()
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(logging_level=logging.WARNING, include_dashboard=False)
        logger.info("ray: joined %s in %.1f s", f"the cluster at {address}" if address else "a local Ray instance",
                    time.perf_counter() - started)
    _connections += 1
    return True


def _disconnect(ray: Any) -> None:
    """The last executor on this module's connection ends it (a local instance stops with it)."""
    global _connections
    _connections -= 1
    if _connections == 0:
        with contextlib.suppress(Exception):
            ray.shutdown()


def _first_line(exc: BaseException) -> str:
    """An exception's first meaningful line (Ray's errors run to many lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
