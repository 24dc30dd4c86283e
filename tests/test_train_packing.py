"""The trainer's throughput changes keep its math: packed rows (several examples end to end, Examples.pack) give the
loss, per-step accuracy and gradient the same examples give one per row (no attention, position or prediction crosses
from one packed example into the next), and a run reports its tokens per second and phases. A tiny random target,
float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_model
from jaxspec.nn.eagle import EagleHead
from jaxspec.train import Examples, TrainConfig, train
from jaxspec.train.eagle3 import head_config, init_head, loss_weights, make_target_fn, ttt_forward

T, J = 48, 3


@pytest.fixture(scope="module")
def target():
    return random_model(13, vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, attn_gain=1.0)


def examples_of_lengths(lengths, vocab, seed=0) -> Examples:
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((len(lengths), T), np.int32), np.zeros((len(lengths), T), np.float32)
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(1, vocab, n)
        mask[r, n // 3:n] = 1.0        # a prompt, then the answer
    return Examples(ids, mask, np.asarray(lengths, np.int32))


def test_pack_places_every_example_once():
    ex = examples_of_lengths([30, 7, 20, 12, 25, 9, 40], 96)
    packed = ex.pack()
    assert len(packed) < len(ex) and packed.ids.shape[1] == T
    assert packed.num_target_tokens == ex.num_target_tokens
    found = []
    for r in range(len(packed)):
        seg = packed.segments[r]
        assert (seg[packed.lengths[r]:] == 0).all() and (seg[:packed.lengths[r]] > 0).all()
        for s in range(1, seg.max() + 1):
            at = np.nonzero(seg == s)[0]
            assert (np.diff(at) == 1).all()                      # contiguous
            found.append((tuple(packed.ids[r, at]), tuple(packed.mask[r, at])))
    want = [(tuple(ex.ids[i, :n]), tuple(ex.mask[i, :n])) for i, n in enumerate(ex.lengths)]
    assert sorted(found) == sorted(want)


@pytest.mark.parametrize("arch", ["chain", "parallel"])
def test_packed_rows_train_what_their_examples_would_alone(target, arch):
    """One training-time-test loss over seven examples one per row and over the same examples packed into fewer
    rows: the per-step losses, accuracies and the gradient agree to float32 rounding. The target's forward would
    see the examples before it in a row without its segments, the head's chains would attend across them and
    predict the next example's tokens without theirs: each changes the loss by orders of magnitude more."""
    tc = target.config
    ex = examples_of_lengths([30, 7, 20, 12, 25, 9, 40], tc.vocab_size, seed=1)
    packed = ex.pack()
    d2t = np.arange(tc.vocab_size, dtype=np.int32)
    head = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t), parallel=arch == "parallel")
    params = init_head(head, target.params, d2t, seed=0)
    target_fn = make_target_fn(tc, head.aux_layers)

    def loss(params, ids, mask, segments):
        aux, teacher, in_vocab = target_fn(target.params, ids, jnp.asarray(d2t), segments)
        weights = loss_weights(mask, in_vocab)
        return ttt_forward(head, params, target.params["embed"], ids, aux, teacher, weights, J, 0.8,
                           segments=segments)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))   # eager, op by op, it took ~25 s

    def grad(params, e: Examples):
        segments = None if e.segments is None else jnp.asarray(e.segments)
        return value_and_grad(params, jnp.asarray(e.ids), jnp.asarray(e.mask), segments)
    (total1, (steps1, acc1, _)), g1 = grad(params, ex)
    (total2, (steps2, acc2, _)), g2 = grad(params, packed)
    np.testing.assert_allclose(np.asarray(steps2), np.asarray(steps1), rtol=2e-6)   # <= 2.4e-7 measured
    np.testing.assert_array_equal(np.asarray(acc2), np.asarray(acc1))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):   # <= 5e-7 of the largest
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b - a).max() <= 5e-6 * np.abs(a).max()


def test_a_run_reports_its_throughput(target, tmp_path):
    """tokens per second, padding, and the phases of a step (data, target forward, head), in the result and in
    training.json; packing cuts the padding the run computes."""
    import json
    ex = examples_of_lengths([30, 7, 20, 12, 25, 9, 40, 11], target.config.vocab_size, seed=2)
    runs = {}
    for pack in (False, True):
        config = TrainConfig(steps=8, batch_size=2, draft_vocab_size=64, ttt_steps=2, warmup_steps=1, pack=pack,
                             save_every=8)
        runs[pack] = train(target, ex, tmp_path / str(pack), config, progress=False)
        t = runs[pack].throughput
        assert t["step_ms"] > 0 and t["target_tokens_per_s"] > 0 and t["sequence_tokens_per_s"] > 0
        assert set(t["phases_ms"]) == {"data", "target_forward", "head"} and all(v > 0 for v in t["phases_ms"].values())
        assert t["mfu"]["step"] is None   # no peak known for a CPU
        saved = json.loads((tmp_path / str(pack) / "training.json").read_text())
        assert saved["throughput"] == t and saved["num_examples"] == len(ex)
    assert runs[True].throughput["padding_fraction"] < runs[False].throughput["padding_fraction"] - 0.2


def test_the_draft_vocabulary_pass_reads_packed_rows_as_their_examples(target):
    """The target's predictions over packed rows (the draft vocabulary's pass, one row of several examples) are the
    predictions over the examples one per row: without the segments a packed example would see the one before it."""
    from jaxspec.train.eagle3 import predicted_tokens
    ex = examples_of_lengths([30, 7, 20, 12, 25, 9, 40], target.config.vocab_size, seed=3)
    packed = ex.pack()
    alone, together = predicted_tokens(target, ex, 4), predicted_tokens(target, packed, 4)
    want = sorted(tuple(alone[i, :n]) for i, n in enumerate(ex.lengths))
    got = sorted(tuple(together[r, packed.segments[r] == s]) for r in range(len(packed))
                 for s in range(1, packed.segments[r].max() + 1))
    assert got == want


def test_the_target_forward_batched_equals_row_by_row(target):
    """make_target_fn's two forms (rows one after another, rows side by side) give the same features, teacher and
    in-vocabulary flags, packed rows included."""
    tc = target.config
    ex = examples_of_lengths([30, 7, 20, 12, 25, 9, 40], tc.vocab_size, seed=4).pack()
    d2t = jnp.asarray(np.arange(0, tc.vocab_size, 2, dtype=np.int32))
    aux_layers = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t)).aux_layers
    ids, segments = jnp.asarray(ex.ids), jnp.asarray(ex.segments)
    one_by_one = make_target_fn(tc, aux_layers)(target.params, ids, d2t, segments)
    batched = make_target_fn(tc, aux_layers, rows_side_by_side=True)(target.params, ids, d2t, segments)
    for a, b in zip(one_by_one[:2], batched[:2]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(batched[2]), np.asarray(one_by_one[2]))
