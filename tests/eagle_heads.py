"""Randomly initialised EAGLE heads in the published HF layouts (config.json + model.safetensors), sized for
a given (tiny) target: what `jaxspec.decode.drafters.eagle` loads, since real heads are not available offline.

EAGLE-1 (the yuhuili/EAGLE-LLaMA3-Instruct-8B layout): fc.weight [D, 2D] (+ fc.bias), layers.{i}.* with no
input_layernorm in layer 0, embed_tokens.weight (unused: the target's embedding is shared).
EAGLE-3 (the yuhuili/EAGLE3-LLaMA3.1-Instruct-8B layout): fc.weight [D, 3D], midlayer.* with q/k/v over 2D,
midlayer.hidden_norm, norm.weight, lm_head.weight [draft_vocab, D], d2t (int64) and t2d (bool).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def _head_config(target_config, num_layers: int, **extra) -> dict:
    c = target_config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": 2 * c.hidden_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-5,
            "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "max_position_embeddings": 2048,
            "torch_dtype": "float32", **extra}


def _layer(rng, prefix: str, cfg: dict, attn_in: int, with_input_norm: bool) -> dict:
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or D // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    out = {f"{prefix}self_attn.q_proj.weight": mat(q, attn_in), f"{prefix}self_attn.k_proj.weight": mat(kv, attn_in),
           f"{prefix}self_attn.v_proj.weight": mat(kv, attn_in), f"{prefix}self_attn.o_proj.weight": mat(D, q),
           f"{prefix}mlp.gate_proj.weight": mat(F, D), f"{prefix}mlp.up_proj.weight": mat(F, D),
           f"{prefix}mlp.down_proj.weight": mat(D, F),
           f"{prefix}post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if with_input_norm:
        out[f"{prefix}input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return out


def write_eagle1_head(path, target_config, seed: int = 0, num_layers: int = 1, fc_bias: bool = True) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = _head_config(target_config, num_layers, bias=fc_bias)
    D = cfg["hidden_size"]
    tensors = {"fc.weight": (rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D)).astype(np.float32),
               "embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], D)).astype(np.float32)}
    if fc_bias:
        tensors["fc.bias"] = (0.1 * rng.standard_normal(D)).astype(np.float32)
    for i in range(num_layers):
        tensors.update(_layer(rng, f"layers.{i}.", cfg, D, with_input_norm=i > 0))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def write_eagle3_head(path, target_config, seed: int = 0, draft_vocab_size: int | None = None,
                      draft_to_target=None, head_dim: int | None = None) -> Path:
    """A random EAGLE-3 head in the published HF layout for `target_config`; head_dim: its attention's head width
    where it is not hidden_size / heads (the published heads of Gemma 3 and GPT-OSS targets take the target's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    V = target_config.vocab_size
    Vd = len(draft_to_target) if draft_to_target is not None else draft_vocab_size or V // 2
    cfg = _head_config(target_config, 1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd,
                       **({"head_dim": head_dim} if head_dim else {}))
    D = cfg["hidden_size"]
    if draft_to_target is None:
        draft_to_target = np.sort(rng.choice(V, Vd, replace=False))
    t2d = np.zeros(V, bool)
    t2d[draft_to_target] = True
    tensors = {"fc.weight": (rng.standard_normal((D, 3 * D)) / np.sqrt(3 * D)).astype(np.float32),
               "midlayer.hidden_norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
               "norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
               "lm_head.weight": (2 * rng.standard_normal((Vd, D)) / np.sqrt(D)).astype(np.float32),
               "d2t": (draft_to_target - np.arange(Vd)).astype(np.int64), "t2d": t2d}
    tensors.update(_layer(rng, "midlayer.", cfg, 2 * D, with_input_norm=True))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


# ---- heads fitted to a target, so that they accept drafts ----------------------------------------------------

def target_sequences(target, num: int, prompt_len: int, length: int, seed: int, temperature: float = 0.8):
    """`num` sequences of `length` tokens: random prompts continued by the target itself (half greedy, half
    sampled at `temperature`), computed with the dense reference."""
    import jax
    import jax.numpy as jnp
    from reference import target_forward

    tcfg, tensors = target.config, {k: jnp.asarray(v) for k, v in target.hf_tensors.items()}
    rng = np.random.default_rng(seed)
    seqs = np.zeros((num, length), np.int32)
    seqs[:, :prompt_len] = rng.integers(0, tcfg.vocab_size, (num, prompt_len))
    logits_at = jax.jit(jax.vmap(lambda ids, p: target_forward(tensors, tcfg, ids)[0][p], (0, None)))
    temps = np.where(np.arange(num) % 2 == 0, 0.0, temperature)[:, None]
    for p in range(prompt_len, length):
        logits = np.asarray(logits_at(jnp.asarray(seqs), p - 1), np.float64)
        gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, logits.shape)))
        seqs[:, p] = np.where(temps[:, 0] > 0, np.argmax(logits / np.maximum(temps, 1e-9) + gumbel, -1),
                              np.argmax(logits, -1))
    return seqs


def fit_eagle_head(method: str, path, target, seed: int = 0, steps: int = 300, num_layers: int = 1,
                   draft_vocab_size: int | None = None, num_sequences: int = 48, lr: float = 1e-2,
                   reg_weight: float = 1.0) -> Path:
    """An EAGLE-1 ("eagle") or EAGLE-3 ("eagle3") head trained in seconds against `target` (a tests Model
    with `hf_tensors`), written in the published HF layout: it matches the target's next-token distribution
    on the target's own sequences (cross-entropy), and its output hidden regresses onto the next position's
    feature, so the drafts after the first (which feed that hidden back) are accepted too."""
    import jax
    import jax.numpy as jnp
    import optax
    from reference import EagleReference, eagle3_fc, eagle3_feature_layers, target_forward
    from jaxspec.models.config import ModelConfig

    path = Path(path)
    writer = write_eagle3_head if method == "eagle3" else write_eagle1_head
    tcfg = target.config
    seqs = target_sequences(target, num_sequences, 6, 40, seed)
    tensors = {k: jnp.asarray(v) for k, v in target.hf_tensors.items()}
    logits, final, after = jax.vmap(lambda ids: target_forward(tensors, tcfg, ids))(jnp.asarray(seqs))
    if method == "eagle3":   # the draft vocabulary: the tokens the target predicts most often
        counts = np.bincount(np.asarray(jnp.argmax(logits, -1)).ravel(), minlength=tcfg.vocab_size)
        kept = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size or tcfg.vocab_size // 2])
        writer(path, tcfg, seed=seed, draft_to_target=kept)
    else:
        writer(path, tcfg, seed=seed, num_layers=num_layers)
    from safetensors.numpy import load_file, save_file
    head = load_file(str(path / "model.safetensors"))
    hcfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    frozen = {"d2t", "t2d", "embed_tokens.weight"}
    trainable = {k: jnp.asarray(v) for k, v in head.items() if k not in frozen}
    ref = EagleReference(method, head, hcfg, target.hf_tensors, tcfg)
    fixed = {k: v for k, v in head.items() if k in frozen}
    teacher = jax.nn.softmax(logits[:, 1:-1], -1)   # pair (feature p, token p+1) predicts token p+2
    aux = jnp.array(eagle3_feature_layers(tcfg.num_layers))

    def loss_fn(train):
        ref.head = train

        def one(ids, final_s, after_s):
            feats = eagle3_fc(train, after_s[aux]) if method == "eagle3" else final_s
            hidden = ref.hidden(feats[:-1], ids[1:])                                      # [T-1, D]
            return ref.logits(hidden)[:-1], hidden[:-1], jax.lax.stop_gradient(feats[1:-1])

        lg, hid, nxt = jax.vmap(one)(jnp.asarray(seqs), final, after)
        logp = jax.nn.log_softmax(jnp.where(jnp.isfinite(lg), lg, -1e9), -1)
        ce = -jnp.mean(jnp.sum(teacher * jnp.where(jnp.isfinite(lg), logp, 0.0), -1))
        return ce + reg_weight * jnp.mean((hid - nxt) ** 2) / jnp.mean(nxt ** 2)

    opt = optax.adam(optax.cosine_decay_schedule(lr, steps))
    state = opt.init(trainable)

    @jax.jit
    def update(train, state):
        loss, grads = jax.value_and_grad(loss_fn)(train)
        upd, state = opt.update(grads, state)
        return optax.apply_updates(train, upd), state, loss

    for _ in range(steps):
        trainable, state, _ = update(trainable, state)
    save_file({**{k: np.asarray(v, np.float32) for k, v in trainable.items()}, **fixed}, str(path / "model.safetensors"))
    return path
