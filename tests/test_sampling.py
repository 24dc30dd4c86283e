import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decode.sampling import (
    SamplingTensors,
    apply_penalties,
    processed_logprobs,
    row_keys,
    sample,
    token_counts,
    topn_logprobs,
)

# jitted once (eager dispatch compiles every small op separately, which is slow on the CI box)
processed_logprobs = jax.jit(processed_logprobs)
sample = jax.jit(sample)
apply_penalties = jax.jit(apply_penalties)
row_keys = jax.jit(row_keys)
topn_logprobs = jax.jit(topn_logprobs, static_argnums=2)


def make_st(n, **kw):
    st = SamplingTensors.defaults(n)
    fields = {f: np.asarray(getattr(st, f)).copy() for f in st.__dataclass_fields__}
    for name, value in kw.items():
        fields[name][:] = value
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in fields.items()})


def keys_for(n, seed=0, counter0=0):
    return row_keys(jnp.full((n,), seed, jnp.uint32), jnp.arange(counter0, counter0 + n, dtype=jnp.int32))


# ---------------------------------------------------------------- numpy references

def np_penalties(logits, counts, prompt_mask, pp, fp, rp):
    out = logits.astype(np.float64).copy()
    n, v = out.shape
    for i in range(n):
        for t in range(v):
            if prompt_mask[i, t] or counts[i, t] > 0:
                out[i, t] = out[i, t] / rp[i] if out[i, t] > 0 else out[i, t] * rp[i]
            out[i, t] -= fp[i] * counts[i, t]
            out[i, t] -= pp[i] * (counts[i, t] > 0)
    return out


def np_processed(logits, temp, top_k, top_p, min_p):
    """Sequential top-k -> top-p -> min-p on logits/T (distinct logits, so no ties)."""
    x = logits.astype(np.float64) / temp
    v = x.size
    keep = np.ones(v, bool)
    order = np.argsort(-x)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = np.exp(x - x.max()) * keep
        p /= p.sum()
        cum, first = 0.0, True
        for idx in order:
            if not keep[idx]:
                continue
            if cum >= top_p and not first:  # the most likely token always survives
                keep[idx] = False
            first = False
            cum += p[idx]
    if min_p > 0:
        p = np.exp(x - x.max()) * keep
        p /= p.sum()
        keep &= p >= min_p * p.max()
    lse = np.log(np.exp(x[keep] - x[keep].max()).sum()) + x[keep].max()
    return np.where(keep, x - lse, -np.inf)


# ---------------------------------------------------------------- tests

def test_greedy_is_argmax_first_on_ties():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    logits[2, 7] = logits[2, 30] = 10.0  # tie: first index wins
    st = make_st(6)
    lp = processed_logprobs(jnp.asarray(logits), st)
    toks = sample(lp, st.is_greedy, keys_for(6))
    np.testing.assert_array_equal(np.asarray(toks), np.argmax(logits, axis=-1))
    assert int(toks[2]) == 7
    # greedy rows are the unscaled log_softmax, whatever their (ignored) filters say
    st2 = make_st(6, top_k=3, top_p=0.5, min_p=0.3)
    np.testing.assert_allclose(np.asarray(processed_logprobs(jnp.asarray(logits), st2)),
                               np.asarray(jax.nn.log_softmax(jnp.asarray(logits))), rtol=1e-6, atol=1e-6)


def test_token_counts_windows_and_out_of_range():
    v = 10
    hist = np.array([[1, 2, 2, -1, 10, 3, 999999, 2],
                     [0, 0, 9, 9, 9, -5, 4, 4],
                     [5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
    start = np.array([0, 2, 3], np.int32)
    end = np.array([8, 7, 3], np.int32)  # row 2: empty window
    got = np.asarray(jax.jit(token_counts, static_argnums=3)(hist, start, end, v))
    want = np.zeros((3, v), np.int32)
    for i in range(3):
        for t in hist[i, start[i]:end[i]]:
            if 0 <= t < v:
                want[i, t] += 1
    np.testing.assert_array_equal(got, want)
    assert want[0, 2] == 3 and want[1, 9] == 3 and want[2].sum() == 0


def test_penalties_match_vllm_semantics():
    rng = np.random.default_rng(1)
    n, v = 5, 40
    logits = rng.normal(scale=3.0, size=(n, v)).astype(np.float32)
    counts = rng.integers(0, 3, size=(n, v)) * (rng.random((n, v)) < 0.3)
    prompt_mask = rng.random((n, v)) < 0.2
    pp = np.array([0.0, 0.5, 1.0, 0.0, 2.0], np.float32)
    fp = np.array([0.0, 0.3, 0.0, 0.7, 1.0], np.float32)
    rp = np.array([1.0, 1.3, 1.0, 0.8, 2.0], np.float32)
    st = make_st(n, presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp)
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(counts, jnp.int32), jnp.asarray(prompt_mask), st)
    want = np_penalties(logits, counts, prompt_mask, pp, fp, rp)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # row 0 has every penalty off
    np.testing.assert_array_equal(np.asarray(got[0]), logits[0])


def test_processed_logprobs_match_reference_filters():
    rng = np.random.default_rng(2)
    v = 32
    cfgs = [  # (temperature, top_k, top_p, min_p)
        (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.1),
        (0.9, 8, 0.8, 0.05), (2.0, 1, 1.0, 0.0), (1.0, 0, 0.0, 0.0), (0.5, 40, 0.95, 0.2),
    ]
    n = len(cfgs)
    logits = rng.normal(scale=2.0, size=(n, v)).astype(np.float32)
    st = make_st(n, temperature=[c[0] for c in cfgs], top_k=[c[1] for c in cfgs],
                 top_p=[c[2] for c in cfgs], min_p=[c[3] for c in cfgs])
    got = np.asarray(jax.jit(processed_logprobs)(jnp.asarray(logits), st))
    for i, c in enumerate(cfgs):
        want = np_processed(logits[i], *c)
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=str(c))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-4, atol=1e-4, err_msg=str(c))
        assert np.isclose(np.exp(got[i]).sum(), 1.0, atol=1e-5)
    assert np.isfinite(got[5]).sum() == 1 and np.isfinite(got[6]).sum() == 1  # top_k=1, top_p=0
    assert np.isfinite(got[1]).sum() == 5


def test_masked_tokens_never_sampled():
    v, m = 16, 3000
    rng = np.random.default_rng(3)
    base = rng.normal(size=(v,)).astype(np.float32)
    logits = jnp.broadcast_to(jnp.asarray(base), (m, v))
    for kw in ({"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.4}):
        st = make_st(m, temperature=1.5, **kw)
        lp = processed_logprobs(logits, st)
        allowed = np.isfinite(np.asarray(lp[0]))
        assert 0 < allowed.sum() < v
        toks = np.asarray(sample(lp, st.is_greedy, keys_for(m, seed=11)))
        assert allowed[toks].all(), kw
        assert len(np.unique(toks)) == allowed.sum()  # and every allowed one does occur


def test_row_independent_of_batch():
    rng = np.random.default_rng(4)
    v = 100
    row = rng.normal(size=(1, v)).astype(np.float32)
    key = row_keys(jnp.array([1234], jnp.uint32), jnp.array([7], jnp.int32))
    toks = []
    n = 6
    for trial in range(3):
        others = rng.normal(size=(n - 1, v)).astype(np.float32)
        logits = jnp.asarray(np.concatenate([others[:2], row, others[2:]]))
        temp = np.concatenate([rng.uniform(0, 2, 2), [0.8], rng.uniform(0, 2, n - 3)]).astype(np.float32)
        temp[rng.random(n) < 0.3] = 0.0
        temp[2] = 0.8
        st = make_st(n, temperature=temp)
        other_keys = row_keys(jnp.asarray(rng.integers(0, 1000, n), jnp.uint32), jnp.zeros((n,), jnp.int32))
        keys = other_keys.at[2].set(key[0])
        toks.append(int(sample(processed_logprobs(logits, st), st.is_greedy, keys)[2]))
    assert toks[0] == toks[1] == toks[2]


def test_seeded_draw_is_the_gumbel_max_of_its_key():
    """A row's draw is argmax(logprobs - log(-log(U))) with U the uniforms of that row's key (seed, counter),
    recomputed here draw by draw; another counter gives other draws."""
    rng = np.random.default_rng(5)
    n, v = 8, 1000
    logits = jnp.asarray(rng.normal(size=(n, v)).astype(np.float32))
    st = make_st(n, temperature=1.0)
    lp = processed_logprobs(logits, st)
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.full((n,), 3, jnp.int32))
    got = np.asarray(sample(lp, st.is_greedy, keys))
    for i in range(n):
        u = np.asarray(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(i), 3), (v,), jnp.float32,
                                          minval=np.finfo(np.float32).tiny), np.float64)
        assert got[i] == int(np.argmax(np.asarray(lp[i], np.float64) - np.log(-np.log(u))))
    other = sample(lp, st.is_greedy, row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.full((n,), 4, jnp.int32)))
    assert (got != np.asarray(other)).any()   # another counter, another draw


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sample_follows_softmax_chi_square(temperature):
    v, m = 6, 20000
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], np.float32)
    st = make_st(m, temperature=temperature)
    lp = processed_logprobs(jnp.broadcast_to(jnp.asarray(logits), (m, v)), st)
    toks = np.asarray(sample(lp, st.is_greedy, keys_for(m, seed=99)))
    p = np.exp(logits.astype(np.float64) / temperature)
    p /= p.sum()
    obs = np.bincount(toks, minlength=v)
    assert stats.chisquare(obs, p * m).pvalue > 1e-3


def test_topn_logprobs():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 30)).astype(np.float32)
    toks = np.array([3, 29, -1, 30], np.int32)
    tok_lp, ids, lps = topn_logprobs(jnp.asarray(logits), jnp.asarray(toks), 5)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
    np.testing.assert_allclose(np.asarray(tok_lp[:2]), [ref[0, 3], ref[1, 29]], rtol=1e-6)
    assert np.isneginf(np.asarray(tok_lp[2:])).all()  # out-of-range tokens are not indexed
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(lps), -np.sort(-ref, axis=-1)[:, :5], rtol=1e-6)
    _, ids0, lps0 = topn_logprobs(jnp.asarray(logits), jnp.asarray(toks), 0)
    assert ids0.shape == (4, 0) and lps0.shape == (4, 0)
