"""Structured outputs (JSON schema, regex, choice) applied on the device, under speculation and async scheduling.

The target is a tiny random model whose vocabulary is SmolLM2's first 512 tokens (every byte and the first
merges), with SmolLM2's tokenizer: outputs are real text, and a random model's unconstrained text is never
JSON, so the constraint has to do all the work. Host references mask the full-vocabulary logits of the dense
reference model (tests/reference.py) with outlines-core's own automaton queries, not with the engine's table.
Every engine shares one shape configuration and one token bucket (few compilations, which the persistent
cache of conftest shares between async and sync engines).
"""
import concurrent.futures
import json
import re
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from conftest import random_model
from eagle_heads import write_eagle3_head
from reference import EagleReference, Greedy, greedy_spec_counts, target_forward
from test_spec_sampling import chi2_rejects
from jaxspec import LLM, SamplingParams, StructuredOutputsParams
from jaxspec.structured.compile_pool import CompileUnavailable
from jaxspec.structured.compiler import GrammarCompiler, token_bytes
from jaxspec.structured.table import GrammarTables

VOCAB = 512
# One token bucket (8); a 20-block pool that four long requests overflow (forced preemption).
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=96, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=20, warmup=False)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "ok", "tag"]}
JSON = StructuredOutputsParams(json=SCHEMA)
REGEX = StructuredOutputsParams(regex=r"(ab|cd)( (ab|cd)){5}")
CHOICE = StructuredOutputsParams(choice=["yes", "no", "maybe", "yes sir"])


def valid(so: StructuredOutputsParams, text: str) -> bool:
    if so.kind == "choice":
        return text in so.choice
    if so.kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    try:
        jsonschema.validate(json.loads(text), so.json)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(20, VOCAB, length)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_path):
    from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf
    from jaxspec.models.tokenizer import Tokenizer
    return Tokenizer(hf_tokenizer_from_gguf(smollm2_gguf_path), eos_token_id=2)


@pytest.fixture(scope="module")
def target(tokenizer):
    model = random_model(0, vocab_size=VOCAB, num_layers=2, attn_gain=0.3)
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def draft(target):
    """A perturbed copy of the target: it agrees with it often but not always."""
    model = random_model(1, vocab_size=VOCAB, num_layers=2, base=target, noise=0.15)
    model.tokenizer = target.tokenizer
    return model


@pytest.fixture(scope="module")
def eagle3_head(target, tmp_path_factory):
    """A random EAGLE-3 head for the target in the published layout (tests/eagle_heads.py; its draft vocabulary a
    random half of the target's). Fitting one to the target takes longer than this file's whole budget on a CPU;
    under a grammar a random head's masked drafts are accepted wherever the grammar leaves one token (or the
    masked argmaxes agree), at every draft position, and are rejected elsewhere."""
    return write_eagle3_head(tmp_path_factory.mktemp("heads") / "eagle3", target.config, seed=3)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


class HostReference:
    """The target's logits from the dense reference, masked on the host with outlines-core's Index of the same
    constraint: its allowed tokens that lead to a state from which the regex can still end, and EOS (any of the
    model's) exactly where it may end (where the Index allows the END token)."""

    def __init__(self, target, compiler, length: int = 128):
        t = {k: jnp.asarray(v) for k, v in target.hf_tensors.items()}
        self._logits = jax.jit(lambda ids: target_forward(t, target.config, ids)[0])
        self.length, self.eos, self.end = length, set(target.tokenizer.eos_token_ids), compiler.end_token
        self.index = compiler.index
        self._graphs = []

    def logits(self, ids) -> np.ndarray:
        padded = np.zeros(self.length, np.int32)
        padded[:len(ids)] = ids
        return np.asarray(self._logits(jnp.asarray(padded)), np.float64)[len(ids) - 1]

    def graph(self, index) -> tuple[dict, set]:
        """(transitions, the states from which the regex can still end) of `index`, computed once per Index."""
        for known, edges, can_end in self._graphs:
            if known is index:
                return edges, can_end
        edges = index.get_transitions()
        finals = set(index.get_final_states())
        can_end = {s for s, out in edges.items() if out.get(self.end) in finals}
        while True:   # states that reach one that can end
            more = {s for s, out in edges.items() if s not in can_end and set(out.values()) & can_end}
            if not more:
                break
            can_end |= more
        self._graphs.append((index, edges, can_end))
        return edges, can_end

    def allowed(self, index, state) -> list[int]:
        edges, can_end = self.graph(index)
        tokens = {t for t in index.get_allowed_tokens(state) if edges[state][t] in can_end}
        ends = edges[state].get(self.end) in set(index.get_final_states())
        return sorted((tokens - self.eos - {self.end}) | (self.eos if ends else set()))

    def greedy(self, so, prompt, max_tokens: int) -> list[int]:
        index = self.index(so)
        state, out = index.get_initial_state(), []
        while len(out) < max_tokens:
            allowed = self.allowed(index, state)
            logits = self.logits(prompt + out)
            out.append(allowed[int(np.argmax(logits[allowed]))])
            if out[-1] in self.eos:
                break
            state = index.get_next_state(state, out[-1])
        return out

    def outcomes(self, so, prompt, temperature: float) -> dict:
        """{output token ids (EOS included): probability} of sampling at `temperature` under the constraint."""
        index = self.index(so)
        probs, todo = {}, [((), index.get_initial_state(), 1.0)]
        while todo:
            seq, state, pr = todo.pop()
            allowed = self.allowed(index, state)
            x = self.logits(prompt + list(seq))[allowed] / temperature
            p = np.exp(x - x.max())
            for tok, q in zip(allowed, p / p.sum()):
                if tok in self.eos:
                    probs[seq + (tok,)] = pr * q
                else:
                    todo.append((seq + (tok,), index.get_next_state(state, tok), pr * q))
        return probs


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_constrained_greedy_is_the_host_reference_and_drafts_stay_inside(target, compiler):
    """Three constraints in one batch, greedy, the target as its own draft model: every output is the host
    reference's (logits masked with outlines-core's automaton at each step), valid, and ends with EOS; every
    draft at every position is accepted (the drafter masks its logits with the state its drafts reach, exactly as
    the verifier does); the unconstrained continuations are not valid (the constraint decides)."""
    reference = HostReference(target, compiler)
    constraints = [JSON, REGEX, CHOICE]
    prompts = [prompt_of(n, 10 + i) for i, n in enumerate([5, 9, 3])]
    llm = LLM(target, **ENGINE, speculative_config=dict(method="draft_model", model=target, num_speculative_tokens=3))
    outs = run(llm, prompts, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
                              for so in constraints])
    unconstrained = Greedy(target.hf_tensors, target.config, 128)
    for so, prompt, out in zip(constraints, prompts, outs):
        assert out.token_ids == reference.greedy(so, prompt, 60), so.kind
        assert out.finish_reason == "stop" and valid(so, out.text), (so.kind, out.text)
        free = target.tokenizer.decode(unconstrained.next_tokens(prompt, 24))
        assert not valid(so, free), free
    spec = llm.stats()["spec"]
    assert spec["per_position_acceptance"] == [1.0] * 3 and spec["draft_tokens"] > 30, spec
    assert llm.stats()["structured_outputs"]["automata"] == 3


def mixed_batch():
    """Constrained and unconstrained requests, greedy and seeded, three constraints, a min_tokens that the grammar
    overrides: one batch."""
    prompts = [prompt_of(n, 20 + i) for i, n in enumerate([6, 11, 4, 8, 7, 5])]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON),
              SamplingParams(temperature=0.8, seed=1, max_tokens=60, structured_outputs=JSON),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=REGEX),
              SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs=REGEX),
              # min_tokens past every choice's length: where the grammar allows only EOS, the grammar wins
              SamplingParams(temperature=1.0, seed=3, max_tokens=10, min_tokens=8, structured_outputs=CHOICE),
              SamplingParams(temperature=0.8, seed=4, max_tokens=60, ignore_eos=True)]
    return prompts, params


def test_mixed_batches_under_speculation_preemption_async_and_sync(target, draft):
    """n-gram and draft-model speculation, async and sync, a pool that forces preemption (a preempted request
    resumes from the automaton state its outputs lead to): every constrained output is valid, async == sync
    (tokens; and drafted/accepted counts of the requests neither run preempted: a preemption's timing differs
    between the modes, and a re-prefilled request drafts afresh), and with argmax drafts the seeded tokens are the
    same whatever the drafter (speculation never changes them)."""
    prompts, params = mixed_batch()
    tokens = {}
    for method in ("ngram", "draft_model"):
        spec = dict(method=method, num_speculative_tokens=3, **({"model": draft} if method == "draft_model" else {}))
        for mode in (True, False):
            llm = LLM(target, **ENGINE, async_scheduling=mode, speculative_config=spec)
            outs = run(llm, prompts, params)
            stats = llm.stats()
            assert stats["num_preemptions"] > 0 and stats["spec"]["accepted_tokens"] > 0, (method, mode, stats)
            for p, o in zip(params, outs):
                if p.structured_outputs is not None:
                    assert o.finish_reason == "stop" and valid(p.structured_outputs, o.text), (method, o.text)
            assert not valid(JSON, outs[-1].text)
            tokens[method, mode] = [(o.token_ids, o.metrics["num_preemptions"], o.metrics["num_draft_tokens"],
                                     o.metrics["num_accepted_tokens"]) for o in outs]
        runs = tokens[method, True], tokens[method, False]
        assert [r[0] for r in runs[0]] == [r[0] for r in runs[1]], method
        kept = [i for i in range(len(prompts)) if runs[0][i][1] == runs[1][i][1] == 0]
        assert kept and [runs[0][i][2:] for i in kept] == [runs[1][i][2:] for i in kept], (method, runs)
    assert [r[0] for r in tokens["ngram", True]] == [r[0] for r in tokens["draft_model", True]]


def test_eagle3_drafts_inside_the_grammar_are_accepted_and_lossless(target, compiler, eagle3_head):
    """An EAGLE-3 head drafting under a JSON schema and a regex, greedy, async and sync: the outputs are the host
    reference's constrained greedy tokens (what decoding without speculation emits), valid, and each request's
    drafted and accepted counts (and the accepted count per draft position) equal a step-by-step host
    recomputation in which the head's drafts are its argmax over the tokens the automaton allows after the
    sequence and the drafts before them (outlines-core's Index, not the engine's table; the unrestricted argmax
    where the draft vocabulary holds no allowed token). Drafts the head proposed outside the grammar would be
    rejected, not emitted: only these counts see a drafter that does not mask."""
    from safetensors.numpy import load_file
    from jaxspec.models.config import ModelConfig
    k, max_tokens, length = 3, 60, 128
    reference = HostReference(target, compiler, length)
    hcfg = ModelConfig.from_hf({"model_type": "llama", **json.loads((eagle3_head / "config.json").read_text())})
    head = EagleReference("eagle3", load_file(str(eagle3_head / "model.safetensors")), hcfg, target.hf_tensors,
                          target.config)
    constraints = [JSON, REGEX]
    prompts = [prompt_of(7, 60), prompt_of(4, 61)]
    outputs = [reference.greedy(so, p, max_tokens) for so, p in zip(constraints, prompts)]

    def state_after(index, tokens):
        """The Index's state after `tokens` (EOS keeps it, as the engine's automaton does); None outside."""
        state = index.get_initial_state()
        for t in tokens:
            if state is None or t not in reference.allowed(index, state):
                return None
            state = state if t in reference.eos else index.get_next_state(state, t)
        return state

    expected = []
    for so, prompt, out in zip(constraints, prompts, outputs):
        index = reference.index(so)
        assert out[-1] in reference.eos and reference.allowed(index, state_after(index, out)) == [out[-1]]
        continuation = prompt + out + [out[-1]] * (k + 1)   # past the end the automaton allows EOS alone

        def allowed_after(tokens, index=index):
            state = state_after(index, tokens)
            return None if state is None else reference.allowed(index, state)

        def propose(seq, prompt_len=len(prompt), allowed_after=allowed_after):
            return head.greedy_drafts(seq, k, length, allowed=lambda drafts: allowed_after(seq[prompt_len:] + drafts))
        expected.append(greedy_spec_counts(continuation, len(prompt), len(out), ENGINE["max_model_len"], k, propose))
    for mode in (True, False):
        llm = LLM(target, **{**ENGINE, "num_kv_blocks": 64}, async_scheduling=mode,
                  speculative_config=dict(method="eagle3", model=str(eagle3_head), num_speculative_tokens=k))
        outs = run(llm, prompts, [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
                                  for so in constraints])
        assert llm.stats()["num_preemptions"] == 0
        for so, out, o in zip(constraints, outputs, outs):
            assert o.token_ids == out and o.finish_reason == "stop" and valid(so, o.text), (mode, so.kind, o.text)
        got = [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
        assert got == [(e["draft_tokens"], e["accepted_tokens"]) for e in expected], f"async={mode}"
        spec = llm.stats()["spec"]
        per_position = np.round(np.asarray(spec["per_position_acceptance"]) * spec["drafts"]).astype(int)
        assert per_position.tolist() == np.sum([e["per_position"] for e in expected], axis=0).tolist()
        assert (per_position > 0).all() and 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec


def test_a_parallel_head_carries_the_grammar_state_across_its_drafts(target, compiler, eagle3_head, tmp_path):
    """A parallel EAGLE-3 head (the random head above with random placeholders: docs/parallel_drafting.md) drafting
    under a JSON schema and a regex, greedy, async and sync: the outputs are the host reference's constrained greedy
    tokens, valid, the same counts async and sync, and drafts are accepted at every draft position: where the
    grammar leaves one token, each of the k drafts picked from the one forward is masked by the state its
    predecessors reached (masked by the state before the first, the later forced drafts would be rejected)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    head = tmp_path / "parallel"
    shutil.copytree(eagle3_head, head)
    tensors = load_file(str(head / "model.safetensors"))
    D = target.config.hidden_size
    rng = np.random.default_rng(4)
    tensors.update(mask_embed=rng.standard_normal(D).astype(np.float32),
                   mask_hidden=rng.standard_normal(D).astype(np.float32))
    save_file(tensors, str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "parallel_drafting": True}))
    k, max_tokens = 3, 60
    reference = HostReference(target, compiler)
    constraints = [JSON, REGEX]
    prompts = [prompt_of(7, 60), prompt_of(4, 61)]
    outputs = [reference.greedy(so, p, max_tokens) for so, p in zip(constraints, prompts)]
    runs = {}
    for mode in (True, False):
        llm = LLM(target, **{**ENGINE, "num_kv_blocks": 64}, async_scheduling=mode,
                  speculative_config=dict(method="eagle3", model=str(head), num_speculative_tokens=k))
        outs = run(llm, prompts, [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
                                  for so in constraints])
        for so, out, o in zip(constraints, outputs, outs):
            assert o.token_ids == out and o.finish_reason == "stop" and valid(so, o.text), (mode, so.kind, o.text)
        spec = llm.stats()["spec"]
        assert all(p > 0 for p in spec["per_position_acceptance"]), spec
        runs[mode] = [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert runs[True] == runs[False]


def test_sampled_drafts_keep_the_constrained_distribution(target, draft, compiler):
    """Seeded requests under a choice constraint, drafts sampled by a draft model that differs from the target:
    the distribution of whole outputs is the target's masked distribution, computed exactly on the host (p and
    q are both masked, so rejection sampling stays exact). The same samples reject a distribution with 0.1 of
    probability moved between the two likeliest outputs (the test's power)."""
    n, temperature = 1000, 1.0
    prompt = prompt_of(6, 40)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=10, structured_outputs=CHOICE)
              for i in range(n)]
    llm = LLM(target, **ENGINE, speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=3,
                                                        draft_sampling="sample"))
    outs = run(llm, [prompt] * n, params)
    assert all(o.text in CHOICE.choice for o in outs)
    spec = llm.stats()["spec"]
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec
    probs = HostReference(target, compiler).outcomes(CHOICE, prompt, temperature)
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert not chi2_rejects(counts, probs, n), (counts, probs)
    ranked = sorted(probs, key=probs.get, reverse=True)
    shifted = dict(probs)
    shifted[ranked[0]] -= 0.1
    shifted[ranked[1]] += 0.1
    assert chi2_rejects(counts, shifted, n), "the test cannot see a 0.1 error"


# ---- host side: errors, compilation, the table ---------------------------------------------------------------

def test_bad_constraints_are_refused_with_what_is_valid(compiler):
    for kwargs, match in [(dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"),
                          (dict(choice=[]), "non-empty list"), (dict(json="{not json"), "not valid JSON"),
                          (dict(json=[1]), "a JSON schema is an object"), (dict(grammar="root ::= 'a'"), "not supported")]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs == StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="Unsupported type: foo"):
        compiler.compile(StructuredOutputsParams(json={"type": "foo"}))
    with pytest.raises(ValueError, match="regex cannot be compiled"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    assert compiler.compile(REGEX) is compiler.compile(StructuredOutputsParams(regex=REGEX.regex))   # cached
    slow = GrammarCompiler(compiler.tokenizer, VOCAB, timeout=0.01)
    with pytest.raises(ValueError, match="took longer than 0.01 s"):
        slow.compile(StructuredOutputsParams(json_object=True))
    assert slow.pool.pids == []   # its compile process was killed: nothing runs on after the refusal
    slow.close()


def test_compiles_are_bounded_and_explosions_refused_before_compiling(tokenizer):
    """Issue #34: a compile past its budget ran on in the background with unbounded memory. Counts that explode
    are refused before any compile (no process even starts), a compile past its memory budget is stopped with a
    message that says so, and the next constraint compiles as usual."""
    bounded = GrammarCompiler(tokenizer, VOCAB, timeout=60, memory_gb=0.25)
    for regex, named in [("(a|b){1,100000}", "{1,100000}"), ("((ab){1,1000}){1,1000}", "{1,1000}")]:
        start = time.monotonic()
        with pytest.raises(ValueError, match=re.escape(named)):
            bounded.compile(StructuredOutputsParams(regex=regex))
        assert time.monotonic() - start < 1
    assert bounded.pool.pids == []
    with pytest.raises(ValueError, match="needs more memory to compile than the 0.25 GiB"):
        bounded.compile(StructuredOutputsParams(regex=".{0,1000}"))   # ~16M edges: gigabytes while compiling
    assert bounded.pool.pids == []   # the process that ran out is gone, with its memory
    assert bounded.compile(CHOICE).num_states > 1
    bounded.close()


def test_a_full_compile_pool_answers_busy_and_closing_it_stops_what_runs(tokenizer):
    """Others' slow constraints hold every compile process: a new constraint waits its time, then is told the
    server is busy (not that it is bad). Closing the pool (shutdown) stops the compile under way."""
    one = GrammarCompiler(tokenizer, VOCAB, timeout=60, workers=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(one.compile, StructuredOutputsParams(regex=".{0,2000}"))   # seconds to compile
        deadline = time.monotonic() + 30
        while not one.pool.pids and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(CompileUnavailable, match="server is busy"):
            one.pool.compile("choice", "(yes|no)\uffff", timeout=5, wait=0.2)
        one.close()
        with pytest.raises(CompileUnavailable, match="shutting down"):
            slow.result(timeout=10)
    assert one.pool.pids == []


def test_automaton_walks_and_the_table_grows_only_when_it_must(compiler, tokenizer):
    byte_token = {data: i for i, data in token_bytes(tokenizer, VOCAB).items() if len(data) == 1}
    ids = lambda text: [byte_token[bytes([b])] for b in text.encode()]   # noqa: E731  one token per byte
    a = compiler.compile(CHOICE)
    assert set(a.allowed(a.walk(ids("maybe")))) == {2}     # a whole choice that nothing extends: EOS only
    assert 2 in a.allowed(a.walk(ids("yes"))) and byte_token[b" "] in a.allowed(a.walk(ids("yes")))
    assert 2 not in a.allowed(a.initial) and a.walk(ids("yes no")) == -1
    inside = compiler.compile(JSON)
    string = inside.walk(ids('{"name":"ab'))      # END's character is a string character too: not an end here
    assert string >= 0 and 2 not in inside.allowed(string) and inside.token.max() < VOCAB
    any_object = compiler.compile(StructuredOutputsParams(json_object=True))
    assert 2 in any_object.allowed(any_object.walk(ids('{"a": [1.5, null], "b": {"c": "d"}}')))
    for text in ('{"a": {"b": {"c": 1}}}', '{"a": [{"b": 1}]}', "[1]"):   # nested too deep; not an object
        assert any_object.walk(ids(text)) == -1, text
    tables = GrammarTables(VOCAB)
    b, c = compiler.compile(REGEX), compiler.compile(JSON)
    tables.acquire(a)
    tables.acquire(b)
    assert (tables.base(a), tables.base(b)) == (0, a.num_states) and tables.growths == 0
    tables.release(a)
    tables.acquire(c)     # it fits after `b`: `a`, unused, keeps its place
    assert tables.growths == 0 and tables.base(c) == a.num_states + b.num_states
    tables.acquire(any_object)   # more states and wide ones than the table holds: `a` dropped, then one growth
    assert tables.growths == 1 and tables.stats()["automata"] == 3 and tables.base(b) == 0
    assert tables.num_bitmap_rows == 1 + sum(int((x.count > tables.dense_above).sum()) for x in (b, c, any_object))
    table = tables.device_table()
    assert table.search_width >= int(c.count.max()) and table is tables.device_table()   # no upload without a change
    states, edges = np.asarray(table.states), np.asarray(table.edges)
    s = tables.base(c) + c.initial
    assert edges[states[s, 0]:states[s, 0] + states[s, 1], 0].tolist() == c.allowed(c.initial).tolist()


def test_the_device_table_masks_and_advances_as_each_automaton(compiler):
    """Every state of three automata laid out in one table: the device's mask (bitmap rows for the wide states,
    scattered edges for the narrow ones) is the state's allowed tokens, and its search finds the next state of
    every allowed token and -1 for tokens the state does not allow; unconstrained rows allow everything."""
    from jaxspec.decode import grammar
    tables = GrammarTables(VOCAB)
    automata = [compiler.compile(so) for so in (JSON, REGEX, CHOICE)]
    for a in automata:
        tables.acquire(a)
    table = tables.device_table()
    assert 1 < tables.num_bitmap_rows < sum(a.num_states for a in automata) + 1   # both kinds of state
    mask_of = jax.jit(lambda base, state: grammar.allowed_tokens(table, base, state, VOCAB))
    advance = jax.jit(lambda base, state, token: grammar.advance(table, base, state, token))
    rng = np.random.default_rng(0)
    for a in automata:
        states = np.arange(a.num_states, dtype=np.int32)
        base = np.full_like(states, tables.base(a))
        mask = np.asarray(mask_of(base, states))
        for s in states:
            assert np.flatnonzero(mask[s]).tolist() == a.allowed(s).tolist(), s
        rows = [(s, int(t)) for s in states for t in a.allowed(s)]                   # every edge
        rows += [(int(s), int(t)) for s, t in zip(rng.integers(0, a.num_states, 2000), rng.integers(0, VOCAB, 2000))]
        s, t = (np.array(x, np.int32) for x in zip(*rows))
        got = np.asarray(advance(np.full_like(s, tables.base(a)), s, t))
        assert got.tolist() == [a.next(int(si), int(ti)) for si, ti in zip(s, t)]
    free = np.array([-1, 0], np.int32), np.array([3, -1], np.int32)                  # no automaton; no state
    assert np.asarray(mask_of(*free)).all() and np.asarray(advance(*free, np.array([5, 5], np.int32))).tolist() == [-1, -1]
