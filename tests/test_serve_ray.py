"""Data-parallel serving on Ray Serve (jaxspec/serve/ray.py): a local Ray cluster, two replicas of a tiny random
model (token-id prompts: it has no tokenizer) behind the OpenAI-compatible ingress. Requests reach both replicas,
prompts sharing a prefix go to the same one (Ray Serve LLM's prefix-aware router), and a replica killed mid-run
fails its streams cleanly and has its unanswered requests retried while the other keeps serving. Every call has a
timeout: nothing may hang."""
import concurrent.futures
import json
import os
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from conftest import random_model   # noqa: E402

MODEL = "tiny"
TIMEOUT = 120          # seconds any one HTTP call may take (the first ones compile the replicas' steps)
LONG = 300             # tokens of the requests that are running when a replica is killed
ENGINE = dict(max_num_seqs=4, max_model_len=LONG + 32, max_num_batched_tokens=16, block_size=4, warmup=False)
PROMPTS = {"a": list(range(1, 13)), "b": list(range(70, 82))}   # no shared prefix, as token ids or as their text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    from jaxspec.serve.ray import build_app
    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))}   # conftest's CPU settings
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        model = random_model(0, max_position_embeddings=LONG + 64)
        serve.run(build_app(model, num_replicas=2, served_model_name=MODEL, llm_kwargs=ENGINE,
                            ray_actor_options={"num_cpus": 1, "num_gpus": 0}, metrics_interval_s=0.25),
                  name="jaxspec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def replica(r: httpx.Response) -> str:
    return r.headers["x-jaxspec-replica"]


def test_requests_reach_both_replicas_with_prefix_affinity(url):
    a, b = complete(url, PROMPTS["a"]), complete(url, PROMPTS["b"])
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert replica(a) != replica(b)   # nothing cached matches b: the replica with the least cached text
    again = complete(url, PROMPTS["a"] + [40, 41])
    assert replica(again) == replica(a) and again.json()["usage"]["completion_tokens"] == 4
    models = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # /metrics: both replicas' samples, engine="0" and "1", their finished requests together the 3 sent
    from prometheus_client.parser import text_string_to_metric_families
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
        assert metrics.status_code == 200, metrics.text
        success = {s.labels["engine"]: s.value for f in text_string_to_metric_families(metrics.text)
                   if f.name == "vllm:request_success" for s in f.samples
                   if s.name.endswith("_total") and s.labels["finished_reason"] == "length"}
        if sorted(success) == ["0", "1"] and sum(success.values()) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert sorted(success) == ["0", "1"] and sorted(success.values()) == [1, 2], success
    bad = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json={"model": MODEL, "prompt": [1], "max_tokens": 2,
                                                                      "best_of": 3})
    assert bad.status_code == 400 and "best_of" in bad.text   # the replica's own errors come through unchanged


def stream(url: str, prompt: list[int], started: threading.Event) -> dict:
    """A streamed completion: its replica, its events, whether it ended with [DONE] or an error event."""
    out = {"events": [], "done": False, "error": None}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            out["replica"], out["status"] = r.headers.get("x-jaxspec-replica"), r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    else:
                        out["events"].append(event)
                        started.set()
    except httpx.TransportError as e:   # the connection dropped: also a clean failure
        out["error"] = repr(e)
    return out


def test_a_replica_killed_mid_run_fails_or_retries_its_requests_and_the_other_keeps_serving(url):
    victim = replica(complete(url, PROMPTS["a"]))     # the replica prompt a goes to (its prefix is cached there)
    survivor_prompt = PROMPTS["b"]
    assert replica(complete(url, survivor_prompt)) != victim
    started = {k: threading.Event() for k in ("victim", "survivor")}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        on_victim = pool.submit(stream, url, PROMPTS["a"] + [50], started["victim"])
        on_survivor = pool.submit(stream, url, survivor_prompt + [50], started["survivor"])
        assert started["victim"].wait(TIMEOUT) and started["survivor"].wait(TIMEOUT)
        whole = pool.submit(complete, url, PROMPTS["a"] + [60], LONG)   # routed to the victim too, unanswered
        time.sleep(0.5)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed, kept, retried = (f.result(timeout=TIMEOUT) for f in (on_victim, on_survivor, whole))
    # the victim's stream ended, with an error event or a dropped connection, and without [DONE]
    assert killed["replica"] == victim and killed["error"] and not killed["done"]
    assert 0 < len(killed["events"]) < LONG
    # the survivor's stream ran to its end
    assert kept["replica"] != victim and kept["done"] and kept["error"] is None
    assert kept["events"][-1]["choices"][0]["finish_reason"] == "length"
    # the request nothing was sent for yet was answered whole by another replica
    assert retried.status_code == 200, retried.text
    assert replica(retried) != victim and retried.json()["usage"]["completion_tokens"] == LONG
    # and the deployment keeps serving
    for prompt in (PROMPTS["a"], PROMPTS["b"], [90, 91, 92]):
        r = complete(url, prompt)
        assert r.status_code == 200 and replica(r) != victim, r.text


def test_a_replica_sends_a_streams_tokens_in_fewer_chunks_with_stream_batching():
    """The replica's side alone (no cluster): a streamed completion through JaxspecServer.serve_request, every
    write sent at once (interval 0) and batched (an interval longer than the whole stream: after the first
    chunk, one more). The same events arrive either way."""
    import asyncio

    from jaxspec.serve.ray import ForwardedRequest, JaxspecServer
    server = JaxspecServer(random_model(0, max_position_embeddings=LONG + 64), MODEL, ENGINE,
                           stream_batching_interval_ms=0)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS["a"], "max_tokens": 12, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = ForwardedRequest("POST", "/v1/completions", b"", [(b"content-type", b"application/json")], body)

    async def chunks():
        return [c async for c in server.serve_request(request)]

    def events(chunks):
        assert chunks[0][0] == "start" and chunks[0][1] == 200
        lines = b"".join(chunks[1:]).decode().split("\n\n")
        assert lines[-2] == "data: [DONE]"
        return [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-2]]
    try:
        each = asyncio.run(chunks())
        server.batching_interval = 60.0
        batched = asyncio.run(chunks())
    finally:
        server.llm.engine.stop()
    assert len(each) - 1 >= 12                 # a chunk per token (and the end)
    assert len(batched) - 1 == 2               # the first token's chunk, then the rest in one
    assert events(batched) == events(each) and len(events(each)) >= 12
