"""A parallel draft model (PARD) trained in-tree: a pretrained small model of the target's tokenizer taught to fill
mask tokens, so that the engine's parallel drafting (SpeculativeConfig(method="draft_model", parallel_drafting=True),
docs/parallel_drafting.md) gets its k drafts from two forwards.

At inference, for a row of tokens x_0..x_{n-1}, draft 1 is the model's argmax after x_{n-1} and draft j+1 its argmax
at the j-th of the mask tokens placed at positions n..n+j-1 (mask at n+j-1 predicts the token at n+j). Training
computes every anchor n of a row at once, in one forward of k*T tokens per row of T:

    block 0:     x_0 .. x_{T-1}          at positions p (within its segment)   -> x_{p+1}   (draft 1)
    block j>=1:  MASK x T                at positions p                        -> x_{p+1}   (draft j+1 of anchor
                                                                                             n = p-j+1)

block j's token at p stands for "x_0..x_{n-1}, then j mask tokens at positions n..p", so a query (block j, p) sees
the real keys (block 0, q) with q <= p-j (q < n; block 0 itself: causal) and the mask keys (block i, q) of its own
anchor, 1 <= i <= j and q - i = p - j, all within its segment (packed rows, Examples.pack). A target counts where
x_{p+1} is in the row's segment, the anchor has a real token (n >= 1) and the loss mask marks x_{p+1} (the
assistant's tokens; all of a plain text's). The loss is cross-entropy, draft j+1 weighted step_decay ** j (as
jaxspec.train.eagle3); every weight of the model is trained, the mask token's embedding row among them.

The optimizer, schedule, loop, checkpoints and held-out acceptance replay are jaxspec.train.eagle3's; the result is
written in the HF layout (jaxspec.models.hf_writer) with `"pard_token": MASK` in its config.json, which the engine
reads as the mask token.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.nn.decoder import Decoder, segment_positions
from jaxspec.train import eagle3
from jaxspec.train.config import PardConfig
from jaxspec.train.data import Examples

PARD_JSON = "pard.json"   # beside the checkpoints: what a resumed run must match (the mask token, the model's sizes)


# ---- the mask token -----------------------------------------------------------------------------------------

def default_mask_token(tokenizer_size: int | None, vocab_size: int) -> int:
    """The first id past the tokenizer's (an embedding row no text encodes to: Qwen2.5's checkpoints have spare
    rows); refused by name when the embedding has none or the model has no tokenizer to tell."""
    if tokenizer_size is None:
        raise ValueError("the draft model has no tokenizer to find a spare embedding row by: pass mask_token_id "
                         "(--mask-token-id)")
    if tokenizer_size >= vocab_size:
        raise ValueError(f"no spare embedding row for the mask token: the tokenizer has {tokenizer_size} tokens and "
                         f"the model's vocab_size is {vocab_size}; pass mask_token_id (--mask-token-id), an id the "
                         "training text never holds")
    return int(tokenizer_size)


def mask_token_of(model, config: PardConfig) -> int:
    """config.mask_token_id (checked to be in the model's vocabulary), or default_mask_token."""
    V = model.config.vocab_size
    if config.mask_token_id is None:
        return default_mask_token(None if model.tokenizer is None else len(model.tokenizer.hf), V)
    if not 0 <= config.mask_token_id < V:
        raise ValueError(f"mask_token_id={config.mask_token_id} is outside the draft model's vocabulary (vocab_size "
                         f"{V})")
    return int(config.mask_token_id)


# ---- the training forward -------------------------------------------------------------------------------------

def pard_layout(segments, num_drafts: int):
    """segments i32[T] (a row's examples numbered, as Examples.pack) -> (positions i32[kT], segments i32[kT],
    attention mask bool[kT, kT]) of the k = num_drafts blocks (the module docstring's rule)."""
    T, k = segments.shape[0], num_drafts
    pos = segment_positions(segments)
    block = jnp.repeat(jnp.arange(k, dtype=jnp.int32), T)
    P, S = jnp.tile(pos, k), jnp.tile(segments, k)
    qb, kb, qp, kp = block[:, None], block[None, :], P[:, None], P[None, :]
    real = (kb == 0) & (kp <= qp - qb)                                   # x_q with q < n = p - j + 1
    own = (kb >= 1) & (kb <= qb) & (kp - kb == qp - qb)                  # the masks of the same anchor
    return P, S, (real | own) & (S[:, None] == S[None, :])


def pard_logits(decoder: Decoder, params, ids, segments, mask_token: int, num_drafts: int):
    """One row's training forward: ids i32[T], segments i32[T] -> f32 logits [k, T, V], block j's row p the model's
    draft j+1 for anchor p - j + 1 (block 0: the next token after x_p)."""
    T = ids.shape[0]
    tokens = jnp.concatenate([ids, jnp.full(((num_drafts - 1) * T,), mask_token, ids.dtype)])
    positions, segs, mask = pard_layout(segments, num_drafts)
    logits = decoder.dense_forward(params, tokens, segments=segs, positions=positions, attention_mask=mask)[0]
    return logits.reshape(num_drafts, T, -1)


def _shift(x, n: int = 1):
    """x[:, n:] padded with zeros at the end (position p holds what p + n held)."""
    return jnp.pad(x[:, n:], [(0, 0), (0, n)])


def target_weights(mask, segments, num_drafts: int):
    """mask f32[B, T] (the tokens trained), segments i32[B, T] -> weights f32[k, B, T]: block j's position p trains
    when x_{p+1} is marked and in p's segment and its anchor p - j + 1 is >= 1 within the segment."""
    pos = segment_positions(segments)
    next_in = _shift(mask, 1) * (_shift(segments, 1) == segments)
    return jnp.stack([next_in * (pos >= j) for j in range(num_drafts)])


def pard_loss(decoder: Decoder, params, ids, mask, segments, mask_token: int, num_drafts: int, step_decay: float,
              compute_dtype=jnp.float32):
    """A batch's loss -> (sum over drafts of step_decay ** j times draft j+1's mean cross-entropy, (per-draft loss
    [k], per-draft hits [k], per-draft weight [k], hits bool[k, B, T]: block j's argmax at p is x_{p+1}, where it
    trains)). ids/mask [B, T], segments [B, T] (None: one example per row). The rows run one after another, each
    recomputed in the backward pass (jax.checkpoint): one row's k*T x V logits live at a time."""
    if segments is None:
        segments = jnp.ones(ids.shape, jnp.int32)
    params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
    weights = target_weights(mask, segments, num_drafts)                           # [k, B, T]
    targets = _shift(ids, 1)                                                        # [B, T] x_{p+1}

    @jax.checkpoint
    def row(xs):
        seq, seg, tgt, w = xs
        logits = pard_logits(decoder, params, seq, seg, mask_token, num_drafts)     # [k, T, V]
        ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[None, :, None], -1)[..., 0]
        hit = (jnp.argmax(logits, -1) == tgt[None]) & (w > 0)
        return jnp.sum(w * ce, -1), hit

    ce_sums, hits = jax.lax.map(row, (ids, segments, targets, jnp.moveaxis(weights, 0, 1)))   # [B, k], [B, k, T]
    hits = jnp.moveaxis(hits, 0, 1)                                                 # [k, B, T]
    counts = jnp.sum(weights, (1, 2))
    per_loss = jnp.sum(ce_sums, 0) / jnp.maximum(counts, 1.0)
    decay = step_decay ** jnp.arange(num_drafts, dtype=jnp.float32)
    return jnp.sum(decay * per_loss), (per_loss, jnp.sum(hits, (1, 2)).astype(jnp.float32), counts, hits)


@dataclasses.dataclass(frozen=True)
class PardSteps:
    """The run's jitted steps: train_step (eagle3.training_loop's signature: the target params and cached outputs
    it passes are unused here) and eval_step."""
    train_step: Callable
    eval_step: Callable


def pard_steps(model_config, config: PardConfig, mask_token: int) -> PardSteps:
    import optax
    decoder, k, decay = Decoder(model_config), config.num_drafts, config.step_decay
    cd = eagle3.compute_dtype(config)
    loss = functools.partial(pard_loss, decoder, mask_token=mask_token, num_drafts=k, step_decay=decay,
                             compute_dtype=cd)

    @functools.partial(jax.jit, compiler_options=eagle3.COMPILER_OPTIONS)
    def train_step(params, opt_state, _target_params, ids, mask, learning_rate, _cached=None, segments=None):
        (value, (_, hits, counts, _)), grads = jax.value_and_grad(
            lambda p: loss(p, ids, mask, segments), has_aux=True)(params)
        updates, opt_state = eagle3.head_optimizer(config, learning_rate).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, hits / jnp.maximum(counts, 1.0)

    @functools.partial(jax.jit, compiler_options=eagle3.COMPILER_OPTIONS)
    def eval_step(params, ids, mask):
        _, (per_loss, hits, counts, hit_map) = loss(params, ids, mask, None)
        return per_loss, hits, counts, hit_map

    return PardSteps(train_step, eval_step)


# ---- held-out evaluation and throughput -------------------------------------------------------------------------

def acceptance_hits(hit_map: np.ndarray) -> np.ndarray:
    """hits bool[k, B, T] (block j at p: the draft of x_{p+1}) -> eagle3.simulated_acceptance's layout: [j, b, a]
    whether draft j+1 is right after the token a+1 is emitted (anchor n = a + 2, block j at p = a + 1 + j)."""
    out = np.zeros_like(hit_map)
    for j in range(hit_map.shape[0]):
        out[j, :, :hit_map.shape[2] - (j + 1)] = hit_map[j, :, j + 1:]
    return out


def evaluate(params, held_out: Examples, steps: PardSteps, config: PardConfig) -> dict:
    """The held-out report: per-draft loss and accuracy (drafts 1..k, each over the positions it trains), greedy
    speculation at k replayed over the answers (eagle3.simulated_acceptance) and the accuracies' estimate of it
    (eagle3.estimated_acceptance_length). Batches padded to batch_size (eval_step compiles once)."""
    k = config.num_drafts
    tot_l, tot_h, tot_w, hit_maps = np.zeros(k), np.zeros(k), np.zeros(k), []
    for i in range(0, len(held_out), config.batch_size):
        ids, mask = held_out.ids[i:i + config.batch_size], held_out.mask[i:i + config.batch_size]
        pad = config.batch_size - len(ids)
        if pad:
            ids, mask = np.pad(ids, ((0, pad), (0, 0))), np.pad(mask, ((0, pad), (0, 0)))
        per_loss, hits, counts, hit_map = jax.device_get(steps.eval_step(params, ids, mask))
        tot_l, tot_h, tot_w = tot_l + per_loss * counts, tot_h + hits, tot_w + counts
        hit_maps.append(np.asarray(hit_map)[:, :len(ids) - pad])
    per_loss, per_acc = tot_l / np.maximum(tot_w, 1), tot_h / np.maximum(tot_w, 1)
    # a row's first token is its prompt however it is marked (plain text: every token): the replay starts after it
    answers = np.asarray(held_out.mask).copy()
    answers[:, 0] = 0
    length, per_position = eagle3.simulated_acceptance(acceptance_hits(np.concatenate(hit_maps, 1)), answers, k)
    return {"loss": per_loss.tolist(), "accuracy": per_acc.tolist(), "num_examples": len(held_out),
            f"acceptance_length_k{k}": length, f"per_position_acceptance_k{k}": per_position,
            f"estimated_acceptance_length_k{k}": eagle3.estimated_acceptance_length(per_acc, k)}


def training_throughput(params, examples: Examples, config: PardConfig, step_seconds, data_seconds) -> dict:
    """Tokens per second and model FLOPs utilisation of a steady training step: 6 FLOPs per weight (the embedding
    lookup's excluded) per position of the k blocks (B x k x T), attention's scores left out. {} when too few steps
    ran to time."""
    if step_seconds is None:
        return {}
    B, T, k = config.batch_size, examples.ids.shape[1], config.num_drafts
    host = jax.tree_util.tree_leaves(params)
    size = sum(int(np.prod(x.shape)) for x in host) - (params["embed"].size if "lm_head" in params else 0)
    used = float(examples.row_lengths().mean()) / T
    peak = eagle3.peak_flops()
    flops = 6 * size * B * k * T
    return {"step_ms": 1e3 * step_seconds, "padding_fraction": 1 - used,
            "sequence_tokens_per_s": used * B * T / step_seconds,
            "target_tokens_per_s": examples.num_target_tokens / len(examples) * B / step_seconds,
            "trained_positions_per_s": B * k * T / step_seconds, "phases_ms": {"data": 1e3 * data_seconds},
            "mfu": None if peak is None else flops / step_seconds / peak}


def format_throughput(t: dict) -> str:
    mfu = "n/a (no peak known for this device)" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%"
    return (f"training: {t['step_ms']:.1f} ms/step, {t['sequence_tokens_per_s']:.0f} sequence tokens/s "
            f"({t['trained_positions_per_s']:.0f} positions/s over the mask blocks), {t['target_tokens_per_s']:.0f} "
            f"target tokens/s, {100 * t['padding_fraction']:.0f}% padding; data {t['phases_ms']['data']:.2f} ms; "
            f"MFU {mfu}")


# ---- the run ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DraftState:
    """The model being trained: its params (f32) and optimizer state after `step` steps (eagle3.training_loop's
    state)."""
    params: dict
    opt_state: object
    step: int


def check_inputs(model, examples: Examples, mask_token: int):
    """Refuses what cannot be trained or written back: a quantized model, layer kinds the HF writer cannot write,
    examples with nothing to train or of another tokenizer, examples that hold the mask token."""
    from jaxspec.models.hf_writer import check_writable
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"the draft model is quantized ({model.quantization}): train it from its unquantized "
                         "weights")
    check_writable(model.config)
    if len(examples) == 0 or examples.num_target_tokens == 0:
        raise ValueError("nothing to train on: the examples mark no token to predict")
    if examples.ids.max() >= model.config.vocab_size:
        raise ValueError(f"the examples hold token id {int(examples.ids.max())} but the draft model's vocabulary "
                         f"has {model.config.vocab_size}: they were rendered with another tokenizer")
    if mask_token != 0 and np.any(examples.ids == mask_token):   # (0: the padding's id)
        raise ValueError(f"the examples hold the mask token {mask_token} as text: pick another mask_token_id")


def restore_or_start(model, checkpoints: eagle3.Checkpoints, config: PardConfig, mask_token: int) -> DraftState:
    """The model's weights (f32) at step 0, or the latest checkpoint's once pard.json shows it was made with this
    mask token and a model of these sizes."""
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), model.params)
    opt_state = eagle3.head_optimizer(config, 0.0).init(params)
    c = model.config
    record = {"mask_token_id": mask_token, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "num_layers": c.num_layers}
    path = checkpoints.directory / PARD_JSON
    if checkpoints.resume_step is None:
        checkpoints.directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        return DraftState(params, opt_state, 0)
    saved = json.loads(path.read_text()) if path.is_file() else None
    if saved != record:
        raise ValueError(f"{str(checkpoints.directory)!r} holds checkpoints made with {saved} (pard.json); this run "
                         f"has {record}: resume with the same model and mask token, or use another out directory")
    params, opt_state = checkpoints.restore(params, opt_state)
    return DraftState(params, opt_state, checkpoints.resume_step)


def train(model, examples: Examples, out_dir, config: PardConfig | None = None, held_out: Examples | None = None,
          progress: bool = True) -> eagle3.TrainResult:
    """Trains (or resumes, from the latest orbax checkpoint under out_dir/checkpoints) `model` (a Model: the draft
    model's pretrained weights) to fill mask tokens and writes it to out_dir in the HF layout with its pard_token,
    loadable with SpeculativeConfig(method="draft_model", model=out_dir, parallel_drafting=True). The phases, as
    eagle3.train's: inputs checked, state restored or started, steps compiled, the loop, its throughput, the
    held-out evaluation, the model written and training.json."""
    from jaxspec.models.hf_writer import save_hf_model
    config = PardConfig() if config is None else config
    out_dir = Path(out_dir).absolute()
    mask_token = mask_token_of(model, config)
    check_inputs(model, examples, mask_token)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_examples = len(examples)
    if config.pack:
        examples = examples.pack()
    checkpoints = eagle3.Checkpoints(out_dir)
    state = restore_or_start(model, checkpoints, config, mask_token)
    steps = pard_steps(model.config, config, mask_token)
    started = time.perf_counter()
    run = eagle3.training_loop(None, examples, state, steps, None, checkpoints, config, started, progress,
                               desc=f"training a parallel draft model (k={config.num_drafts})",
                               num_accuracies=config.num_drafts)
    throughput = training_throughput(run.params, examples, config, run.steady_seconds, run.data_seconds)
    if progress and throughput:
        print(format_throughput(throughput))
    seconds = time.perf_counter() - started
    report = evaluate(run.params, held_out, steps, config) if held_out is not None and len(held_out) else {}
    save_hf_model(out_dir, model.config, run.params, source=model.source, tokenizer=model.tokenizer,
                  extra={"pard_token": mask_token})
    result = eagle3.TrainResult(out_dir, run.losses, run.accuracies, state.step, report, seconds, num_examples,
                                examples.num_target_tokens, throughput)
    eagle3.write_training_json(out_dir, result, run.total_steps, examples, config)
    return result
