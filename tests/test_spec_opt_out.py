"""A request that does not speculate (SamplingParams.speculative=False) beside requests that do, in the same steps:
its rows verify no drafts and give plain decoding's tokens (greedy, and seeded with sampled drafts, which would
change a speculating request's draws); the speculating rows keep drafting and are lossless too; async equals sync;
the engine's stats and the server's /metrics count the requests that opted out and their tokens; the server takes
the field in the body of both endpoints and refuses a value that is not a bool by name. The tiny target is
tests/test_spec.py's."""
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import random_model
from test_serve_fields import MESSAGES, PROMPT, model, serving, speculative_llm  # noqa: F401 (fixtures)
from test_spec import ENGINE, VOCAB, run, target  # noqa: F401 (fixtures)
from jaxspec import LLM, SamplingParams

K = 3
# Budget for two speculating decode rows (1 + K tokens each) and two that do not (1 each) in every step.
OPT_OUT_ENGINE = {**ENGINE, "max_num_batched_tokens": 16, "num_kv_blocks": 64, "warmup": False}
# Repetitive prompts (n-gram lookup finds drafts in them), one per request, every other request opting out; short
# enough that no row comes near max_model_len, where the drafts a row verifies are cut to the room left.
PROMPTS = [[5, 6, 7, 8, 9] * 3, [40, 41, 42] * 4, [60, 61, 62, 63] * 3, [90, 91] * 6]
SPECULATIVE = [True, False, True, False]


@pytest.fixture(scope="module")
def draft(target):  # noqa: F811
    """A perturbed copy of the target (conftest's spec_drafters' draft model, without fitting the EAGLE heads)."""
    return random_model(1, vocab_size=VOCAB, num_layers=4, base=target, noise=0.15)


def speculating_llm(target, method, draft=None, **options):  # noqa: F811
    spec = dict(method=method, num_speculative_tokens=K, **({} if draft is None else {"model": draft}))
    spec.update({k: options.pop(k) for k in ("draft_sampling", "adaptive") if k in options})
    return LLM(target, **{**OPT_OUT_ENGINE, **options}, speculative_config=spec)


def record_rows(llm) -> list[list[tuple]]:
    """Each step's rows as the scheduler plans them: (the request speculates, a decode row, drafts it verifies)."""
    steps, schedule = [], llm.engine.scheduler.schedule

    def recording():
        rows = schedule()
        steps.append([(row.request.params.speculative, row.start < 0, row.num_drafts) for row in rows])
        return rows
    llm.engine.scheduler.schedule = recording
    return steps


def assert_opted_out_rows_verify_no_drafts_beside_drafting_ones(steps):
    decode_rows = [row for step in steps for row in step if row[1]]
    assert decode_rows and all(drafts == 0 for speculates, _, drafts in decode_rows if not speculates)
    shared = [step for step in steps if any(not speculates and decode for speculates, decode, _ in step)
              and any(speculates and drafts for speculates, _, drafts in step)]
    assert len(shared) >= 3, steps


def assert_opt_out_counts(llm, outs, speculative):
    """Per request: drafts verified by the speculating ones only (some accepted); the stats count the others."""
    for out, speculates in zip(outs, speculative):
        assert (out.metrics["num_draft_tokens"] > 0) == speculates, out.metrics
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    spec = llm.stats()["spec"]
    assert spec["opted_out_requests"] == speculative.count(False)
    assert spec["opted_out_tokens"] == sum(len(o.token_ids) for o, s in zip(outs, speculative) if not s) > 0
    assert spec["accepted_tokens"] > 0 and spec["acceptance_rate"] > 0


@pytest.fixture(scope="module")
def plain_greedy(target):  # noqa: F811
    return [o.token_ids for o in run(LLM(target, **OPT_OUT_ENGINE), PROMPTS,
                                     SamplingParams(temperature=0, max_tokens=20))]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_opted_out_and_speculating_rows_share_steps_losslessly(target, draft, plain_greedy, method):  # noqa: F811
    """Every request's tokens are plain decoding's; the opted-out rows verify no drafts in steps whose other rows
    verify some; async and sync give the same tokens and counts."""
    params = [SamplingParams(temperature=0, max_tokens=20, speculative=s) for s in SPECULATIVE]
    results = {}
    for mode in (True, False):
        llm = speculating_llm(target, method, draft if method == "draft_model" else None, async_scheduling=mode)
        steps = record_rows(llm)
        outs = run(llm, PROMPTS, params)
        assert [o.token_ids for o in outs] == plain_greedy, f"async={mode}"
        assert_opted_out_rows_verify_no_drafts_beside_drafting_ones(steps)
        assert_opt_out_counts(llm, outs, SPECULATIVE)
        assert llm.stats()["num_preemptions"] == 0
        results[mode] = [(o.token_ids, o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"])
                         for o in outs]
    assert results[True] == results[False]


def test_seeded_opted_out_rows_draw_plain_decodings_tokens_beside_sampled_drafts(target, draft):  # noqa: F811
    """Sampled drafts change a seeded request's draws (its distribution is kept, not its tokens); a request that
    opts out draws exactly plain decoding's tokens with its seed, in the same steps, async and sync."""
    params = [SamplingParams(temperature=0.8, top_k=8, seed=50 + i, max_tokens=20, speculative=s)
              for i, s in enumerate(SPECULATIVE)]
    plain = [o.token_ids for o in run(LLM(target, **OPT_OUT_ENGINE), PROMPTS, params)]
    for mode in (True, False):
        llm = speculating_llm(target, "draft_model", draft, draft_sampling="sample", async_scheduling=mode)
        steps = record_rows(llm)
        outs = run(llm, PROMPTS, params)
        assert_opted_out_rows_verify_no_drafts_beside_drafting_ones(steps)
        assert_opt_out_counts(llm, outs, SPECULATIVE)
        for out, want, speculates in zip(outs, plain, SPECULATIVE):
            assert speculates or out.token_ids == want, f"async={mode}"
        # the equality has teeth: speculation with sampled drafts drew other tokens for some request
        assert any(o.token_ids != want for o, want, s in zip(outs, plain, SPECULATIVE) if s)


def test_adaptive_k_proposes_nothing_when_no_request_speculates(target, plain_greedy):  # noqa: F811
    """Under adaptive k, steps whose sampling rows all opted out propose no drafts (k = 0, the plain step), without
    asking the chooser; the tokens are plain decoding's."""
    llm = speculating_llm(target, "ngram", adaptive=True)
    outs = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=20, speculative=False))
    assert [o.token_ids for o in outs] == plain_greedy
    spec = llm.stats()["spec"]
    assert spec["chosen_k"][0] > 0 and spec["chosen_k"][1:] == [0] * K, spec["chosen_k"]
    assert spec["draft_tokens"] == 0 and spec["opted_out_requests"] == len(PROMPTS)
    assert spec["opted_out_tokens"] == sum(len(o.token_ids) for o in outs)


def test_speculative_must_be_a_bool():
    for value in ("no", 0, None):
        with pytest.raises(ValueError, match=r"SamplingParams\.speculative=.*it must be a bool"):
            SamplingParams(speculative=value)


# ---- over HTTP: the field in the body of both endpoints ---------------------------------------------------------
def metric(text: str, name: str) -> float:
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_speculative_false_in_the_body_reaches_the_engine(speculative_llm):  # noqa: F811
    """`"speculative": false` (the openai client's extra_body) on /v1/completions and /v1/chat/completions to
    test_serve_fields' engine (its tiny model over SmolLM2's tokenizer, drafting 2 tokens a step with a perturbed
    copy): those requests verify no drafts and give the text a speculating request gives; the stats and /metrics
    count them. A value that is not a bool is a 400 naming the field."""
    served = speculative_llm
    greedy = dict(model="tiny", temperature=0, max_tokens=10)
    with serving(served) as (http, client):
        def spec_delta(create, **extra):
            before = served.stats()["spec"]
            answer = create(**extra)
            after = served.stats()["spec"]
            return answer, {k: after[k] - before[k] for k in ("draft_tokens", "opted_out_requests",
                                                               "opted_out_tokens")}
        kinds = {"completions": lambda **kw: client.completions.create(prompt=PROMPT, **greedy, **kw),
                 "chat": lambda **kw: client.chat.completions.create(messages=MESSAGES, **greedy, **kw)}
        for kind, create in kinds.items():
            drafting, drafted = spec_delta(create)
            not_drafting, opted_out = spec_delta(create, extra_body={"speculative": False})
            n = not_drafting.usage.completion_tokens
            assert drafted["draft_tokens"] > 0 and drafted["opted_out_requests"] == 0, kind
            assert opted_out == {"draft_tokens": 0, "opted_out_requests": 1, "opted_out_tokens": n}, kind
            text = (lambda r: r.choices[0].text) if kind == "completions" else (lambda r: r.choices[0].message.content)
            assert text(not_drafting) == text(drafting), kind
        spec = served.stats()["spec"]
        exported = http.get("/metrics").text
        assert metric(exported, "jaxspec:spec_decode_opted_out_requests_total") == spec["opted_out_requests"] == 2
        assert metric(exported, "jaxspec:spec_decode_opted_out_tokens_total") == spec["opted_out_tokens"] > 0
        for endpoint, body in (("completions", dict(greedy, prompt=PROMPT)),
                               ("chat/completions", dict(greedy, messages=MESSAGES))):
            for value in ("maybe", [False], {"off": True}):
                r = http.post(f"/v1/{endpoint}", json=dict(body, speculative=value))
                assert r.status_code == 400 and "speculative" in r.json()["error"]["message"], (endpoint, r.text)
