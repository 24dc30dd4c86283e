import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.pallas import acceptance, acceptance_reference, slot_mapping, slot_mapping_reference

# Shapes are drawn from small sets so the (interpret-mode) kernels compile only a few times.
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def acceptance_inputs(seed, r, k, v=10):
    rng = np.random.default_rng(seed)
    target_argmax = rng.integers(0, v, (r, k + 1)).astype(np.int32)
    recovered = rng.integers(0, v, (r, k + 1)).astype(np.int32)
    num_drafts = rng.integers(0, k + 1, r).astype(np.int32)
    draft_ids = np.where(rng.random((r, k)) < 0.6, target_argmax[:, :k], rng.integers(-2, v + 2, (r, k)))
    valid = (draft_ids >= 0) & (draft_ids < v) & (np.arange(k)[None, :] < num_drafts[:, None])
    valid &= rng.random((r, k)) < 0.95  # some in-range drafts flagged invalid too
    draft_ids = np.where(valid | (rng.random((r, k)) < 0.5), draft_ids, -1).astype(np.int32)
    p_d = np.where(rng.random((r, k)) < 0.1, 0.0, rng.random((r, k))).astype(np.float32)
    q_d = rng.random((r, k)).astype(np.float32) + 1e-3
    uniforms = rng.random((r, k)).astype(np.float32)
    is_greedy = rng.random(r) < 0.5
    return draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts


def np_acceptance(draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts):
    r, k = draft_ids.shape
    out = np.full((r, k + 1), -1, np.int32)
    n_acc = np.zeros(r, np.int32)
    for i in range(r):
        j = 0
        while j < num_drafts[i] and valid[i, j] and (
                draft_ids[i, j] == target_argmax[i, j] if is_greedy[i]
                else uniforms[i, j] * q_d[i, j] < p_d[i, j]):
            out[i, j] = draft_ids[i, j]
            j += 1
        out[i, j] = target_argmax[i, j] if is_greedy[i] else recovered[i, j]
        n_acc[i] = j
    return out, n_acc


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(7, 3, None), (130, 3, 16), (33, 0, None)]))
def test_acceptance_kernel_matches_reference(seed, shape):
    r, k, block_rows = shape  # 130 rows with 16-row blocks: several programs and a padded tail block
    args = acceptance_inputs(seed, r, k)
    out, n_acc = acceptance(*map(jnp.asarray, args), block_rows=block_rows)
    ref_out, ref_n = jax.jit(acceptance_reference)(*map(jnp.asarray, args))
    np_out, np_n = np_acceptance(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(n_acc), np.asarray(ref_n))
    np.testing.assert_array_equal(np.asarray(out), np_out)
    np.testing.assert_array_equal(np.asarray(n_acc), np_n)


def test_acceptance_kernel_jit_and_edge_rows():
    # row 0: all accepted (greedy) -> bonus; row 1: first rejected (random, p=0); row 2: num_drafts=0
    k = 3
    draft_ids = jnp.array([[4, 5, 6], [1, 2, 3], [7, 7, 7]], jnp.int32)
    valid = jnp.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]], bool)
    p_d = jnp.array([[0, 0, 0], [0, 1, 1], [1, 1, 1]], jnp.float32)
    q_d = jnp.ones((3, k), jnp.float32)
    u = jnp.full((3, k), 0.5, jnp.float32)
    greedy = jnp.array([True, False, False])
    am = jnp.array([[4, 5, 6, 9], [0, 0, 0, 0], [0, 0, 0, 0]], jnp.int32)
    rec = jnp.array([[8, 8, 8, 8], [3, 3, 3, 3], [2, 1, 1, 1]], jnp.int32)
    nd = jnp.array([3, 3, 0], jnp.int32)
    out, n_acc = jax.jit(acceptance)(draft_ids, valid, p_d, q_d, u, greedy, am, rec, nd)
    np.testing.assert_array_equal(np.asarray(out), [[4, 5, 6, 9], [3, -1, -1, -1], [2, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(n_acc), [3, 0, 0])


def slot_inputs(seed, t, r, mb, block_size):
    rng = np.random.default_rng(seed)
    num_blocks = 50
    block_tables = rng.integers(0, num_blocks, (r, mb)).astype(np.int32)
    block_tables[rng.random((r, mb)) < 0.1] = -1  # unallocated entries
    positions = rng.integers(-3, mb * block_size + 8, t).astype(np.int32)  # some beyond the table
    row_of_token = rng.integers(-1, r + 1, t).astype(np.int32)  # some rows out of range
    valid = rng.random(t) < 0.8
    return positions, row_of_token, valid, block_tables, block_size, num_blocks * block_size


def np_slots(positions, row_of_token, valid, block_tables, block_size, num_slots):
    r, mb = block_tables.shape
    out = np.full(positions.shape, num_slots, np.int32)
    for i, (p, row, ok) in enumerate(zip(positions, row_of_token, valid)):
        if ok and p >= 0 and 0 <= row < r and p // block_size < mb and block_tables[row, p // block_size] >= 0:
            out[i] = block_tables[row, p // block_size] * block_size + p % block_size
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1),
       shape=st.sampled_from([(1, 1, 3, 4, None), (13, 5, 3, 16, None), (300, 5, 8, 4, 64)]))
def test_slot_mapping_kernel_matches_reference(seed, shape):
    t, r, mb, block_size, block_tokens = shape  # 300 tokens in 64-token blocks: padded tail block
    pos, row, valid, bt, bs, ns = slot_inputs(seed, t, r, mb, block_size)
    got = slot_mapping(jnp.asarray(pos), jnp.asarray(row), jnp.asarray(valid), jnp.asarray(bt), bs, ns,
                       block_tokens=block_tokens)
    ref = jax.jit(slot_mapping_reference, static_argnums=(4, 5))(jnp.asarray(pos), jnp.asarray(row), jnp.asarray(valid), jnp.asarray(bt), bs, ns)
    want = np_slots(pos, row, valid, bt, bs, ns)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (np.asarray(got) <= ns).all()


def test_slot_mapping_sentinel_is_dropped_by_kv_write():
    bt = jnp.array([[2, 0], [1, -1]], jnp.int32)
    pos = jnp.array([0, 3, 4, 1, 2, 5, 0], jnp.int32)
    row = jnp.array([0, 0, 0, 1, 1, 1, 0], jnp.int32)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 0], bool)
    slots = jax.jit(slot_mapping, static_argnums=(4, 5))(pos, row, valid, bt, 4, 12)
    np.testing.assert_array_equal(np.asarray(slots), [8, 11, 0, 5, 6, 12, 12])
    kv = jnp.zeros((12,), jnp.int32).at[slots].set(jnp.arange(1, 8), mode="drop")
    np.testing.assert_array_equal(np.asarray(kv), [3, 0, 0, 0, 0, 4, 5, 0, 1, 0, 0, 2])


def ragged_delta_rule_inputs(seed: int):
    """A ragged step over a ring of W = 3 entries per slot: a prefill chunk longer than the ring (slot 0, from
    position 5), a fresh row (slot 2, position 0), a decode row (slot 1), a padding row with no tokens (trash
    slot 3), then padding tokens on row 0 that keep no state. -> (ForwardBatch, q, k, v, beta, g, ring, real)."""
    from jaxspec.nn.ops import ForwardBatch
    rng = np.random.default_rng(seed)
    Hv, dk, dv, W, slots, T = 4, 8, 8, 3, 4, 16
    rows = [(0, 5, 7), (2, 0, 3), (1, 9, 1)]                     # (slot, first position, tokens)
    pos, row_of, first, slot_of = [], [], [], []
    for r, (slot, p0, n) in enumerate(rows):
        first.append(len(pos))
        slot_of.append(slot)
        pos += range(p0, p0 + n)
        row_of += [r] * n
    real = len(pos)
    first.append(real)
    slot_of.append(slots - 1)
    pos += [4] * (T - real)
    row_of += [0] * (T - real)
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)   # noqa: E731
    batch = ForwardBatch(i32(np.zeros(T)), i32(pos), i32(pos), i32(row_of), i32(np.zeros((len(first), 1))),
                         i32(np.arange(T)), slot_of_row=i32(slot_of), first_token_of_row=i32(first),
                         writes_state=jnp.arange(T) < real)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)   # noqa: E731
    k = f32(T, Hv, dk)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    return (batch, f32(T, Hv, dk), k, f32(T, Hv, dv), jax.nn.sigmoid(f32(T, Hv)), -jax.nn.softplus(f32(T, Hv)),
            f32(2, slots, W, Hv, dk, dv), real)


def test_delta_rule_kernel_matches_the_scan():
    """The kernels give the plain-JAX scan's outputs at every token that keeps state and the same ring after the
    step (each row started from its entry, its last W states written, nothing else touched), for either layer
    of a stacked ring: the prefill row's tokens before its last W in the chunked kernels (one partial chunk of
    64, or two chunks of 2), the rest recurrent."""
    from jaxspec.nn.layers import delta_rule_scan
    from jaxspec.nn.kernels import delta_rule_fn
    batch, q, k, v, beta, g, ring, real = ragged_delta_rule_inputs(0)
    for layer, chunk in ((0, 64), (1, 2)):
        want_o, want_ring = jax.jit(delta_rule_scan)(ring, layer, batch, q, k, v, beta, g)
        o, got_ring = jax.jit(functools.partial(delta_rule_fn, chunk=chunk))(ring, layer, batch, q, k, v, beta, g)
        np.testing.assert_allclose(np.asarray(o[:real]), np.asarray(want_o[:real]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_ring), np.asarray(want_ring), rtol=1e-5, atol=1e-5)
        assert not np.allclose(np.asarray(got_ring), np.asarray(ring))   # the step did write entries
        np.testing.assert_array_equal(np.asarray(o[real:]), 0.0)         # tokens that keep no state: untouched


def one_sequence(seed: int, T: int, Hv: int = 2, dk: int = 8, dv: int = 8, repeat_keys: bool = False):
    """q, k (L2-normalised), v, beta, g (log decay <= 0) of one sequence of T tokens, and a non-zero state."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)   # noqa: E731
    k = f32(T, Hv, dk)
    if repeat_keys:   # runs of equal keys: (I + A) is far from I, its inverse's power series would blow up
        k = k.at[3:9].set(k[3]).at[12:20].set(k[12])
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)   # noqa: E731
    return (unit(f32(T, Hv, dk)), unit(k), f32(T, Hv, dv), jax.nn.sigmoid(f32(T, Hv)),
            -jax.nn.softplus(f32(T, Hv)), f32(Hv, dk, dv))


def test_chunked_reference_matches_the_scan():
    """The chunked (WY) form in plain JAX gives the scan's outputs and final state (f32, ~1e-6), for a sequence
    of 37 tokens in chunks of 16 (a partial last chunk) from a non-zero state, with runs of repeated keys."""
    from jaxspec.nn.layers import delta_rule_chunked, delta_rule_scan
    from jaxspec.nn.ops import ForwardBatch
    T, W, p0 = 37, 3, 10
    q, k, v, beta, g, S0 = one_sequence(1, T, repeat_keys=True)
    ring = jnp.zeros((1, 2, W) + S0.shape, jnp.float32).at[0, 1, (p0 - 1) % W].set(S0)
    i32 = lambda x: jnp.asarray(x, jnp.int32)   # noqa: E731
    batch = ForwardBatch(i32(np.zeros(T)), i32(np.arange(p0, p0 + T)), i32(np.zeros(T)), i32(np.zeros(T)),
                         i32(np.zeros((1, 1))), i32(np.arange(T)), slot_of_row=i32([1]), first_token_of_row=i32([0]))
    want_o, want_ring = jax.jit(delta_rule_scan)(ring, 0, batch, q, k, v, beta, g)
    o, S = jax.jit(delta_rule_chunked, static_argnums=6)(q, k, v, beta, g, S0, 16)
    scale = float(jnp.max(jnp.abs(want_o)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(S), np.asarray(want_ring[0, 1, (p0 + T - 1) % W]), rtol=1e-5, atol=1e-5)


def test_chunked_kernel_matches_the_reference():
    """The chunked Pallas kernels (interpreted) against the plain-JAX chunked form, rows of one step in chunks of
    8: 21 tokens of slot 0 from position 7 (the state before it read from its ring entry: non-zero), 19 of
    slot 2 from position 0 (zeros), a row with none. Outputs of those tokens and the state after each row's last
    token in that token's ring entry; no other entry touched."""
    from jaxspec.nn.layers import delta_rule_chunked as reference
    from jaxspec.pallas.delta_rule import delta_rule_chunked
    q, k, v, beta, g, _ = one_sequence(2, 40, repeat_keys=True)
    W, rng = 3, np.random.default_rng(3)
    ring = jnp.asarray(rng.standard_normal((2, 4, W) + (2, 8, 8)), jnp.float32)
    rows = [(0, 0, 21, 7), (2, 21, 19, 0), (1, 40, 0, 3)]                 # (slot, first token, tokens, position)
    slot, first, count, start = (jnp.asarray([r[f] for r in rows], jnp.int32) for f in range(4))
    o, got = delta_rule_chunked(q, k, v, beta, g, ring, 1, first, count, slot, start, chunk=8, block_v=4)
    want = np.array(ring)
    for s, f, n, p0 in rows[:2]:
        S0 = ring[1, s, (p0 - 1) % W] if p0 > 0 else jnp.zeros_like(ring[1, s, 0])
        want_o, want[1, s, (p0 + n - 1) % W] = reference(*(x[f:f + n] for x in (q, k, v, beta, g)), S0, 8)
        np.testing.assert_allclose(np.asarray(o[f:f + n]), np.asarray(want_o), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
