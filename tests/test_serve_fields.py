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

import numpy as np
import pytest

from conftest import random_model
from reference import Greedy
from jaxspec import LLM, SamplingParams
from jaxspec.models.tokenizer import Tokenizer

VOCAB = 9728   # SmolLM2's ids up to its chat template's "system" (9690)
ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, block_size=4, warmup=False)
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
def cases(model, reference):
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
    }


def completions_of(response: dict, endpoint: str, decode) -> list[tuple]:
    """(text, finish reason, token texts, logprobs [n], top alternatives [{text: logprob}]) per choice."""
    out = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        if endpoint == "completions":
            lp = choice["logprobs"]
            out.append((choice["text"], choice["finish_reason"], lp["tokens"], lp["token_logprobs"],
                        lp["top_logprobs"]))
        else:
            entries = choice["logprobs"]["content"]
            out.append((choice["message"]["content"], choice["finish_reason"], [e["token"] for e in entries],
                        [e["logprob"] for e in entries],
                        [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]))
    return out


def expected_of(outputs, decode) -> list[tuple]:
    """The same of `LLM.generate`'s completions (CompletionOutput), each token named by its text."""
    return [(o.text, o.finish_reason, [decode(t) for t in o.token_ids], [e["logprob"] for e in o.logprobs],
             [{decode(t): lp for t, lp in e["top"]} for e in o.logprobs]) for o in outputs]


def assert_same(got: list[tuple], want: list[tuple], name: str):
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        assert g[:3] == w[:3], name
        np.testing.assert_allclose(g[3], w[3], atol=LOGPROB_TOLERANCE, err_msg=name)
        assert [sorted(t) for t in g[4]] == [sorted(t) for t in w[4]], name
        np.testing.assert_allclose([v for t in g[4] for _, v in sorted(t.items())],
                                   [v for t in w[4] for _, v in sorted(t.items())],
                                   atol=LOGPROB_TOLERANCE, err_msg=name)


@pytest.fixture(scope="module")
def expected(model, reference, cases):
    """What `LLM.generate` gives for each case: its completions as completions_of reads a response."""
    decode = lambda t: model.tokenizer.decode([t])   # noqa: E731  what the server names each token by
    want = {}
    for name, (endpoint, _, params, _) in cases.items():
        prompt = PROMPT if endpoint == "completions" else [MESSAGES]
        want[name] = expected_of(reference.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs,
                                 decode)
    return want


@pytest.mark.parametrize("speculative", [False, True])
def test_every_sampling_field_over_http_equals_llm_generate(model, cases, expected, speculative):
    """Each case as one HTTP request to the app over its own engine (plain, or drafting 2 tokens with a perturbed
    copy of the model): the response's completions are `expected`'s, and each case's differ from those of the case
    it varies. With speculation, drafts are accepted."""
    from fastapi.testclient import TestClient
    from jaxspec.serve import build_app
    spec = None
    if speculative:
        draft = random_model(6, vocab_size=model.config.vocab_size, hidden_size=32, base=model, noise=0.1)
        spec = dict(method="draft_model", model=draft, num_speculative_tokens=2)
    llm = LLM(model, **ENGINE, speculative_config=spec)
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
    if speculative:
        assert llm.stats()["spec"]["accepted_tokens"] > 0
