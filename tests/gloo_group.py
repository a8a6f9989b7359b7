"""gloo process groups for tests of collectives: one rank in this process, or N spawned ranks.

The rendezvous is a file in a temporary directory (``file://``), so no port is taken and two
test sessions never meet. ``spawn_ranks`` checks by PID that every rank it started has exited.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def single_rank_group() -> Iterator[str]:
    """The default group as a 1-rank gloo group; yields its name (what a traced all-reduce
    carries). Reuses a 1-rank default group that already exists, and leaves it in place."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("a multi-rank default process group is already initialized")
        yield dist.group.WORLD.group_name
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            yield dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()


def _rank_main(rank: int, world_size: int, rendezvous: str, fn: Callable[..., None], args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, dist.group.WORLD.group_name, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Runs ``fn(rank, world_size, group_name, *args)`` in ``world_size`` spawned processes
    joined in one gloo group; an exception in any rank fails the caller. ``fn`` must be
    importable (a module-level function)."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_rank_main, args=(world_size, f"{tmp}/rendezvous", fn, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        pids = context.pids()
        try:
            while not context.join(timeout=60):
                pass
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        for pid in pids:  # every rank is gone (joined and reaped)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"rank process {pid} is still alive")
