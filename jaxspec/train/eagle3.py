"""EAGLE-3 heads trained for a target, on the device the target runs on.

Per training step, for a batch of rendered conversations ids [B, T] (mask [B, T] on the assistant's tokens):

    aux, teacher = target(ids)                  # the residual stream after the 3 EAGLE-3 layers [B, T, 3D]; the
                                                # target's next-token distribution over the draft vocabulary
    hidden = fc(aux)                            # the feature of each position a                    [B, T, D]
    for j in 0..J-1:                            # the training-time test: the head unrolled on its own output
        x = [norm(embed(ids[a+j+1])); hidden_norm(hidden)] at position a+j        # chain a, step j
        hidden = layer(x) attending to step 0's keys at positions <= a and to chain a's own keys of steps 1..j
        loss_j = cross-entropy(teacher at a+j+1, draft logits of hidden)        # it predicts token a+j+2

A parallel head (TrainConfig.arch "parallel") has no token or hidden to feed back: its steps j >= 1 read the
placeholders [norm(mask_embed); hidden_norm(mask_hidden)] at a+j, with mask_hidden as the residual, and attend to
the same keys; step j still predicts token a+j+2, so the loss is the chain's. This is what the engine's head
(jaxspec.nn.eagle) computes at inference: from the last accepted position a, its
first draft reads the real feature at a, draft j the head's hidden of draft j-1, and each attends to the pairs
written at positions <= a and to the chain's own. Gradients reach only the head; the target (and its embedding,
which the head shares) stays frozen, and its features are computed here, never stored.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import save_head
from jaxspec.nn.decoder import Decoder, segment_positions
from jaxspec.nn.eagle import EagleHead
from jaxspec.nn.layers import mlp, project_qkv
from jaxspec.nn.ops import Ops, rms_norm
from jaxspec.nn.schema import initialize
from jaxspec.train.config import TrainConfig
from jaxspec.train.data import Examples

CHECKPOINTS = "checkpoints"
# XLA options of train_step/eval_step's compiles (None: XLA's defaults): the CPU tests turn LLVM optimisation back on.
COMPILER_OPTIONS: dict | None = None


# The target layer kinds whose residual streams the trainer reads (jaxspec.nn.layers.LAYER_KINDS): attention with
# a KV cache alone. The hybrids' kinds (gated_deltanet, gated_attention) carry per-slot recurrent state.
EAGLE3_TARGET_LAYER_KINDS = ("attention", "attention_moe", "gemma3_attention", "gpt_oss")


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's config: one plain Llama decoder layer (no biases, q/k norms, window, sinks, experts, (1 + w) norms,
    embedding scale or GELU, whatever the target's family) of the target's width, heads, head_dim and MLP size, with
    the target's global rotary (rope_theta and rope_scaling: Gemma 3's full-attention layers', GPT-OSS's YaRN), which
    the head's config.json carries and the head loader reads back (`save_head`). Built field by field, so that no
    family field of the target reaches the head."""
    return ModelConfig(arch="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                       intermediate_size=target.intermediate_size, num_layers=1, num_heads=target.num_heads,
                       num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                       rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                       max_position_embeddings=target.max_position_embeddings, bos_token_id=target.bos_token_id,
                       eos_token_ids=target.eos_token_ids)


def draft_vocabulary(tokens: np.ndarray, weights: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent of `tokens` where `weights` > 0 (ties: lower id), sorted: draft id i stands for
    target id d2t[i]. Ids that never occur fill the rest in id order."""
    size = min(size, vocab_size)
    counts = np.bincount(np.asarray(tokens)[np.asarray(weights) > 0].ravel(), minlength=vocab_size)[:vocab_size]
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def predicted_tokens(target, examples: Examples, batch_size: int, progress: bool = False) -> np.ndarray:
    """The target's argmax after every position of the examples [N, T]: the tokens a draft head must be able to
    propose (with self-distilled data they are the data's own tokens; with other data they are not). A pass of the
    target over all the data (minutes on a CPU): progress shown per batch when `progress`."""
    from tqdm.auto import tqdm
    decoder = Decoder(target.config)
    argmax = lambda params, seq, seg: jnp.argmax(decoder.dense_forward(params, seq, (), seg)[0], -1).astype(  # noqa
        jnp.int32)
    if target.config.moe:   # the experts' grouped matmul (ragged_dot) has no batching rule: one sequence at a time
        fn = jax.jit(lambda params, seqs, segs: jax.lax.map(lambda row: argmax(params, *row), (seqs, segs)))
    else:   # the batch's sequences side by side (vmap): one matmul of B x T rows per weight, not B of T rows
        fn = jax.jit(jax.vmap(argmax, in_axes=(None, 0, 0)))
    starts = range(0, len(examples), batch_size)
    bar = tqdm(total=len(examples), desc="target predictions (draft vocabulary)", disable=not progress, unit="row")
    parts = []
    for i in starts:   # each batch read back as it ends, so that the bar moves with the device
        segments = None if examples.segments is None else examples.segments[i:i + batch_size]
        parts.append(np.asarray(fn(target.params, examples.ids[i:i + batch_size], segments)))
        bar.update(len(parts[-1]))
    bar.close()
    return np.concatenate(parts)


def init_head(head: EagleHead, target_params: dict, d2t: np.ndarray, seed: int) -> dict:
    """Trainable head params (f32): the layer and fc drawn at random, norms at one, the draft lm_head started
    from the target's output rows of the draft vocabulary (the target's own readout of its final hidden)."""
    schema = {k: v for k, v in head.param_schema().items() if k != "draft_to_target"}
    params = initialize(schema, jnp.float32, jax.random.PRNGKey(seed), scale=0.02)
    out_rows = target_params.get("lm_head", target_params["embed"])
    params["lm_head"] = jnp.asarray(out_rows, jnp.float32)[jnp.asarray(d2t)]
    return params


# ---- the device side ---------------------------------------------------------------------------------------

def make_target_fn(target_config: ModelConfig, aux_layers: tuple[int, ...], rows_side_by_side: bool = False):
    """jit: (target params, ids [B, T], d2t [Vd], segments [B, T] or None) -> (aux [B, T, 3D] f32, teacher
    log-probs over the draft vocabulary [B, T, Vd] f32, in_vocab bool[B, T]: the target's argmax is a
    draft-vocabulary token). Packed rows (segments) run as their sequences would alone. The rows run one after
    another, or with `rows_side_by_side` as one batched forward (one matmul of B x T rows per weight; B times the
    full-vocabulary logits live at once; not for MoE targets, whose grouped matmul has no batching rule): which is
    faster on the GPU is what benchmarks/profiles/profile_train_step.py measures."""
    if rows_side_by_side and target_config.moe:
        raise ValueError("rows_side_by_side: a MoE target's experts (ragged_dot) have no batching rule")
    decoder = Decoder(target_config)

    @jax.jit
    def target_fn(params, ids, d2t, segments=None):
        def one(row):
            seq, seg = row
            logits, _, aux = decoder.dense_forward(params, seq, aux_layers, seg)  # [T, V], _, [3, T, D]
            in_vocab = jnp.zeros(logits.shape[-1], bool).at[d2t].set(True)[jnp.argmax(logits, -1)]
            teacher = jax.nn.log_softmax(logits[:, d2t], axis=-1)                # [T, Vd]
            return jnp.concatenate(list(aux), -1).astype(jnp.float32), teacher, in_vocab
        if rows_side_by_side:
            return jax.vmap(lambda seq, seg: one((seq, seg)))(ids, segments)
        return jax.lax.map(one, (ids, segments))
    return target_fn


def _shift(x, n: int):
    """x[:, n:] padded with zeros to x's length (position a holds what position a+n held)."""
    pad = [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, n:], pad)


def unrolled_logits(head: EagleHead, params, embed, ids, aux, num_steps: int, compute_dtype=jnp.float32,
                    ops: Ops = Ops(), segments=None) -> list:
    """The head unrolled `num_steps` draft steps from every position at once -> [J] of draft-vocabulary logits
    [B, T, Vd] f32: step j's row a is chain a's draft j, which predicts token a+j+2 (a parallel head: its
    placeholder j). ids i32[B, T];
    aux [B, T, 3D] the target's residual streams. The matmuls run in `compute_dtype` (bf16 on a GPU: the
    f32 params are cast here, so their gradients stay f32), each projection through `ops.linear` as at
    inference; norms, softmaxes and logits in f32. `segments` [B, T]: packed rows (Examples.pack): positions
    restart at each of a row's sequences and a chain attends within its own."""
    params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
    aux = aux.astype(compute_dtype)
    c = head.config
    B, T = ids.shape
    Hq, Hkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    G, scale = Hq // Hkv, 1.0 / math.sqrt(hd)
    lp = {k: w[0] for k, w in params["layers"]["attention"].items()}
    causal = jnp.tril(jnp.ones((T, T), bool))[None]                                       # [1|B, T, T]
    base = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segments is not None:
        causal = causal & (segments[:, :, None] == segments[:, None, :])
        base = segment_positions(segments)
    hidden = ops.linear(aux, params, "fc")                                                # [B, T, D]
    keys0 = values0 = None
    own_k, own_v, out_logits = [], [], []
    flat = lambda x: x.reshape(B * T, *x.shape[2:])                                      # noqa: E731
    for j in range(num_steps):
        if j and head.parallel:   # the placeholders: the same two vectors in every chain, at a+j
            emb = jnp.broadcast_to(params["mask_embed"], hidden.shape)
            hidden = jnp.broadcast_to(params["mask_hidden"], hidden.shape)
        else:
            emb = embed[_shift(ids, j + 1)].astype(compute_dtype)                         # [B, T, D] t_{a+j+1}
        x = jnp.concatenate([rms_norm(emb, lp["attn_norm"], c.rms_norm_eps),
                             rms_norm(hidden, params["hidden_norm"], c.rms_norm_eps)], -1)   # [B, T, 2D]
        positions = (base + j).reshape(B * T)                                            # chain a at a+j
        q, k, v = project_qkv(c, ops, lp, flat(x), positions)                             # [BT, Hq|Hkv, hd]
        q = q.reshape(B, T, Hkv, G, hd)
        k, v = k.reshape(B, T, Hkv, hd), v.reshape(B, T, Hkv, hd)
        if j == 0:          # the pairs of real features: every chain attends to those at positions <= a
            keys0, values0 = k, v
        else:               # a chain's own drafts: each attends to its earlier ones and itself
            own_k.append(k)
            own_v.append(v)
        s0 = jnp.einsum("btkgd,bskd->btkgs", q, keys0) * scale                            # [B, T, Hkv, G, T]
        s0 = jnp.where(causal[:, :, None, None, :], s0, -jnp.inf)
        s_own = [jnp.einsum("btkgd,btkd->btkg", q, ki)[..., None] * scale for ki in own_k]
        p = jax.nn.softmax(jnp.concatenate([s0] + s_own, -1).astype(jnp.float32), -1).astype(compute_dtype)
        out = jnp.einsum("btkgs,bskd->btkgd", p[..., :T], values0)
        for i, vi in enumerate(own_v):
            out = out + p[..., T + i, None] * vi[:, :, :, None, :]
        attn = ops.linear(out.reshape(B * T, Hq * hd), lp, "o_proj")
        hidden = mlp(c, ops, lp, flat(hidden) + attn).reshape(B, T, -1)                   # [B, T, D]
        logits = ops.linear(hidden, params, "lm_head", norm="norm", eps=c.rms_norm_eps)   # [B, T, Vd]
        out_logits.append(logits.astype(jnp.float32))
    return out_logits


def head_optimizer(config: TrainConfig, learning_rate):
    """The head's optimizer. The learning rate is an argument of the step, computed on the host: a time budget can
    then resize the schedule after the first steps are timed without recompiling (the optimizer's state does not
    depend on it)."""
    import optax
    return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                       optax.adamw(learning_rate, weight_decay=config.weight_decay))


def compute_dtype(config: TrainConfig):
    """The head's matmul dtype: bf16 on a GPU unless the config names one (f32 params, f32 gradients)."""
    if config.compute_dtype != "auto":
        return jnp.dtype(config.compute_dtype)
    return jnp.dtype("bfloat16" if jax.default_backend() == "gpu" else "float32")


def make_train_step(head: EagleHead, target_fn, d2t, config: TrainConfig):
    """jit: (params, opt_state, target params, ids [B, T], mask [B, T], learning rate, cached target outputs or
    None, segments [B, T] or None) -> (params, opt_state, loss, per-step accuracy [J]): one training step, the
    target's forward (target_fn) included unless its outputs are cached. The target's weights are arguments (as
    constants they would be copied into the compiled program)."""
    import optax
    d2t_dev, J, decay, cd = jnp.asarray(d2t), config.ttt_steps, config.step_decay, compute_dtype(config)

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def train_step(params, opt_state, target_params, ids, mask, learning_rate, cached=None, segments=None):
        aux, teacher, in_vocab = cached if cached is not None else target_fn(target_params, ids, d2t_dev, segments)
        weights = loss_weights(mask, in_vocab)
        grad_fn = jax.value_and_grad(lambda p: ttt_forward(head, p, target_params["embed"], ids, aux, teacher,
                                                           weights, J, decay, compute_dtype=cd, segments=segments),
                                     has_aux=True)
        (loss, (_, accs, _)), grads = grad_fn(params)
        updates, opt_state = head_optimizer(config, learning_rate).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accs
    return train_step


def make_eval_step(head: EagleHead, target_fn, d2t, config: TrainConfig):
    """jit: (params, target params, ids [B, T], mask [B, T]) -> (per-step loss [J], per-step accuracy [J] over every
    assistant position, the count of those positions, hits bool[J, B, T]): the training-time test of a batch
    without a gradient, for the held-out report."""
    d2t_dev, J, decay, cd = jnp.asarray(d2t), config.ttt_steps, config.step_decay, compute_dtype(config)

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def eval_step(params, target_params, ids, mask):
        aux, teacher, in_vocab = target_fn(target_params, ids, d2t_dev)
        weights = loss_weights(mask, in_vocab)
        counted = _shift(mask, 1)
        _, (losses, accs, hits) = ttt_forward(head, params, target_params["embed"], ids, aux, teacher, weights, J,
                                              decay, counted, compute_dtype=cd)
        return losses, accs, jnp.sum(counted), hits
    return eval_step


def ttt_forward(head: EagleHead, params, embed, ids, aux, teacher, weights, num_steps: int, step_decay: float,
                counted=None, compute_dtype=jnp.float32, segments=None):
    """The training-time test over a batch -> (weighted loss, (per-step loss [J], per-step accuracy [J],
    hits bool[J, B, T]: chain a's draft j is the target's token a+j+2 and that token is trained)).
    teacher: the target's log-probs over the draft vocabulary [B, T, Vd]; weights [B, T]: 1 where position p's
    prediction (of token p+1) is trained. Accuracy is over `weights` too, or over `counted` when given (every
    assistant position: a draft cannot match where the target's argmax is outside the draft vocabulary, and
    those positions carry weight 0 in `weights`). Packed rows (`segments`): a chain predicts no token of the next
    sequence."""
    losses, accs, hit_maps, total = [], [], [], 0.0
    for j, logits in enumerate(unrolled_logits(head, params, embed, ids, aux, num_steps, compute_dtype,
                                               segments=segments)):
        t_lp = _shift(teacher, j + 1)                                                     # teacher at a+j+1
        w = _shift(weights, j + 1)
        if segments is not None:   # token a+j+2 in chain a's own sequence
            w = w * (_shift(segments, j + 2) == segments)
        ce = -jnp.sum(jnp.exp(t_lp) * jax.nn.log_softmax(logits, -1), -1)                 # [B, T]
        n = jnp.maximum(jnp.sum(w), 1.0)
        losses.append(jnp.sum(w * ce) / n)
        hit = (w > 0) & (jnp.argmax(logits, -1) == jnp.argmax(t_lp, -1))                  # w = 0 off-vocabulary
        hit_maps.append(hit)
        hits = hit.astype(jnp.float32)
        c = w if counted is None else _shift(counted, j + 1)
        accs.append(jnp.sum(hits) / jnp.maximum(jnp.sum(c), 1.0))
        total = total + step_decay ** j * losses[-1]
    return total, (jnp.stack(losses), jnp.stack(accs), jnp.stack(hit_maps))


def loss_weights(mask, in_vocab):
    """Position p's prediction (of token p+1) counts when token p+1 is the assistant's and the target's argmax
    there is a draft-vocabulary token (a draft head cannot propose the others)."""
    return _shift(mask, 1) * in_vocab.astype(jnp.float32)


def simulated_acceptance(hits, mask, k: int) -> tuple[float, list[float]]:
    """Greedy speculative decoding replayed over the held-out answers -> (acceptance length, per-position
    acceptance), what the engine reports for them. hits bool[J, B, T] (ttt_forward), mask [B, T] (the answer's
    tokens). Each row starts where the answer does (the first draft chain sits at the position before the first
    answer token, which the prefill emits); a chain accepts its leading hits, and the next chain starts after
    the emitted token. With self-distilled answers this is the engine's own run; with other answers it follows
    the data's tokens, which the target may not have produced.

    The per-step accuracies overstate acceptance: a chain starts right after a rejection, where the next token
    was hard to draft, more often than an average position is."""
    hits, mask = np.asarray(hits, bool)[:k], np.asarray(mask) > 0
    accepted, steps = np.zeros(k), 0
    for b in range(mask.shape[0]):
        answer = np.nonzero(mask[b])[0]
        if len(answer) < 2 or answer[0] == 0:
            continue
        a, last = answer[0] - 1, answer[-1]
        while a + 2 <= last:
            m = 0
            while m < k and hits[m, b, a]:
                m += 1
            accepted[:m] += 1
            steps += 1
            a += m + 1
    per_position = (accepted / max(steps, 1)).tolist()
    return 1 + float(sum(per_position)), per_position


def estimated_acceptance_length(accuracies, k: int) -> float:
    """1 + sum over j <= k of the chance that the first j drafts all match, from per-step accuracies measured
    with the earlier tokens given (each an estimate of the conditional acceptance of draft j)."""
    acc = np.asarray(accuracies, np.float64)[:k]
    return float(1 + np.sum(np.cumprod(acc)))


# ---- throughput -----------------------------------------------------------------------------------------------

# Dense bf16 peak of the GPUs this trainer is measured on (FLOP/s), for the model FLOPs utilisation; other devices
# get none.
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def training_flops(target_params, head_params, positions: int, ttt_steps: int) -> tuple[int, int]:
    """(target forward, head) FLOPs of a training step over `positions` positions: 2 per parameter per position for
    the target (its lm_head, not its embedding lookup), 6 for the head's forward and backward at each of its
    unrolled steps; attention's score FLOPs are left out."""
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))   # noqa: E731
    target_size = size(target_params) - (target_params["embed"].size if "lm_head" in target_params else 0)
    return 2 * target_size * positions, 6 * size(head_params) * positions * ttt_steps


def training_throughput(target_params, head_params, examples, config: TrainConfig, step_seconds, target_seconds,
                        data_seconds) -> dict:
    """Tokens per second and model FLOPs utilisation of a training step and of its phases: the data (the host's
    batch), the target's forward (with cached target outputs: their one pass, per batch), the head's steps (the
    step less the target's forward). FLOPs: training_flops's. Positions are every row's B x T, padding included:
    `padding_fraction` says how many of them carry no token (what packing removes). {} when too few steps ran to
    time."""
    if step_seconds is None:
        return {}
    B, T = config.batch_size, examples.ids.shape[1]
    positions = B * T
    used = float(examples.row_lengths().mean()) / T
    target_flops, head_flops = training_flops(target_params, head_params, positions, config.ttt_steps)
    cached = config.cache_target_outputs
    head_seconds = step_seconds if cached else max(step_seconds - target_seconds, 1e-9)
    peak = peak_flops()
    mfu = (lambda flops, s: None if peak is None else flops / s / peak)   # noqa: E731
    trained_per_row = examples.num_target_tokens / len(examples)
    return {"step_ms": 1e3 * step_seconds, "padding_fraction": 1 - used,
            "target_tokens_per_s": trained_per_row * B / step_seconds,
            "sequence_tokens_per_s": used * positions / step_seconds,
            "phases_ms": {"data": 1e3 * data_seconds, "target_forward": 1e3 * target_seconds,
                          "head": 1e3 * head_seconds},
            "mfu": {"target_forward": mfu(target_flops, target_seconds), "head": mfu(head_flops, head_seconds),
                    "step": mfu(head_flops + (0 if cached else target_flops), step_seconds)}}


def format_throughput(t: dict) -> str:
    pct = lambda x: "n/a (no peak known for this device)" if x is None else f"{100 * x:.1f}%"   # noqa: E731
    ph = t["phases_ms"]
    return (f"training: {t['step_ms']:.1f} ms/step, {t['target_tokens_per_s']:.0f} target tokens/s, "
            f"{t['sequence_tokens_per_s']:.0f} sequence tokens/s, {100 * t['padding_fraction']:.0f}% padding; "
            f"phases: data {ph['data']:.2f} ms, target forward {ph['target_forward']:.1f} ms (MFU "
            f"{pct(t['mfu']['target_forward'])}), head {ph['head']:.1f} ms (MFU {pct(t['mfu']['head'])}); "
            f"step MFU {pct(t['mfu']['step'])}")


# ---- the run -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    losses: list[float]              # the weighted loss of each step run here (from the resumed step on)
    accuracies: np.ndarray           # [steps run, J] per-step accuracy
    first_step: int                  # the step this run started from (0, or a resumed checkpoint's)
    held_out: dict                   # per-step loss/accuracy and the estimated acceptance length at k=4
    seconds: float
    num_examples: int
    num_target_tokens: int
    throughput: dict = dataclasses.field(default_factory=dict)   # training_throughput's; {} with too few steps


def _batches(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The example indices of training step `step`: epochs of seeded permutations, so a resumed run sees the
    same batches as one that never stopped."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[i * batch_size:(i + 1) * batch_size] if n >= batch_size else order[np.arange(batch_size) % n]


def train(target, examples: Examples, out_dir, config: TrainConfig = TrainConfig(), held_out: Examples | None = None,
          progress: bool = True) -> TrainResult:
    """Trains (or resumes, from the latest orbax checkpoint under out_dir/checkpoints) an EAGLE-3 head for
    `target` (a Model) and writes it to out_dir in the HF layout the engine loads. The phases, in order: the
    inputs checked; the head restored or started (a new one's draft vocabulary from a pass of the target); the
    optimizer and the compiled steps; the target's outputs cached (cache_target_outputs); the training loop; its
    throughput; the held-out evaluation; the head saved (jaxspec.models.heads.save_head) and the report written."""
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    check_inputs(target.config, examples)
    num_examples = len(examples)
    if config.pack:   # before the draft vocabulary's pass too: it reads fewer rows
        examples = examples.pack()
    checkpoints = Checkpoints(out_dir)
    state = restore_or_start(target, examples, checkpoints, config, progress)
    steps = training_steps(state.head, target.config, state.d2t, config)
    started = time.perf_counter()
    cache, target_seconds = (cache_target_outputs(target, examples, steps, config, progress)
                             if config.cache_target_outputs else (None, None))
    run = training_loop(target.params, examples, state, steps, cache, checkpoints, config, started, progress)
    throughput = measure_throughput(target, examples, config, run, steps, target_seconds)
    if progress and throughput:
        print(format_throughput(throughput))
    seconds = time.perf_counter() - started
    report = evaluate(run.params, target, held_out, steps, config) if held_out is not None and len(held_out) else {}
    save_head(out_dir, state.head, run.params, state.d2t)
    result = TrainResult(out_dir, run.losses, run.accuracies, state.step, report, seconds, num_examples,
                         examples.num_target_tokens, throughput)
    write_training_json(out_dir, result, run.total_steps, examples, config)
    return result


# ---- the phases of a run, in order ------------------------------------------------------------------------------

def check_inputs(target_config: ModelConfig, examples: Examples):
    """Refuses, before anything loads or runs, what cannot be trained: a target with layer kinds whose residual
    stream the trainer cannot read (recurrent per-slot state), examples with no assistant token, and token ids past
    the target's vocabulary (examples rendered with another tokenizer would train on the wrong tokens)."""
    tc = target_config
    refused = sorted(set(tc.layer_types or ()) - set(EAGLE3_TARGET_LAYER_KINDS))
    if refused:
        raise ValueError(f"EAGLE-3 training does not support a target with layer kinds {', '.join(refused)} (arch "
                         f"{tc.arch!r}: per-slot recurrent state); supported: targets whose layers are all of "
                         f"{', '.join(EAGLE3_TARGET_LAYER_KINDS)} (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, "
                         f"GPT-OSS)")
    if len(examples) == 0 or examples.num_target_tokens == 0:
        raise ValueError("nothing to train on: the examples have no assistant tokens")
    if examples.ids.max() >= tc.vocab_size:
        raise ValueError(f"the examples hold token id {int(examples.ids.max())} but the target's vocabulary has "
                         f"{tc.vocab_size}: they were rendered with another tokenizer")


class Checkpoints:
    """A run's orbax checkpoints under out_dir/checkpoints (the head's params and optimizer state; the last two
    kept) and head.json beside them: the target's sizes, the draft vocabulary and the arch they were made with.
    A resumed run reads head.json back, because the head's lm_head rows stand for that vocabulary's ids and the
    vocabulary pass need not run again."""

    def __init__(self, out_dir: Path):
        import orbax.checkpoint as ocp
        self.out_dir, self.directory = out_dir, out_dir / CHECKPOINTS
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, save_interval_steps=1))
        self.resume_step = self.manager.latest_step()   # the step a run resumes from; None: a new run

    def resumed_vocabulary(self, target_config: ModelConfig, arch: str) -> np.ndarray:
        """The draft vocabulary (d2t) the checkpoints were made with, once head.json shows they were made for a
        target of this one's sizes and for a head of this arch."""
        path = self.directory / "head.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(self.directory)!r} holds checkpoints (latest step {self.resume_step}) but "
                                    "no head.json, the draft vocabulary they were trained on: use another --out "
                                    "directory")
        saved = json.loads(path.read_text())
        tc = target_config
        if saved["hidden_size"] != tc.hidden_size or saved["vocab_size"] != tc.vocab_size:
            raise ValueError(f"{str(self.out_dir)!r} holds a checkpoint for a target of hidden_size="
                             f"{saved['hidden_size']}, vocab_size={saved['vocab_size']}; this target has "
                             f"{tc.hidden_size}, {tc.vocab_size}: use another --out directory")
        if saved.get("arch", "chain") != arch:
            raise ValueError(f"{str(self.out_dir)!r} holds a checkpoint of a head with arch="
                             f"{saved.get('arch', 'chain')!r}; this run asks for arch={arch!r}: resume with that arch "
                             f"or use another --out")
        return np.asarray(saved["d2t"], np.int32)

    def record_start(self, target_config: ModelConfig, d2t: np.ndarray, arch: str):
        """head.json of a new run: what `resumed_vocabulary` reads back and checks."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "head.json").write_text(json.dumps(
            {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size, "d2t": d2t.tolist(),
             "arch": arch}))

    def restore(self, params: dict, opt_state) -> tuple:
        """(params, optimizer state) of step `resume_step`, in the structure of the ones given."""
        import orbax.checkpoint as ocp
        restored = self.manager.restore(self.resume_step, args=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state}))
        return restored["params"], restored["opt_state"]

    def save(self, step: int, params: dict, opt_state):
        """Step `step`'s params and optimizer state, written on orbax's thread."""
        import orbax.checkpoint as ocp
        # from host copies taken here, not orbax's device reads on its own thread (see
        # xla_flags.release_update_mode: the save crashed on an H100 under the VMM allocator)
        self.manager.save(step, args=ocp.args.StandardSave(jax.device_get({"params": params, "opt_state": opt_state})))

    def wait_until_finished(self):
        self.manager.wait_until_finished()


def draft_vocabulary_pass(target, examples: Examples, config: TrainConfig, progress: bool) -> np.ndarray:
    """A new head's draft vocabulary (d2t): the config.draft_vocab_size tokens the target predicts most where the
    head is trained (positions followed by an assistant token of the same example). The target's predictions, not
    the data's tokens: a draft is accepted when it is what the target would emit. One pass of the target over the
    data (minutes on a CPU)."""
    predicted = predicted_tokens(target, examples, config.batch_size, progress)
    next_is_assistant = np.pad(examples.mask[:, 1:], ((0, 0), (0, 1)))
    if examples.segments is not None:   # a packed example's last token is not followed by the next's first
        next_is_assistant *= np.pad(examples.segments[:, 1:] == examples.segments[:, :-1], ((0, 0), (0, 1)))
    return draft_vocabulary(predicted, next_is_assistant, target.config.vocab_size, config.draft_vocab_size)


@dataclasses.dataclass
class HeadState:
    """The head being trained and where it stands: its module, its draft vocabulary (draft id i stands for target
    id d2t[i]), its params and optimizer state after `step` steps."""
    head: EagleHead
    d2t: np.ndarray
    params: dict
    opt_state: object
    step: int


def restore_or_start(target, examples: Examples, checkpoints: Checkpoints, config: TrainConfig,
                     progress: bool) -> HeadState:
    """The head to train and the step it starts at: the latest checkpoint's, on the draft vocabulary its head.json
    recorded (checked to be of this target's sizes and this run's arch), or else a new head (init_head) at step 0
    on a new vocabulary (draft_vocabulary_pass), recorded for a later resume. A resumed run continues the curve it
    left, because each step's batch and learning rate depend on the step alone (`_batches`, the schedule)."""
    tc = target.config
    resuming = checkpoints.resume_step is not None
    d2t = (checkpoints.resumed_vocabulary(tc, config.arch) if resuming else
           draft_vocabulary_pass(target, examples, config, progress))
    head = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t), parallel=config.arch == "parallel")
    params = init_head(head, target.params, d2t, config.seed)
    opt_state = head_optimizer(config, 0.0).init(params)   # resuming: the structure the checkpoint restores into
    if not resuming:
        checkpoints.record_start(tc, d2t, config.arch)
        return HeadState(head, d2t, params, opt_state, 0)
    params, opt_state = checkpoints.restore(params, opt_state)
    return HeadState(head, d2t, params, opt_state, checkpoints.resume_step)


@dataclasses.dataclass(frozen=True)
class TrainingSteps:
    """The jitted functions of a run: the target's forward (make_target_fn) over the draft vocabulary `d2t` (on the
    device), the training step (make_train_step: the optimizer inside) and the evaluation step (make_eval_step)."""
    target_fn: Callable
    d2t: jax.Array
    train_step: Callable
    eval_step: Callable

    def target_outputs(self, target_params, ids, segments=None) -> tuple:
        """(aux, teacher, in_vocab) of the rows ids [B, T] (make_target_fn's)."""
        return self.target_fn(target_params, ids, self.d2t, segments)


def training_steps(head: EagleHead, target_config: ModelConfig, d2t: np.ndarray, config: TrainConfig) -> TrainingSteps:
    """The optimizer and the steps: the target's forward, and the head's training and evaluation steps built on it,
    each compiled once for the run. The learning rate is an argument of the training step, so that a time budget
    can shorten the schedule (learning_rate_schedule) without a recompile."""
    target_fn = make_target_fn(target_config, head.aux_layers)
    return TrainingSteps(target_fn, jnp.asarray(d2t), make_train_step(head, target_fn, d2t, config),
                         make_eval_step(head, target_fn, d2t, config))


def learning_rate_schedule(config: TrainConfig, total_steps: int):
    """step -> learning rate: a linear warm-up from 0 over config.warmup_steps (fewer in a shorter run), then a
    cosine decay to a tenth of config.learning_rate at total_steps. Built for a total, so that a run cut by its
    time budget decays over the steps it will run."""
    import optax
    warmup = min(config.warmup_steps, total_steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, max(total_steps, warmup + 1),
                                              end_value=0.1 * config.learning_rate)


def cache_target_outputs(target, examples: Examples, steps: TrainingSteps, config: TrainConfig,
                         progress: bool) -> tuple[tuple, float]:
    """(the target's outputs for every example, kept on the device and never on disk; the seconds of the pass per
    batch, its compile included): config.cache_target_outputs, for small datasets trained over many epochs, whose
    steps then skip the target's forward."""
    from tqdm.auto import tqdm
    parts, started = [], time.perf_counter()
    for i in tqdm(range(0, len(examples), config.batch_size), desc="target features (cached)",
                  disable=not progress, unit="batch"):
        rows = slice(i, i + config.batch_size)
        parts.append(jax.block_until_ready(steps.target_outputs(   # each batch awaited: the bar moves with the device
            target.params, examples.ids[rows], None if examples.segments is None else examples.segments[rows])))
    cache = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)
    return cache, (time.perf_counter() - started) / len(parts)


class Batch(NamedTuple):
    ids: np.ndarray                 # [B, T]
    mask: np.ndarray                # [B, T] the assistant's tokens
    cached: tuple | None            # the target's outputs of these rows (cache_target_outputs), or None
    segments: np.ndarray | None     # [B, T] packed rows' example numbers (Examples.pack), or None


def training_batch(examples: Examples, cache, config: TrainConfig, step: int) -> Batch:
    """Step `step`'s batch: the rows `_batches` names (a function of the step alone, so that a resumed run trains
    on what an unbroken one would), with their cached target outputs and segments."""
    idx = _batches(len(examples), config.batch_size, config.seed, step)
    return Batch(examples.ids[idx], examples.mask[idx],
                 None if cache is None else jax.tree_util.tree_map(lambda x: x[idx], cache),
                 None if examples.segments is None else examples.segments[idx])


# Steps after a run's first before its steady rate is timed (the compile and the first steps behind them), and the
# steps after its first whose time per step a time budget is measured over.
STEADY_AFTER = 5
BUDGET_TIMED = (5, 25)


@dataclasses.dataclass
class LoopRun:
    """What the training loop leaves: the head's params after its last step, each step's loss and per-step
    accuracies (on the host), the step count it ran to (config.steps, or fewer under a time budget), the seconds
    of a steady step (None when too few steps ran to time one) and of its data, and the last batch."""
    params: dict
    losses: list[float]
    accuracies: np.ndarray
    total_steps: int
    steady_seconds: float | None
    data_seconds: float
    last_batch: Batch | None


def training_loop(target_params, examples: Examples, state: HeadState, steps: TrainingSteps, cache,
                  checkpoints: Checkpoints, config: TrainConfig, started: float, progress: bool,
                  desc: str | None = None, num_accuracies: int | None = None) -> LoopRun:
    """Steps state.step .. config.steps: each on its seeded batch at the schedule's learning rate, a checkpoint
    every config.save_every steps and at the last. With config.max_seconds, the steps BUDGET_TIMED after the first
    are timed and the run is cut to the steps that fit in the budget (counted from `started`), the schedule
    decaying over the cut count. The device runs ahead of the host: the loop waits on it only to time (the steady
    rate from STEADY_AFTER steps in to the last step, before the last save), and the progress bar shows the step
    before's loss, which is done by the time it is read. `target_params` are passed to every steps.train_step;
    another trainer (jaxspec.train.pard) passes its own steps, its bar's `desc` and the width of its per-step
    accuracies (`num_accuracies`; default config.ttt_steps)."""
    from tqdm.auto import tqdm
    params, opt_state, first_step = state.params, state.opt_state, state.step
    total_steps, lr_at = config.steps, learning_rate_schedule(config, config.steps)
    steady_from = first_step + STEADY_AFTER
    timed_from, timed_until = (first_step + n for n in BUDGET_TIMED)
    bar = tqdm(total=total_steps, initial=first_step, desc=desc or f"training EAGLE-3 ({config.arch})", disable=not progress,
               unit="step")
    step, losses, accs, batch, t_steady, data_seconds = first_step, [], [], None, None, 0.0
    while step < total_steps:
        t_data = time.perf_counter()
        batch = training_batch(examples, cache, config, step)
        if step >= steady_from:
            data_seconds += time.perf_counter() - t_data
        params, opt_state, loss, acc = steps.train_step(params, opt_state, target_params, batch.ids, batch.mask,
                                                        np.float32(lr_at(step)), batch.cached, batch.segments)
        losses.append(loss)
        accs.append(acc)
        step += 1
        bar.update(1)
        if step == steady_from:   # the compile and the first steps behind: the steady rate is timed from here
            jax.block_until_ready(loss)
            t_steady = time.perf_counter()
        if config.max_seconds is not None and step in (timed_from, timed_until):
            jax.block_until_ready(loss)
            if step == timed_from:
                t_timed = time.perf_counter()
            else:
                per_step = (time.perf_counter() - t_timed) / (timed_until - timed_from)
                left = config.max_seconds - (time.perf_counter() - started)
                fits = step + max(int(left / per_step), 0)
                if fits < total_steps:
                    total_steps, lr_at = fits, learning_rate_schedule(config, fits)
                    bar.total = total_steps
                    bar.write(f"{per_step * 1e3:.0f} ms per step: {total_steps} steps fit in "
                              f"max_seconds={config.max_seconds:g}")
        if step == total_steps:   # the steady rate's end, before the last checkpoint's save (not a step's cost)
            jax.block_until_ready(loss)
            t_last = time.perf_counter()
        if step % config.save_every == 0 or step == total_steps:
            checkpoints.save(step, params, opt_state)
        if progress and len(losses) > 1 and (step % 10 == 1 or step == total_steps):
            # the step before's loss: done while this one runs, so reading it does not hold the device's queue
            a = np.asarray(accs[-2])
            bar.set_postfix(loss=f"{float(losses[-2]):.3f}", acc="/".join(f"{x:.2f}" for x in a[:4]))
    steady_seconds = (t_last - t_steady) / (step - steady_from) if t_steady is not None and step > steady_from else None
    bar.close()
    checkpoints.wait_until_finished()
    return LoopRun(params, [float(x) for x in jax.device_get(losses)],
                   np.asarray(jax.device_get(accs)).reshape(-1, num_accuracies or config.ttt_steps), total_steps, steady_seconds,
                   data_seconds / max(step - steady_from, 1), batch)


def measure_throughput(target, examples: Examples, config: TrainConfig, run: LoopRun, steps: TrainingSteps,
                       target_seconds: float | None) -> dict:
    """training_throughput of the run's steady steps. The target's share of a step is its forward alone, timed
    here on the last batch (three runs after one that compiles it) unless the cached pass timed it already: inside
    the step it cannot be told apart from the head's. {} when too few steps ran to time."""
    if run.steady_seconds is not None and target_seconds is None:
        ids, segments = run.last_batch.ids, run.last_batch.segments
        jax.block_until_ready(steps.target_outputs(target.params, ids, segments))   # (compiled here)
        t_target = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(steps.target_outputs(target.params, ids, segments))
        target_seconds = (time.perf_counter() - t_target) / 3
    return training_throughput(target.params, run.params, examples, config, run.steady_seconds, target_seconds,
                               run.data_seconds)


def evaluate(params, target, held_out: Examples, steps: TrainingSteps, config: TrainConfig) -> dict:
    """The held-out report: per-step loss and accuracy (over every assistant position), greedy speculation at
    k = min(4, J) replayed over the answers (simulated_acceptance: what the engine would accept) and the per-step
    accuracies' estimate of it, so that a run says how good its head is before an engine serves it. Batches are
    padded to batch_size (eval_step compiles once); padded rows carry no weight."""
    J = config.ttt_steps
    tot_l, tot_a, tot_w, hit_maps = np.zeros(J), np.zeros(J), 0.0, []
    for i in range(0, len(held_out), config.batch_size):
        ids, mask = held_out.ids[i:i + config.batch_size], held_out.mask[i:i + config.batch_size]
        pad = config.batch_size - len(ids)
        if pad:
            ids, mask = np.pad(ids, ((0, pad), (0, 0))), np.pad(mask, ((0, pad), (0, 0)))
        l, a, w, hits = jax.device_get(steps.eval_step(params, target.params, ids, mask))
        tot_l, tot_a, tot_w = tot_l + l * w, tot_a + a * w, tot_w + float(w)
        hit_maps.append(hits[:, :len(ids) - pad])
    per_loss, per_acc = tot_l / max(tot_w, 1), tot_a / max(tot_w, 1)
    length, per_position = simulated_acceptance(np.concatenate(hit_maps, 1), held_out.mask, min(4, J))
    return {"loss": per_loss.tolist(), "accuracy": per_acc.tolist(), "num_examples": len(held_out),
            "acceptance_length_k4": length, "per_position_acceptance_k4": per_position,
            "estimated_acceptance_length_k4": estimated_acceptance_length(per_acc, 4)}


def write_training_json(out_dir: Path, result: TrainResult, total_steps: int, examples: Examples,
                        config: TrainConfig):
    """out_dir/training.json: the run's report kept beside its head, so that the head's directory says how it was
    made: the steps it ran to and from, its seconds, its data (examples, rows, their length, the tokens trained),
    its throughput, its config and the held-out report."""
    (out_dir / "training.json").write_text(json.dumps({
        "steps": total_steps, "first_step": result.first_step, "seconds": result.seconds,
        "num_examples": result.num_examples, "num_rows": len(examples), "throughput": result.throughput,
        "seq_len": int(examples.ids.shape[1]), "num_target_tokens": result.num_target_tokens,
        "config": dataclasses.asdict(config), "final_loss": result.losses[-1] if result.losses else None,
        "held_out": result.held_out}, indent=1))
