"""What a vLLM user's habits meet: one log line per finished request."""
from __future__ import annotations

import logging
import re
import time

from vgraph.engine.stats import EngineStats, RequestTiming, StepOutput
from vgraph.server.request_log import RequestLog


def test_each_finished_request_is_one_log_line(server, model):
    response = server.post("/v1/completions", {"model": model, "prompt": "def f(", "max_tokens": 3,
                                               "temperature": 0})
    assert response.status_code == 200, response.text
    rid = response.json()["id"]
    deadline = time.monotonic() + 10
    while f"request {rid}" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log().splitlines() if f"request {rid}" in line]
    assert len(lines) == 1, lines
    assert re.search(r"finished: prompt tokens \d+, output tokens 3, finish length, latency [\d.]+ s$", lines[0])
    assert "def f(" not in lines[0], "prompts are logged only with --max-log-len"


def _step(*timings: RequestTiming, outputs: list | None = None) -> StepOutput:
    return StepOutput(outputs or [], list(timings), EngineStats())


def test_the_request_log_counts_tokens_over_steps_and_caps_the_prompt(caplog):
    from vgraph.engine.outputs import RequestOutput
    log = RequestLog(max_log_len=5)
    prompt = RequestOutput("r1", "a long prompt", [1, 2, 3])
    with caplog.at_level(logging.INFO, logger="vgraph.server.requests"):
        log.observe(_step(RequestTiming("r1", 3, num_new_tokens=1), outputs=[prompt]))
        log.observe(_step(RequestTiming("r1", 3, num_new_tokens=2, e2e_latency=0.25, finish_reasons=["stop"])))
        log.observe(_step(RequestTiming("r2", 4, finish_reasons=["abort"])))
    assert [r.getMessage() for r in caplog.records] == [
        "request r1 finished: prompt tokens 3, output tokens 3, finish stop, latency 0.250 s, prompt 'a lon'",
        "request r2 finished: prompt tokens 4, output tokens 0, finish abort, latency aborted"]
    assert not log._tokens and not log._prompts, "nothing is kept for finished requests"


def test_disable_log_requests_leaves_the_log_hook_out():
    from vgraph.server.app import build_app
    from vgraph.server.state import ServerSettings

    class Engine:
        on_step = None
        stats = EngineStats()

    for log_requests, hook in ((False, "observe"), (True, "on_step")):
        engine = Engine()
        build_app(ServerSettings(served_model_names=["m"], log_requests=log_requests), engine)  # type: ignore
        assert engine.on_step.__name__ == hook

