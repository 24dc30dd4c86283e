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

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import DRAFT_HEAD_ROPE_TYPES, ModelConfig
from jaxspec.nn.decoder import Decoder, segment_positions
from jaxspec.nn.eagle import EagleHead, eagle3_aux_layers
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


# ---- the loop -----------------------------------------------------------------------------------------------

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
    `target` (a Model) and writes it to out_dir in the HF layout the engine loads."""
    import optax
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    tc = target.config
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
    aux_layers = eagle3_aux_layers(tc.num_layers)
    first_step = 0
    manager = ocp.CheckpointManager(out_dir / CHECKPOINTS, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=1))
    latest = manager.latest_step()
    num_examples = len(examples)
    if config.pack:   # before the draft vocabulary's pass too: it reads fewer rows
        examples = examples.pack()
    if latest is None:   # the draft vocabulary: what the target predicts most where the head is trained
        predicted = predicted_tokens(target, examples, config.batch_size, progress)
        next_is_assistant = np.pad(examples.mask[:, 1:], ((0, 0), (0, 1)))
        if examples.segments is not None:   # a packed example's last token is not followed by the next's first
            next_is_assistant *= np.pad(examples.segments[:, 1:] == examples.segments[:, :-1], ((0, 0), (0, 1)))
        d2t = draft_vocabulary(predicted, next_is_assistant, tc.vocab_size, config.draft_vocab_size)
    else:
        d2t = np.asarray(json.loads((out_dir / CHECKPOINTS / "head.json").read_text())["d2t"], np.int32)
    head = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t), parallel=config.arch == "parallel")

    optimizer = functools.partial(head_optimizer, config)

    def schedule(total_steps):
        warmup = min(config.warmup_steps, total_steps - 1)
        return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, max(total_steps, warmup + 1),
                                                  end_value=0.1 * config.learning_rate)
    params = init_head(head, target.params, d2t, config.seed)
    opt_state = optimizer(0.0).init(params)

    if latest is not None:
        saved = json.loads((out_dir / CHECKPOINTS / "head.json").read_text())
        if saved["hidden_size"] != tc.hidden_size or saved["vocab_size"] != tc.vocab_size:
            raise ValueError(f"{str(out_dir)!r} holds a checkpoint for a target of hidden_size="
                             f"{saved['hidden_size']}, vocab_size={saved['vocab_size']}; this target has "
                             f"{tc.hidden_size}, {tc.vocab_size}: use another --out directory")
        if saved.get("arch", "chain") != config.arch:
            raise ValueError(f"{str(out_dir)!r} holds a checkpoint of a head with arch={saved.get('arch', 'chain')!r};"
                             f" this run asks for arch={config.arch!r}: resume with that arch or use another --out")
        restored = manager.restore(latest, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state, first_step = restored["params"], restored["opt_state"], latest
    else:
        (out_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        (out_dir / CHECKPOINTS / "head.json").write_text(json.dumps(
            {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "d2t": d2t.tolist(), "arch": config.arch}))

    target_fn = make_target_fn(tc, aux_layers)
    d2t_dev = jnp.asarray(d2t)
    J, decay = config.ttt_steps, config.step_decay
    cd = compute_dtype(config)
    train_step = make_train_step(head, target_fn, d2t, config)

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def eval_step(params, target_params, ids, mask):
        aux, teacher, in_vocab = target_fn(target_params, ids, d2t_dev)
        weights = loss_weights(mask, in_vocab)
        counted = _shift(mask, 1)
        _, (losses, accs, hits) = ttt_forward(head, params, target_params["embed"], ids, aux, teacher, weights, J,
                                              decay, counted, compute_dtype=cd)
        return losses, accs, jnp.sum(counted), hits

    losses, accs = [], []
    t0 = time.perf_counter()
    cache, target_seconds = None, None
    if config.cache_target_outputs:   # the target's features and teacher of every example, once (on the device)
        parts, t_cache = [], time.perf_counter()
        for i in tqdm(range(0, len(examples), config.batch_size), desc="target features (cached)",
                      disable=not progress, unit="batch"):
            rows = slice(i, i + config.batch_size)
            parts.append(jax.block_until_ready(target_fn(   # each batch awaited, so that the bar moves with the device
                target.params, examples.ids[rows], d2t_dev,
                None if examples.segments is None else examples.segments[rows])))
        cache = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)
        target_seconds = (time.perf_counter() - t_cache) / len(parts)   # per batch, its compile included
    total_steps, lr_at = config.steps, schedule(config.steps)
    timed_from, timed_until = first_step + 5, first_step + 25   # after the compile; then the budget is applied
    bar = tqdm(total=total_steps, initial=first_step, desc=f"training EAGLE-3 ({config.arch})", disable=not progress,
               unit="step")
    step, steady_from, t_steady, data_seconds = first_step, first_step + 5, None, 0.0
    while step < total_steps:
        t_data = time.perf_counter()
        idx = _batches(len(examples), config.batch_size, config.seed, step)
        batch = (examples.ids[idx], examples.mask[idx], None if cache is None else
                 jax.tree_util.tree_map(lambda x: x[idx], cache),
                 None if examples.segments is None else examples.segments[idx])
        if step >= steady_from:
            data_seconds += time.perf_counter() - t_data
        params, opt_state, loss, acc = train_step(params, opt_state, target.params, batch[0], batch[1],
                                                  np.float32(lr_at(step)), batch[2], batch[3])
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
                left = config.max_seconds - (time.perf_counter() - t0)
                fits = step + max(int(left / per_step), 0)
                if fits < total_steps:
                    total_steps, lr_at = max(fits, step), schedule(max(fits, step))
                    bar.total = total_steps
                    bar.write(f"{per_step * 1e3:.0f} ms per step: {total_steps} steps fit in "
                              f"max_seconds={config.max_seconds:g}")
        if step == total_steps:   # the steady rate's end, before the last checkpoint's save (not a step's cost)
            jax.block_until_ready(loss)
            t_last = time.perf_counter()
        if step % config.save_every == 0 or step == total_steps:
            # from host copies taken here, not orbax's device reads on its own thread (see
            # xla_flags.release_update_mode: the save crashed on an H100 under the VMM allocator)
            manager.save(step, args=ocp.args.StandardSave(jax.device_get({"params": params, "opt_state": opt_state})))
        if progress and len(losses) > 1 and (step % 10 == 1 or step == total_steps):
            # the step before's loss: done while this one runs, so reading it does not hold the device's queue
            a = np.asarray(accs[-2])
            bar.set_postfix(loss=f"{float(losses[-2]):.3f}", acc="/".join(f"{x:.2f}" for x in a[:4]))
    steady_seconds = (t_last - t_steady) / (step - steady_from) if t_steady and step > steady_from else None
    bar.close()
    manager.wait_until_finished()
    if steady_seconds is not None and target_seconds is None:   # the target's share of a step: its forward alone
        jax.block_until_ready(target_fn(target.params, batch[0], d2t_dev, batch[3]))   # (compiled here)
        t_target = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(target_fn(target.params, batch[0], d2t_dev, batch[3]))
        target_seconds = (time.perf_counter() - t_target) / 3
    throughput = training_throughput(target.params, params, examples, config, steady_seconds, target_seconds,
                                     data_seconds / max(step - steady_from, 1))
    if progress and throughput:
        print(format_throughput(throughput))
    losses = [float(x) for x in jax.device_get(losses)]
    accs = np.asarray(jax.device_get(accs)).reshape(-1, J)
    seconds = time.perf_counter() - t0

    report = {}
    if held_out is not None and len(held_out):
        tot_l, tot_a, tot_w, hit_maps = np.zeros(J), np.zeros(J), 0.0, []
        for i in range(0, len(held_out), config.batch_size):
            ids, mask = held_out.ids[i:i + config.batch_size], held_out.mask[i:i + config.batch_size]
            pad = config.batch_size - len(ids)
            if pad:   # one compiled shape: padded examples have no weight
                ids, mask = np.pad(ids, ((0, pad), (0, 0))), np.pad(mask, ((0, pad), (0, 0)))
            l, a, w, hits = jax.device_get(eval_step(params, target.params, ids, mask))
            tot_l, tot_a, tot_w = tot_l + l * w, tot_a + a * w, tot_w + float(w)
            hit_maps.append(hits[:, :len(ids) - pad])
        per_loss, per_acc = tot_l / max(tot_w, 1), tot_a / max(tot_w, 1)
        length, per_position = simulated_acceptance(np.concatenate(hit_maps, 1), held_out.mask, min(4, J))
        report = {"loss": per_loss.tolist(), "accuracy": per_acc.tolist(), "num_examples": len(held_out),
                  "acceptance_length_k4": length, "per_position_acceptance_k4": per_position,
                  "estimated_acceptance_length_k4": estimated_acceptance_length(per_acc, 4)}
    save_head(out_dir, head, params, d2t)
    result = TrainResult(out_dir, losses, accs, first_step, report, seconds, num_examples, examples.num_target_tokens,
                         throughput)
    (out_dir / "training.json").write_text(json.dumps({
        "steps": total_steps, "first_step": first_step, "seconds": seconds, "num_examples": num_examples,
        "num_rows": len(examples), "throughput": throughput,
        "seq_len": int(examples.ids.shape[1]), "num_target_tokens": examples.num_target_tokens,
        "config": dataclasses.asdict(config), "final_loss": losses[-1] if losses else None,
        "held_out": report}, indent=1))
    return result


# ---- the HF layout ------------------------------------------------------------------------------------------

def head_rope_scaling(c: ModelConfig) -> dict | None:
    """The head's rope scaling as its config.json's `rope_scaling`, its type named (the loaders require one), each
    field as the head loader (ModelConfig.from_hf, draft_head) reads it back to the same ModelConfig.rope_scaling:
    linear (Gemma 3's global layers), llama3 (held without a type), yarn. None: plain rope."""
    written = tuple(t for t in DRAFT_HEAD_ROPE_TYPES if t != "default")
    if c.rope_freq_factors is not None:   # a GGUF target's per-frequency divisors: no config.json field holds them
        raise ValueError(f"a head with rope_freq_factors (GGUF rope_freqs) cannot be written in the HF layout; "
                         f"supported: rope_scaling of type {', '.join(written)}, or none")
    scaling = c.rope_scaling_dict
    if not scaling:
        return None
    if c.rope_type not in written:
        raise ValueError(f"the head's rope scaling {scaling!r} (type {c.rope_type!r}) cannot be written in its "
                         f"config.json; supported: {', '.join(written)}")
    return {**scaling, "rope_type": c.rope_type}


def save_head(path, head: EagleHead, params: dict, d2t: np.ndarray) -> Path:
    """config.json + model.safetensors in the published EAGLE-3 layout: fc, midlayer.* (q/k/v/o, gate/up/down,
    input_layernorm, hidden_norm, post_attention_layernorm), norm, lm_head over the draft vocabulary, d2t (the
    offset of each draft id's target id) and t2d (the target ids that are in the draft vocabulary); a parallel
    head adds its placeholders mask_embed and mask_hidden and `"parallel_drafting": true` in config.json."""
    from safetensors.numpy import save_file
    path = Path(path)
    c, tc = head.config, head.target_config
    lp = {k: np.asarray(w[0], np.float32) for k, w in jax.device_get(params["layers"]["attention"]).items()}
    Hkv, G, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    qkv = lp["qkv_proj"].reshape(Hkv, G + 2, hd, -1)
    m = "midlayer."
    tensors = {
        "fc.weight": params["fc"], "norm.weight": params["norm"], "lm_head.weight": params["lm_head"],
        m + "hidden_norm.weight": params["hidden_norm"],
        m + "input_layernorm.weight": lp["attn_norm"], m + "post_attention_layernorm.weight": lp["mlp_norm"],
        m + "self_attn.q_proj.weight": qkv[:, :G].reshape(Hkv * G * hd, -1),
        m + "self_attn.k_proj.weight": qkv[:, G].reshape(Hkv * hd, -1),
        m + "self_attn.v_proj.weight": qkv[:, G + 1].reshape(Hkv * hd, -1),
        m + "self_attn.o_proj.weight": lp["o_proj"],
        m + "mlp.gate_proj.weight": lp["gate_up_proj"][:, 0], m + "mlp.up_proj.weight": lp["gate_up_proj"][:, 1],
        m + "mlp.down_proj.weight": lp["down_proj"]}
    if head.parallel:
        tensors.update(mask_embed=params["mask_embed"], mask_hidden=params["mask_hidden"])
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    t2d = np.zeros(tc.vocab_size, bool)
    t2d[d2t] = True
    tensors["d2t"] = (np.asarray(d2t, np.int64) - np.arange(len(d2t)))
    tensors["t2d"] = t2d
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": hd, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": tc.vocab_size,
              "draft_vocab_size": len(d2t), "max_position_embeddings": c.max_position_embeddings,
              "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if head.parallel:
        config["parallel_drafting"] = True
    # No eagle_aux_hidden_state_layer_ids: vLLM reads those ids as "the output of layer id-1" and SGLang as "the
    # output of layer id", so any value is wrong in one of them; both default to the layers this head reads.
    rope_scaling = head_rope_scaling(c)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
