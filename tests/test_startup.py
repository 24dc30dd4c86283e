"""Start-up (jaxspec/decode/compiler.py, Engine.warmup): what a fresh engine compiles before it serves, and serving
while the rest compiles in the background.

On a CPU both tiers of a program are one compile, so these count programs and check the scheduling around them;
the tiers' seconds are measured on the GPU (docs/performance.md, "Start-up").
"""
import threading
import time

import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.decode.compiler import StepPrograms
from jaxspec.decode.step import StepVariant
from jaxspec.sched.adaptive import KChooser
from jaxspec.sched.warmup import WARM_VARIANTS
from test_spec import ENGINE, drafters, prompt_of, target  # noqa: F401 (fixtures)

BUCKETS = [8, 16]
ENGINE16 = {**ENGINE, "max_num_batched_tokens": 16}


def record_background(monkeypatch) -> list:
    """StepPrograms.start_background records its jobs instead of compiling them."""
    jobs = []
    monkeypatch.setattr(StepPrograms, "start_background", lambda self, todo: jobs.extend(todo))
    return jobs


@pytest.mark.parametrize("method,adaptive", [(None, False), ("draft_model", False), ("eagle3", False),
                                             ("draft_model", True)])
def test_tiered_start_compiles_two_programs_whatever_the_drafter(target, drafters, monkeypatch, method, adaptive):  # noqa: F811
    """The design's bound: before a tiered engine serves, it compiles the smallest bucket's greedy and sampling
    programs at the full draft width, two programs for any drafter and for adaptive k (which would otherwise
    need (K + 1) x as many); every other warm program is left to the background, each once per tier."""
    jobs = record_background(monkeypatch)
    K = 2
    spec = None if method is None else dict(method=method, num_speculative_tokens=K, model=drafters[method],
                                            adaptive=adaptive)
    llm = LLM(target, **ENGINE16, warmup="tiered", speculative_config=spec)
    runner = llm.engine.runner
    assert runner.token_buckets == BUCKETS
    assert {(k[0], k[1]) for k in runner.programs.programs} == {(8, v) for v in WARM_VARIANTS}
    widths = [None] + (list(range(K)) if adaptive else [])
    warm = {(T, StepVariant(sample=v.sample, drafts=d)) for T in BUCKETS for v in WARM_VARIANTS for d in widths}
    assert len(warm) == len(BUCKETS) * 2 * len(widths)
    assert {(key[0], key[1]) for key, _ in jobs} == warm
    assert len(jobs) == 2 * len(warm)   # each once per tier: fast, then tuned
    assert llm.stats()["compile"]["programs"] == 2 and llm.startup["compile_blocking_s"] > 0


def test_full_start_compiles_every_warm_program(target, monkeypatch):  # noqa: F811
    jobs = record_background(monkeypatch)
    llm = LLM(target, **ENGINE16, warmup="full")
    assert llm.stats()["compile"]["programs"] == len(BUCKETS) * len(WARM_VARIANTS) and jobs == []
    assert LLM(target, **ENGINE16, warmup=False).stats()["compile"]["programs"] == 0


def test_after_a_full_start_requests_compile_nothing(target, caplog):  # noqa: F811
    """After warmup="full", requests compile nothing: not a step, and not the small programs around the steps (the
    inbox load, the outputs' copy and their buffers, the history write of a prefix-cache hit, a logit-bias row),
    which otherwise compiled at the first request and at the first cache hit (~0.4 s of TTFT each on an H100)."""
    import jax
    llm = LLM(target, **ENGINE16, warmup="full")
    prompts = [prompt_of(37, 0), prompt_of(21, 1)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for _ in range(2):   # the second time, both prompts' first blocks come from the prefix cache
            llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["prefix_cache"]["hit_tokens"] >= 32
    compiled = [r.getMessage()[:80] for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert compiled == []


def test_warmup_mode_is_checked(target):  # noqa: F811
    with pytest.raises(ValueError, match="warmup='eager' is invalid.*'tiered'"):
        LLM(target, **ENGINE16, warmup="eager")


def test_a_request_is_served_while_other_programs_compile(target, monkeypatch):  # noqa: F811
    """The 16-token bucket's compiles are held back: requests are served by the 8-token programs (prefill in
    8-token chunks), with the tokens of a fully warmed engine; once the compiles land, steps use 16 again and
    nothing compiled on demand."""
    release, held = threading.Event(), []

    def hold(key, tier):
        if key[0] == 16:
            held.append(key)
            assert release.wait(120), "the test never released the held compile"
    init = StepPrograms.__init__

    def init_holding(self, *a, **kw):
        init(self, *a, **kw)
        self.before_compile = hold
    monkeypatch.setattr(StepPrograms, "__init__", init_holding)
    prompts = [prompt_of(n, seed) for n, seed in ((13, 0), (11, 1), (5, 2))]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, seed=5, max_tokens=6),
              SamplingParams(temperature=0, max_tokens=6)]
    llm = LLM(target, **ENGINE16, warmup="tiered")
    runner, used = llm.engine.runner, []
    bucket_for = runner.bucket_for
    monkeypatch.setattr(runner, "bucket_for", lambda n: used.append(bucket_for(n)) or used[-1])
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert set(used) == {8} and llm.engine.runner.programs.compiling()
        assert not any(runner.programs.ready((16, v, None)) for v in WARM_VARIANTS)
        for _ in range(600):   # the background reaches the held compile (it may still be lowering)
            if held:
                break
            time.sleep(0.1)
        assert held and not any(runner.programs.ready((16, v, None)) for v in WARM_VARIANTS)
    finally:
        release.set()
    assert llm.engine.wait_compiled(120)
    used.clear()
    fresh = [prompt_of(n, seed) for n, seed in ((14, 10), (12, 11), (6, 12))]   # not in the prefix cache
    later = llm.generate(fresh, params, use_tqdm=False)
    assert 16 in used
    monkeypatch.setattr(StepPrograms, "__init__", init)
    full = LLM(target, **ENGINE16, warmup="full")
    assert [o.token_ids for o in outs] == [o.token_ids for o in full.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in later] == [o.token_ids for o in full.generate(fresh, params, use_tqdm=False)]
    assert llm.stats()["recompiles"] == 0 and llm.stats()["compile"]["programs"] == len(BUCKETS) * 2


def test_adaptive_k_picks_only_compiled_widths():
    class Compiling:   # what decode.compiled.CompiledSteps answers while widths 2 and 3 compile in the background
        widths = {0, 1}

        def ready(self, k, T):
            return k in self.widths

        def token_budget(self):
            return 64
    compiled = Compiling()
    c = KChooser(3, 64, lambda n: max(8, 1 << (n - 1).bit_length()), compiled)
    c.time_model = lambda k, T: 1.0 + 0.01 * T   # drafts cost nothing here: the widest k wins
    assert {c.choose(s, 2) for s in range(20)} == {1}
    compiled.widths = {0, 1, 2, 3}   # the compiles ended
    assert c.choose(20, 2) == 3


def test_fast_programs_are_replaced_by_tuned_ones(target, monkeypatch, tmp_path):  # noqa: F811
    """With the GPU's two tiers (their options: a CPU compile accepts and ignores them), a tiered engine serves
    from fast programs and swaps each for its tuned one when that lands; every warm program ends tuned and the
    tokens never change."""
    import dataclasses

    from jaxspec.nn.ops import Ops
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))   # no tuned-on-disk hint from an earlier run
    for_backend = Ops.for_backend
    monkeypatch.setattr(Ops, "for_backend", staticmethod(
        lambda *a, **kw: dataclasses.replace(for_backend(*a, **kw), cublas_from_tokens=16)))
    prompts = [prompt_of(12, 3), prompt_of(4, 4)]
    params = SamplingParams(temperature=0, max_tokens=5)
    llm = LLM(target, **ENGINE16, warmup="tiered")
    runner = llm.engine.runner
    assert runner._tiers(8) == ("fast", "tuned")
    first = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.wait_compiled(120)
    assert set(runner.programs.tier.values()) == {"tuned"}
    assert llm.stats()["compile"]["programs"] == len(BUCKETS) * 2
    assert sorted(e["tier"] for e in runner.programs.log) == ["fast"] * 4 + ["tuned"] * 4
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in first]


def test_a_warm_start_loads_the_stored_programs(target, drafters, monkeypatch, tmp_path):  # noqa: F811
    """An engine keeps its compiled programs in the store; the next engine of the same fingerprint loads every one
    of them (tuned at once, nothing traced, lowered or compiled) and decodes the same tokens, speculation included.
    A stored file that does not load is removed and its program compiled (here: from JAX's persistent cache)."""
    import dataclasses

    from jaxspec.nn.ops import Ops
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("JAXSPEC_PROGRAM_STORE", "1")   # on the CPU only within one process (see store_wanted)
    for_backend = Ops.for_backend
    monkeypatch.setattr(Ops, "for_backend", staticmethod(   # the GPU's two tiers for bucket 8
        lambda *a, **kw: dataclasses.replace(for_backend(*a, **kw), cublas_from_tokens=16)))
    spec = dict(method="draft_model", num_speculative_tokens=2, model=drafters["draft_model"])
    prompts = [prompt_of(12, 3), prompt_of(9, 4)]
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.9, seed=3, max_tokens=8)]

    def engine(warmup):
        # a KV pool of its own: programs no other test has put in the session's persistent cache (a program loaded
        # from there is not stored), compiled here
        llm = LLM(target, **{**ENGINE16, "num_kv_blocks": 17}, warmup=warmup, speculative_config=spec)
        assert llm.engine.wait_compiled(120)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.runner.programs.store.flush()
        return llm, [o.token_ids for o in outs]

    first, tokens = engine("full")
    assert first.stats()["spec"]["accepted_tokens"] > 0
    store = first.engine.runner.programs.store
    names = {f"{T}-{v.name()}-tuned" for T in BUCKETS for v in WARM_VARIANTS}
    assert {p.stem for p in store.dir.glob("*.xla")} == names
    again, again_tokens = engine("tiered")
    log = again.engine.runner.programs.log
    assert [e["source"] for e in log] == ["store"] * len(names) and {e["tier"] for e in log} == {"tuned"}
    assert again_tokens == tokens and again.stats()["recompiles"] == 0
    (store.dir / "8-sample-tuned.xla").write_bytes(b"not a program")
    third, third_tokens = engine("tiered")
    sources = {(e["bucket"], e["variant"]): e["source"] for e in third.engine.runner.programs.log}
    assert sources.pop((8, "sample")) != "store" and set(sources.values()) == {"store"}
    assert third_tokens == tokens and not (store.dir / "8-sample-tuned.xla").exists()   # removed, not loaded again


def test_adaptive_k_prefill_runs_a_compiled_width_while_others_compile(target, drafters, monkeypatch):  # noqa: F811
    """Adaptive k's prefill chunks run the width-0 program when it exists; while only the full width is compiled
    (the rest held back), they run that one instead of waiting for a compile, and decoding stays exact."""
    release = threading.Event()
    init = StepPrograms.__init__

    def init_holding(self, *a, **kw):
        init(self, *a, **kw)
        # every compile but the start's own (the smallest bucket at the full width) waits for the release
        self.before_compile = lambda key, tier: (key[0] == 8 and key[1].drafts is None) or release.wait(120)
    monkeypatch.setattr(StepPrograms, "__init__", init_holding)
    spec = dict(method="draft_model", num_speculative_tokens=2, model=drafters["draft_model"], adaptive=True)
    prompts = [prompt_of(21, 7)]   # three 8-token prefill chunks before the first token
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(target, **ENGINE16, warmup="tiered", speculative_config=spec)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.runner.compiled_on_demand == 0 and llm.engine.runner.programs.compiling()
    finally:
        llm.engine.runner.programs.stop()   # the held compiles are dropped, not waited for
        release.set()
    monkeypatch.setattr(StepPrograms, "__init__", init)
    plain = LLM(target, **ENGINE16, warmup=False).generate(prompts, params, use_tqdm=False)
    assert out[0].token_ids == plain[0].token_ids


@pytest.mark.parametrize("error,survives", [("RESOURCE_EXHAUSTED: Not enough PA budget", True),
                                            ("INTERNAL: ptxas exited with a non-zero status", False)])
def test_a_tuned_compile_out_of_memory_keeps_the_fast_program(target, monkeypatch, tmp_path, error, survives):  # noqa: F811
    """The GPU's two tiers, the 8-token bucket's tuned compiles failing as XLA's autotuner did on GPT-OSS-20B's
    stacked experts (out of device memory): a full warm-up still builds the engine, that bucket runs its fast
    programs (compiled in its place), the others their tuned ones, no tuned compile of it is tried again, and the
    tokens are the engine's. Any other compile error still stops the warm-up."""
    import dataclasses

    import jax

    from jaxspec.nn.ops import Ops
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    for_backend = Ops.for_backend
    monkeypatch.setattr(Ops, "for_backend", staticmethod(
        lambda *a, **kw: dataclasses.replace(for_backend(*a, **kw), cublas_from_tokens=16)))
    compile_lowered, attempts = StepPrograms._compile_lowered, []

    def failing(self, key, tier, *rest):
        if tier == "tuned" and key[0] == 8:
            attempts.append(key)
            raise jax.errors.JaxRuntimeError(error)
        return compile_lowered(self, key, tier, *rest)
    monkeypatch.setattr(StepPrograms, "_compile_lowered", failing)
    prompts = [prompt_of(12, 3), prompt_of(4, 4)]
    params = SamplingParams(temperature=0, max_tokens=5)
    if not survives:
        with pytest.raises(RuntimeError, match="ptxas"):
            LLM(target, **ENGINE16, warmup="full")
        return
    with pytest.warns(RuntimeWarning, match="ran out of device memory"):
        llm = LLM(target, **ENGINE16, warmup="full")
    programs = llm.engine.runner.programs
    assert attempts and set(programs.untunable) == set(attempts)
    assert {programs.tier[k] for k in attempts} == {"fast"}
    assert {t for k, t in programs.tier.items() if k[0] == 16} == {"tuned"}
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    programs.compile(list(programs.tier), "tuned")          # asked again: nothing tried for the untunable bucket
    assert len(attempts) == len(set(attempts))
    plain = LLM(target, **ENGINE16, warmup="none")
    assert tokens == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
