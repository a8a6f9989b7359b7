"""What a vLLM user's client and habits meet: context overflows in OpenAI's words (which
litellm maps to ContextWindowExceededError), and one log line per finished request."""
from __future__ import annotations

import logging
import re
import time

import pytest

from vgraph.engine.stats import EngineStats, RequestTiming, StepOutput
from vgraph.server.request_log import RequestLog

OVERFLOW = re.compile(r"This model's maximum context length is 512 tokens\. However, you requested (\d+) tokens "
                      r"\((\d+) in the (prompt|messages), (\d+) in the completion\)\. Please reduce the length of "
                      r"the (prompt|messages) or completion\.")


@pytest.mark.parametrize("path,body,where,param", [
    ("/v1/completions", {"prompt": [7] * 9, "max_tokens": 100000}, "prompt", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "messages",
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
     "messages", "max_completion_tokens"),
])
def test_context_overflow_is_said_as_openai_says_it(server, model, path, body, where, param):
    response = server.post(path, {"model": model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    match = OVERFLOW.fullmatch(error["message"])
    assert match, error["message"]
    requested, prompt, said, completion, said_again = match.groups()
    assert (said, said_again, int(completion)) == (where, where, 100000)
    assert int(requested) == int(prompt) + 100000
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              "context_length_exceeded")


def test_a_prompt_over_max_prompt_tokens_but_within_the_context_names_the_flag():
    """--max-prompt-tokens below the context is the server's limit, not an overflow."""
    from vgraph.server.errors import APIError
    from vgraph.server.limits import Limits
    from vgraph.server.state import ServerSettings
    limits = Limits.resolve(ServerSettings(["m"], max_prompt_tokens=100), 512)
    with pytest.raises(APIError) as within:
        limits.check_tokens(200, "the prompt", "prompt")
    assert within.value.code == "prompt_too_long" and "--max-prompt-tokens" in within.value.message
    with pytest.raises(APIError) as beyond:
        limits.check_tokens(512, "the prompt", "prompt")
    assert beyond.value.code == "context_length_exceeded"
    assert beyond.value.message.startswith("This model's maximum context length is 512 tokens. However, the prompt "
                                           "has 512 tokens")


def test_litellm_sees_a_context_window_error(server, model):
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{model}", api_base=server.url + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": "hi"}], max_tokens=100000, num_retries=0)


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



def test_generation_config_fills_only_the_sampling_settings_a_request_leaves_unset(tmp_path):
    import json

    from vgraph import vllm_compat
    from vgraph.server.protocol import CompletionRequest
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": 1, "top_k": None}))
    defaults = vllm_compat.sampling_defaults("auto", str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9}
    assert vllm_compat.sampling_defaults(str(tmp_path), "/elsewhere") == defaults
    assert vllm_compat.sampling_defaults("vllm", str(tmp_path)) == {}
    unset = CompletionRequest(prompt="x").sampling_params(16, None, 5, defaults=defaults)
    assert (unset.temperature, unset.top_p) == (0.6, 0.9)
    sent = CompletionRequest(prompt="x", temperature=0.0).sampling_params(16, None, 5, defaults=defaults)
    assert (sent.temperature, sent.top_p) == (0.0, 0.9)
