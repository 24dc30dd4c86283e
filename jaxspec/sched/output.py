"""Output processing: append confirmed tokens, stop checks, incremental detokenization, metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from jaxspec.sched.request import Request


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt (SamplingParams.n gives several)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length", "abort"; None while it runs
    logprobs: list | None = None       # per token: {"logprob", "top": [(token_id, logprob), ...]}
    metrics: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result (or, from `LLM.stream`, the delta since the last one): its completions in
    `outputs`, by index. `text`, `token_ids`, `finish_reason`, `logprobs` and `metrics` are the first
    completion's (a request with n=1 has only that one)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> dict:
        return self.outputs[0].metrics


def merge_completions(parts: list[RequestOutput]) -> RequestOutput:
    """One prompt's RequestOutput from its completions' (each holding one), ordered by index."""
    outputs = sorted((o for p in parts for o in p.outputs), key=lambda o: o.index)
    first = parts[0]
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outputs,
                         finished=all(o.finished for o in outputs))


class AsyncSink:
    """An output target (`put(delta)`) for a request read from asyncio: the engine thread's deltas land on
    `queue`, an asyncio.Queue of the event loop it was made on."""

    def __init__(self, loop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, delta):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:   # the loop has closed: nobody is reading any more
            pass


def append_tokens(req: Request, tokens, tokenizer, max_model_len: int, logprobs=None) -> tuple[list[int], str]:
    """Append device-confirmed tokens, truncating exactly where a stop condition fires.

    Returns (new token ids, new text). Sets req.finish_reason when the request is done.
    """
    p = req.params
    now = time.perf_counter()
    new_ids: list[int] = []
    for i, tok in enumerate(tokens):
        tok = int(tok)
        req.output_token_ids.append(tok)
        new_ids.append(tok)
        if logprobs is not None:
            req.logprobs.append(logprobs[i])
        req.token_times.append(now)
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens and ((not p.ignore_eos and tok in req.eos_token_ids) or tok in p.stop_token_ids):
            req.finish_reason = "stop"
        elif n_out >= p.max_tokens or req.num_tokens >= max_model_len:
            req.finish_reason = "length"
        if req.finish_reason:
            break
    if req.first_token_time is None and new_ids:
        req.first_token_time = now
    old_text = req.text
    if tokenizer is not None and (req.stream_text or p.stop):
        _detokenize(req, tokenizer, _text_ids(req))
        if p.stop and len(req.output_token_ids) >= p.min_tokens:
            hit = _first_stop(req.text, p.stop, max(0, len(old_text) - max(map(len, p.stop))))
            if hit is not None:
                req.text = req.text[:hit]
                req.finish_reason = "stop"
    else:
        final_text(req, tokenizer)
    return new_ids, req.text[len(old_text):] if req.text.startswith(old_text) else req.text


def _text_ids(req: Request) -> list[int]:
    """The output ids that make up the text: a final stop token is not part of it."""
    ids, p = req.output_token_ids, req.params
    if req.finish_reason == "stop" and ids and (ids[-1] in req.eos_token_ids or ids[-1] in p.stop_token_ids):
        return ids[:-1]
    return ids


def final_text(req: Request, tokenizer) -> str:
    """The request's text. Nobody reads it before the request ends unless it is streamed or has stop
    strings (those render it every step), so otherwise it is decoded once, when the request ends."""
    if tokenizer is not None and req.finish_reason and not req.text and req.output_token_ids and not (
            req.stream_text or req.params.stop):
        req.text = tokenizer.decode(_text_ids(req), skip_special_tokens=True)
    return req.text


def _detokenize(req: Request, tokenizer, ids: list[int]):
    """Incremental detokenization: decode only a short window of the newest tokens each step (a whole
    decode per step is quadratic in the output length). The window starts a few tokens back so that
    tokens whose text depends on their neighbours (leading spaces, multi-byte characters split over
    tokens) render as a full decode would."""
    if req.detok_read >= len(ids):
        return
    prefix = tokenizer.decode(ids[req.detok_prefix:req.detok_read], skip_special_tokens=True)
    full = tokenizer.decode(ids[req.detok_prefix:], skip_special_tokens=True)
    if len(full) > len(prefix) and (not full.endswith("\ufffd") or req.finish_reason):
        req.text += full[len(prefix):]  # a trailing incomplete character waits for its remaining tokens
        req.detok_prefix, req.detok_read = req.detok_read, len(ids)


def _first_stop(text: str, stops: list[str], search_from: int) -> int | None:
    found = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    return min(found) if found else None


def request_output(req: Request, tokenizer, delta_from: tuple[int, int] = (0, 0), text_end: int | None = None):
    """The request's RequestOutput: whole, or the delta from (tokens, characters) already sent."""
    n_tok, n_chr = delta_from
    completion = CompletionOutput(
        index=req.index, text=final_text(req, tokenizer)[n_chr:text_end], token_ids=req.output_token_ids[n_tok:],
        finish_reason=req.finish_reason, logprobs=req.logprobs[n_tok:] if req.params.logprobs is not None else None,
        metrics=request_metrics(req))
    return RequestOutput(request_id=req.parent_id if req.parent_id is not None else req.request_id,
                         prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, outputs=[completion],
                         finished=req.finished)


def take_delta(req: Request, tokenizer) -> RequestOutput | None:
    """What the request confirmed since its last delta, or None when nothing did. While it runs, the last
    len(longest stop string) - 1 characters are held back: a stop string completed by a later token may start
    inside them, the final text is cut right before it, and text already sent cannot be taken back."""
    n_tok, n_chr = req.sent
    if not req.finished and len(req.output_token_ids) == n_tok:
        return None
    hold = 0 if req.finished or not req.params.stop else max(map(len, req.params.stop)) - 1
    n_chr_now = max(n_chr, len(req.text) - hold)
    req.sent = (len(req.output_token_ids), n_chr_now)
    return request_output(req, tokenizer, (n_tok, n_chr), n_chr_now)


def request_metrics(req: Request) -> dict:
    times = req.token_times
    n = len(req.output_token_ids)
    m = {
        "num_prompt_tokens": len(req.prompt_token_ids),
        "num_output_tokens": n,
        "ttft": (req.first_token_time - req.arrival_time) if req.first_token_time else None,
        "tpot": ((times[-1] - times[0]) / (n - 1)) if n > 1 else None,
        "inter_token_latencies": [b - a for a, b in zip(times, times[1:])],
        "e2e_latency": ((req.finish_time or time.perf_counter()) - req.arrival_time),
        "num_preemptions": req.num_preemptions,
        "num_draft_tokens": req.num_draft_tokens,
        "num_accepted_tokens": req.num_accepted_tokens,
    }
    return m
