"""`jaxspec serve` as a user runs it: a subprocess on 127.0.0.1 serving SmolLM2-135M (float32, CPU), driven
with the official `openai` client and raw HTTP. The last test shuts the server down (SIGTERM)."""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import optimized_env

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://allowed.example"   # the one origin CORS lets in
SHUTDOWN_TIMEOUT = 1.0               # seconds running requests get after SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """(the server's Popen, its base URL)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # the real model's steps with LLVM's optimisation (conftest.optimized_env): they run far more than they compile
    env = optimized_env(JAX_PLATFORMS="cpu", JAXSPEC_API_KEY=API_KEY)
    cmd = [sys.executable, "-m", "jaxspec.cli", "serve", MODEL, "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
           "--log-level", "warning", "--allowed-origins", json.dumps([ORIGIN]),
           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
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
    yield proc, base
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(server_process):
    return server_process[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def metrics(server) -> list:
    """/metrics's samples, parsed by prometheus_client (open without the API key, as vLLM's /metrics is)."""
    text = httpx.get(f"{server}/metrics").text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(samples, name: str, **labels) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def wait_for(condition, seconds: float, what: str):
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"{what}: not within {seconds} s")
        time.sleep(0.1)


def resident_bytes_with_children(pid: int) -> int:
    """RSS of a process and its children (the server and its compile processes), from /proc."""
    def rss(p):
        with open(f"/proc/{p}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:   # "pid (name) state ppid ..."
                    children.append(int(entry))
        except (OSError, ValueError):   # gone meanwhile
            continue
    return rss(pid) + sum(rss(c) for c in children)


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


def test_a_non_streamed_client_that_disconnects_is_aborted_within_a_step(server):
    """A non-streamed request keeps producing tokens: its client going away is noticed all the same (issue #34:
    it was checked only after 0.5 s without output, so it ran to max_tokens). Its request is aborted within the
    engine steps already under way, counted as an abort, and its blocks are freed."""
    before = metrics(server)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        steps = lambda: value(metrics(server), "jaxspec:engine_steps_total")   # noqa: E731
        first = steps()
        wait_for(lambda: value(metrics(server), "jaxspec:num_requests_running") == 1 and steps() > first + 2, 60,
                 "the request producing tokens")
        at_close = steps()
    wait_for(lambda: value(metrics(server), "jaxspec:num_requests_running") == 0, 30, "the request aborted")
    after = metrics(server)
    assert value(after, "jaxspec:kv_cache_usage_perc") == 0
    assert value(after, "jaxspec:request_success_total", finished_reason="abort") == value(
        before, "jaxspec:request_success_total", finished_reason="abort") + 1
    # the step in flight when the client left, the one that was being dispatched, and the one that applies the
    # abort; then nothing runs
    assert value(after, "jaxspec:engine_steps_total") - at_close <= 3
    generated = value(after, "jaxspec:generation_tokens_total") - value(before, "jaxspec:generation_tokens_total")
    assert generated < 200


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


def test_api_key_is_required_except_for_health_version_and_metrics(server):
    """As vLLM: /health, /version and /metrics (Prometheus scrapes without the key) are open; the API and the
    tokenizer endpoints need the key."""
    import jaxspec
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.head(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json() == {"version": jaxspec.__version__}
    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 200 and "jaxspec:num_requests_running" in r.text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


# SmolLM2's tokenizer, as transformers gives it (hf_tokenizer_from_gguf(...).encode / apply_chat_template /
# convert_ids_to_tokens): the reference for /tokenize, written down because building it costs seconds.
PARIS_IS = ([38634, 314], ["Paris", "\u0120is"])   # \u0120: byte-level BPE's space
HI_CHAT = dict(length=27, tail=[198, 26843, 2, 198])              # "...<|im_start|>user\nHi<|im_end|>\n"
GENERATION_PROMPT = [1, 520, 9531, 198]                            # "<|im_start|>assistant\n"


def test_model_retrieval_tokenize_and_detokenize_as_in_vllm(client, server):
    """/v1/models/{id} (404 for another model), and vLLM's /tokenize (a prompt or a conversation) and /detokenize,
    against transformers' tokenizer of the same GGUF; fields they do not take are refused by name."""
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    post = lambda path, body: httpx.post(f"{server}{path}", json=body, headers=AUTH)   # noqa: E731
    r = post("/tokenize", {"model": MODEL, "prompt": "Paris is", "return_token_strs": True}).json()
    assert r == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": PARIS_IS[0], "token_strs": PARIS_IS[1]}
    messages = [{"role": "user", "content": "Hi"}]
    bare = post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] == HI_CHAT["length"] and bare["tokens"][-4:] == HI_CHAT["tail"]
    prompted = post("/tokenize", {"messages": messages}).json()   # vLLM's default: the generation prompt added
    assert prompted["tokens"] == bare["tokens"] + GENERATION_PROMPT and prompted["token_strs"] is None
    assert post("/detokenize", {"tokens": GENERATION_PROMPT}).json() == {"prompt": "<|im_start|>assistant\n"}
    for path, body, named in [("/tokenize", {"prompt": "hi", "echo": True}, "echo"),
                              ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary")]:
        r = post(path, body)
        assert r.status_code == 400 and named in r.json()["error"]["message"]
    assert post("/tokenize", {"model": "gpt-4", "prompt": "hi"}).status_code == 404


def test_cors_and_request_ids(server):
    """--allowed-origins lets that origin's pages read responses (a 401 too) and pass the preflight; another origin
    gets no CORS header. X-Request-Id is echoed (or made up) and names the completion, as in vLLM."""
    r = httpx.get(f"{server}/v1/models", headers={"Origin": ORIGIN, "X-Request-Id": "req-42"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["x-request-id"] == "req-42"
    r = httpx.get(f"{server}/v1/models", headers={"Origin": "https://other.example", **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers and r.headers["x-request-id"]
    r = httpx.options(f"{server}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and "POST" in r.headers["access-control-allow-methods"]
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                   headers={**AUTH, "X-Request-Id": "req-43"})
    assert r.headers["x-request-id"] == "req-43" and r.json()["id"] == "cmpl-req-43"


def test_metrics_count_requests_tokens_and_cache_hits(client, server):
    before = metrics(server)
    prompt = "A shared system prompt that is long enough to fill a whole KV block or two. " * 3
    prompt_tokens = 0
    for suffix, n in (("First?", 1), ("Second?", 1), ("Third?", 3)):
        out = client.completions.create(model=MODEL, prompt=prompt + suffix, max_tokens=4 // n, temperature=0, n=n)
        prompt_tokens += out.usage.prompt_tokens
    after = metrics(server)
    for name, grew_by in [("jaxspec:request_success_total", 5), ("jaxspec:generation_tokens_total", 11),
                          ("jaxspec:prompt_tokens_total", prompt_tokens),   # each prompt once, whatever its n
                          ("jaxspec:time_to_first_token_seconds_count", 5),
                          ("jaxspec:e2e_request_latency_seconds_count", 5)]:
        assert value(after, name) == value(before, name) + grew_by, name
    hits = value(after, "jaxspec:prefix_cache_hits_total") - value(before, "jaxspec:prefix_cache_hits_total")
    assert hits >= 16     # the second request reuses the first one's blocks of the shared part
    assert value(after, "jaxspec:prefix_cache_queries_total") > value(before, "jaxspec:prefix_cache_queries_total")
    assert value(after, "jaxspec:kv_cache_usage_perc") == 0 and value(after, "jaxspec:num_requests_waiting") == 0


VLLM_COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
VLLM_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_time_per_output_token_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def test_metrics_carry_vllms_names_beside_jaxspecs(client, server):
    """/metrics also exports what vLLM's v1 engine does, under its names, types and labels (model_name, engine),
    so that vLLM's dashboards and llm-d's scheduler read it unmodified: the counters grow as jaxspec's do (vLLM's
    prompt tokens once per completion), the gauges equal jaxspec's, mid-request too, and each step after a
    completion's first token is one inter-token latency."""
    text = httpx.get(f"{server}/metrics").text
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    for name in VLLM_COUNTERS:   # exposed as vLLM's are: the counter's name with _total
        assert re.search(rf"^{name}{{.*engine=\"0\".*}}", text, re.M), name
        assert types[name.removesuffix("_total")] == "counter", name
    for name in VLLM_GAUGES + VLLM_HISTOGRAMS:
        assert types[name] == ("gauge" if name in VLLM_GAUGES else "histogram"), name
    before = metrics(server)
    assert value(before, "vllm:request_success_total", finished_reason="stop", engine="0") >= 0
    assert {s.labels["finished_reason"] for s in before if s.name == "vllm:request_success_total"} >= {
        "stop", "length", "abort"}   # each reason's series exists before its first request, as vLLM's

    with client.completions.create(model=MODEL, prompt="Count to twenty: 1, 2,", max_tokens=24, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))
        running = metrics(server)
        for name in VLLM_GAUGES:
            assert value(running, name, model_name=MODEL, engine="0") == value(running, f"jaxspec:{name[5:]}"), name
        assert value(running, "vllm:num_requests_running") == 1 and value(running, "vllm:kv_cache_usage_perc") > 0
        streamed = 1 + sum(1 for _ in stream)
    out = client.completions.create(model=MODEL, prompt="Name two planets:", max_tokens=5, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    after = metrics(server)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    completions, generated = 3, 24 + out.usage.completion_tokens
    assert generated == 24 + 10 and streamed >= 1
    assert grew("vllm:generation_tokens_total") == grew("jaxspec:generation_tokens_total") == generated
    assert grew("vllm:request_success_total", finished_reason="length") == completions == \
        grew("jaxspec:request_success_total", finished_reason="length")
    first_prompt = grew("jaxspec:prompt_tokens_total") - out.usage.prompt_tokens
    assert grew("vllm:prompt_tokens_total") == first_prompt + 2 * out.usage.prompt_tokens   # n=2: twice
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"vllm:{name}_count") == grew(f"jaxspec:{name}_count") == completions, name
        assert grew(f"vllm:{name}_sum") == pytest.approx(grew(f"jaxspec:{name}_sum")), name
    assert grew("vllm:inter_token_latency_seconds_count") == generated - completions   # a token a step
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_prompt_tokens_sum") == grew("vllm:prompt_tokens_total")
    for name in VLLM_COUNTERS[3:] + VLLM_GAUGES:   # the engine's, read at the scrape
        jaxspec = f"jaxspec:{name[5:]}"
        assert value(after, name, model_name=MODEL, engine="0") == value(after, jaxspec), name
    assert value(after, "vllm:num_requests_running") == 0 == value(after, "vllm:kv_cache_usage_perc")


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


def test_exploding_constraints_are_refused_at_once_and_others_still_compile(client, server_process):
    """Issue #34: `(a|b){1,100000}` was refused only after 30 s, and its compile then ran on, growing the idle
    server from 4.3 to 11.2 GB. Now it is refused before compiling, with what is wrong (a JSON schema whose counts
    explode too), the server's memory stays put, and a plain constraint is served right after."""
    proc, _ = server_process
    rss = resident_bytes_with_children(proc.pid)
    messages = [{"role": "user", "content": "Say something."}]
    long_string = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string",
                                                                                "maxLength": 100000}}}
    for kwargs, named in [(dict(extra_body={"structured_outputs": {"regex": "(a|b){1,100000}"}}), "{1,100000}"),
                          (dict(response_format=long_string), "maxLength")]:
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError, match=re.escape(named)):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **kwargs)
        assert time.monotonic() - start < 5
    choice = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    assert resident_bytes_with_children(proc.pid) < rss + 300 * 2**20


def test_masked_processed_logprobs_are_written_as_json_numbers():
    """Under --logprobs-mode processed_logprobs a top alternative the sampling masked (top_logprobs beyond top-k)
    has logprob -inf, which JSON has no number for (the server's JSON responses refuse it): it is written as vLLM's
    server writes it, -9999.0, in both APIs' logprobs."""
    import json
    import types
    from jaxspec.serve.serving_common import LogprobJSON
    server = types.SimpleNamespace(token_text=str)
    entries = [{"token_id": 3, "logprob": -0.25, "top": [(3, -0.25), (5, float("-inf"))]}]
    chat, completion = LogprobJSON.chat_logprobs(server, entries), LogprobJSON.completion_logprobs(server, entries, 0)
    json.dumps([chat, completion], allow_nan=False)
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.25, -9999.0]
    assert completion["top_logprobs"] == [{"3": -0.25, "5": -9999.0}] and completion["token_logprobs"] == [-0.25]


def test_drain_lets_running_requests_finish_within_the_grace_period_then_aborts_them():
    """Server.drain (what SIGTERM runs): a request that ends within the grace period ends on its own; one still
    running after it is aborted; new requests are refused from the start."""
    import asyncio
    import types

    from jaxspec.serve.app import Server

    class Job:
        def __init__(self, server, runs_for: float):
            self.server, self.stopped = server, False
            asyncio.get_running_loop().call_later(runs_for, server.jobs.discard, self)

        def stop(self):
            self.stopped = True
            self.server.jobs.discard(self)

    async def drain(grace: float):
        compiles = []
        server = types.SimpleNamespace(jobs=set(), draining=False, accepting=True, llm=types.SimpleNamespace(
            engine=types.SimpleNamespace(stop_compiling=lambda: compiles.append(1))))
        server._wait_for_jobs = lambda until: Server._wait_for_jobs(server, until)
        quick, slow = Job(server, 0.2), Job(server, 60)
        server.jobs |= {quick, slow}
        await Server.drain(server, grace)
        return quick.stopped, slow.stopped, server.draining, server.accepting, compiles

    assert asyncio.run(drain(1.0)) == (False, True, True, False, [1])
    assert asyncio.run(drain(0.0)) == (True, True, True, False, [1])


def test_sigterm_aborts_running_requests_and_exits_within_the_grace_period(server_process):
    """Issue #34: after SIGTERM the server stayed up for as long as a running request had tokens left to make
    (90 s). Now the listening socket closes at once, running requests get --shutdown-timeout seconds, then end with
    finish_reason "abort" (their responses still go out), and the process exits. Last in this file: it ends the
    module's server."""
    proc, server = server_process
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
            "ignore_eos": True}

    def whole():
        return httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=300).json()

    def streamed():
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=300) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(whole), pool.submit(whole), pool.submit(streamed)]
        wait_for(lambda: value(metrics(server), "jaxspec:num_requests_running") == 3, 60, "three requests running")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        exited_after = time.monotonic() - start
        first, second, stream = [f.result(timeout=10) for f in running]
    # the grace period, a step to apply the aborts, the engine's stop and the interpreter's exit
    assert exited_after < SHUTDOWN_TIMEOUT + 10
    assert [r["choices"][0]["finish_reason"] for r in (first, second, stream[-1])] == ["abort"] * 3
    assert 0 < first["usage"]["completion_tokens"] < body["max_tokens"]
