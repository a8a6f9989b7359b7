"""``vgraph serve --pipeline-parallel-size 2`` (the engine in its engine-core process): it serves,
and when a stage dies the server answers with an error naming the rank and its stage, exits
non-zero, and leaves no process behind."""
from __future__ import annotations

import os
import re
import signal
import time

from tests.checkpoints import tiny_checkpoint
from tests.distributed.processes import pid_alive
from tests.server.conftest import ServerProcess


def _worker_pids(log: str) -> list[int]:
    """The ranks' pids, from the executor's startup line (in the engine-core process's log)."""
    match = re.search(r"pipeline parallelism \(2 stages\): 2 ranks \(pids (\d+), (\d+)\)", log)
    assert match, f"no pipeline-parallel startup line in the log:\n{log}"
    return [int(match.group(1)), int(match.group(2))]


def test_serve_pp2_answers_then_reports_a_dead_stage_and_exits():
    server = ServerProcess("--model", tiny_checkpoint(arch="llama"), "-pp", "2", "--enforce-eager",
                           "--num-gpu-blocks", "128", "--max-model-len", "256")
    try:
        server.wait_ready()
        body = {"model": server.client().models.list().data[0].id, "prompt": [5, 6, 7, 8], "max_tokens": 4,
                "temperature": 0}
        ok = server.post("/v1/completions", body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        pids = _worker_pids(server.log())
        os.kill(pids[1], signal.SIGKILL)  # the last stage, the one that samples
        failed = server.post("/v1/completions", body)
        assert failed.status_code >= 500
        assert "rank 1" in failed.json()["error"]["message"]
        assert "pipeline stage 1 of 2" in failed.json()["error"]["message"]
        assert server.proc.wait(60) != 0, "the server exits non-zero after its engine failed"
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), "a worker outlived the server"
    finally:
        server.close()
