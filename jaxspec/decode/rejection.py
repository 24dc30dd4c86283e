"""Rejection (token-acceptance) sampling for speculative decoding (Leviathan et al. 2023).

Greedy rows accept draft j while it equals argmax(p_j); the first mismatch emits argmax(p_j); if all
`num_drafts` drafts match, the bonus argmax(p_{num_drafts}) is emitted.
Random rows accept draft d with probability min(1, p(d)/q(d)) (`u * q(d) < p(d)`, u ~ U[0, 1), so
p(d) = 0 never accepts); the first rejection emits a sample of norm(max(0, p - q)) (for point-mass q,
i.e. argmax drafts: p with p(d) zeroed; an all-zero residual falls back to p); if every draft is
accepted, a bonus sample from p_{num_drafts}. Invalid drafts (id < 0 or >= V, or j >= num_drafts) are
rejected and never used as an index; a rejection at an invalid draft emits a sample of p.

Split: the vocabulary-wide work runs here in plain XLA (one Gumbel-max draw per position covers both
the recovered token at positions j < num_drafts and the bonus token at j = num_drafts); the per-row
walk over the K positions is the Pallas kernel `jaxspec.pallas.acceptance`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.pallas.acceptance import acceptance, acceptance_reference


def _per_row_randoms(keys, k: int, v: int):
    """Per row, from that row's key only (one threefry call): K uniforms in [0, 1) for the accept
    tests and Gumbel noise [K+1, V] for the recovered/bonus draws."""

    def one(key):
        u = jax.random.uniform(key, (k + (k + 1) * v,), jnp.float32, minval=jnp.finfo(jnp.float32).tiny)
        return u[:k], -jnp.log(-jnp.log(u[k:].reshape(k + 1, v)))

    return jax.vmap(one)(keys)


def _recovered_tokens(target_logprobs, draft_ids_c, valid, draft_logprobs, gumbel):
    """Sample, per position j in 0..K, from the residual (j a valid draft) or from p (otherwise)."""
    r, k1, v = target_logprobs.shape
    k = k1 - 1
    p = jnp.exp(target_logprobs[:, :k])  # [R, K, V]
    if draft_logprobs is None:
        vocab = jnp.arange(v, dtype=jnp.int32)[None, None, :]
        resid = jnp.where(vocab == draft_ids_c[..., None], 0.0, p)
    else:
        resid = jnp.maximum(p - jnp.exp(draft_logprobs.astype(jnp.float32)), 0.0)
    use_resid = valid & jnp.any(resid > 0.0, axis=-1)  # all-zero residual -> fall back to p
    resid_lp = jnp.where(use_resid[..., None], jnp.log(resid), target_logprobs[:, :k])
    dist = jnp.concatenate([resid_lp, target_logprobs[:, k:]], axis=1)  # position K: bonus from p
    return jnp.argmax(dist + gumbel, axis=-1).astype(jnp.int32)


def rejection_sample(target_logprobs, is_greedy, draft_ids, draft_logprobs, num_drafts, keys,
                     *, all_greedy: bool = False, use_kernel: bool = True, interpret: bool | None = None):
    """Verify drafts against the target -> (output_tokens i32[R, K+1] padded with -1, num_accepted i32[R]).

    target_logprobs f32[R, K+1, V]: processed log-probs (-inf where masked).
    is_greedy bool[R]; draft_ids i32[R, K] (may be invalid); draft_logprobs f32[R, K, V] or None
    (argmax drafts: q is a point mass); num_drafts i32[R] in 0..K; keys: one PRNG key per row.
    Row r emits output_tokens[r, :num_accepted[r] + 1].
    all_greedy=True: the caller knows every row is greedy, so no random draws are made.
    use_kernel=False uses the pure-jnp reference instead of the Pallas kernel.
    """
    target_logprobs = jnp.asarray(target_logprobs, jnp.float32)
    r, k1, v = target_logprobs.shape
    k = k1 - 1
    draft_ids = jnp.asarray(draft_ids, jnp.int32).reshape(r, k)
    is_greedy = jnp.asarray(is_greedy, bool)
    num_drafts = jnp.clip(jnp.asarray(num_drafts, jnp.int32), 0, k)

    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    valid = (pos < num_drafts[:, None]) & (draft_ids >= 0) & (draft_ids < v)
    d = jnp.where(valid, draft_ids, 0)  # safe index

    p_d = jnp.exp(jnp.take_along_axis(target_logprobs[:, :k], d[..., None], axis=-1)[..., 0])
    p_d = jnp.where(valid, p_d, 0.0)
    if draft_logprobs is None:
        q_d = jnp.ones((r, k), jnp.float32)
    else:
        draft_logprobs = jnp.asarray(draft_logprobs, jnp.float32)
        q_d = jnp.exp(jnp.take_along_axis(draft_logprobs, d[..., None], axis=-1)[..., 0])
        q_d = jnp.where(valid, q_d, 1.0)
    target_argmax = jnp.argmax(target_logprobs, axis=-1).astype(jnp.int32)  # [R, K+1]

    def random_path():
        uniforms, gumbel = _per_row_randoms(keys, k, v)
        return uniforms, _recovered_tokens(target_logprobs, d, valid, draft_logprobs, gumbel)

    def greedy_path():  # every row greedy (the caller knows): no draws over the vocabulary
        return jnp.zeros((r, k), jnp.float32), target_argmax

    uniforms, recovered = greedy_path() if all_greedy else random_path()

    fn = acceptance if use_kernel else acceptance_reference
    kwargs = {"interpret": interpret} if use_kernel else {}
    return fn(d, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts, **kwargs)
