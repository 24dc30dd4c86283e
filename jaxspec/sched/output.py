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
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token {"token_id",
    # "logprob", "rank", "top": [(token_id, logprob), ...]}. A stream carries them in its first delta.
    prompt_logprobs: list | None = None

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
                         finished=all(o.finished for o in outputs),
                         prompt_logprobs=next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None),
                                              None))


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
    old_text = req.text
    new_ids = confirm_tokens(req, [int(t) for t in tokens], max_model_len, logprobs, time.perf_counter())
    render_texts([req], tokenizer)
    return new_ids, req.text[len(old_text):] if req.text.startswith(old_text) else req.text


def confirm_tokens(req: Request, tokens: list[int], max_model_len: int, logprobs, now: float) -> list[int]:
    """Appends device-confirmed tokens (Python ints) up to the first that ends the request (stop id, EOS,
    max_tokens, max_model_len), setting req.finish_reason then; `now`: their arrival time. Returns those
    appended. The text is rendered apart (`render_texts`), for all of a step's requests at once."""
    p = req.params
    out = req.output_token_ids
    stop_ids = p.stop_token_ids if p.ignore_eos else (*req.eos_token_ids, *p.stop_token_ids)
    prompt_len = len(req.prompt_token_ids)
    for i, tok in enumerate(tokens):
        out.append(tok)
        n_out = len(out)
        if n_out >= p.min_tokens and tok in stop_ids:
            req.finish_reason = "stop"
        elif n_out >= p.max_tokens or prompt_len + n_out >= max_model_len:
            req.finish_reason = "length"
        if req.finish_reason:
            tokens = tokens[:i + 1]
            break
    if logprobs is not None:
        req.logprobs.extend(logprobs[:len(tokens)])
    if tokens and req.token_times:
        req.inter_token_latencies.append(now - req.token_times[-1])
    req.inter_token_latencies.extend([0.0] * (len(tokens) - 1))   # a step's tokens arrive together
    req.token_times.extend([now] * len(tokens))
    if req.first_token_time is None and tokens:
        req.first_token_time = now
    return tokens


# The step's prompt-logprobs outputs (decode.step.prompt_logprobs), per token of the step.
PROMPT_LOGPROB_ARRAYS = ("prompt_logprob", "prompt_rank", "prompt_top_ids", "prompt_top_logprobs")


def record_prompt_logprobs(req: Request, start: int, first_token: int, num_new: int, arrays: dict):
    """A prefill row's prompt logprobs: its token at position q (step token first_token + q - start) gives the
    entry of prompt position q + 1. Only positions not recorded yet are taken (a preempted request prefills its
    prompt again)."""
    prompt, n_top = req.prompt_token_ids, req.params.prompt_logprobs
    for q in range(max(start, len(req.prompt_logprobs) - 1), min(start + num_new, len(prompt) - 1)):
        t = first_token + q - start
        req.prompt_logprobs.append({
            "token_id": prompt[q + 1], "logprob": float(arrays["prompt_logprob"][t]),
            "rank": int(arrays["prompt_rank"][t]),
            "top": list(zip(arrays["prompt_top_ids"][t, :n_top].tolist(),
                            arrays["prompt_top_logprobs"][t, :n_top].tolist()))})


def row_logprobs(lp: dict, r: int, n: int, n_top: int | None) -> list | None:
    """Row r's first n positions of a step's logprobs arrays (`logprob`, `top_ids`, `top_logprobs`), with the
    n_top most likely tokens at each; None for a request that asked for no logprobs (n_top None)."""
    if n_top is None:
        return None
    return [{"logprob": float(lp["logprob"][r, j]),
             "top": list(zip(lp["top_ids"][r, j, :n_top].tolist(), lp["top_logprobs"][r, j, :n_top].tolist()))}
            for j in range(n)]


def renders_text(req: Request, tokenizer) -> bool:
    """Whether the request's text is read while it runs (streamed, or checked for stop strings) and is so
    rendered every step; otherwise it is decoded once, when the request ends (`final_text`)."""
    return tokenizer is not None and (req.stream_text or bool(req.params.stop))


def decode_options(req: Request) -> dict:
    """How the request's tokens become text (SamplingParams.skip_special_tokens, spaces_between_special_tokens)."""
    p = req.params
    return {"skip_special_tokens": p.skip_special_tokens,
            "spaces_between_special_tokens": p.spaces_between_special_tokens}


def render_texts(reqs: list[Request], tokenizer):
    """Brings each request's text up to its confirmed tokens: incremental detokenization of the requests that
    render text (one `decode_batch` for all of them), then stop strings, which end a request and cut its text
    right before the first one; a finished request that rendered nothing gets its whole text."""
    rendering = [req for req in reqs if renders_text(req, tokenizer)]
    old_lens = [len(req.text) for req in rendering]
    old_reads = [req.detok_read for req in rendering]
    windows = [_detok_window(req, _text_ids(req)) for req in rendering]
    live = [w for w in windows if w is not None]
    skips = [req.params.skip_special_tokens for req, w in zip(rendering, windows) if w is not None]
    texts = iter(tokenizer.decode_batch([ids for w in live for ids in w[:2]],
                                        skip_special_tokens=[skip for skip in skips for _ in range(2)])
                 if live else [])
    for req, old_len, old_read, window in zip(rendering, old_lens, old_reads, windows):
        if window is not None:
            _advance_text(req, next(texts), next(texts), window[2])
        p = req.params
        if p.stop and len(req.output_token_ids) >= p.min_tokens:
            search_from = max(0, old_len - max(map(len, p.stop)))
            hit = _first_stop(req.text, p.stop, search_from)
            if hit is not None:
                at, stop = hit
                req.text = req.text[:at + len(stop) if p.include_stop_str_in_output else at]
                req.finish_reason = "stop"
                _drop_tokens_past_stop(req, tokenizer, search_from, old_read)
    for req in reqs:
        if req.finish_reason and not req.text:
            final_text(req, tokenizer)


def _drop_tokens_past_stop(req: Request, tokenizer, search_from: int, rendered: int):
    """A step that confirms several tokens (speculation) may complete a stop string before its last one: the
    output keeps the tokens up to the one that completes it, as one token a step would (their logprobs and times
    too); `rendered`: output tokens whose text was searched in earlier steps."""
    ids, p = req.output_token_ids, req.params
    for n in range(max(rendered + 1, p.min_tokens, 1), len(ids)):
        if _first_stop(tokenizer.decode(ids[:n], **decode_options(req)), p.stop, search_from) is not None:
            del ids[n:], req.logprobs[n:], req.token_times[n:], req.inter_token_latencies[max(n - 1, 0):]
            req.detok_prefix, req.detok_read = min(req.detok_prefix, n), min(req.detok_read, n)
            return


def _text_ids(req: Request) -> list[int]:
    """The output ids that make up the text: a final stop token is not part of it, unless
    include_stop_str_in_output (then its text is, when it is not a special token skipped anyway)."""
    ids, p = req.output_token_ids, req.params
    if p.include_stop_str_in_output:
        return ids
    if req.finish_reason == "stop" and ids and (ids[-1] in req.eos_token_ids or ids[-1] in p.stop_token_ids):
        return ids[:-1]
    return ids


def final_text(req: Request, tokenizer) -> str:
    """The request's text. Nobody reads it before the request ends unless it is streamed or has stop
    strings (those render it every step), so otherwise it is decoded once, when the request ends."""
    if tokenizer is not None and req.finish_reason and not req.text and req.output_token_ids and not (
            req.stream_text or req.params.stop):
        req.text = tokenizer.decode(_text_ids(req), **decode_options(req))
    return req.text


# Incremental detokenization: decode only a short window of the newest tokens each step (a whole decode per
# step is quadratic in the output length). The window starts a few tokens back so that tokens whose text
# depends on their neighbours (leading spaces, multi-byte characters split over tokens) render as a full
# decode would: the text of ids[prefix:] minus that of ids[prefix:read] is what the new tokens add.
def _detok_window(req: Request, ids: list[int]) -> tuple[list[int], list[int], int] | None:
    """(ids[prefix:read], ids[prefix:], len(ids)) to decode, or None when no token is new."""
    if req.detok_read >= len(ids):
        return None
    return ids[req.detok_prefix:req.detok_read], ids[req.detok_prefix:], len(ids)


def _advance_text(req: Request, prefix: str, full: str, num_ids: int):
    if len(full) > len(prefix) and (not full.endswith("\ufffd") or req.finish_reason):
        req.text += full[len(prefix):]  # a trailing incomplete character waits for its remaining tokens
        req.detok_prefix, req.detok_read = req.detok_read, num_ids


def _first_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """(where, which) of the stop string found first in text[search_from:], or None."""
    found = [(i, s) for i, s in ((text.find(s, search_from), s) for s in stops) if i >= 0]
    return min(found, key=lambda f: f[0]) if found else None


def request_output(req: Request, tokenizer, delta_from: tuple[int, int] = (0, 0), text_end: int | None = None):
    """The request's RequestOutput: whole, or the delta from (tokens, characters) already sent."""
    n_tok, n_chr = delta_from
    completion = CompletionOutput(
        index=req.index, text=final_text(req, tokenizer)[n_chr:text_end], token_ids=req.output_token_ids[n_tok:],
        finish_reason=req.finish_reason, logprobs=req.logprobs[n_tok:] if req.params.logprobs is not None else None,
        metrics=request_metrics(req))
    return RequestOutput(request_id=req.parent_id if req.parent_id is not None else req.request_id,
                         prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, outputs=[completion],
                         finished=req.finished, prompt_logprobs=req.prompt_logprobs if delta_from == (0, 0) else None)


def take_delta(req: Request, tokenizer) -> RequestOutput | None:
    """What the request confirmed since its last delta, or None when nothing did. While it runs, the last
    len(longest stop string) - 1 characters are held back: a stop string completed by a later token may start
    inside them, the final text is cut right before it, and text already sent cannot be taken back."""
    n_tok, n_chr = req.sent
    if not req.finished and len(req.output_token_ids) == n_tok:
        return None
    # (with include_stop_str_in_output nothing is held: text before a stop string's end is all kept)
    p = req.params
    hold = 0 if req.finished or not p.stop or p.include_stop_str_in_output else max(map(len, p.stop)) - 1
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
        "inter_token_latencies": list(req.inter_token_latencies),
        "e2e_latency": ((req.finish_time or time.perf_counter()) - req.arrival_time),
        "num_preemptions": req.num_preemptions,
        "num_draft_tokens": req.num_draft_tokens,
        "num_accepted_tokens": req.num_accepted_tokens,
    }
    return m
