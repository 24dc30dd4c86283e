"""Prompt lookup on the device: the next drafts are what followed the latest earlier occurrence of the
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in the token history; when
that continuation reaches the present, it repeats with the period the match implies.

It reads only the device history, so it works under async scheduling, where the host does not yet know
the tokens the previous step accepted.
"""
from __future__ import annotations

import jax.numpy as jnp


class NgramDrafter:
    method = "ngram"
    draft_sampling = "argmax"
    aux_layers = ()
    needs_kv_lookahead = False
    kv_reads_next_token = False
    config = None             # no model
    quantization = None       # no weights
    whole_on_each_device = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def configured(self, quantization: str | None, whole_on_each_device: bool) -> "NgramDrafter":
        return self   # nothing to quantize or place

    def param_schema(self):
        return None

    def state_schema(self, step_config):
        return None

    def propose(self, params, state, ctx):
        hist = ctx.history[ctx.slot]                                   # [R, H]
        num_tokens = ctx.num_tokens                                    # [R]
        R, H = hist.shape
        k = ctx.num_speculative_tokens
        if k == 0:   # a plain decoding step: nothing to look up, no state to keep
            return state, jnp.zeros((R, 0), jnp.int32)
        start = jnp.arange(H)[None, :]                                 # candidate match starts i
        drafts = jnp.full((R, k), -1, jnp.int32)
        found = jnp.zeros((R,), bool)
        for n in range(self.max_n, self.min_n - 1, -1):                # longest suffix first
            suffix = jnp.take_along_axis(hist, jnp.clip(num_tokens[:, None] - n + jnp.arange(n), 0, H - 1), 1)
            # hist[i:i+n] == suffix, for an occurrence that ends before the suffix itself starts over
            match = (start < num_tokens[:, None] - n) & (num_tokens[:, None] > n)
            for m in range(n):
                shifted = jnp.concatenate([hist[:, m:], jnp.full((R, m), -1, hist.dtype)], axis=1)
                match &= shifted == suffix[:, m:m + 1]
            latest = jnp.max(jnp.where(match, start, -1), axis=1)       # [R]
            # The match says the sequence repeats with period `shift`; proposals that would run past the
            # known tokens continue that period (what followed the match is what follows now).
            shift = jnp.maximum(num_tokens - n - latest, 1)             # [R]
            cont = latest[:, None] + n + jnp.arange(k)[None, :] % shift[:, None]
            proposal = jnp.take_along_axis(hist, jnp.clip(cont, 0, H - 1), 1)
            hit = (latest >= 0) & ~found
            drafts = jnp.where(hit[:, None], proposal, drafts)
            found |= hit
        return state, drafts
