"""`LLM` and `generate`: the public entry points, shaped like vLLM's offline API."""
from __future__ import annotations

import collections
import dataclasses
import gc
import numbers
import os
import queue
import threading
import time
from typing import Iterator

from tqdm.auto import tqdm

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.engine import Engine, EngineConfig
from jaxspec.sched.output import RequestOutput, merge_completions, request_output
from jaxspec.sched.request import Request

DEFAULT_MODEL = "smollm2-135m-instruct"


class LLM:
    """An engine over one model.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(self, model=DEFAULT_MODEL, *, dtype: str = "auto", max_num_seqs: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_memory_fraction: float | None = None,
                 gpu_memory_utilization: float | None = None, async_scheduling: bool = True, speculative_config=None, enable_prefix_caching: bool = True,
                 warmup: bool | str = "auto", seed: int = 0, attention: str = "auto", unroll_layers: bool | None = None,
                 tensor_parallel_size: int = 1, structured_compile_timeout: float = 30.0,
                 structured_compile_memory: float = 2.0,
                 delta_rule: str = "auto", logprobs_mode: str = "raw_logprobs", quantization: str | None = None,
                 kv_cache_dtype: str = "auto", enable_lora: bool = False, max_loras: int = 1,
                 max_lora_rank: int = 16):
        from jaxspec.models.loader import load_model

        t0 = time.perf_counter()
        self.model = model if hasattr(model, "params") else load_model(model, dtype=dtype)
        weights_s = time.perf_counter() - t0
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(self.model, EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_memory_fraction=kv_memory_fraction,
            gpu_memory_utilization=gpu_memory_utilization, async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching, warmup=warmup, seed=seed,
            attention=attention, unroll_layers=unroll_layers, tensor_parallel_size=tensor_parallel_size,
            structured_compile_timeout=structured_compile_timeout,
            structured_compile_memory=structured_compile_memory, delta_rule=delta_rule,
            logprobs_mode=logprobs_mode, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank),
            speculative_config)
        self.model = self.engine.model   # quantized, where asked (a model this LLM loaded is then released)
        self.speculative_config = self.engine.speculative_config
        # Start-up phases in seconds: weights loaded and placed (0 for a model passed in), the engine built, the
        # compiles the constructor waited for (`engine.wait_compiled()` waits for the background ones).
        self.startup = {"weights_s": weights_s, **self.engine.startup}

    # ---- prompts -----------------------------------------------------------------------------------
    def encode_prompt(self, prompt, index: int = 0, chat_options: dict | None = None) -> tuple[list[int], str | None]:
        """One prompt -> (token ids, text or None). A ValueError names the prompt and what is wrong with it.
        `chat_options`: how a conversation is rendered (`apply_chat_template`'s keywords, and `add_special_tokens`:
        the tokenizer's own BOS and such on top of what the template writes)."""
        where = f"prompt {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where} is a string, but this model has no tokenizer: pass token-id lists")
            _check_text(prompt, where)
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], where), None
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            options = dict(chat_options or {})
            add_special_tokens = options.pop("add_special_tokens", False)
            text = self.apply_chat_template(prompt, where=where, **options)
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), text
        if isinstance(prompt, (list, tuple)):
            return _token_ids(prompt, where), None
        raise ValueError(f"{where} is {_show(prompt)}: a prompt must be a string, a list of token ids, "
                         "{'prompt_token_ids': [...]} or a list of chat messages")

    def apply_chat_template(self, messages: list[dict], where: str = "the conversation", *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None) -> str:
        """The conversation's prompt text (vLLM's `LLM.chat` options): `add_generation_prompt` opens the assistant's
        turn; `continue_final_message` instead leaves the last message open, for the model to continue it;
        `tools` are shown to the template; `chat_template` replaces the tokenizer's; `chat_template_kwargs` are
        more template variables. An assistant message with `tool_calls` may have no content."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are both set; the last message is "
                             "either closed and answered, or continued: set add_generation_prompt=False")
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                    isinstance(content, str) or (content is None and m.get("tool_calls"))):
                raise ValueError(f"{where}: message {i} is {_show(m)}; every chat message needs a string 'role' "
                                 "and a string 'content' (or, from the assistant, 'tool_calls')")
            if content is not None:
                _check_text(content, f"{where}: message {i}'s content")
        if continue_final_message and not isinstance(messages[-1].get("content"), str):
            raise ValueError(f"{where}: continue_final_message needs a last message with text content to continue")
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "chat_template", "tokenize"})
        if clash:
            raise ValueError(f"chat_template_kwargs has {clash}, which are options of their own; give them as such")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
                chat_template=chat_template, **kwargs)
        except ValueError:
            raise
        except Exception as e:   # the template raised (jinja's TemplateError, a missing variable, ...)
            raise ValueError(f"{where}: the chat template could not render it: {type(e).__name__}: {e}") from None

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

    def add_requests(self, prompts, sampling_params=None, outputs=None, chat_options: dict | None = None,
                     lora_request=None) -> list[list[Request]]:
        """Queues every prompt (all checked before any is queued: a ValueError queues nothing); per prompt,
        its SamplingParams.n completions. `outputs`: an object with `put(RequestOutput)` (a queue) that gets
        their deltas as the engine confirms them (a server drives the engine on its thread and reads them).
        `chat_options`: how conversations are rendered (`encode_prompt`). `lora_request`: a jaxspec.LoRARequest for
        every prompt, a list of one (or None) per prompt, or None (the base model)."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one, or one each")
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} lora requests for {len(prompts)} prompts; give one, or one each")
        encoded = [self.encode_prompt(p, i, chat_options) for i, p in enumerate(prompts)]
        # every request is checked (and built) before any is queued
        groups = []
        try:
            for (ids, text), sp, lora in zip(encoded, params, adapters):
                groups.append(self.engine.intake.build(ids, sp, prompt=text, outputs=outputs, lora_request=lora))
        except ValueError:
            for group in groups:   # built, never queued: their adapter slots go back
                self.engine.intake.discard(group)
            raise
        for group in groups:
            self.engine.submit(group)
        return groups

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; SamplingParams.n completions each in `outputs`. `lora_request`:
        the jaxspec.LoRARequest every prompt runs with, or one (or None) per prompt (needs enable_lora=True)."""
        return self._generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, chat_options: dict | None = None,
                  lora_request=None):
        groups = self.add_requests(prompts, sampling_params, chat_options=chat_options, lora_request=lora_request)
        reqs = [r for group in groups for r in group]
        bar = tqdm(total=len(reqs), desc="generating", disable=not use_tqdm, unit="req")
        finished = [0]

        def done() -> bool:
            n = sum(r.finished for r in reqs)
            bar.update(n - finished[0])
            finished[0] = n
            return n == len(reqs)
        try:
            self.engine.run_until(done)
        except BaseException:
            for req in reqs:
                self.engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        self.engine.drain()
        return [merge_completions([request_output(r, self.tokenizer) for r in group]) for group in groups]

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yields deltas (new text and token ids) as the engine confirms them: each holds one completion
        (`outputs[0]`, its `index` among the prompt's n). The stream ends when its requests end, whoever ends
        them (this loop, another call driving the engine, an abort)."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        reqs = [r for group in self.add_requests(prompts, sampling_params, outputs=outputs) for r in group]
        pending = {(r.parent_id or r.request_id, r.index) for r in reqs}
        try:
            while pending:
                try:
                    delta = outputs.get(block=self.engine.running_on_thread, timeout=1.0)
                except queue.Empty:
                    if not self.engine.running_on_thread:
                        self.engine.step()
                    continue
                if delta.finished:
                    pending.discard((delta.request_id, delta.outputs[0].index))
                yield delta
        finally:
            for req in reqs:
                if not req.finished:
                    self.engine.abort(req.request_id)
            self.engine.drain()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered as `apply_chat_template`
        says (vLLM's options)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools,
                       chat_template_kwargs=chat_template_kwargs)
        return self._generate([list(c) for c in convs], sampling_params, use_tqdm, options)

    def abort(self, request_id: str):
        self.engine.abort(request_id)

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

    Keyword arguments that are SamplingParams fields go to SamplingParams, the rest to LLM. `model` is an LLM
    (used as it is), or what LLM takes (a preset name, a path, a Model): the engine built for it is kept and
    reused by every later call with the same model and LLM options in this process, so only the first call loads
    and compiles. One engine is kept at a time (MAX_CACHED_ENGINES): a call with another model or other options
    drops the kept one before building its own, whose memory is then free unless another thread's call still
    runs on it (on a GPU an engine takes half the free memory for its KV pool). A reused engine continues its
    random stream: give SamplingParams.seed for outputs that do not depend on earlier calls. Calls from several
    threads share the engine (its lock serializes the steps; a call that must build one waits while another is
    built). `generate.cache_clear()` drops the kept engine.
    """
    sp_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    sp_kwargs = {k: llm_kwargs.pop(k) for k in list(llm_kwargs) if k in sp_fields}
    if sampling_params is None:
        sampling_params = SamplingParams(**sp_kwargs)
    elif sp_kwargs:
        raise ValueError(f"give either sampling_params or its fields {sorted(sp_kwargs)}, not both")
    llm = model if isinstance(model, LLM) else _engines.get(model, llm_kwargs)
    return llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)


# Engines `generate` keeps: one, since each holds its weights, KV pool and compiled steps in device memory (on a
# GPU the KV pool takes half of the memory free when it is built, so a second engine would get half as much).
MAX_CACHED_ENGINES = 1


class _EngineCache:
    """The LLMs `generate` built, by (model, options); at most `size`, the least recently used dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()   # held while building: a second caller waits, then reuses
        self._llms: collections.OrderedDict = collections.OrderedDict()   # key -> (LLM, the options it was built with)

    def get(self, model, llm_kwargs: dict) -> LLM:
        key = (_frozen(model), _frozen(llm_kwargs))
        with self._lock:
            if key in self._llms:
                self._llms.move_to_end(key)
                return self._llms[key][0]
            self._drop(keep=self.size - 1)   # before building: the dropped engine's memory is free for the new one
            llm = LLM(model, **llm_kwargs)
            # The options are kept with the LLM: a key holds the ids of unhashable options (a Model), and the
            # objects must outlive the key for their ids to stay theirs.
            self._llms[key] = (llm, (model, llm_kwargs))
            return llm

    def cache_clear(self):
        with self._lock:
            self._drop(keep=0)

    def _drop(self, keep: int):
        if len(self._llms) <= keep:
            return
        while len(self._llms) > keep:
            self._llms.popitem(last=False)
        gc.collect()   # an engine's device buffers are freed when it is collected, not at some later collection


def _frozen(value):
    """A hashable stand-in for an option: containers and dataclasses (SpeculativeConfig, a Model) by their
    contents, strings and numbers as they are, any other object (an array, a tokenizer) by its identity."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple((f.name, _frozen(getattr(value, f.name)))
                                               for f in dataclasses.fields(value))
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    return ("object", id(value))


_engines = _EngineCache(MAX_CACHED_ENGINES)
generate.cache_clear = _engines.cache_clear
