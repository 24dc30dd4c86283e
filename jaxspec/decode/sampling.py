"""Device-side sampling: penalties, processed log-probabilities, per-row draws.

Everything here is pure JAX with static shapes: it runs inside the one jitted step.
Per-request parameters live in `SamplingTensors` (one entry per row); no Python value in
here changes from step to step, so nothing recompiles.

Conventions
-----------
* temperature 0 (below `GREEDY_EPS`) means greedy; top_k 0, top_p 1, min_p 0 mean "off";
  presence 0, frequency 0, repetition 1 mean "no penalty".
* Each row draws from its own PRNG key (`row_keys`), so a row's token never depends on
  which other rows share its batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are treated as greedy (same threshold as vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


def is_random(temperature: float) -> bool:
    """Whether a row with this temperature samples (the host's copy of the device's greedy test)."""
    return not float(np.float32(temperature)) < GREEDY_EPS


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters (a pytree of [N] arrays)."""

    temperature: jax.Array  # f32[N]; 0.0 => greedy
    top_k: jax.Array  # i32[N]; 0 => off
    top_p: jax.Array  # f32[N]; 1.0 => off
    min_p: jax.Array  # f32[N]; 0.0 => off
    presence_penalty: jax.Array  # f32[N]; 0.0 => off
    frequency_penalty: jax.Array  # f32[N]; 0.0 => off
    repetition_penalty: jax.Array  # f32[N]; 1.0 => off

    @classmethod
    def defaults(cls, n: int) -> "SamplingTensors":
        """Greedy rows with every filter and penalty off (host-side numpy arrays)."""
        return cls(
            temperature=np.zeros((n,), np.float32),
            top_k=np.zeros((n,), np.int32),
            top_p=np.ones((n,), np.float32),
            min_p=np.zeros((n,), np.float32),
            presence_penalty=np.zeros((n,), np.float32),
            frequency_penalty=np.zeros((n,), np.float32),
            repetition_penalty=np.ones((n,), np.float32),
        )

    @property
    def is_greedy(self) -> jax.Array:
        return jnp.asarray(self.temperature) < GREEDY_EPS

    def take(self, idx) -> "SamplingTensors":
        """Rows `idx` of every field (e.g. to broadcast rows to positions)."""
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[idx], self)


def add_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits f32[R, V] or [R, K+1, V] plus each row's sparse bias (ids i32[R, B], values f32[R, B]; ids outside
    [0, V), the padding, add nothing): the same bias at every position of a row. A scatter-add of R*B values,
    so its cost does not grow with the vocabulary."""
    logits = jnp.asarray(logits, jnp.float32)
    v = logits.shape[-1]
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)   # v: dropped
    rows = jnp.arange(ids.shape[0])[:, None]
    if logits.ndim == 2:
        return logits.at[rows, ids].add(values, mode="drop")
    # [R, 1] and [R, B] around a slice index [R, B, K+1]: the update is broadcast over the positions
    return logits.at[rows, :, ids].add(values[..., None], mode="drop")


def token_counts(history: jax.Array, start: jax.Array, end: jax.Array, vocab_size: int) -> jax.Array:
    """Counts of history[n, start[n]:end[n]] per vocabulary id -> i32[N, V].

    Ids outside [0, vocab_size) (placeholders, padding) are ignored and never used as an index:
    the scatter goes to a clipped id with a zero increment.
    """
    history = jnp.asarray(history, jnp.int32)
    n, length = history.shape
    pos = jnp.arange(length, dtype=jnp.int32)[None, :]
    live = (
        (pos >= jnp.asarray(start, jnp.int32)[:, None])
        & (pos < jnp.asarray(end, jnp.int32)[:, None])
        & (history >= 0)
        & (history < vocab_size)
    )
    ids = jnp.where(live, history, 0)
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, length))
    counts = jnp.zeros((n, vocab_size), jnp.int32)
    return counts.at[rows, ids].add(live.astype(jnp.int32), mode="drop")


def apply_penalties(
    logits: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array, st: SamplingTensors
) -> jax.Array:
    """vLLM penalty semantics.

    repetition: on tokens seen in the prompt or the output, logit > 0 -> logit / rp, else logit * rp.
    frequency:  logit -= fp * count(output).  presence: logit -= pp * (count(output) > 0).
    """
    logits = jnp.asarray(logits, jnp.float32)
    output_counts = jnp.asarray(output_counts)
    in_output = output_counts > 0
    seen = jnp.asarray(prompt_mask, bool) | in_output
    rp = jnp.asarray(st.repetition_penalty, jnp.float32)[:, None]
    rp = jnp.where(seen, rp, 1.0)
    logits = jnp.where(logits > 0, logits / rp, logits * rp)
    fp = jnp.asarray(st.frequency_penalty, jnp.float32)[:, None]
    pp = jnp.asarray(st.presence_penalty, jnp.float32)[:, None]
    logits = logits - fp * output_counts.astype(jnp.float32)
    logits = logits - pp * in_output.astype(jnp.float32)
    return logits


def _top_k_top_p_threshold(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row value threshold: entries of x below it are masked by top-k then top-p. -> f32[N, 1]."""
    v = x.shape[-1]
    s = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(top_k <= 0, v, jnp.clip(top_k, 1, v))
    kth = jnp.take_along_axis(s, (k - 1)[:, None], axis=-1)  # [N, 1]
    s = jnp.where(s >= kth, s, -jnp.inf)  # top-k applied, in sorted order
    probs = jax.nn.softmax(s, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (cum_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    last = jnp.sum(keep, axis=-1) - 1  # keep is a prefix in sorted order
    cut = jnp.take_along_axis(s, last[:, None], axis=-1)
    return jnp.maximum(kth, cut)


def processed_logprobs(logits: jax.Array, st: SamplingTensors, top_k_top_p: bool = True) -> jax.Array:
    """Log-probabilities of the distribution actually sampled from -> f32[N, V].

    Random rows: logits / temperature, then top-k, top-p, min-p (masked entries -inf),
    renormalised. Greedy rows: log_softmax of the unscaled logits (argmax = greedy token).
    Ties at a top-k/top-p threshold are kept. top_k_top_p=False: no row uses them (the sort is skipped).
    """
    logits = jnp.asarray(logits, jnp.float32)
    temperature = jnp.asarray(st.temperature, jnp.float32)
    greedy = temperature < GREEDY_EPS
    top_k = jnp.where(greedy, 0, jnp.asarray(st.top_k, jnp.int32))
    top_p = jnp.where(greedy, 1.0, jnp.asarray(st.top_p, jnp.float32))
    min_p = jnp.where(greedy, 0.0, jnp.asarray(st.min_p, jnp.float32))

    x = logits / jnp.where(greedy, 1.0, temperature)[:, None]

    # The sort is the expensive part: callers that know no row uses top-k/top-p skip it (a static
    # choice: a data-dependent branch would make a GPU host wait for the device mid-step).
    if top_k_top_p:
        thresh = _top_k_top_p_threshold(x, top_k, top_p)
    else:
        thresh = jnp.full((x.shape[0], 1), -jnp.inf, x.dtype)
    x = jnp.where(x >= thresh, x, -jnp.inf)

    # min-p: keep p >= min_p * p_max, i.e. x >= x_max + log(min_p). It is last, and the ratio
    # p/p_max does not change under renormalisation, so the scaled logits can be used directly.
    x_max = jnp.max(x, axis=-1, keepdims=True)
    log_min_p = jnp.log(min_p)[:, None]  # log(0) = -inf => off
    x = jnp.where(x >= x_max + log_min_p, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def row_keys(seeds: jax.Array, counters: jax.Array, seeds_hi: jax.Array | None = None) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed), counter) -> u32[N, 2] (raw threefry keys). The key of a
    64-bit seed is its two 32-bit words [hi, lo]: PRNGKey(seed) for seeds below 2**32 (seeds_hi None)."""
    seeds = jnp.asarray(seeds, jnp.uint32)
    hi = jnp.zeros_like(seeds) if seeds_hi is None else jnp.asarray(seeds_hi, jnp.uint32)
    counters = jnp.asarray(counters, jnp.int32)
    return jax.vmap(lambda h, s, c: jax.random.fold_in(jnp.stack([h, s]), c))(hi, seeds, counters)


def gumbel_noise(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Per-row Gumbel noise: f32[N, *shape], row n drawn from keys[n] only."""

    def one(key):
        u = jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny)  # (0, 1)
        return -jnp.log(-jnp.log(u))

    return jax.vmap(one)(keys)


def sample(logprobs: jax.Array, is_greedy: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row -> i32[N].

    Greedy rows: argmax (first index on ties). Others: Gumbel-max categorical draw with noise
    of shape [V] from the row's own key, so a row's token never depends on other rows.
    Entries at -inf are never drawn.
    """
    logprobs = jnp.asarray(logprobs, jnp.float32)
    greedy_tok = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)
    g = gumbel_noise(keys, logprobs.shape[-1:])
    drawn = jnp.argmax(logprobs + g, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(is_greedy, bool), greedy_tok, drawn)


def topn_logprobs(logits: jax.Array, tokens: jax.Array, n: int):
    """Log-probabilities under the distribution of `logits` (the raw logits, or the processed ones: -inf
    where masked), for the logprobs API.

    Returns (tok_logprob f32[N], top_ids i32[N, n], top_lp f32[N, n]). Out-of-range tokens
    (e.g. -1 padding) get tok_logprob = -inf and are never used as an index.
    """
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    v = lp.shape[-1]
    tokens = jnp.asarray(tokens, jnp.int32)
    ok = (tokens >= 0) & (tokens < v)
    tok_lp = jnp.take_along_axis(lp, jnp.where(ok, tokens, 0)[:, None], axis=-1)[:, 0]
    tok_lp = jnp.where(ok, tok_lp, -jnp.inf)
    if n <= 0:
        return tok_lp, jnp.zeros((lp.shape[0], 0), jnp.int32), jnp.zeros((lp.shape[0], 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lp, n)
    return tok_lp, top_ids.astype(jnp.int32), top_lp
