"""Every SamplingParams field through the OpenAI-compatible server, in-process (the ASGI app `jaxspec serve` runs,
driven with HTTP by starlette's TestClient): each request's completions equal `LLM.generate`'s on an independent
in-process engine over the same model with the same parameters and seeds (text, finish reason, every token by its
logprob entry, the logprobs themselves), served plainly and with a draft model (`--speculative-config`'s
equivalent: speculation with argmax drafts emits what plain decoding does, seeds included; two drafts a step, so
that a stop string can be completed mid-step). Each field changes the output, so a server that dropped or mis-mapped
one would be seen.

The model is a tiny random one over SmolLM2's first VOCAB tokens (those of its chat template among them), with
its tokenizer and chat template; its end-of-sequence token is chosen as the 7th token of the base prompt's greedy
continuation, so that ignore_eos and min_tokens act.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import tempfile

import numpy as np
import pytest

from conftest import random_model
from reference import Greedy
from jaxspec import LLM, SamplingParams
from jaxspec.models.tokenizer import Tokenizer

VOCAB = 9728   # SmolLM2's ids up to its chat template's "system" (9690)
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=8, block_size=4, warmup=False)
PROMPT = "The weather today is"
MESSAGES = [{"role": "system", "content": "Be"}, {"role": "user", "content": "in"}]
GREEDY = dict(temperature=0, max_tokens=10)
SAMPLED = dict(temperature=0.9, seed=11, top_k=50, max_tokens=10)   # sampled cases differ from this in one field
EOS_AT = 6
COLOUR = {"enum": ["red", "green"]}   # one constraint for both structured-output fields: one grammar table
LOGPROB_TOLERANCE = 1e-6   # the same compiled steps, other batches: equal to the bit as measured


@pytest.fixture(scope="module")
def model(smollm2_model):
    """A random 2-layer model over SmolLM2's first VOCAB tokens, with its tokenizer; its end-of-sequence token is
    the (EOS_AT+1)-th token of PROMPT's greedy continuation (from the dense reference), one not emitted before it."""
    model = random_model(5, vocab_size=VOCAB, hidden_size=32)
    tok = smollm2_model.tokenizer
    assert max(tok.encode(PROMPT) + tok.encode(tok.apply_chat_template(MESSAGES))) < VOCAB
    prompt = tok.encode(PROMPT, add_special_tokens=True)
    continuation = Greedy(model.hf_tensors, model.config).next_tokens(prompt, EOS_AT + 1)
    assert continuation[EOS_AT] not in continuation[:EOS_AT]
    model.tokenizer = Tokenizer(tok.hf, chat_template=tok.chat_template, eos_token_id=continuation[EOS_AT],
                                bos_token_id=tok.bos_token_id)
    return model


@pytest.fixture(scope="module")
def reference(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def dense(model):
    """The model's dense float32 reference (tests/reference.py)."""
    return Greedy(model.hf_tensors, model.config)


@pytest.fixture(scope="module")
def speculative_llm(model):
    """An engine drafting 2 tokens a step with a perturbed copy of the model (argmax drafts: it emits what plain
    decoding does, seeds included)."""
    draft = random_model(6, vocab_size=model.config.vocab_size, hidden_size=32, base=model, noise=0.1)
    return LLM(model, **ENGINE, speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=2))


@pytest.fixture(scope="module")
def bias(model, dense):
    """A logit bias that changes PROMPT's greedy continuation from its first token on: the runner-up of the first
    position raised past the winner, and two later tokens of the plain continuation banned."""
    prompt = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    logits = dense.logits(prompt)[-1]
    first, second = np.argsort(-logits)[:2]
    plain = dense.next_tokens(prompt, 4)
    return {int(second): float(logits[first] - logits[second]) + 1.0, plain[2]: -100.0, plain[3]: -100.0}


@pytest.fixture(scope="module")
def cases(model, reference, bias):
    """(endpoint, JSON body fields, SamplingParams kwargs, the case it must differ from or None): every field once.
    Values that depend on the model's output (a stop token, a stop string) are read from the base runs."""
    base = reference.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop" and len(base.token_ids) <= EOS_AT + 1   # the EOS token ends it
    stop_text = model.tokenizer.decode(base.token_ids[2:4])
    assert stop_text.strip() and stop_text in base.text
    c, s = "completions", "chat"
    return {
        "greedy": (c, dict(GREEDY, logprobs=1), dict(GREEDY, logprobs=1), None),
        "ignore_eos": (c, dict(GREEDY, logprobs=1, ignore_eos=True), dict(GREEDY, logprobs=1, ignore_eos=True),
                       "greedy"),
        "min_tokens": (c, dict(GREEDY, logprobs=1, min_tokens=8), dict(GREEDY, logprobs=1, min_tokens=8), "greedy"),
        "stop_token_ids": (c, dict(GREEDY, logprobs=1, stop_token_ids=[base.token_ids[2]]),
                           dict(GREEDY, logprobs=1, stop_token_ids=[base.token_ids[2]]), "greedy"),
        "stop": (c, dict(GREEDY, logprobs=1, stop=[stop_text]), dict(GREEDY, logprobs=1, stop=[stop_text]), "greedy"),
        "max_tokens": (c, dict(GREEDY, logprobs=1, max_tokens=3), dict(GREEDY, logprobs=1, max_tokens=3), "greedy"),
        "logprobs": (c, dict(GREEDY, logprobs=3), dict(GREEDY, logprobs=3), "greedy"),
        "presence_penalty": (c, dict(GREEDY, logprobs=1, presence_penalty=-2.0),
                             dict(GREEDY, logprobs=1, presence_penalty=-2.0), "greedy"),
        "frequency_penalty": (c, dict(GREEDY, logprobs=1, frequency_penalty=-2.0),
                              dict(GREEDY, logprobs=1, frequency_penalty=-2.0), "greedy"),
        "repetition_penalty": (c, dict(GREEDY, logprobs=1, repetition_penalty=0.2),
                               dict(GREEDY, logprobs=1, repetition_penalty=0.2), "greedy"),
        "structured_outputs": (c, dict(GREEDY, logprobs=1, structured_outputs={"json": COLOUR}),
                               dict(GREEDY, logprobs=1, structured_outputs={"json": COLOUR}), "greedy"),
        "sampled": (c, dict(SAMPLED, logprobs=1), dict(SAMPLED, logprobs=1), "greedy"),
        "temperature": (c, dict(SAMPLED, logprobs=1, temperature=0.3), dict(SAMPLED, logprobs=1, temperature=0.3),
                        "sampled"),
        "seed": (c, dict(SAMPLED, logprobs=1, seed=12), dict(SAMPLED, logprobs=1, seed=12), "sampled"),
        "top_k": (c, dict(SAMPLED, logprobs=1, top_k=2), dict(SAMPLED, logprobs=1, top_k=2), "sampled"),
        "top_p": (c, dict(SAMPLED, logprobs=1, top_p=0.2), dict(SAMPLED, logprobs=1, top_p=0.2), "sampled"),
        "min_p": (c, dict(SAMPLED, logprobs=1, min_p=0.3), dict(SAMPLED, logprobs=1, min_p=0.3), "sampled"),
        "n": (c, dict(SAMPLED, logprobs=1, n=2), dict(SAMPLED, logprobs=1, n=2), "sampled"),
        "chat": (s, dict(GREEDY, logprobs=True, top_logprobs=1), dict(GREEDY, logprobs=1), None),
        "chat_top_logprobs": (s, dict(GREEDY, logprobs=True, top_logprobs=2), dict(GREEDY, logprobs=2), "chat"),
        "max_completion_tokens": (s, dict(GREEDY, logprobs=True, top_logprobs=1, max_tokens=None,
                                          max_completion_tokens=3), dict(GREEDY, logprobs=1, max_tokens=3), "chat"),
        "response_format": (s, dict(GREEDY, logprobs=True, top_logprobs=1, response_format={
            "type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}}),
            dict(GREEDY, logprobs=1, structured_outputs={"json": COLOUR}), "chat"),
        "guided_json": (c, dict(GREEDY, logprobs=1, guided_json=COLOUR),
                        dict(GREEDY, logprobs=1, structured_outputs={"json": COLOUR}), "greedy"),
        "logit_bias": (c, dict(GREEDY, logprobs=1, logit_bias={str(t): v for t, v in bias.items()}),
                       dict(GREEDY, logprobs=1, logit_bias=bias), "greedy"),
        "include_stop_str_in_output": (c, dict(GREEDY, logprobs=1, stop=[stop_text], include_stop_str_in_output=True),
                                       dict(GREEDY, logprobs=1, stop=[stop_text], include_stop_str_in_output=True),
                                       "stop"),
        # <|im_start|> (a special token) at every position: skipped in the text unless skip_special_tokens is false
        "special_tokens": (c, dict(GREEDY, logprobs=1, logit_bias={"1": 100}), dict(GREEDY, logprobs=1,
                                                                                   logit_bias={1: 100.0}), "greedy"),
        "skip_special_tokens": (c, dict(GREEDY, logprobs=1, logit_bias={"1": 100}, skip_special_tokens=False),
                                dict(GREEDY, logprobs=1, logit_bias={1: 100.0}, skip_special_tokens=False),
                                "special_tokens"),
        "prompt_logprobs": (c, dict(GREEDY, logprobs=1, prompt_logprobs=2), dict(GREEDY, logprobs=1, prompt_logprobs=2),
                            "greedy"),
    }


def completions_of(response: dict, endpoint: str, decode) -> list[tuple]:
    """(text, finish reason, token texts, logprobs [n], top alternatives [{text: logprob}], prompt logprobs
    [None | {token id: (logprob, rank)}] or None) per choice."""
    out = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        prompt = choice.get("prompt_logprobs")
        prompt = None if prompt is None else [None if e is None else {int(t): (v["logprob"], v["rank"])
                                                                      for t, v in e.items()} for e in prompt]
        if endpoint == "completions":
            lp = choice["logprobs"]
            out.append((choice["text"], choice["finish_reason"], lp["tokens"], lp["token_logprobs"],
                        lp["top_logprobs"], prompt))
        else:
            entries = choice["logprobs"]["content"]
            out.append((choice["message"]["content"], choice["finish_reason"], [e["token"] for e in entries],
                        [e["logprob"] for e in entries],
                        [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries], prompt))
    return out


def expected_of(request_output, decode) -> list[tuple]:
    """The same of a `LLM.generate` RequestOutput's completions, each token named by its text."""
    prompt = request_output.prompt_logprobs
    prompt = None if prompt is None else [None if e is None else {
        **{t: (lp, rank) for rank, (t, lp) in enumerate(e["top"], 1)}, e["token_id"]: (e["logprob"], e["rank"])}
        for e in prompt]
    return [(o.text, o.finish_reason, [decode(t) for t in o.token_ids], [e["logprob"] for e in o.logprobs],
             [{decode(t): lp for t, lp in e["top"]} for e in o.logprobs], prompt) for o in request_output.outputs]


def assert_same(got: list[tuple], want: list[tuple], name: str):
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        assert g[:3] == w[:3], name
        np.testing.assert_allclose(g[3], w[3], atol=LOGPROB_TOLERANCE, err_msg=name)
        assert [sorted(t) for t in g[4]] == [sorted(t) for t in w[4]], name
        np.testing.assert_allclose([v for t in g[4] for _, v in sorted(t.items())],
                                   [v for t in w[4] for _, v in sorted(t.items())],
                                   atol=LOGPROB_TOLERANCE, err_msg=name)
        assert (g[5] is None) == (w[5] is None), name
        if w[5] is not None:
            assert [e and sorted(e) for e in g[5]] == [e and sorted(e) for e in w[5]], name
            assert [e and [r for _, (_, r) in sorted(e.items())] for e in g[5]] == \
                [e and [r for _, (_, r) in sorted(e.items())] for e in w[5]], name
            np.testing.assert_allclose([lp for e in g[5] if e for _, (lp, _) in sorted(e.items())],
                                       [lp for e in w[5] if e for _, (lp, _) in sorted(e.items())],
                                       atol=LOGPROB_TOLERANCE, err_msg=name)


@pytest.fixture(scope="module")
def expected(model, reference, cases):
    """What `LLM.generate` gives for each case: its completions as completions_of reads a response."""
    decode = lambda t: model.tokenizer.decode([t])   # noqa: E731  what the server names each token by
    want = {}
    for name, (endpoint, _, params, _) in cases.items():
        prompt = PROMPT if endpoint == "completions" else [MESSAGES]
        want[name] = expected_of(reference.generate(prompt, SamplingParams(**params), use_tqdm=False)[0], decode)
    return want


@pytest.mark.parametrize("speculative", [False, True])
def test_every_sampling_field_over_http_equals_llm_generate(model, cases, expected, speculative, request):
    """Each case as one HTTP request to the app over its own engine (plain, or drafting 2 tokens with a perturbed
    copy of the model): the response's completions are `expected`'s, and each case's differ from those of the case
    it varies. With speculation, drafts are accepted."""
    from fastapi.testclient import TestClient
    from jaxspec.serve import build_app
    llm = request.getfixturevalue("speculative_llm") if speculative else LLM(model, **ENGINE)
    decode = lambda t: model.tokenizer.decode([t])   # noqa: E731
    want = expected
    with TestClient(build_app(llm, "tiny")) as client:
        for name, (endpoint, fields, _, differs_from) in cases.items():
            body = dict(model="tiny", **{k: v for k, v in fields.items() if v is not None})
            body.update(prompt=PROMPT) if endpoint == "completions" else body.update(messages=MESSAGES)
            r = client.post(f"/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}", json=body)
            assert r.status_code == 200, (name, r.text)
            assert_same(completions_of(r.json(), endpoint, decode), want[name], name)
            if differs_from is not None:   # the field matters
                assert want[name] != want[differs_from], f"{name} changes nothing"
        if speculative:   # vLLM's spec-decode counters on /metrics are the engine's (the engine is idle now)
            assert_vllm_spec_decode_metrics(client.get("/metrics").text, llm.stats()["spec"])
    if speculative:
        assert llm.stats()["spec"]["accepted_tokens"] > 0


def assert_vllm_spec_decode_metrics(text: str, spec: dict):
    """vllm:spec_decode_* (labels model_name, engine; per position too) equal the engine's speculation counts."""
    from prometheus_client.parser import text_string_to_metric_families
    samples = {(s.name, s.labels.get("position")): s for f in text_string_to_metric_families(text) for s in f.samples}
    for name, key in [("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens")]:
        s = samples[(f"vllm:spec_decode_num_{name}_total", None)]
        assert s.value == spec[key] and s.labels == {"model_name": "tiny", "engine": "0"}, name
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))].value
               for p in range(spec["num_speculative_tokens"])]
    assert sum(per_pos) == spec["accepted_tokens"] > 0 and per_pos == sorted(per_pos, reverse=True)


# ---- the fields' effects, against references that are not the engine -------------------------------------------
def biased_greedy(dense, prompt: list[int], bias: dict, n: int) -> list[int]:
    """Greedy decoding of the dense float32 reference with the bias added to its logits, in float32."""
    seq, out = list(prompt), []
    for _ in range(n):
        logits = dense.logits(seq)[-1].astype(np.float32)
        for t, v in bias.items():
            logits[t] += np.float32(v)
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_logit_bias_is_the_dense_reference_with_the_bias_added(model, dense, bias, reference, speculative_llm):
    """Plain decoding and speculation (drafts accepted within the biased request) give the dense reference's greedy
    tokens with the bias added to its logits; a neighbour without a bias in the same batch keeps its own."""
    prompt = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    want, plain = biased_greedy(dense, prompt, bias, 10), dense.next_tokens(prompt, 10)
    assert want != plain
    for llm in (reference, speculative_llm):
        biased, unbiased = llm.generate([prompt, prompt], [
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias, logprobs=1),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)], use_tqdm=False)
        assert biased.token_ids == want and unbiased.token_ids == plain
    assert biased.metrics["num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="logit_bias"):
        reference.generate(prompt, SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)


def test_prompt_logprobs_are_the_dense_log_softmax(model, dense, reference):
    """Each prompt token's logprob, rank and top-3 are the dense reference's log-softmax at the position before it:
    over a prompt prefilled in several chunks (the engine's budget is 8 tokens), whose blocks a plain request cached
    just before (the cached prefix is not reused by a request that needs its logprobs), with n=2 and streamed."""
    prompt = model.tokenizer.encode(PROMPT, add_special_tokens=True) * 5
    assert len(prompt) > 2 * ENGINE["max_num_batched_tokens"]
    lp = dense.log_probs(prompt)
    reference.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # caches the prompt
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=3)
    whole = reference.generate(prompt, dataclasses.replace(params, n=2), use_tqdm=False)[0]
    streamed = [d.prompt_logprobs for d in reference.stream(prompt, params)]
    assert streamed[0] is not None and all(p is None for p in streamed[1:])
    for got in (whole.prompt_logprobs, streamed[0]):
        assert len(got) == len(prompt) and got[0] is None
        for p, e in enumerate(got[1:], 1):
            row, token = lp[p - 1], prompt[p]
            assert e["token_id"] == token and e["logprob"] == pytest.approx(row[token], abs=LOGPROB_TOLERANCE * 10)
            assert e["rank"] == 1 + int((row > row[token]).sum())
            assert [t for t, _ in e["top"]] == np.argsort(-row)[:3].tolist()


def test_stop_strings_and_special_tokens_in_the_text_follow_the_tokenizer(model, reference):
    """include_stop_str_in_output keeps the stop string (or stop token) that ended the text; skip_special_tokens
    false keeps special tokens: each text is the tokenizer's own decoding of the tokens, cut where the stop ends,
    whole and streamed."""
    tok = model.tokenizer
    base = reference.generate(PROMPT, SamplingParams(**GREEDY, ignore_eos=True), use_tqdm=False)[0]
    full = tok.decode(base.token_ids)
    stop = tok.decode(base.token_ids[2:4])
    at = full.find(stop)

    def text(**kw):
        params = SamplingParams(**GREEDY, ignore_eos=True, logprobs=1, **kw)
        whole = reference.generate(PROMPT, params, use_tqdm=False)[0]
        assert "".join(d.text for d in reference.stream(PROMPT, params)) == whole.text
        return whole
    assert text(stop=[stop]).text == full[:at]
    assert text(stop=[stop], include_stop_str_in_output=True).text == full[:at + len(stop)]
    stop_id = base.token_ids[2]
    at_id = base.token_ids.index(stop_id)
    assert text(stop_token_ids=[stop_id]).text == tok.decode(base.token_ids[:at_id])
    assert text(stop_token_ids=[stop_id], include_stop_str_in_output=True).text == \
        tok.decode(base.token_ids[:at_id + 1])
    special = text(logit_bias={1: 100.0}, skip_special_tokens=False)
    assert special.token_ids == [1] * GREEDY["max_tokens"]
    assert special.text == tok.decode(special.token_ids, skip_special_tokens=False) == "<|im_start|>" * 10
    assert text(logit_bias={1: 100.0}).text == tok.decode(special.token_ids) == ""


# ---- chat rendering, tools and the fields a request may not use, over HTTP -------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
# What a hermes-style model writes to call a tool: forced here with a regex, since a random model never would.
HERMES_CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


@contextlib.contextmanager
def serving(llm, **options):
    """The app over `llm` (its engine loop running meanwhile), and the official openai client talking to it."""
    import openai
    from fastapi.testclient import TestClient
    from jaxspec.serve import build_app
    if options:
        from jaxspec.serve import ServeOptions
        options = {"options": ServeOptions(**options)}
    with TestClient(build_app(llm, "tiny", **options)) as client:
        yield client, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client,
                                    max_retries=0)


def test_tool_calls_through_the_openai_client(reference):
    """tool_choice "required" and a named function: tool_calls whose arguments the function's schema validates
    (finish_reason tool_calls / stop, as vLLM); "auto" with the hermes parser: the call the model writes; "none":
    text. Streamed, the deltas add up to the same calls."""
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, logprobs=True, top_logprobs=1)
    weather = {"type": "function", "function": {"name": "get_weather"}}
    with serving(reference, enable_auto_tool_choice=True, tool_call_parser="hermes") as (_, client):
        def calls(stream=False, max_tokens=60, **extra):
            extra["max_tokens"] = max_tokens
            if not stream:
                choice = client.chat.completions.create(**kw, **extra).choices[0]
                return choice.finish_reason, choice.message.content, [
                    (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
            chunks = [c.choices[0] for c in client.chat.completions.create(**kw, **extra, stream=True) if c.choices]
            whole: dict[int, list] = {}
            for delta in (c.delta for c in chunks):
                for call in delta.tool_calls or []:
                    name, args = whole.setdefault(call.index, ["", ""])
                    whole[call.index] = [name + (call.function.name or ""), args + (call.function.arguments or "")]
            content = "".join(c.delta.content or "" for c in chunks) or None
            return chunks[-1].finish_reason, content, [(n, json.loads(a)) for n, a in whole.values()]

        for stream in (False, True):
            reason, content, got = calls(stream, tool_choice="required", parallel_tool_calls=False)
            assert reason == "tool_calls" and not content and len(got) == 1
            jsonschema.validate(got[0][1], schemas[got[0][0]])
            reason, content, got = calls(stream, tool_choice=weather)
            assert reason == "stop" and not content and [name for name, _ in got] == ["get_weather"]
            jsonschema.validate(got[0][1], schemas["get_weather"])
            reason, content, got = calls(stream, max_tokens=len(HERMES_CALL) + 1,
                                         extra_body={"structured_outputs": {"regex": re.escape(HERMES_CALL)}})
            assert (reason, content, got) == ("tool_calls", None, [("get_time", {"zone": "UTC"})])
        reason, content, got = calls(tool_choice="none", max_tokens=4)
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4)
        assert (reason, content, got) == ("length", plain.choices[0].message.content, [])


def test_hermes_parser_on_text():
    from jaxspec.serve.tools import ToolAnswer, ToolPlan, parse_hermes
    content, calls = parse_hermes('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                                  '<tool_call>{"name": "b", "arguments": {}}')   # the last one cut by max_tokens
    assert content == "Let me look.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("a", {"x": 1}),
                                                                                            ("b", {})]
    assert parse_hermes("no call") == ("no call", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    # streamed in small pieces: content before the tag at once (a tag's first characters held back), calls at the end
    answer, pieces = ToolAnswer(ToolPlan("auto", TOOLS)), ["Hi <to", "ol_call>{\"name\": \"a\", ", "\"arguments\": {}}"]
    sent = [answer.deltas(p, None)[0] for p in pieces] + [answer.deltas("</tool_call>", "stop")]
    assert sent[:3] == [[{"content": "Hi "}], [], []]
    deltas, reason = sent[3]
    assert reason == "tool_calls" and deltas[0]["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    # text that only looked like a call start ends as content
    answer = ToolAnswer(ToolPlan("auto", TOOLS))
    assert answer.deltas("a <to", None) == ([{"content": "a "}], None)
    assert answer.deltas("day", "length") == ([{"content": "<today"}], "length")


def test_chat_template_options_render_as_the_tokenizer_does(model, reference):
    """continue_final_message, add_generation_prompt, chat_template_kwargs, tools and --chat-template (a file) give
    the prompt transformers' own apply_chat_template renders (return_token_ids shows it); echo starts the answer
    with the message being continued."""
    from jaxspec.serve.options import load_chat_template
    tok = model.tokenizer
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}{{ tools | length }} functions\n{% endif %}"
                "{% if greeting %}{{ greeting }}\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
    open_turn = MESSAGES + [{"role": "assistant", "content": "The weather"}]
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as f:
        f.write(template)
        f.flush()
        custom = load_chat_template(f.name)
    cases = [  # (server's template, request fields, transformers' apply_chat_template keywords)
        (None, dict(messages=open_turn, add_generation_prompt=False, continue_final_message=True, echo=True),
         dict(conversation=open_turn, add_generation_prompt=False, continue_final_message=True)),
        (None, dict(messages=MESSAGES, add_generation_prompt=False), dict(conversation=MESSAGES,
                                                                          add_generation_prompt=False)),
        (custom, dict(messages=MESSAGES, tools=TOOLS, tool_choice="none", chat_template_kwargs={"greeting": "hi"}),
         dict(conversation=MESSAGES, tools=TOOLS, greeting="hi", add_generation_prompt=True, chat_template=custom))]
    for server_template, fields, hf_kwargs in cases:
        with serving(reference, **({"chat_template": server_template} if server_template else {})) as (client, _):
            r = client.post("/v1/chat/completions", json=dict(model="tiny", max_tokens=2, temperature=0,
                                                                return_token_ids=True, **fields))
        assert r.status_code == 200, r.text
        want = tok.hf.apply_chat_template(**{"chat_template": tok.chat_template, **hf_kwargs}, tokenize=False)
        assert r.json()["prompt_token_ids"] == tok.encode(want)
        content = r.json()["choices"][0]["message"]["content"]
        assert content.startswith("The weather") == bool(fields.get("echo"))


def test_echo_stream_usage_and_logprob_limits_over_http(model, reference):
    """Completions' echo: the prompt's text and its logprobs (the first token none) before the answer's, equal to
    LLM.generate's prompt_logprobs; max_tokens 0 scores the prompt alone. continuous_usage_stats puts the usage so
    far on every chunk. --max-logprobs refuses more."""
    prompt_ids = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    want = reference.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    with serving(reference, max_logprobs=2) as (client, _):
        body = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=1, temperature=0)
        whole = client.post("/v1/completions", json=dict(body, max_tokens=GREEDY["max_tokens"])).json()["choices"][0]
        only = client.post("/v1/completions", json=dict(body, max_tokens=0)).json()
        chunks = [json.loads(line[6:]) for line in client.post("/v1/completions", json=dict(
            model="tiny", prompt=PROMPT, max_tokens=3, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})).text.splitlines()
            if line.startswith("data: {")]
        refused = [client.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, **f))
                   for f in ({"logprobs": 3}, {"prompt_logprobs": 3})]
    assert whole["text"] == PROMPT + want.text
    lp = whole["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want_lps = [e["logprob"] for e in want.prompt_logprobs[1:]] + [e["logprob"] for e in want.logprobs]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want_lps, atol=LOGPROB_TOLERANCE)
    assert len(lp["tokens"]) == len(prompt_ids) + len(want.token_ids)
    assert only["choices"][0]["text"] == PROMPT and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(prompt_ids)]
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]] == [1, 2, 3]
    assert chunks[-1]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 3,
                                   "total_tokens": len(prompt_ids) + 3}
    for r, name in zip(refused, ("logprobs", "prompt_logprobs")):
        assert r.status_code == 400 and f"{name}=3" in r.json()["error"]["message"]


REFUSED = [  # (endpoint, fields, what the 400's message names)
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"no_such_field": 1}, "no_such_field"),
    ("completions", {"guided_grammar": "root ::= 'a'"}, "grammar"),
    ("completions", {"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "guided_*"),
    ("completions", {"priority": 3}, "priority"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": TOOLS}, "auto"),                                   # "auto" without --enable-auto-tool-choice
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ("chat", {"tool_choice": "required"}, "tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "required"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ("chat", {"messages": [{"role": "user", "content": "in", "reasoning_content": "x"}]}, "reasoning_content"),
]


def test_fields_not_served_are_refused_by_name(reference):
    with serving(reference) as (client, _):
        for endpoint, fields, name in REFUSED:
            body = {"model": "tiny", "max_tokens": 2, **({"prompt": PROMPT} if endpoint == "completions" else
                                                         {"messages": MESSAGES}), **fields}
            r = client.post("/v1/completions" if endpoint == "completions" else "/v1/chat/completions", json=body)
            assert r.status_code == 400 and name in r.json()["error"]["message"], (fields, r.text)
        # OpenAI's bookkeeping fields change nothing and are taken, as vLLM takes them
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "user": "u",
                                                 "metadata": {"k": "v"}, "store": False})
        assert r.status_code == 200, r.text


def test_serve_options_from_the_command_line(tmp_path):
    import argparse
    from jaxspec.serve.options import add_serve_args, options_from_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    opts = options_from_args(p.parse_args(["--chat-template", str(tmp_path / "t.jinja"), "--max-logprobs", "5",
                                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert (opts.chat_template, opts.max_logprobs, opts.auto_tool_parser) == ("{{ messages[0]['content'] }}", 5,
                                                                             "hermes")
    assert options_from_args(p.parse_args(["--chat-template", "{% if x %}y{% endif %}"])).chat_template == \
        "{% if x %}y{% endif %}"
    for argv, match in ((["--chat-template", "missing.jinja"], "neither a file"), (["--max-logprobs", "21"], "21"),
                        (["--enable-auto-tool-choice"], "tool_call_parser")):
        with pytest.raises(ValueError, match=match):
            options_from_args(p.parse_args(argv))
