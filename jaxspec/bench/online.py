"""Online benchmarking, as `vllm bench serve` does it: requests arrive over time (Poisson at --request-rate, or
all at once), at most --max-concurrency in flight, and a multi-turn session sends each turn after the answer to
the previous one. They are served by an LLM in this process (its engine loop on its own thread) or by a running
`jaxspec serve` (--base-url). Latencies are taken where a client sees them: time to first token from sending
the request, inter-token latency between arriving chunks."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time

import numpy as np

from jaxspec.bench.outputs import output_digest, output_summary
from jaxspec.sched.output import AsyncSink


@dataclasses.dataclass
class Sent:
    """What a client saw of one request."""
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    chunk_times: list[float]      # arrival times of chunks that carried tokens
    e2e: float
    token_ids: list[int] | None   # (in-process backend only)
    text: str = ""                # the output's text, as it streamed in
    finish_reason: str | None = None
    sent_at: float = 0.0          # when the request was sent (time.perf_counter)
    chunk_tokens: list[int] | None = None   # tokens per chunk of chunk_times (in-process backend only)


class LocalBackend:
    """An LLM in this process; its engine runs on its own thread while the benchmark lasts."""

    def __init__(self, llm):
        self.llm = llm
        llm.engine.start()

    async def send(self, prompt, params) -> Sent:
        sink = AsyncSink(asyncio.get_running_loop())
        t0 = time.perf_counter()
        (group,) = self.llm.add_requests([prompt], params, outputs=sink)
        ttft, times, counts, ids, text = None, [], [], [], ""
        while True:
            delta = await sink.queue.get()
            now = time.perf_counter()
            if delta.token_ids:
                ttft = now - t0 if ttft is None else ttft
                times.append(now)
                counts.append(len(delta.token_ids))
                ids += delta.token_ids
            text += delta.text
            if delta.finished:
                break
        return Sent(len(group[0].prompt_token_ids), len(ids), ttft, times, time.perf_counter() - t0, ids, text,
                    delta.finish_reason, t0, counts)

    def close(self):
        self.llm.engine.stop()


class ServerError(RuntimeError):
    """The server answered a request with an error (its status and message) or without the usage it must send."""


class HTTPBackend:
    """A running OpenAI-compatible server: streamed /v1/completions."""

    def __init__(self, base_url: str, model: str, api_key: str | None):
        import httpx
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/v1/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=self.headers, timeout=None,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def send(self, prompt, params) -> Sent:
        body = {"model": self.model, "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "seed": params.seed, "ignore_eos": params.ignore_eos,
                "stream": True, "stream_options": {"include_usage": True}}
        so = params.structured_outputs
        if so is not None:   # vLLM's (and jaxspec serve's) extra body field
            body["structured_outputs"] = {so.kind: getattr(so, so.kind)}
        t0 = time.perf_counter()
        ttft, times, usage, text, finish = None, [], None, "", None
        async with self._post(body) as r:
            if r.status_code != 200:
                raise ServerError(f"{self.url} answered {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk["choices"]:
                    ttft = now - t0 if ttft is None else ttft
                    times.append(now)
                    text += chunk["choices"][0].get("text") or ""
                    finish = chunk["choices"][0].get("finish_reason") or finish
        if usage is None:
            raise ServerError(f"{self.url} sent no usage (it needs stream_options.include_usage)")
        return Sent(usage["prompt_tokens"], usage["completion_tokens"], ttft, times, time.perf_counter() - t0, None,
                    text, finish, t0)

    @contextlib.asynccontextmanager
    async def _post(self, body: dict):
        """The streamed response; a server that cannot be reached, or drops the connection, is a ConnectionError
        that names the URL (not a stack of httpx frames)."""
        import httpx
        try:
            async with self.client.stream("POST", self.url, json=body) as r:
                yield r
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.url}: {type(e).__name__}: {e or 'no answer'}") from e

    def close(self):
        pass


async def _drive(backend, sessions, params_for, request_rate: float, max_concurrency: int, seed: int, progress):
    """Starts the sessions at Poisson times (all at once for an infinite rate), at most max_concurrency at a
    time; a session's turns go one after another. -> [Sent] in completion order."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency)
    results: list[Sent] = []

    async def session(i, turns):
        async with gate:
            for t, (prompt, out_len) in enumerate(turns):
                results.append((i, t, await backend.send(prompt, params_for(i, t, out_len))))
                progress.update(1)

    tasks = []
    for i, turns in enumerate(sessions):
        tasks.append(asyncio.create_task(session(i, turns)))
        if np.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    await asyncio.gather(*tasks)
    return [sent for _, _, sent in sorted(results, key=lambda r: r[:2])]


def run_online(backend, sessions: list[list[tuple]], args, label: str) -> dict:
    """Runs the sessions ([(prompt, output_len) per turn]) through the backend; the same report fields as
    an offline run (jaxspec.bench.measure.run_config)."""
    from tqdm.auto import tqdm

    from jaxspec import SamplingParams

    so = getattr(args, "structured", None)   # a constrained request ends where its automaton accepts

    def params_for(i, t, out_len):
        return SamplingParams(temperature=args.temperature, max_tokens=out_len,
                              ignore_eos=args.ignore_eos and so is None, seed=args.seed + 1000 * t + i,
                              structured_outputs=so)
    num = sum(len(s) for s in sessions)
    bar = tqdm(total=num, desc=f"{label} requests", disable=args.quiet, unit="req")
    t0 = time.perf_counter()
    try:
        sent = asyncio.run(_drive(backend, sessions, params_for, args.request_rate, args.max_concurrency,
                                  args.seed, bar))
    finally:
        bar.close()
        backend.close()
    duration = time.perf_counter() - t0
    ttft = [s.ttft for s in sent if s.ttft is not None]
    tpot = [(s.e2e - s.ttft) / (s.output_tokens - 1) for s in sent if s.ttft is not None and s.output_tokens > 1]
    itl = [b - a for s in sent for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    n_in, n_out = sum(s.prompt_tokens for s in sent), sum(s.output_tokens for s in sent)

    def stats(xs):
        if not xs:
            return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
        return {"mean": 1e3 * float(np.mean(xs)), "median": 1e3 * float(np.median(xs)),
                "p99": 1e3 * float(np.percentile(xs, 99))}
    res = {"label": label, "requests": len(sent), "duration_s": duration, "input_tokens": n_in,
            "output_tokens": n_out, "request_throughput": len(sent) / duration,
            "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl)}
    res.update(output_summary(args, [s.output_tokens for s in sent], [s.text for s in sent],
                              [s.finish_reason for s in sent]))
    res.update(saturated_throughput(sent, t0, args.request_rate, args.max_concurrency))
    res["output_lens"] = [s.output_tokens for s in sent]     # per request, in session order
    if all(s.token_ids is not None for s in sent):
        res["output_digest"] = output_digest([s.token_ids for s in sent])
    return res


def saturated_throughput(sent: list[Sent], start: float, request_rate: float, max_concurrency: int) -> dict:
    """Output tokens per second while the run held max_concurrency requests in flight: from its start to the
    sending of its last request (all sent at once, each next one as soon as one finishes). After that the batch
    only drains, at a pace set by how unevenly the last requests finish. Under speculation the requests of one
    batch finish at different steps, so the whole-run throughput of a short run weighs that drain as much as the
    rate at this concurrency (2026-11-28, 2 x concurrency prompts: speculative runs 0.88-0.92x plain over the
    whole run where their mean TPOT was equal or better). {} where it does not apply: paced arrivals, no more
    requests than the concurrency, or chunks without token counts (HTTP)."""
    if np.isfinite(request_rate) or len(sent) <= max_concurrency or any(s.chunk_tokens is None for s in sent):
        return {}
    end = max(s.sent_at for s in sent)
    if end <= start:
        return {}
    tokens = sum(n for s in sent for t, n in zip(s.chunk_times, s.chunk_tokens) if t <= end)
    return {"saturated_s": end - start, "saturated_output_throughput": tokens / (end - start)}


def check_reachable(backend: HTTPBackend, timeout_s: float = 10.0):
    """A ConnectionError at once if nothing answers at the server's address (before a tokenizer loads and the
    requests are built); any HTTP answer will do, the requests themselves say what the server thinks of them."""
    import httpx
    try:
        httpx.get(backend.base_url + "/v1/models", headers=backend.headers, timeout=timeout_s)
    except httpx.TransportError as e:
        raise ConnectionError(f"--base-url {backend.base_url}: no server answers there ({type(e).__name__}: "
                              f"{e or 'no answer'}); start one with `jaxspec serve MODEL` or fix the URL") from None


def http_backend(args) -> HTTPBackend:
    api_key = args.api_key or os.environ.get("JAXSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return HTTPBackend(args.base_url, args.served_model_name or args.model, api_key)
