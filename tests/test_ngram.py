"""The on-device prompt-lookup drafter, on hand-made histories."""
import types

import jax.numpy as jnp
import numpy as np

from jaxspec.decode.drafters.ngram import NgramDrafter


def propose(history_rows, num_tokens, k=4, min_n=2, max_n=4):
    H = max(len(r) for r in history_rows) + 8
    hist = np.zeros((len(history_rows), H), np.int32)
    for i, r in enumerate(history_rows):
        hist[i, :len(r)] = r
    ctx = types.SimpleNamespace(history=jnp.asarray(hist), slot=jnp.arange(len(history_rows)),
                                num_tokens=jnp.asarray(num_tokens, jnp.int32), num_speculative_tokens=k)
    _, drafts = NgramDrafter(min_n, max_n).propose(None, None, ctx)
    return np.asarray(drafts).tolist()


def test_continuation_of_the_latest_match():
    seq = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]          # suffix [5, 6, 7] occurred at 0: then 8, 9, 10, 11
    assert propose([seq], [len(seq)]) == [[8, 9, 10, 11]]


def test_continuation_repeats_the_period_past_the_present():
    seq = [3, 1, 4, 3, 1, 4, 3, 1, 4]                      # period 3: the 4th draft wraps to the period
    assert propose([seq], [len(seq)]) == [[3, 1, 4, 3]]


def test_no_match_gives_invalid_drafts_and_rows_are_independent():
    seq_a = [1, 2, 3, 4, 5, 6, 7, 8]
    seq_b = [9, 9, 9, 9]
    out = propose([seq_a, seq_b], [len(seq_a), len(seq_b)])
    assert out[0] == [-1, -1, -1, -1]                      # rejected by the verifier, never embedded
    assert out[1] == [9, 9, 9, 9]


def test_tokens_past_num_tokens_are_never_read():
    seq = [4, 5, 6, 4, 5, 6, 77, 77, 77]                   # stale tokens past num_tokens=6 (e.g. a reused slot)
    assert propose([seq], [6], min_n=2, max_n=3) == [[4, 5, 6, 4]]
