"""Automatic prefix caching: the block manager's hash-and-refcount bookkeeping, and requests that start from
cached blocks drafting, accepting and emitting exactly what they would have computed themselves.

The engine checks reuse the tiny target and the drafters of test_spec (EAGLE heads fitted to the target, so
drafts are accepted at several positions): a cached block that held stale KV for the target or a drafter, or
a slot whose device history missed the cached prefix (n-gram lookup and penalties read it), changes the
drafts, and so the per-request accepted counts that tests/reference.py recomputes on the host.
"""
import jax
import numpy as np
import pytest

from reference import greedy_spec_counts
from test_spec import (ENGINE, METHODS, PARALLEL, assert_greedy_lossless, drafters, make_llm,  # noqa: F401
                       prompt_of, references, run, target)
from jaxspec import LLM, SamplingParams
from jaxspec.sched import block_manager as bm
from jaxspec.sched.block_manager import BlockManager

BS = ENGINE["block_size"]


# ---- the block manager -------------------------------------------------------------------------------------

def test_shared_blocks_are_freed_by_their_last_holder_and_evicted_least_recent_first():
    blocks = BlockManager(num_blocks=6, block_size=2, num_slots=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    first, hashes = [], []
    assert blocks.grow(first, 5) and len(first) == 3
    blocks.cache_blocks(first, tokens, hashes, num_final=5)       # two full blocks; the third holds one token
    assert len(hashes) == 2 and blocks.stats()["cached_blocks"] == 2

    second_hashes = []
    second = blocks.match_prefix(tokens, second_hashes)
    assert second == first[:2] and second_hashes == hashes       # leaves the last token to compute
    assert blocks.match_prefix([1, 2, 3, 4], []) == first[:1]     # (4 tokens: only the first block)
    blocks.free_blocks(first[:1])                                 # drop the extra reference just taken
    assert blocks.match_prefix([1, 2, 9, 9, 9], []) == first[:1]  # diverging in block 2: block 1 only
    blocks.free_blocks(first[:1])

    held = list(first)
    blocks.free_blocks(first)
    assert blocks.num_free_blocks == 4                            # the shared two are still held
    blocks.free_blocks(second)
    assert blocks.num_free_blocks == 6 and blocks.stats()["cached_blocks"] == 2
    # Uncached blocks are reused first; then cached ones, the tail of a sequence before its head.
    taken = []
    assert blocks.grow(taken, 12)
    assert taken[:4] == [b for b in range(6) if b not in held[:2]] and taken[4:] == [held[1], held[0]]
    assert blocks.stats()["cached_blocks"] == 0 and blocks.match_prefix(tokens, []) == []


def test_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm, "block_hash", lambda parent, tokens: 7)   # every block hashes alike
    blocks = BlockManager(num_blocks=4, block_size=2, num_slots=1, enable_prefix_caching=True)
    owner, hashes = [], []
    blocks.grow(owner, 4)
    blocks.cache_blocks(owner, [1, 2, 3, 4], hashes, num_final=4)
    assert blocks.stats()["cached_blocks"] == 1                   # the second block's hash is taken: not cached
    assert blocks.match_prefix([5, 6, 7], []) == []
    assert blocks.match_prefix([1, 2, 7], []) == owner[:1]


def test_key_overlap_keys_a_block_by_the_token_after_it():
    blocks = BlockManager(num_blocks=4, block_size=2, num_slots=1, enable_prefix_caching=True, key_overlap=1)
    owner, hashes = [], []
    blocks.grow(owner, 4)
    blocks.cache_blocks(owner, [1, 2, 3, 4, 5], hashes, num_final=4)
    assert len(hashes) == 2
    assert blocks.match_prefix([1, 2, 3, 4, 5, 6], []) == owner[:2]
    blocks.free_blocks(list(owner[:2]))
    assert blocks.match_prefix([1, 2, 3, 9, 9, 9], []) == owner[:1]   # block 1 is cached for "3" after it
    blocks.free_blocks(list(owner[:1]))
    assert blocks.match_prefix([1, 2, 3, 4, 9], []) == owner[:1]      # block 2 needs the token after it too


def test_disabled_cache_matches_nothing():
    blocks = BlockManager(num_blocks=4, block_size=2, num_slots=1)
    owner, hashes = [], []
    blocks.grow(owner, 4)
    blocks.cache_blocks(owner, [1, 2, 3, 4], hashes, num_final=4)
    assert blocks.match_prefix([1, 2, 3, 4, 5], []) == [] and blocks.stats()["cached_blocks"] == 0


# ---- the engine --------------------------------------------------------------------------------------------

SYSTEM = prompt_of(2 * BS, 90)                 # two blocks the first two prompts below start with
# The target's own greedy continuation of [2]: its 2-grams recur, and the one draft n-gram lookup gets
# accepted after it comes from the cached part (without that part's history it accepts none).
RECURRING = [2, 25, 97, 120, 99, 29, 83, 65, 55, 31, 107, 75, 87, 57, 4, 75, 87, 57, 0, 25]


@pytest.mark.parametrize("method", METHODS + (PARALLEL,))
def test_cached_prefixes_draft_and_accept_what_the_host_recomputes(target, drafters, references, method):
    """A first wave fills the cache. Then a request diverging right after the shared two blocks, one that
    repeats a first prompt and the start of its output, and one that repeats a first prompt whole start from
    cached blocks (prompt and decoded ones) in slots that held other requests. Each request's drafted and
    accepted counts equal the host recomputation, and exactly the blocks that may be reused are (an EAGLE
    head's block is keyed by the token after it as well)."""
    k, max_tokens = 3, 14
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = make_llm(target, drafters, method, k, num_kv_blocks=48)
    first = [SYSTEM + prompt_of(3, 91), RECURRING]
    first_outs = run(llm, first, params)
    later = [SYSTEM + prompt_of(2, 92), first[0] + list(first_outs[0].token_ids[:6]), RECURRING]
    assert later[0][2 * BS] != first[0][2 * BS]
    outs = run(llm, later, params)

    overlap = int(method in ("eagle", "eagle3"))
    expected_hits = (2 - overlap) * BS + sum((len(p) - 1 - overlap) // BS * BS for p in later[1:])
    stats = llm.stats()
    assert stats["prefix_cache"]["hit_tokens"] == expected_hits
    assert stats["num_preemptions"] == 0
    assert_greedy_lossless(target, later, outs)
    for prompt, out in zip(first + later, first_outs + outs):
        continuation = prompt + references["target"].next_tokens(prompt, max_tokens + k + 1)
        e = greedy_spec_counts(continuation, len(prompt), max_tokens, ENGINE["max_model_len"], k,
                               lambda seq: references["propose"][method](seq, k))
        assert (out.metrics["num_draft_tokens"], out.metrics["num_accepted_tokens"]) == \
            (e["draft_tokens"], e["accepted_tokens"])
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 2
    assert method != "ngram" or outs[2].metrics["num_accepted_tokens"] > 0   # its drafts come from the cached part
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]      # nothing leaked; cached blocks are free


def request_kv(llm, req, num_positions: int) -> list:
    """Every KV pool entry (the target's and the drafter's, each layer) at the request's first positions."""
    engine = llm.engine
    S, bs = engine.step_config.cache_shape.num_kv_slots, engine.step_config.block_size
    slots = [req.block_ids[p // bs] * bs + p % bs for p in range(num_positions)]
    state = engine.runner.state
    pools = [x for x in jax.tree.leaves((state.layers, state.drafter)) if x.ndim == 4 and x.shape[1] == S]
    return [np.asarray(pool[:, slots]) for pool in pools]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_kv_of_a_cached_prefix_equals_the_kv_computed_without_the_cache(target, drafters, method):
    """A request diverging right after two blocks another request filled: every final KV entry it holds, the
    target's and the drafter's (an EAGLE head's entry at p pairs the token at p+1 with the feature at p), is
    the one it computes with the cache off."""
    first, second = SYSTEM + prompt_of(3, 120), SYSTEM + prompt_of(4, 121)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kv, hits = {}, {}
    for caching in (False, True):
        llm = make_llm(target, drafters, method, 3, async_scheduling=False, num_kv_blocks=40,
                       enable_prefix_caching=caching)
        run(llm, [first], params)
        req = llm.engine.add_request(second, params)
        while len(req.output_token_ids) < 6:
            llm.engine.step()
        kv[caching] = request_kv(llm, req, len(second) + 4)     # final: below num_computed - 1
        hits[caching] = llm.stats()["prefix_cache"]["hit_tokens"]
    assert hits == {False: 0, True: (1 if method.startswith("eagle") else 2) * BS}
    assert len(kv[True]) == len(kv[False]) > 0
    for on, off in zip(kv[True], kv[False]):
        assert np.abs(on - off).max() <= 1e-5 * (1 + np.abs(off).max())


@pytest.mark.parametrize("method,async_scheduling", [("ngram", True), ("eagle", False)])
def test_caching_changes_no_token_under_preemption_and_penalties(target, drafters, method, async_scheduling):
    """Seeded sampling with penalties (they read the slot's history, cached prefix included) in a pool too
    small for the batch: preempted requests come back through their own cached blocks. Every token equals
    the run without the cache."""
    prompts = [SYSTEM + prompt_of(n, 100 + n) for n in (1, 3, 5, 7)] + [SYSTEM]
    params = [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=16, presence_penalty=0.6,
                             frequency_penalty=0.3, repetition_penalty=1.2) for i in range(len(prompts))]
    results = {}
    for caching in (False, True):
        llm = make_llm(target, drafters, method, 3, async_scheduling=async_scheduling,
                       enable_prefix_caching=caching, num_kv_blocks=12)
        results[caching] = [o.token_ids for o in run(llm, prompts, params)]
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
        assert (stats["prefix_cache"]["hit_tokens"] > 0) == caching
    assert results[True] == results[False]


def test_repeated_prompts_reuse_their_blocks_without_speculation(target):
    """Plain decoding: the same prompt twice (greedy and seeded) gives the same tokens, the second time from
    the cache; the cache can be switched off."""
    prompt = prompt_of(13, 110)
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=1.0, seed=5, max_tokens=8)]
    llm = LLM(target, **ENGINE)
    a = run(llm, [prompt] * 2, params)
    b = run(llm, [prompt] * 2, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert llm.stats()["prefix_cache"]["hit_tokens"] == 2 * 12
    off = LLM(target, **ENGINE, enable_prefix_caching=False)
    assert [o.token_ids for o in run(off, [prompt] * 2, params)] == [o.token_ids for o in a]
    assert off.stats()["prefix_cache"] == {"enabled": False, "cached_blocks": 0, "queried_tokens": 0,
                                           "hit_tokens": 0, "hit_rate": 0.0,
                                           "disabled_reason": "enable_prefix_caching=False"}


# ---- n completions per prompt ------------------------------------------------------------------------------

def test_n_completions_share_the_prompt_and_each_sample_with_its_own_seed(target):
    """SamplingParams(n=3): three completions of one prompt, by index. The first is the n=1 request with the
    same seed, the others the n=1 requests with their own seeds; the two later ones reuse the first one's
    prompt blocks instead of computing them."""
    prompt = prompt_of(14, 130)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    llm = LLM(target, **ENGINE)
    (out,) = run(llm, [prompt], params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert llm.stats()["prefix_cache"]["hit_tokens"] == 2 * (13 // BS * BS)
    alone = LLM(target, **ENGINE, enable_prefix_caching=False)
    for i, completion in enumerate(out.outputs):
        (single,) = run(alone, [prompt], params.for_completion(i))
        assert completion.token_ids == single.token_ids and len(completion.token_ids) == 10
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.token_ids == out.outputs[0].token_ids

    greedy = run(llm, [prompt, prompt_of(5, 131)], SamplingParams(n=2, temperature=0, max_tokens=6))
    for o in greedy:
        assert len(o.outputs) == 2 and o.outputs[0].token_ids == o.outputs[1].token_ids


def test_n_completions_stream_by_index_and_abort_together(target):
    llm = LLM(target, **ENGINE)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    streamed = {}
    for delta in llm.stream([prompt_of(9, 140)], params):
        assert len(delta.outputs) == 1
        streamed.setdefault(delta.outputs[0].index, []).extend(delta.token_ids)
    (whole,) = run(llm, [prompt_of(9, 140)], params)
    assert streamed == {c.index: c.token_ids for c in whole.outputs}

    group = llm.engine.add_group(prompt_of(9, 141), SamplingParams(n=3, max_tokens=30), request_id="q")
    assert [r.request_id for r in group] == ["q-0", "q-1", "q-2"]
    llm.engine.step()
    llm.abort("q")
    assert all(r.finish_reason == "abort" for r in group) and not llm.engine.requests
    llm.engine.drain()
    assert llm.stats()["free_kv_blocks"] == llm.stats()["num_kv_blocks"]
    with pytest.raises(ValueError, match=r"SamplingParams.n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="add_group"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))


def assert_pool_consistent(blocks: BlockManager):
    """Idle: no block held, each free exactly once, every cached block among the free ones."""
    assert blocks.ref_count == [0] * blocks.num_blocks
    assert sorted(blocks.free) == list(range(blocks.num_blocks))
    assert set(blocks.cached.values()) == set(blocks.block_key) <= set(blocks.free)


def test_many_mixed_requests_leak_no_block(target, drafters):
    """Repeated and fresh prompts, n > 1, aborts mid-run, stop strings of ids, preemption: afterwards every
    block is free exactly once, and cached blocks are among them."""
    llm = make_llm(target, drafters, "ngram", 2, num_kv_blocks=12)
    engine = llm.engine
    prompts = [SYSTEM + prompt_of(n % 5 + 1, 150 + n % 3) for n in range(9)] + [prompt_of(6, 160)] * 3
    groups = [engine.add_group(p, SamplingParams(n=1 + i % 3, temperature=0.9, seed=i, max_tokens=12 + i % 9,
                                                 stop_token_ids=[i % 11]), request_id=f"r{i}")
              for i, p in enumerate(prompts)]
    for step in range(200):
        engine.step()
        if step in (3, 9):
            engine.abort(f"r{step}")
        if not engine.has_unfinished():
            break
    engine.drain()
    assert all(r.finished for g in groups for r in g)
    assert engine.scheduler.num_preemptions > 0 and llm.stats()["prefix_cache"]["hit_tokens"] > 0
    assert_pool_consistent(engine.blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        engine.blocks.free_blocks([0])


def test_a_long_cached_prefix_reaches_the_device_history_whole(target, monkeypatch):  # noqa: F811
    """The history write of a cached prefix goes in fixed chunks (one program for every length): a prefix longer
    than two chunks lands whole at its positions, and the slot's later positions and other slots are untouched."""
    from jaxspec.decode import runner as runner_module
    monkeypatch.setattr(runner_module, "HISTORY_CHUNK", 16)
    runner = LLM(target, **ENGINE, warmup=False).engine.runner
    ids = prompt_of(2 * 16 + 5, 5)
    before = np.asarray(runner.state.history)
    runner.write_history(1, ids)
    after = np.asarray(runner.state.history)
    assert after[1, :len(ids)].tolist() == ids
    np.testing.assert_array_equal(after[1, len(ids):], before[1, len(ids):])
    np.testing.assert_array_equal(np.delete(after, 1, axis=0), np.delete(before, 1, axis=0))
