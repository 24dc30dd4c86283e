import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decode.rejection import rejection_sample
from jaxspec.decode.sampling import row_keys

V, K = 8, 3
# Few distinct shapes => few compilations (XLA:CPU compiles the per-row threefry draws slowly).
M_BIG, M = 20000, 256


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def _rs(target_lp, is_greedy, draft_ids, draft_lp, num_drafts, keys, use_kernel=True):
    return rejection_sample(target_lp, is_greedy, draft_ids, draft_lp, num_drafts, keys, use_kernel=use_kernel)


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def _rs_argmax(target_lp, is_greedy, draft_ids, num_drafts, keys, use_kernel=True):
    return rejection_sample(target_lp, is_greedy, draft_ids, None, num_drafts, keys, use_kernel=use_kernel)


def run(target_lp, is_greedy, draft_ids, draft_lp, num_drafts, keys, use_kernel=True):
    args = (jnp.asarray(target_lp, jnp.float32), jnp.asarray(is_greedy, bool), jnp.asarray(draft_ids, jnp.int32))
    rest = (jnp.asarray(num_drafts, jnp.int32), keys)
    if draft_lp is None:
        out, n = _rs_argmax(*args, *rest, use_kernel=use_kernel)
    else:
        out, n = _rs(*args, jnp.asarray(draft_lp, jnp.float32), *rest, use_kernel=use_kernel)
    return np.asarray(out), np.asarray(n)


def keys_for(m, seed=0, positions=K + 1):
    """One key per (row, position) [m, positions]: rows and positions all draw different noise."""
    n = m * positions
    return row_keys(jnp.full((n,), seed, jnp.uint32), jnp.arange(n, dtype=jnp.int32)).reshape(m, positions, -1)


def log(p):
    with np.errstate(divide="ignore"):
        return np.log(p)


def distributions(rng, masked=True):
    """Per-position target p (some entries masked to 0, like top-k) and a different draft q."""
    p = rng.dirichlet(np.ones(V), size=K + 1)
    if masked:
        for j in range(K + 1):
            p[j, rng.choice(V, size=2, replace=False)] = 0.0
        p /= p.sum(-1, keepdims=True)
    q = rng.dirichlet(np.ones(V) * 0.7, size=K)  # q puts mass on p's masked tokens too
    return p, q


def check_structure(out, n_acc, draft_ids, num_drafts):
    m = out.shape[0]
    assert (n_acc >= 0).all() and (n_acc <= num_drafts).all()
    for r in range(m):
        a = n_acc[r]
        np.testing.assert_array_equal(out[r, :a], draft_ids[r, :a])
        assert 0 <= out[r, a] < V
        assert (out[r, a + 1:] == -1).all()


def chi_square_per_position(out, n_acc, p, min_count=500):
    """Among rows that reached position j (n_acc >= j), out[:, j] must follow p[j]."""
    for j in range(p.shape[0]):
        reached = n_acc >= j
        toks = out[reached, j]
        if len(toks) < min_count:
            continue
        obs = np.bincount(toks, minlength=V)
        support = p[j] > 0
        assert obs[~support].sum() == 0, f"masked token emitted at position {j}"
        pv = stats.chisquare(obs[support], p[j][support] / p[j][support].sum() * len(toks)).pvalue
        assert pv > 1e-3, (j, obs, p[j] * len(toks))


@pytest.mark.parametrize("num_drafts_mode", ["full", "mixed"])
def test_distribution_sampled_drafts(num_drafts_mode):
    rng = np.random.default_rng(10)
    m = M_BIG
    p, q = distributions(rng)
    drafts = np.stack([rng.choice(V, size=m, p=q[j]) for j in range(K)], axis=1)
    nd = np.full(m, K) if num_drafts_mode == "full" else rng.integers(0, K + 1, m)
    target = np.broadcast_to(log(p), (m, K + 1, V))
    draft_lp = np.broadcast_to(log(q), (m, K, V))
    out, n_acc = run(target, np.zeros(m, bool), drafts, draft_lp, nd, keys_for(m, seed=1))
    check_structure(out[:300], n_acc[:300], drafts[:300], nd[:300])
    assert (n_acc <= nd).all()
    chi_square_per_position(out, n_acc, p)
    if num_drafts_mode == "mixed":
        rows0 = nd == 0  # no drafts: plain sampling of one token from p[0]
        assert (n_acc[rows0] == 0).all()
        obs = np.bincount(out[rows0, 0], minlength=V)
        sup = p[0] > 0
        assert obs[~sup].sum() == 0
        assert stats.chisquare(obs[sup], p[0][sup] * rows0.sum()).pvalue > 1e-3
    # acceptance rate of draft 0 is sum_x min(p, q)
    full = nd >= 1
    expected = np.minimum(p[0], q[0]).sum()
    assert abs((n_acc[full] >= 1).mean() - expected) < 0.02


def test_distribution_argmax_drafts_point_mass():
    rng = np.random.default_rng(11)
    m = M_BIG
    p, _ = distributions(rng)
    # point-mass drafts: any token per row (here uniform, including masked ones); q = one-hot
    drafts = rng.integers(0, V, size=(m, K))
    target = np.broadcast_to(log(p), (m, K + 1, V))
    out, n_acc = run(target, np.zeros(m, bool), drafts, None, np.full(m, K), keys_for(m, seed=2))
    check_structure(out[:300], n_acc[:300], drafts[:300], np.full(300, K))
    chi_square_per_position(out, n_acc, p)
    # draft 0 is accepted with probability p(d)
    assert abs((n_acc >= 1).mean() - p[0][drafts[:, 0]].mean()) < 0.02


def test_point_mass_target_uses_fallback():
    # p is a point mass at the draft: always accepted (residual would be all zero)
    m = M
    p = np.zeros((K + 1, V))
    p[:, 5] = 1.0
    drafts = np.full((m, K), 5)
    out, n_acc = run(np.broadcast_to(log(p), (m, K + 1, V)), np.zeros(m, bool), drafts, None,
                     np.full(m, K), keys_for(m))
    assert (n_acc == K).all() and (out == 5).all()


def test_equal_p_q_accepts_everything():
    rng = np.random.default_rng(12)
    m = M
    p, _ = distributions(rng, masked=False)
    drafts = np.stack([rng.choice(V, size=m, p=p[j]) for j in range(K)], axis=1)
    nd = rng.integers(0, K + 1, m)
    out, n_acc = run(np.broadcast_to(log(p), (m, K + 1, V)), np.zeros(m, bool), drafts,
                     np.broadcast_to(log(p[:K]), (m, K, V)), nd, keys_for(m, seed=3))
    np.testing.assert_array_equal(n_acc, nd)
    check_structure(out, n_acc, drafts, nd)


def test_zero_probability_draft_never_accepted():
    m = M
    p = np.full((K + 1, V), 1.0 / (V - 1))
    p[:, 0] = 0.0
    q = np.full((K, V), 1e-4)
    q[:, 0] = 1.0 - 1e-4 * (V - 1)  # q loves token 0, p forbids it
    drafts = np.zeros((m, K), np.int64)
    for draft_lp in (np.broadcast_to(log(q), (m, K, V)), None):
        out, n_acc = run(np.broadcast_to(log(p), (m, K + 1, V)), np.zeros(m, bool), drafts, draft_lp,
                         np.full(m, K), keys_for(m))
        assert (n_acc == 0).all() and (out[:, 0] != 0).all() and (out[:, 1:] == -1).all()


def np_greedy(target_lp, drafts, nd):
    am = np.argmax(target_lp, axis=-1)
    r = target_lp.shape[0]
    out = np.full((r, K + 1), -1)
    n_acc = np.zeros(r, int)
    for i in range(r):
        j = 0
        while j < nd[i] and 0 <= drafts[i, j] < V and drafts[i, j] == am[i, j]:
            out[i, j] = drafts[i, j]
            j += 1
        out[i, j] = am[i, j]
        n_acc[i] = j
    return out, n_acc


def test_all_greedy_matches_numpy_loop():
    rng = np.random.default_rng(13)
    m = M
    target = rng.normal(size=(m, K + 1, V)).astype(np.float32)
    target[:, :, 6] = -np.inf  # masked entries
    am = np.argmax(target, axis=-1)
    drafts = np.where(rng.random((m, K)) < 0.7, am[:, :K], rng.integers(-2, V + 2, (m, K)))
    drafts[:5, 1] = [-1, V, 2**30, -(2**31), V + 1]
    drafts[:5, 0] = am[:5, 0]
    nd = rng.integers(0, K + 1, m)
    nd[:5] = K
    for dlp in (None, rng.normal(size=(m, K, V)).astype(np.float32)):  # q is ignored by greedy rows
        out, n_acc = run(target, np.ones(m, bool), drafts, dlp, nd, keys_for(m))
        want_out, want_n = np_greedy(target, drafts, nd)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(n_acc, want_n)
    assert (n_acc[:5] == 1).all()  # invalid second draft rejected after a good first one


def test_invalid_draft_ids_rejected_random_rows():
    rng = np.random.default_rng(14)
    m = M_BIG
    p = np.full((K + 1, V), 1.0 / V)
    bad = np.array([-1, V, 2**30, -(2**31), 2**31 - 1])
    drafts = rng.integers(0, V, (m, K))
    drafts[:, 1] = bad[rng.integers(0, len(bad), m)]
    q = np.full((m, K, V), 1.0 / V)
    for dlp in (log(q), None):
        out, n_acc = run(np.broadcast_to(log(p), (m, K + 1, V)), np.zeros(m, bool), drafts, dlp,
                         np.full(m, K), keys_for(m, seed=5))
        assert (n_acc <= 1).all()
        assert ((out >= -1) & (out < V)).all()
        reached = n_acc >= 1
        # a rejection at an invalid draft emits a sample of p (uniform here)
        obs = np.bincount(out[reached, 1], minlength=V)
        assert stats.chisquare(obs).pvalue > 1e-3
        if dlp is not None:  # p == q uniform: the valid first draft is always accepted
            assert (n_acc == 1).all()
        else:  # point mass: accepted with probability p(d) = 1/V
            assert abs(reached.mean() - 1.0 / V) < 0.03


def test_mixed_batch_greedy_rows_match_and_random_rows_valid():
    rng = np.random.default_rng(15)
    m = M
    target = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(m, K + 1, V)) * 2.0, jnp.float32))
    target = np.asarray(target)
    greedy = rng.random(m) < 0.5
    am = np.argmax(target, axis=-1)
    drafts = np.where(rng.random((m, K)) < 0.6, am[:, :K], rng.integers(-1, V + 1, (m, K)))
    nd = rng.integers(0, K + 1, m)
    dlp = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(m, K, V)), jnp.float32)))
    for q in (dlp, None):
        out, n_acc = run(target, greedy, drafts, q, nd, keys_for(m, seed=6))
        ref_out, ref_n = run(target, greedy, drafts, q, nd, keys_for(m, seed=6), use_kernel=False)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(n_acc, ref_n)
        want_out, want_n = np_greedy(target[greedy], drafts[greedy], nd[greedy])
        np.testing.assert_array_equal(out[greedy], want_out)
        np.testing.assert_array_equal(n_acc[greedy], want_n)
        check_structure(out[~greedy], n_acc[~greedy], drafts[~greedy], nd[~greedy])
        # a greedy row's result does not depend on the random rows next to it
        # greedy rows do not depend on their neighbours: make every row greedy, change the others' drafts
        drafts2 = np.where(greedy[:, None], drafts, rng.integers(0, V, (m, K)))
        out2, n2 = run(target, np.ones(m, bool), drafts2, q, nd, keys_for(m, seed=7))
        np.testing.assert_array_equal(out2[greedy], out[greedy])
        np.testing.assert_array_equal(n2[greedy], n_acc[greedy])


def test_random_row_independent_of_batch_and_reproducible():
    rng = np.random.default_rng(16)
    m = M
    h = m // 2
    target = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(m, K + 1, V)), jnp.float32)))
    dlp = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(m, K, V)), jnp.float32)))
    drafts = rng.integers(0, V, (m, K))
    keys = keys_for(m, seed=8)
    out_a, n_a = run(target, np.zeros(m, bool), drafts, dlp, np.full(m, K), keys)
    out_b, n_b = run(target, np.zeros(m, bool), drafts, dlp, np.full(m, K), keys)
    np.testing.assert_array_equal(out_a, out_b)
    # change the second half of the batch (and make it greedy): the first half is untouched
    target2, drafts2 = target.copy(), drafts.copy()
    target2[h:] = target2[h:][::-1]
    drafts2[h:] = rng.integers(0, V, (m - h, K))
    greedy2 = np.arange(m) >= h
    out_c, n_c = run(target2, greedy2, drafts2, dlp, np.full(m, K), keys)
    np.testing.assert_array_equal(out_c[:h], out_a[:h])
    np.testing.assert_array_equal(n_c[:h], n_a[:h])
    assert n_a[:h].std() > 0  # the random rows really are random


def test_k_zero_is_plain_sampling():
    m = 4
    target = np.asarray(jax.nn.log_softmax(jnp.asarray(np.random.default_rng(17).normal(size=(m, 1, V)),
                                                       jnp.float32)))
    out, n_acc = run(target, np.array([1, 1, 0, 0], bool), np.zeros((m, 0), np.int32),
                     np.zeros((m, 0, V), np.float32), np.zeros(m), keys_for(m, positions=1))
    assert out.shape == (m, 1) and (n_acc == 0).all()
    np.testing.assert_array_equal(out[:2, 0], np.argmax(target[:2, 0], -1))
    assert ((out >= 0) & (out < V)).all()


def test_argmax_drafts_emit_what_plain_sampling_draws_at_each_position():
    """With point-mass drafts, every emitted token is the token plain sampling draws at that position with the
    position's key, whatever the drafts were: speculation cannot change a seeded request's tokens."""
    from jaxspec.decode.sampling import sample
    rng = np.random.default_rng(18)
    m = M
    target = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(m, K + 1, V)) * 1.5, jnp.float32)))
    keys = keys_for(m, seed=9)
    plain = np.stack([np.asarray(sample(jnp.asarray(target[:, j]), jnp.zeros(m, bool), keys[:, j]))
                      for j in range(K + 1)], axis=1)                                     # [m, K+1]
    # drafts: plain sampling's own tokens at some positions (accepted), other tokens elsewhere (rejected)
    drafts = np.where(rng.random((m, K)) < 0.6, plain[:, :K], rng.integers(0, V, (m, K)))
    out, n_acc = run(target, np.zeros(m, bool), drafts, None, np.full(m, K), keys)
    for r in range(m):
        assert out[r, :n_acc[r] + 1].tolist() == plain[r, :n_acc[r] + 1].tolist()
        match = drafts[r] == plain[r, :K]
        assert n_acc[r] == (K if match.all() else int(np.argmin(match)))
    assert 0 < (n_acc == 0).mean() < 1 and (n_acc == K).any()


# ---- drafts and verification draw from different keys ----------------------------------------------------------
# The step derives every key from the request's seed and a position (decode/step.py): the verifier's key of a
# position draws the Gumbel noise of the token emitted there and, folded by 1, the acceptance uniform; a draft sampled
# for that position must draw from a key of its own.
#
# KEY_SAMPLES rows (random 64-bit seeds and positions) each draw 2 drafts from q with the step's draft keys and verify
# them against p with its verification keys. Pearson's chi-square of the token emitted at position 0 against p[0]
# (df = 3) rejects at p ~ 1e-4 above 21.1. Power: 0.01 of probability moved between p[0]'s two likeliest tokens (0.4
# and 0.3) gives the statistic a noncentrality N * 0.01^2 * (1/0.4 + 1/0.3) = 76 at N = 2^17: mean 79, sd 18, above
# 21.1 with probability 0.9995, so a bias of 1% total variation is seen (measured: 79 against the shifted p, 1.1
# against p). Drafts drawn with the verifier's keys moved 0.03 of probability at position 0 (statistic 849).
KEY_SAMPLES = 1 << 17
KEY_P = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])   # target, per position
KEY_Q = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])                              # draft, per position


@jax.jit
def drafted_and_verified(target_lp, draft_lp, seeds, seeds_hi, positions):
    """Rows with these 64-bit seeds (two int32 words, as the step's inputs hold them), drafting at `positions`: k
    drafts sampled from `draft_lp` [k, V] as a drafter samples them (sampling.sample with the step's draft keys),
    verified against `target_lp` [k+1, V] with the step's verification keys (by the acceptance kernel's jnp
    reference) -> (emitted [N, k+1], num_accepted [N], the keys: the drafts' [N, k, 2], the verifier's [N, k+1, 2],
    the verifier's folded by 1 as rejection._position_uniforms folds them for the acceptance uniforms [N, k+1, 2])."""
    from jaxspec.decode.sampling import sample
    from jaxspec.decode.step import draft_keys, verify_keys
    n, k = seeds.shape[0], draft_lp.shape[0]
    inp = types.SimpleNamespace(rows={"seed": seeds, "seed_hi": seeds_hi})
    dkeys, vkeys, random_rows = draft_keys(inp, positions, k), verify_keys(inp, positions, k + 1), jnp.zeros((n,), bool)
    drafts = jnp.stack([sample(jnp.broadcast_to(draft_lp[j], (n,) + draft_lp.shape[1:]), random_rows, dkeys[:, j])
                        for j in range(k)], axis=1)
    emitted, accepted = rejection_sample(jnp.broadcast_to(target_lp, (n,) + target_lp.shape), random_rows, drafts,
                                         jnp.broadcast_to(draft_lp, (n,) + draft_lp.shape), jnp.full((n,), k), vkeys,
                                         use_kernel=False)
    ukeys = jax.vmap(jax.vmap(jax.random.fold_in, (0, None)), (0, None))(vkeys, 1)
    return emitted, accepted, dkeys, vkeys, ukeys


@pytest.fixture(scope="module")
def drafted():
    """drafted_and_verified of KEY_P and KEY_Q over KEY_SAMPLES rows, as numpy arrays by name."""
    rng = np.random.default_rng(19)
    seeds, seeds_hi = (jnp.asarray(rng.integers(0, 2**32, KEY_SAMPLES).astype(np.uint32).view(np.int32))
                       for _ in range(2))
    positions = jnp.asarray(rng.integers(0, 4000, KEY_SAMPLES), jnp.int32)
    out = drafted_and_verified(jnp.asarray(log(KEY_P), jnp.float32), jnp.asarray(log(KEY_Q), jnp.float32), seeds,
                               seeds_hi, positions)
    return dict(zip(("emitted", "accepted", "draft_keys", "verify_keys", "uniform_keys"), map(np.asarray, out)))


def as_ints(keys):
    """Raw threefry keys [..., 2] (uint32 words) -> one uint64 per key."""
    return np.ascontiguousarray(keys, np.uint32).view(np.uint64).ravel()


def test_draft_keys_are_none_of_the_verifiers_keys(drafted):
    """The keys a step hands its drafter for positions p..p+k-1 are none of the keys a step verifies any position of
    any row with, nor those folded by 1 (the acceptance uniforms'); no two drafts share a key (random 64-bit seeds;
    the first 4096 rows)."""
    rows = slice(0, 4096)
    draft = as_ints(drafted["draft_keys"][rows])
    verifier = np.concatenate([as_ints(drafted["verify_keys"][rows]), as_ints(drafted["uniform_keys"][rows])])
    assert np.unique(verifier).size == verifier.size
    assert np.intersect1d(draft, verifier).size == 0
    assert np.unique(draft).size == draft.size


def chi2_statistic(tokens, p) -> float:
    observed = np.bincount(tokens, minlength=len(p))
    expected = len(tokens) * np.asarray(p)
    return float(((observed - expected) ** 2 / expected).sum())


def test_sampled_drafts_verified_with_the_steps_keys_keep_the_target_distribution(drafted):
    """Drafts sampled with the step's draft keys and verified with its verification keys emit p at each position
    (the token at position 0 over all rows, at position 1 over the rows that accepted draft 0); the same statistic
    rejects p[0] with 0.01 moved between its two likeliest tokens (the power above), and drafts are accepted and
    rejected at both positions."""
    emitted, accepted = drafted["emitted"], drafted["accepted"]
    critical = stats.chi2.isf(1e-4, KEY_P.shape[1] - 1)
    reached = accepted >= 1
    for position, rows in ((0, slice(None)), (1, reached)):
        assert chi2_statistic(emitted[rows, position], KEY_P[position]) < critical, position
    shifted = KEY_P[0] + np.array([-0.01, 0.01, 0, 0])
    assert chi2_statistic(emitted[:, 0], shifted) > critical, "the test cannot see a 1% bias"
    assert 0.1 < reached.mean() < 0.9 and 0 < (accepted == 2).sum() < reached.sum()
