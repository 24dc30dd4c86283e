"""`jaxspec serve` as a user runs it: a subprocess on 127.0.0.1 serving SmolLM2-135M (float32, CPU), driven
with the official `openai` client and raw HTTP."""
import concurrent.futures
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXSPEC_API_KEY": API_KEY}
    cmd = [sys.executable, "-m", "jaxspec.cli", "serve", MODEL, "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def metrics(server) -> list:
    """/metrics's samples, parsed by prometheus_client."""
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(samples, name: str, **labels) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_models_and_completions(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=8,
                                    temperature=0, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.text and c.finish_reason == "length"
        assert len(c.logprobs.tokens) == 8 and "".join(c.logprobs.tokens) == c.text
        assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens > 0


def test_streamed_deltas_add_up_to_the_whole_text(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 == whole.usage.completion_tokens

    prompt = "Once upon a time"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert streamed == whole.choices[0].text


def test_n_completions_are_reproducible_with_a_seed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a word."}], max_tokens=10,
              temperature=1.0, n=3)
    a = client.chat.completions.create(seed=5, **kw)
    b = client.chat.completions.create(seed=5, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1


def test_eight_concurrent_streams_equal_their_whole_answers(client, server):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)

    def stream(prompt):
        return "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(stream, prompts))
    assert streamed == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


def test_a_client_that_disconnects_frees_its_blocks(server):
    aborted = value(metrics(server), "jaxspec:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()          # held: closing the iterator would close the connection
        while not next(lines).startswith("data:"):
            pass
        running = metrics(server)
        assert value(running, "jaxspec:num_requests_running") == 1
        assert value(running, "jaxspec:kv_cache_usage_perc") > 0
    deadline = time.time() + 60
    while time.time() < deadline:
        m = metrics(server)
        if value(m, "jaxspec:num_requests_running") == 0 and value(m, "jaxspec:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert value(m, "jaxspec:num_requests_running") == 0 and value(m, "jaxspec:kv_cache_usage_perc") == 0
    assert value(m, "jaxspec:request_success_total", finished_reason="abort") == aborted + 1


def test_bad_requests_get_400_and_the_server_keeps_serving(client, server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=headers)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    for bad, field in [(dict(temperature=-1), "temperature"), (dict(n=0), "n"), (dict(top_p=2), "top_p"),
                       (dict(max_tokens=MAX_MODEL_LEN), "max_model_len")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=MODEL, prompt="hi", **bad)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt="word " * MAX_MODEL_LEN, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_count_requests_tokens_and_cache_hits(client, server):
    before = metrics(server)
    prompt = "A shared system prompt that is long enough to fill a whole KV block or two. " * 3
    for suffix in ("First?", "Second?"):
        client.completions.create(model=MODEL, prompt=prompt + suffix, max_tokens=4, temperature=0)
    after = metrics(server)
    for name, grew_by in [("jaxspec:request_success_total", 2), ("jaxspec:generation_tokens_total", 8),
                          ("jaxspec:time_to_first_token_seconds_count", 2),
                          ("jaxspec:e2e_request_latency_seconds_count", 2)]:
        assert value(after, name) == value(before, name) + grew_by, name
    hits = value(after, "jaxspec:prefix_cache_hits_total") - value(before, "jaxspec:prefix_cache_hits_total")
    assert hits >= 16     # the second request reuses the first one's blocks of the shared part
    assert value(after, "jaxspec:prefix_cache_queries_total") > value(before, "jaxspec:prefix_cache_queries_total")
    assert value(after, "jaxspec:kv_cache_usage_perc") == 0 and value(after, "jaxspec:num_requests_waiting") == 0


def test_bench_drives_the_server(server):
    from jaxspec.bench import run
    (res,) = run(["--base-url", server, "--served-model-name", MODEL, "--api-key", API_KEY, "--dataset", "random",
                  "--vocab-size", "1000", "--input-len", "8", "--num-prompts", "4", "--output-len", "5",
                  "--max-concurrency", "2", "--request-rate", "20", "--quiet"])
    assert res["requests"] == 4 and res["output_tokens"] == 20 and res["input_tokens"] == 4 * 8
    assert res["ttft_ms"]["median"] > 0 and res["itl_ms"]["median"] > 0


ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}


def test_response_format_json_schema_and_structured_outputs(client):
    """OpenAI's response_format with a JSON schema, and vLLM's structured_outputs extra body (choice, regex): the
    answers are what was asked for (SmolLM2 answers in prose otherwise)."""
    import json
    import re

    import jsonschema
    messages = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER_SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), ANSWER_SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    choice = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["rainy", "sunny"]}})
    assert choice.choices[0].message.content in ("rainy", "sunny")
    code = client.completions.create(model=MODEL, prompt="A postal code:", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{5}"}})
    assert re.fullmatch("[0-9]{5}", code.choices[0].text)


def test_a_schema_that_cannot_compile_is_a_400_and_the_server_keeps_serving(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="Unsupported type: colour"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "colour"}}})
    for bad, field in [({"regex": "(unclosed"}, "regex"), ({"choice": []}, "choice"), ({"jsn": {}}, "unknown keys")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"structured_outputs": bad})
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].message.content


def test_masked_processed_logprobs_are_written_as_json_numbers():
    """Under --logprobs-mode processed_logprobs a top alternative the sampling masked (top_logprobs beyond top-k)
    has logprob -inf, which JSON has no number for (the server's JSON responses refuse it): it is written as vLLM's
    server writes it, -9999.0, in both APIs' logprobs."""
    import json
    import types
    from jaxspec.serve.app import Server
    server = types.SimpleNamespace(token_text=str)
    entries = [{"token_id": 3, "logprob": -0.25, "top": [(3, -0.25), (5, float("-inf"))]}]
    chat, completion = Server.chat_logprobs(server, entries), Server.completion_logprobs(server, entries, 0)
    json.dumps([chat, completion], allow_nan=False)
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.25, -9999.0]
    assert completion["top_logprobs"] == [{"3": -0.25, "5": -9999.0}] and completion["token_logprobs"] == [-0.25]
