"""The small routes, and /metrics counting exactly the traffic that was sent."""
from __future__ import annotations

import threading

import httpx

import vgraph

SERIES = ["vgraph:num_requests_running{engine=0}", "vgraph:num_requests_waiting{engine=0}", "vgraph:kv_cache_usage_perc{engine=0}",
          "vgraph:prefix_cache_queries_total{engine=0}", "vgraph:prefix_cache_hits_total{engine=0}", "vgraph:num_preemptions_total{engine=0}",
          "vgraph:prompt_tokens_total", "vgraph:generation_tokens_total",
          "vgraph:request_success_total{finished_reason=length}",
          "vgraph:request_success_total{finished_reason=stop}",
          "vgraph:request_success_total{finished_reason=abort}",
          "vgraph:time_to_first_token_seconds_count", "vgraph:inter_token_latency_seconds_count",
          "vgraph:e2e_request_latency_seconds_count", "vgraph:request_queue_time_seconds_count"]


def test_models_list_and_retrieve(server, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo-model-v1"] and models[0].owned_by == "vgraph"
    assert models[0].model_extra["max_model_len"] == 512
    assert client.models.retrieve(model).id == model


def test_health_and_version(server):
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": vgraph.__version__}
    assert server.health_statuses[-1] == 200, "the fixture waited for 200"


def test_tokenize_detokenize_round_trip(server):
    text = "The library was quiet; only the turning of pages was heard."
    tokenized = server.post("/tokenize", {"prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 5 and tokenized["max_model_len"] == 512
    assert server.post("/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                     "add_generation_prompt": False}).json()
    decoded = server.post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert decoded == "<|user|>\nhi</s>\n"


def test_metrics_count_what_was_sent(server, client, model):
    before = server.wait_idle()
    assert all(name in before for name in SERIES), sorted(set(SERIES) - set(before))
    sent = [client.completions.create(model=model, prompt=f"Request number {i}", max_tokens=5 + i, temperature=0,
                                      extra_body={"ignore_eos": True}) for i in range(3)]
    sent.append(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, n=2, extra_body={"ignore_eos": True}))
    streamed = list(client.completions.create(model=model, prompt="Streamed", max_tokens=6, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    usages = [r.usage for r in sent] + [streamed[-1].usage]
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("vgraph:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vgraph:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vgraph:request_success_total{finished_reason=length}") == 3 + 2 + 1  # one per choice
    assert delta("vgraph:request_success_total{finished_reason=abort}") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"vgraph:{histogram}_count") == 5, histogram
    # One inter-token gap per step after the first: (5+6+7 - 3) + (4 - 1) + (6 - 1).
    assert delta("vgraph:inter_token_latency_seconds_count") == 15 + 3 + 5
    assert delta("vgraph:prefix_cache_queries_total{engine=0}") > 0
    assert after["vgraph:kv_cache_usage_perc{engine=0}"] == 0 and after["vgraph:num_requests_running{engine=0}"] == 0


ROUTER_GAUGES = {"vllm:num_requests_waiting": "vgraph:num_requests_waiting{engine=0}",
                 "vllm:num_requests_running": "vgraph:num_requests_running{engine=0}",
                 "vllm:kv_cache_usage_perc": "vgraph:kv_cache_usage_perc{engine=0}",
                 "vllm:gpu_cache_usage_perc": "vgraph:kv_cache_usage_perc{engine=0}"}


def test_router_gauges_mirror_vgraphs_own_while_requests_run(server, model):
    """Load-aware routers (the Gateway API Inference Extension's endpoint picker) read vLLM's
    gauge names: they carry vgraph's values (one replica's: the server's), sampled in the same
    scrape, busy and idle."""
    def busy() -> None:
        server.post("/v1/completions", {"model": model, "prompt": "Load", "max_tokens": 48,
                                        "ignore_eos": True, "n": 4})

    workers = [threading.Thread(target=busy) for _ in range(3)]
    for w in workers:
        w.start()
    seen_busy = False
    while any(w.is_alive() for w in workers):
        m = server.metrics()
        for router_name, own in ROUTER_GAUGES.items():
            assert m[router_name] == m[own], router_name
        seen_busy |= m["vllm:num_requests_running"] > 0 and m["vllm:kv_cache_usage_perc"] > 0
    for w in workers:
        w.join()
    assert seen_busy, "a scrape saw the requests running and their KV blocks"
    idle = server.wait_idle()
    assert all(idle[name] == 0 for name in ROUTER_GAUGES)
