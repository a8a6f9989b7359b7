"""``vgraph serve --speculative-config``: the served completion equals the plain engine's, the
startup log names the proposer, and /metrics counts the guesses (vLLM's spec_decode names)."""
from __future__ import annotations

import json

import httpx

from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph import LLM, SamplingParams
from vgraph.models.demo import DEMO_MODEL_NAME

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PROMPT = "import os\nimport sys\nimport os\nimport sys\nimport os\n"


def test_served_speculation_equals_the_plain_engine_and_is_counted():
    expected = LLM(DEMO_MODEL_NAME, enforce_eager=True, device="cpu").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    proc = ServerProcess(*EAGER_ARGS, "--speculative-config", json.dumps(SPEC))
    try:
        proc.wait_ready()
        body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        text = httpx.post(proc.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        metrics = proc.wait_idle()
        assert "speculative decoding: ngram, k=3" in proc.log()
    finally:
        proc.close()
    assert text == expected
    drafts = metrics["vllm:spec_decode_num_draft_tokens_total{engine=0}"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total{engine=0}"]
    assert drafts > 0 and 0 < accepted <= drafts
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=0,position=0}"] > 0
