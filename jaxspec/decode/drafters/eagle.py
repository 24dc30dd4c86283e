"""EAGLE-1 and EAGLE-3 draft heads, loaded from their published HF layouts (config.json + safetensors).

Both heads run on pairs (feature at position p, token at position p+1), stored in the head's own paged
KV at position p, and predict the token at p+2:
  EAGLE-1: feature = the target's hidden state after its final norm;
           x = fc(concat[embed(token), feature]); decoder layer(s) `layers.{i}` (layer 0 without
           input_layernorm); the output hidden goes through the TARGET's lm_head (after `norm` if present).
  EAGLE-3: feature = fc(concat of the target's residual stream after layers (1, L//2-1, L-4));
           one `midlayer` whose q/k/v read concat[input_layernorm(embed(token)), hidden_norm(feature)]
           with the feature as residual; `norm` then its own lm_head over a draft vocabulary, mapped to
           target ids by `d2t` (target id = draft id + d2t[draft id]).
Later proposals feed back the head's own output hidden (before `norm`) as the feature.

Per step, with the target's batch (T tokens, R rows):
  (a) every token x_p of the batch (p >= 1) is paired with the feature at p-1 (the previous token of the
      row, or for a row's first token the feature this slot saved last step) and written at p-1;
  (b) k single-token-per-row head forwards: the first pairs the feature at the last accepted position
      (num_tokens-2) with the emitted token, each next the head's output hidden with its own draft.
  Each slot saves the feature at its last position whose target KV is final, for (a) of its next step.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.drafters.common import init_draft_logprobs, kv_slots_for, one_token_batch, pick_drafts
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import (
    ForwardBatch, apply_rope, init_kv_cache, lm_logits, paged_attention, rms_norm, rope_inv_freq)

_LAYER_NAMES = {  # our key -> HF name inside a decoder layer
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
_OPTIONAL_LAYER_KEYS = ("attn_norm", "q_bias", "k_bias", "v_bias")


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Target layers whose output residual EAGLE-3 reads (the inputs of layers 2, L//2 and L-3)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


# ---- the head as pure functions ---------------------------------------------------------------------------

def _attention_block(c: ModelConfig, lp, attn_in, residual, kv, i, batch: ForwardBatch, block_size, inv_freq):
    """One llama decoder layer with a given attention input (already normed) and residual [T, D]."""
    T, hd, Hq, Hkv = attn_in.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
    q, k, v = attn_in @ lp["q_proj"].T, attn_in @ lp["k_proj"].T, attn_in @ lp["v_proj"].T
    if "q_bias" in lp:
        q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
    q = apply_rope(q.reshape(T, Hq, hd), batch.positions, inv_freq)
    k = apply_rope(k.reshape(T, Hkv, hd), batch.positions, inv_freq)
    k_cache = kv["k"].at[i, batch.slot_mapping].set(k.astype(kv["k"].dtype), mode="drop")
    v = v.reshape(T, Hkv, hd)
    v_cache = kv["v"].at[i, batch.slot_mapping].set(v.astype(kv["v"].dtype), mode="drop")
    attn = paged_attention(q, k_cache, v_cache, i, batch, block_size)                 # [T, Hq*hd]
    h = residual + attn.astype(residual.dtype) @ lp["o_proj"].T
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    h = h + (jax.nn.silu(x @ lp["gate_proj"].T) * (x @ lp["up_proj"].T)) @ lp["down_proj"].T
    return h, {"k": k_cache, "v": v_cache}


def eagle1_forward(c: ModelConfig, params, kv, ids, feature, batch: ForwardBatch, block_size):
    """ids i32[T], feature [T, D] -> (output hidden [T, D] before `norm`, kv)."""
    emb = params["embed"][jnp.clip(ids, 0, params["embed"].shape[0] - 1)]                   # [T, D]
    h = jnp.concatenate([emb, feature.astype(emb.dtype)], axis=-1) @ params["fc"].T         # [T, D]
    if "fc_bias" in params:
        h = h + params["fc_bias"]
    inv_freq = rope_inv_freq(c)
    for i, lp in enumerate(params["layers"]):
        attn_in = rms_norm(h, lp["attn_norm"], c.rms_norm_eps) if "attn_norm" in lp else h
        h, kv = _attention_block(c, lp, attn_in, h, kv, i, batch, block_size, inv_freq)
    return h, kv


def eagle1_logits(c: ModelConfig, params, hidden):
    """Output hidden [N, D] -> f32 logits over the target vocabulary [N, V] (the target's lm_head)."""
    if "norm" in params:
        hidden = rms_norm(hidden, params["norm"], c.rms_norm_eps)
    head = params.get("target_lm_head", params["embed"])                                    # tied: the embedding
    return lm_logits({"embed": head}, hidden)


def eagle3_forward(c: ModelConfig, params, kv, ids, feature, batch: ForwardBatch, block_size):
    """ids i32[T], feature [T, D] (fc output or the head's own previous output) -> (output hidden, kv)."""
    emb = params["embed"][jnp.clip(ids, 0, params["embed"].shape[0] - 1)]                   # [T, D]
    feature = feature.astype(emb.dtype)
    lp = params["midlayer"]
    attn_in = jnp.concatenate([rms_norm(emb, lp["attn_norm"], c.rms_norm_eps),
                               rms_norm(feature, lp["hidden_norm"], c.rms_norm_eps)], axis=-1)  # [T, 2D]
    return _attention_block(c, lp, attn_in, feature, kv, 0, batch, block_size, rope_inv_freq(c))


def eagle3_logits(c: ModelConfig, params, hidden):
    """Output hidden [N, D] -> f32 logits over the target vocabulary [N, V]; ids outside the draft
    vocabulary get -inf."""
    draft_logits = lm_logits({"embed": params["lm_head"]}, rms_norm(hidden, params["norm"], c.rms_norm_eps))
    target_ids = params["draft_to_target"]                                                   # i32[Vd]
    full = jnp.full((hidden.shape[0], params["embed"].shape[0]), -jnp.inf, jnp.float32)
    return full.at[:, target_ids].set(draft_logits)


# ---- the drafter ------------------------------------------------------------------------------------------

class EagleDrafter:
    needs_kv_lookahead = True

    def __init__(self, method: str, head_config: ModelConfig, target_config: ModelConfig, num_spec_tokens: int,
                 draft_sampling: str):
        self.method, self.config = method, head_config
        self.num_spec_tokens, self.draft_sampling = num_spec_tokens, draft_sampling
        self.vocab_size = target_config.vocab_size
        self.aux_layers = eagle3_aux_layers(target_config.num_layers) if method == "eagle3" else ()
        self._forward = eagle3_forward if method == "eagle3" else eagle1_forward
        self._logits = eagle3_logits if method == "eagle3" else eagle1_logits
        self.block_size = None  # set by init_state from the engine's step config

    def init_state(self, step_config, dtype):
        self.block_size = step_config.block_size
        state = {"kv": init_kv_cache(self.config, step_config.num_blocks, step_config.block_size, dtype),
                 "feature": jnp.zeros((step_config.num_slots + 1, self.config.hidden_size), dtype)}
        if self.draft_sampling == "sample":
            state["draft_logprobs"] = init_draft_logprobs(step_config, self.vocab_size)
        return state

    def _features(self, params, ctx):
        """The feature of every token of the batch [T, D]."""
        if self.method == "eagle3":
            aux = ctx.aux_hidden                                                              # [3, T, D]
            return jnp.concatenate(list(aux), axis=-1) @ params["fc"].T
        return ctx.hidden

    def propose(self, params, state, ctx):
        c, bs, k = self.config, self.block_size, self.num_spec_tokens
        kv, b = state["kv"], ctx.batch
        num_kv_slots = kv["k"].shape[1]
        T = b.token_ids.shape[0]
        feature = self._features(params, ctx).astype(state["feature"].dtype)                  # [T, D]

        # (a) pair each token x_p with the feature at p-1, written at p-1.
        row = b.row_of_token
        is_first = jnp.arange(T) == ctx.first_token[row]
        prev_feature = jnp.where(is_first[:, None], state["feature"][ctx.slot[row]], jnp.roll(feature, 1, axis=0))
        pair_pos = b.positions - 1
        pair_valid = ctx.token_valid & (pair_pos >= 0)
        slots = kv_slots_for(pair_pos, row, pair_valid, b.block_tables, bs, num_kv_slots)
        pair_batch = ForwardBatch(b.token_ids, jnp.maximum(pair_pos, 0), slots, row, b.block_tables,
                                  jnp.zeros((1,), jnp.int32))
        _, kv = self._forward(c, params, kv, b.token_ids, prev_feature, pair_batch, bs)

        # The feature at each row's last position whose target KV is final (the last accepted token for
        # rows that sampled, the chunk's last token otherwise): this step's first proposal and next
        # step's pass (a) pair it with the token that follows.
        last_pos = jnp.where(ctx.sample_rows, ctx.num_tokens - 2, ctx.num_tokens - 1)           # [R]
        row_start = b.positions[ctx.first_token]
        last_idx = jnp.clip(ctx.first_token + last_pos - row_start, 0, T - 1)
        last_feature = feature[last_idx]                                                        # [R, D]
        saved = state["feature"].at[ctx.slot].set(last_feature)

        # (b) k single-token head forwards per row.
        first_tok = jnp.take_along_axis(ctx.emitted, ctx.num_accepted[:, None], axis=1)[:, 0]  # [R]

        def draft_one(carry, j):
            kv, feat, tok, pos = carry
            batch = one_token_batch(tok, pos, ctx.sample_rows, b.block_tables, bs, num_kv_slots)
            hidden, kv = self._forward(c, params, kv, tok, feat, batch, bs)                  # [R, D]
            draft, logprobs = pick_drafts(self._logits(c, params, hidden), ctx, j, self.draft_sampling)
            return (kv, hidden.astype(feat.dtype), draft, pos + 1), (draft, logprobs)

        (kv, _, _, _), (drafts, logprobs) = jax.lax.scan(
            draft_one, (kv, last_feature, first_tok, last_pos), jnp.arange(k, dtype=jnp.int32))
        new_state = dict(state, kv=kv, feature=saved)
        if self.draft_sampling == "sample":
            new_state["draft_logprobs"] = state["draft_logprobs"].at[ctx.slot].set(jnp.swapaxes(logprobs, 0, 1))
        return new_state, drafts.T                                                             # [R, k]


# ---- loading ----------------------------------------------------------------------------------------------

def _read_head_dir(path):
    from jaxspec.models.hf_loader import SafetensorsDir
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head {str(path)!r} is not a directory (expected config.json + "
                                "model.safetensors in the published HF layout)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"EAGLE head directory {str(path)!r} has no config.json")
    hf = json.loads(config_path.read_text())
    return {"model_type": "llama", **hf}, SafetensorsDir(path)


def _tensor(tensors, name: str, shape: tuple | None, dtype):
    if name not in tensors:
        raise ValueError(f"the EAGLE head has no tensor {name!r}")
    value = np.asarray(tensors.get_tensor(name))
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"EAGLE head tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return jnp.asarray(value.astype(dtype) if dtype is not None else value)


def _layer_params(tensors, prefix: str, c: ModelConfig, attn_in: int, dtype) -> dict:
    D, F, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"attn_norm": (D,), "mlp_norm": (D,), "q_proj": (q, attn_in), "k_proj": (kv, attn_in),
              "v_proj": (kv, attn_in), "o_proj": (D, q), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}
    out = {}
    for key, shape in shapes.items():
        name = prefix + _LAYER_NAMES[key]
        if key in _OPTIONAL_LAYER_KEYS and name not in tensors:
            continue
        out[key] = _tensor(tensors, name, shape, dtype)
    return out


def build_eagle_drafter(spec, target):
    """-> (EagleDrafter, head params) for method "eagle" (EAGLE-1) or "eagle3", from a head directory."""
    method = spec.method
    if hasattr(spec.model, "params"):
        raise ValueError(f"method {method!r} needs an EAGLE head directory (config.json + safetensors), not a Model")
    hf, tensors = _read_head_dir(spec.model)
    head = ModelConfig.from_hf(hf)
    tc = target.config
    D = tc.hidden_size
    if head.hidden_size != D:
        raise ValueError(f"the EAGLE head has hidden_size={head.hidden_size} but the target has {D}: "
                         "the head was trained for another target model")
    if head.vocab_size != tc.vocab_size:
        raise ValueError(f"the EAGLE head has vocab_size={head.vocab_size} but the target has {tc.vocab_size}: "
                         "it must share the target's tokenizer and vocabulary")
    is_eagle3 = "midlayer.self_attn.q_proj.weight" in tensors
    if (method == "eagle3") != is_eagle3:
        raise ValueError(f"{spec.model!r} holds an {'EAGLE-3' if is_eagle3 else 'EAGLE-1'} head, but the speculative "
                         f"method is {method!r}; use method={'eagle3' if is_eagle3 else 'eagle'!r}")
    dtype = np.dtype(target.params["embed"].dtype)
    params = {"embed": target.params["embed"]}
    if method == "eagle3":
        params["fc"] = _tensor(tensors, "fc.weight", (D, 3 * D), dtype)
        mid = _layer_params(tensors, "midlayer.", head, 2 * D, dtype)
        if "attn_norm" not in mid:
            raise ValueError("the EAGLE-3 head has no tensor 'midlayer.input_layernorm.weight'")
        mid["hidden_norm"] = _tensor(tensors, "midlayer.hidden_norm.weight", (D,), dtype)
        params["midlayer"] = mid
        params["norm"] = _tensor(tensors, "norm.weight", (D,), dtype)
        draft_vocab = int(hf.get("draft_vocab_size", head.vocab_size))
        params["lm_head"] = _tensor(tensors, "lm_head.weight", (draft_vocab, D), dtype)
        if "d2t" in tensors:
            d2t = np.asarray(tensors.get_tensor("d2t")).astype(np.int64)
            if d2t.shape != (draft_vocab,):
                raise ValueError(f"EAGLE-3 d2t has shape {d2t.shape}, expected ({draft_vocab},)")
            target_ids = np.arange(draft_vocab) + d2t
        elif draft_vocab == tc.vocab_size:
            target_ids = np.arange(draft_vocab)
        else:
            raise ValueError("the EAGLE-3 head has a draft vocabulary smaller than the target's but no 'd2t' map")
        if target_ids.min() < 0 or target_ids.max() >= tc.vocab_size or len(set(target_ids.tolist())) != draft_vocab:
            raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {tc.vocab_size}) or "
                             "maps two draft ids to one target id")
        params["draft_to_target"] = jnp.asarray(target_ids, jnp.int32)
    else:
        params["fc"] = _tensor(tensors, "fc.weight", (D, 2 * D), dtype)
        if "fc.bias" in tensors:
            params["fc_bias"] = _tensor(tensors, "fc.bias", (D,), dtype)
        params["layers"] = [_layer_params(tensors, f"layers.{i}.", head, D, dtype) for i in range(head.num_layers)]
        if "norm.weight" in tensors:
            params["norm"] = _tensor(tensors, "norm.weight", (D,), dtype)
        if "lm_head" in target.params:
            params["target_lm_head"] = target.params["lm_head"]
    drafter = EagleDrafter(method, head, tc, spec.num_speculative_tokens, spec.draft_sampling)
    return drafter, params

