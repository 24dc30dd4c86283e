"""`LLM` and `generate`: the public entry points, shaped like vLLM's offline API."""
from __future__ import annotations

import numbers
from typing import Iterator

from tqdm.auto import tqdm

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.engine import Engine, EngineConfig
from jaxspec.sched.output import RequestOutput, final_text, request_metrics
from jaxspec.sched.request import Request

DEFAULT_MODEL = "smollm2-135m-instruct"


def _resolve_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


class LLM:
    """An engine over one model.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(self, model=DEFAULT_MODEL, *, dtype: str = "auto", max_num_seqs: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_memory_fraction: float | None = None,
                 async_scheduling: bool = True, speculative_config=None, warmup: bool = True, seed: int = 0,
                 attention: str = "auto", unroll_layers: bool | None = None):
        from jaxspec.models.loader import load_model
        from jaxspec.spec import SpeculativeConfig, build_drafter

        self.model = model if hasattr(model, "params") else load_model(model, dtype=_resolve_dtype(dtype))
        self.tokenizer = self.model.tokenizer
        spec = SpeculativeConfig.coerce(speculative_config)
        drafter, drafter_params = build_drafter(spec, self.model) if spec is not None else (None, None)
        self.speculative_config = spec
        self.engine = Engine(self.model, EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_memory_fraction=kv_memory_fraction,
            async_scheduling=async_scheduling, warmup=warmup, seed=seed, attention=attention,
            unroll_layers=unroll_layers), drafter, drafter_params)

    # ---- prompts -----------------------------------------------------------------------------------
    def _encode(self, prompt, index: int = 0) -> tuple[list[int], str | None]:
        """One prompt -> (token ids, text or None). A ValueError names the prompt and what is wrong with it."""
        where = f"prompt {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where} is a string, but this model has no tokenizer: pass token-id lists")
            _check_text(prompt, where)
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], where), None
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.apply_chat_template(prompt, where=where)
            return self.tokenizer.encode(text, add_special_tokens=False), text
        if isinstance(prompt, (list, tuple)):
            return _token_ids(prompt, where), None
        raise ValueError(f"{where} is {_show(prompt)}: a prompt must be a string, a list of token ids, "
                         "{'prompt_token_ids': [...]} or a list of chat messages")

    def apply_chat_template(self, messages: list[dict], where: str = "the conversation") -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: message {i} is {_show(m)}; every chat message needs a string 'role' "
                                 "and a string 'content'")
            _check_text(m["content"], f"{where}: message {i}'s content")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and (all(_is_token_id(t) for t in prompts) or
                            all(isinstance(m, dict) and "role" in m for m in prompts)):
                return [prompts]  # one token-id prompt, or one conversation
            return list(prompts)
        raise ValueError(f"prompts is {_show(prompts)}: give a string, a list of token ids, a list of chat "
                         "messages, or a list of those")

    def _add(self, prompts, sampling_params) -> list[Request]:
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one, or one each")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        for (ids, _), sp in zip(encoded, params):   # every request is checked before any is queued
            self.engine.validate_request(ids, sp)
        return [self.engine.add_request(ids, sp, prompt=text) for (ids, text), sp in zip(encoded, params)]

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        reqs = self._add(prompts, sampling_params)
        bar = tqdm(total=len(reqs), desc="generating", disable=not use_tqdm, unit="req")
        pending = set(map(id, reqs))
        try:
            while pending:
                for req in self.engine.step():
                    if req.finished and id(req) in pending:
                        pending.discard(id(req))
                        bar.update(1)
        except BaseException:
            for req in reqs:
                self.engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        self._drain()
        return [self._output(r) for r in reqs]

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yields per-request deltas (new text and token ids) as the engine confirms them. The stream ends
        when its requests end, whoever ends them (this loop, another call driving the engine, an abort)."""
        reqs = self._add(prompts, sampling_params)
        for req in reqs:
            req.stream_text = True
        sent = {id(r): (0, 0) for r in reqs}
        pending = list(reqs)
        try:
            while pending:
                if not any(self._has_news(r, sent[id(r)]) for r in pending):
                    self.engine.step()
                for req in list(pending):
                    n_tok, n_chr = sent[id(req)]
                    if not self._has_news(req, (n_tok, n_chr)):
                        continue
                    # Hold back the last len(longest stop string) - 1 characters while running: a stop
                    # string completed by a later token may start inside them, and the final text is
                    # cut right before it; text already yielded cannot be taken back.
                    hold = 0 if req.finished or not req.params.stop else max(map(len, req.params.stop)) - 1
                    n_chr_now = max(n_chr, len(req.text) - hold)
                    sent[id(req)] = (len(req.output_token_ids), n_chr_now)
                    if req.finished:
                        pending.remove(req)
                    yield self._output(req, delta_from=(n_tok, n_chr), text_end=n_chr_now)
        finally:
            for req in reqs:
                if not req.finished:
                    self.engine.abort(req.request_id)
            self._drain()

    @staticmethod
    def _has_news(req: Request, sent: tuple[int, int]) -> bool:
        return req.finished or len(req.output_token_ids) > sent[0]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([list(c) for c in convs], sampling_params, use_tqdm=use_tqdm)

    def abort(self, request_id: str):
        self.engine.abort(request_id)

    def _drain(self):
        """Reads the last in-flight step so the next call starts from a quiet engine."""
        while self.engine.has_unfinished() and not self.engine.scheduler.has_work():
            self.engine.step()

    def _output(self, req: Request, delta_from=None, text_end: int | None = None) -> RequestOutput:
        n_tok, n_chr = delta_from or (0, 0)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=final_text(req, self.tokenizer)[n_chr:text_end], token_ids=req.output_token_ids[n_tok:], finished=req.finished,
            finish_reason=req.finish_reason,
            logprobs=req.logprobs[n_tok:] if req.params.logprobs is not None else None,
            metrics=request_metrics(req))

    def stats(self) -> dict:
        return self.engine.stats()


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _token_ids(ids, where: str) -> list[int]:
    bad = [t for t in ids if not _is_token_id(t)] if isinstance(ids, (list, tuple)) else [ids]
    if bad:
        raise ValueError(f"{where} has {_show(bad[0])} where a token id (an int) belongs")
    return [int(t) for t in ids]


def _check_text(text: str, where: str):
    """Text the tokenizer can take: valid Unicode (no lone surrogates, which have no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode text: {text[e.start:e.end]!r} at index {e.start} is a "
                         "lone surrogate") from None


def generate(prompts, model=DEFAULT_MODEL, sampling_params=None, *, use_tqdm: bool = True, **llm_kwargs):
    """One call for notebooks: `jaxspec.generate("Hello", max_tokens=32, temperature=0)`.

    Keyword arguments that are SamplingParams fields go to SamplingParams, the rest to LLM.
    """
    import dataclasses
    sp_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    sp_kwargs = {k: llm_kwargs.pop(k) for k in list(llm_kwargs) if k in sp_fields}
    if sampling_params is None:
        sampling_params = SamplingParams(**sp_kwargs)
    elif sp_kwargs:
        raise ValueError(f"give either sampling_params or its fields {sorted(sp_kwargs)}, not both")
    llm = model if isinstance(model, LLM) else LLM(model, **llm_kwargs)
    return llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)
