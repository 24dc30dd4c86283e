"""Rejection (token-acceptance) sampling for speculative decoding (Leviathan et al. 2023).

Every position j of a row has its own PRNG key (from the request seed and the position), and the Gumbel
noise g_j of that key is what a plain decoding step would use to sample position j: t_j = argmax(log p_j + g_j).

Greedy rows accept draft j while it equals argmax(p_j); the first mismatch emits argmax(p_j); if all
`num_drafts` drafts match, the bonus argmax(p_{num_drafts}) is emitted.
Random rows, argmax drafts (q a point mass on d): accept d iff d == t_j, and emit t_j at the first rejection
(and as the bonus). P(accept) = p(d) = min(1, p(d)/q(d)) and, given a rejection, t_j is distributed as
norm(max(0, p - q)) (p with d removed): this is Leviathan's rule, with its randomness taken from g_j. So the
token at every position is t_j whatever was drafted: speculation, step boundaries and preemption never change
a seeded request's tokens.
Random rows, sampled drafts (q a distribution): accept d with probability min(1, p(d)/q(d)) (`u * q(d) <
p(d)`, u ~ U[0, 1) from the position's key, independent of g_j; p(d) = 0 never accepts); the first rejection
emits a sample of norm(max(0, p - q)) drawn with g_j (an all-zero residual falls back to p); if every draft
is accepted, the bonus t_K.
Invalid drafts (id < 0 or >= V, or j >= num_drafts) are rejected and never used as an index; a rejection at
an invalid draft emits t_j.

Split: the vocabulary-wide work runs here in plain XLA; the per-row walk over the K positions is the Pallas
kernel `jaxspec.pallas.acceptance`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decode.sampling import gumbel_noise
from jaxspec.pallas.acceptance import acceptance, acceptance_reference


def _position_gumbel(keys, v: int):
    """keys [R, K+1] -> Gumbel noise f32[R, K+1, V], each position from its own key (as `sample` draws it)."""
    r, k1 = keys.shape[:2]
    return gumbel_noise(keys.reshape(r * k1, *keys.shape[2:]), (v,)).reshape(r, k1, v)


def _position_uniforms(keys, k: int):
    """U[0, 1) per draft position [R, K], from the position's key folded away from its Gumbel noise."""
    folded = jax.vmap(jax.vmap(jax.random.fold_in, (0, None)), (0, None))(keys[:, :k], 1)
    return jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32)))(folded)


def _residual_samples(target_logprobs, valid, draft_logprobs, gumbel):
    """Per position j < K: a sample of norm(max(0, p - q)) where the draft is valid (of p otherwise); the
    bonus position K samples p. All with the positions' Gumbel noise."""
    k = target_logprobs.shape[1] - 1
    resid = jnp.maximum(jnp.exp(target_logprobs[:, :k]) - jnp.exp(draft_logprobs.astype(jnp.float32)), 0.0)
    use_resid = valid & jnp.any(resid > 0.0, axis=-1)  # all-zero residual -> fall back to p
    resid_lp = jnp.where(use_resid[..., None], jnp.log(resid), target_logprobs[:, :k])
    dist = jnp.concatenate([resid_lp, target_logprobs[:, k:]], axis=1)
    return jnp.argmax(dist + gumbel, axis=-1).astype(jnp.int32)


def rejection_sample(target_logprobs, is_greedy, draft_ids, draft_logprobs, num_drafts, keys,
                     *, all_greedy: bool = False, use_kernel: bool = True, interpret: bool | None = None):
    """Verify drafts against the target -> (output_tokens i32[R, K+1] padded with -1, num_accepted i32[R]).

    target_logprobs f32[R, K+1, V]: processed log-probs (-inf where masked).
    is_greedy bool[R]; draft_ids i32[R, K] (may be invalid); draft_logprobs f32[R, K, V] or None
    (argmax drafts: q is a point mass); num_drafts i32[R] in 0..K; keys [R, K+1]: one PRNG key per position.
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
    target_argmax = jnp.argmax(target_logprobs, axis=-1).astype(jnp.int32)  # [R, K+1]

    if all_greedy:   # every row greedy (the caller knows): no draws over the vocabulary
        uniforms, p_d, q_d, emit = jnp.zeros((r, k), jnp.float32), jnp.zeros((r, k)), jnp.ones((r, k)), target_argmax
    else:
        gumbel = _position_gumbel(keys, v)
        sampled = jnp.argmax(target_logprobs + gumbel, axis=-1).astype(jnp.int32)   # t_j [R, K+1]
        if draft_logprobs is None:   # point-mass drafts: accept iff the draft is t_j; emit t_j
            uniforms, q_d, emit = jnp.zeros((r, k), jnp.float32), jnp.ones((r, k), jnp.float32), sampled
            p_d = (valid & (d == sampled[:, :k])).astype(jnp.float32)
        else:
            draft_logprobs = jnp.asarray(draft_logprobs, jnp.float32)
            uniforms = _position_uniforms(keys, k)
            p_d = jnp.where(valid, jnp.exp(jnp.take_along_axis(target_logprobs[:, :k], d[..., None], -1)[..., 0]), 0.0)
            q_d = jnp.where(valid, jnp.exp(jnp.take_along_axis(draft_logprobs, d[..., None], -1)[..., 0]), 1.0)
            emit = _residual_samples(target_logprobs, valid, draft_logprobs, gumbel)

    fn = acceptance if use_kernel else acceptance_reference
    kwargs = {"interpret": interpret} if use_kernel else {}
    return fn(d, valid, p_d, q_d, uniforms, is_greedy, target_argmax, emit, num_drafts, **kwargs)
