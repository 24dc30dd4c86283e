"""Independent dense references over HF-named tensors, written from the published definitions (HF Llama /
Qwen2; EAGLE-1's and EAGLE-3's `cnets.py`), sharing no code with jaxspec's model or drafters.

Everything runs over one whole sequence with plain causal attention (no paging, no steps), in jax.numpy so
the EAGLE heads can also be fitted by gradient descent (tests/eagle_heads.py). Tensors are dicts from HF
tensor name to array; `cfg` is a jaxspec ModelConfig (only its numbers are read).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [T, H, hd], HF's rotate-half layout."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.asarray(positions, jnp.float32)[:, None] * inv[None]          # [T, hd/2]
    cos = jnp.cos(jnp.concatenate([ang, ang], -1))[:, None]
    sin = jnp.sin(jnp.concatenate([ang, ang], -1))[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def self_attention(t, prefix, x, positions, cfg):
    """HF LlamaAttention over one sequence: causal in sequence order, GQA by repeating kv heads."""
    T = x.shape[0]
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name, heads):
        y = x @ t[f"{prefix}{name}.weight"].T
        if f"{prefix}{name}.bias" in t:
            y = y + t[f"{prefix}{name}.bias"]
        return y.reshape(T, heads, hd)

    q, k, v = proj("q_proj", H), proj("k_proj", Hkv), proj("v_proj", Hkv)
    if f"{prefix}q_norm.weight" in t:   # Qwen3: RMSNorm over each head's q and k
        q = rms_norm(q, t[f"{prefix}q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, t[f"{prefix}k_norm.weight"], cfg.rms_norm_eps)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    k, v = jnp.repeat(k, H // Hkv, axis=1), jnp.repeat(v, H // Hkv, axis=1)
    s = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s, -jnp.inf)
    o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v).reshape(T, H * hd)
    return o @ t[f"{prefix}o_proj.weight"].T


def mlp(t, prefix, x):
    gate, up = x @ t[f"{prefix}gate_proj.weight"].T, x @ t[f"{prefix}up_proj.weight"].T
    return (jax.nn.silu(gate) * up) @ t[f"{prefix}down_proj.weight"].T


def decoder_layer(t, prefix, h, positions, cfg):
    h = h + self_attention(t, prefix + "self_attn.", rms_norm(h, t[prefix + "input_layernorm.weight"],
                                                              cfg.rms_norm_eps), positions, cfg)
    return h + mlp(t, prefix + "mlp.", rms_norm(h, t[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps))


def target_forward(t, cfg, ids):
    """-> (logits [T, V], final hidden after the norm [T, D], residual stream after each layer [L, T, D])."""
    ids = jnp.asarray(ids)
    positions = jnp.arange(ids.shape[0])
    h = t["model.embed_tokens.weight"][ids]
    after = []
    for i in range(cfg.num_layers):
        h = decoder_layer(t, f"model.layers.{i}.", h, positions, cfg)
        after.append(h)
    final = rms_norm(h, t["model.norm.weight"], cfg.rms_norm_eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return final @ head.T, final, jnp.stack(after)


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3 reads the residual stream entering target layers 2, L//2 and L-3 (low, mid, high), i.e. the
    output of layers 1, L//2-1 and L-4 (clamped to the model for tiny test targets)."""
    return tuple(min(max(i - 1, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


# ---- EAGLE heads ----------------------------------------------------------------------------------------
# Both run on pairs (feature of position p, token at p+1) at position p and predict the token at p+2;
# later drafts feed the head's own output hidden back as the feature.

def eagle1_hidden(head, hcfg, embed, features, tokens):
    """EAGLE-1: x = fc([embed(token); feature]) (+ bias); decoder layers, layer 0 without input_layernorm.
    -> output hidden [T, D]."""
    positions = jnp.arange(tokens.shape[0])
    x = jnp.concatenate([embed[tokens], features], -1) @ head["fc.weight"].T
    if "fc.bias" in head:
        x = x + head["fc.bias"]
    for i in range(hcfg.num_layers):
        p = f"layers.{i}."
        attn_in = rms_norm(x, head[p + "input_layernorm.weight"], hcfg.rms_norm_eps) if i else x
        x = x + self_attention(head, p + "self_attn.", attn_in, positions, hcfg)
        x = x + mlp(head, p + "mlp.", rms_norm(x, head[p + "post_attention_layernorm.weight"], hcfg.rms_norm_eps))
    return x


def eagle1_logits(head, hcfg, target_lm_head, hidden):
    """The target's lm_head on the output hidden (after the head's `norm` when it has one)."""
    if "norm.weight" in head:
        hidden = rms_norm(hidden, head["norm.weight"], hcfg.rms_norm_eps)
    return hidden @ target_lm_head.T


def eagle3_hidden(head, hcfg, embed, features, tokens):
    """EAGLE-3's midlayer: attention reads [input_layernorm(embed(token)); hidden_norm(feature)] (2D wide),
    the feature is the residual. `features` are already fc-projected (or the head's own outputs)."""
    positions = jnp.arange(tokens.shape[0])
    eps = hcfg.rms_norm_eps
    attn_in = jnp.concatenate([rms_norm(embed[tokens], head["midlayer.input_layernorm.weight"], eps),
                               rms_norm(features, head["midlayer.hidden_norm.weight"], eps)], -1)
    x = features + self_attention(head, "midlayer.self_attn.", attn_in, positions, hcfg)
    return x + mlp(head, "midlayer.mlp.", rms_norm(x, head["midlayer.post_attention_layernorm.weight"], eps))


def eagle3_fc(head, layer_outputs):
    """fc over the concatenated low/mid/high residual streams [3, T, D] -> [T, D]."""
    return jnp.concatenate(list(layer_outputs), -1) @ head["fc.weight"].T


def eagle3_logits(head, hcfg, vocab_size, target_ids, hidden):
    """lm_head over the draft vocabulary after `norm`, scattered to target ids (draft id + d2t[draft id],
    given as `target_ids`); -inf elsewhere."""
    draft = rms_norm(hidden, head["norm.weight"], hcfg.rms_norm_eps) @ head["lm_head.weight"].T
    return jnp.full(draft.shape[:-1] + (vocab_size,), -jnp.inf).at[..., target_ids].set(draft)


class EagleReference:
    """An EAGLE head (its HF tensors and config) with its target (HF tensors and config)."""

    def __init__(self, method, head, hcfg, target, tcfg):
        self.method, self.hcfg, self.tcfg = method, hcfg, tcfg
        if method == "eagle3":
            d2t = np.asarray(head["d2t"])
            self.target_ids = np.arange(len(d2t)) + d2t
        self.head = {k: jnp.asarray(v) for k, v in head.items()}
        self.target = {k: jnp.asarray(v) for k, v in target.items()}
        self.embed = self.target["model.embed_tokens.weight"]

    def features(self, ids):
        """The head's feature of every position of `ids` [T, D]."""
        _, final, after = target_forward(self.target, self.tcfg, ids)
        if self.method == "eagle":
            return final
        return eagle3_fc(self.head, after[jnp.array(eagle3_feature_layers(self.tcfg.num_layers))])

    def hidden(self, features, tokens):
        fn = eagle3_hidden if self.method == "eagle3" else eagle1_hidden
        return fn(self.head, self.hcfg, self.embed, features, jnp.asarray(tokens))

    def logits(self, hidden):
        if self.method == "eagle3":
            return eagle3_logits(self.head, self.hcfg, self.tcfg.vocab_size, self.target_ids, hidden)
        lm_head = self.target.get("lm_head.weight", self.embed)
        return eagle1_logits(self.head, self.hcfg, lm_head, hidden)

    def pair_logits(self, ids):
        """Logits of the head on every pair (feature at p, token p+1) of `ids`: row p predicts ids[p+2]."""
        ids = jnp.asarray(ids)
        return self.logits(self.hidden(self.features(ids)[:-1], ids[1:]))

    def greedy_drafts(self, ids, k: int, length: int = 64, allowed=None) -> list[int]:
        """The k argmax drafts after the sequence `ids`: the head over all its pairs, then k times its own
        last output hidden paired with its own draft. Sequences are padded to `length` pairs (causal: the
        padding never reaches earlier pairs), so one compilation serves every prefix.

        `allowed(drafts so far) -> sorted token ids, or None` restricts each draft to those tokens (structured
        outputs); where none of them has a finite logit (an EAGLE-3 draft vocabulary may miss them all) the
        draft is the unrestricted argmax."""
        return self.greedy_drafts_and_logits(ids, k, length, allowed)[0]

    def greedy_drafts_and_logits(self, ids, k: int, length: int = 64, allowed=None):
        """(greedy_drafts, the head's logits [k, V] where it proposed each of them)."""
        if not hasattr(self, "_hidden_jit"):
            self._hidden_jit = jax.jit(self.hidden)
            self._features_jit = jax.jit(self.features)
        n = len(ids)
        assert n + k <= length
        padded = np.zeros(length, np.int32)
        padded[:n] = ids
        feats = np.array(self._features_jit(jnp.asarray(padded)))[:-1]            # pair p: feature p
        toks = padded[1:].copy()                                                  # ... with token p+1
        drafts, all_logits = [], []
        for j in range(k):
            h = np.asarray(self._hidden_jit(jnp.asarray(feats), jnp.asarray(toks)))[n - 2 + j]
            logits = np.asarray(self.logits(jnp.asarray(h)[None])[0])
            ok = allowed(drafts) if allowed is not None else None
            if ok is not None and len(ok) and np.isfinite(logits[ok]).any():
                d = int(ok[int(np.argmax(logits[ok]))])
            else:
                d = int(np.argmax(logits))
            drafts.append(d)
            all_logits.append(logits)
            feats[n - 1 + j], toks[n - 1 + j] = h, d
        return drafts, np.stack(all_logits)


class Greedy:
    """A target's greedy continuations and a draft model's greedy drafts, from the dense reference (one
    compilation per model: sequences are padded to `length`)."""

    def __init__(self, tensors, cfg, length: int = 64):
        t = {k: jnp.asarray(v) for k, v in tensors.items()}
        self.length = length
        self._logits = jax.jit(lambda ids: target_forward(t, cfg, ids)[0])

    def logits(self, ids) -> np.ndarray:
        """The model's logits at every position of `ids` [len(ids), V] (float64 copies of float32 values)."""
        padded = np.zeros(self.length, np.int32)
        padded[:len(ids)] = ids
        return np.asarray(self._logits(jnp.asarray(padded)), np.float64)[:len(ids)]

    def next_tokens(self, ids, count: int) -> list[int]:
        seq = list(ids)
        for _ in range(count):
            seq.append(int(np.argmax(self.logits(seq)[-1])))
        return seq[len(ids):]

    def log_probs(self, ids) -> np.ndarray:
        """The log-softmax of the logits after each token of `ids` [len(ids), V] (float64): row p is the
        distribution of the token at p+1."""
        padded = np.zeros(max(self.length, len(ids)), np.int32)
        padded[:len(ids)] = ids
        shifted = np.asarray(self._logits(jnp.asarray(padded)), np.float64)[:len(ids)]
        shifted -= shifted.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# ---- drafts of the other methods, and what a greedy run must have counted ----------------------------------

def ngram_drafts(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the latest earlier occurrence of the longest suffix (max_n down to min_n) that starts
    before the suffix itself; drafts continue after it, repeating with the period the match implies."""
    L = len(history)
    for n in range(max_n, min_n - 1, -1):
        if L <= n:
            continue
        suffix = history[L - n:]
        for i in range(L - n - 1, -1, -1):
            if history[i:i + n] == suffix:
                period = max(L - n - i, 1)
                return [history[i + n + j % period] for j in range(k)]
    return [-1] * k


def greedy_spec_counts(continuation: list[int], prompt_len: int, max_tokens: int, max_model_len: int, k: int,
                       propose) -> dict:
    """What a greedy speculative run of one request drafts and accepts, step by step, recomputed on the host.

    `continuation`: the target's greedy sequence (prompt included) long enough to cover the last step's
    drafts; `propose(seq) -> k drafts` after the tokens `seq`. The prefill's sampling step emits the first
    token and proposes; each later step verifies min(k, room) drafts, where room keeps positions below
    max_model_len - 1, accepts the longest prefix that equals the greedy continuation and emits one more.
    -> {"draft_tokens", "accepted_tokens", "per_position" (accepted counts per draft position), "steps"}.
    """
    n = prompt_len + 1
    out = {"draft_tokens": 0, "accepted_tokens": 0, "per_position": [0] * k, "steps": 0}
    while n - prompt_len < max_tokens and n < max_model_len:
        num_drafts = min(k, max_model_len - 2 - (n - 1))
        drafts = propose(continuation[:n])[:num_drafts]
        accepted = 0
        while accepted < num_drafts and drafts[accepted] == continuation[n + accepted]:
            accepted += 1
        out["draft_tokens"] += num_drafts
        out["accepted_tokens"] += accepted
        for j in range(accepted):
            out["per_position"][j] += 1
        out["steps"] += 1
        n += accepted + 1
    return out


# ---- the MTP head of Qwen3-Next / Qwen3.5 (transformers has none) -------------------------------------------

def zero_centred_rms_norm(x, w, eps):
    """The hybrids' RMSNorm (torch): x / rms(x) * (1 + w), in float32."""
    import torch
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


class MtpReference:
    """The MTP head as published (vLLM's qwen3_next_mtp / qwen3_5_mtp), over one whole sequence in torch:

        x   = fc([pre_fc_norm_embedding(embed(token p+1)); pre_fc_norm_hidden(hidden p)])
        out = norm(one full-attention decoder layer(x))         (pair p at position p; predicts token p+2)
        logits = lm_head(out); a later draft pairs `out` with the draft it gave.

    `target`: transformers' causal LM (its hidden after the final norm, embedding and lm_head); `layer_model`:
    transformers' own base model of the target's family with a single full-attention layer, holding the MTP
    layer as layers.0 and the MTP `norm` as its final norm, run on inputs_embeds = x; `tensors`: the mtp.*
    tensors (fc and the two pre-fc norms are read from there)."""

    def __init__(self, target, layer_model, tensors: dict):
        import torch
        self.target, self.layer_model = target, layer_model
        self.t = {k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}
        self.eps = target.config.rms_norm_eps

    def outputs(self, features, tokens):
        """features [n, D] (pair p's hidden), tokens [n] (pair p's token) -> out [n, D]."""
        import torch
        with torch.no_grad():
            emb = self.target.get_input_embeddings()(torch.as_tensor(tokens))
            x = torch.cat([zero_centred_rms_norm(emb, self.t["mtp.pre_fc_norm_embedding.weight"], self.eps),
                           zero_centred_rms_norm(features, self.t["mtp.pre_fc_norm_hidden.weight"], self.eps)], -1)
            x = x @ self.t["mtp.fc.weight"].T
            return self.layer_model(inputs_embeds=x[None]).last_hidden_state[0]

    def logits(self, out):
        import torch
        with torch.no_grad():
            return self.target.get_output_embeddings()(out)

    def target_hidden(self, ids):
        import torch
        with torch.no_grad():
            return self.target.model(torch.as_tensor([list(ids)])).last_hidden_state[0]

    def pair_logits(self, ids) -> np.ndarray:
        """Logits on every pair (hidden p, token p+1) of `ids` [n-1, V]: row p predicts ids[p+2]."""
        ids = list(ids)
        return self.logits(self.outputs(self.target_hidden(ids)[:-1], ids[1:])).double().numpy()

    def greedy_drafts(self, ids, k: int) -> list[int]:
        """The k argmax drafts after the sequence `ids`: the head over all its pairs, then k-1 times its own
        last output paired with its own draft."""
        import torch
        ids = list(ids)
        features, tokens = self.target_hidden(ids)[:-1], ids[1:]
        drafts = []
        for _ in range(k):
            out = self.outputs(features, tokens)[-1]
            drafts.append(int(torch.argmax(self.logits(out[None])[0])))
            features, tokens = torch.cat([features, out[None]]), tokens + drafts[-1:]
        return drafts


def check_drafts_every_step(engine, reqs, expected, width: int) -> int:
    """Steps the engine (sync) until `reqs` end; after every step each unfinished request that has emitted holds the
    `width` drafts `expected(sequence so far)` gives. -> how many times drafts were compared."""
    checked = 0
    while not all(r.finished for r in reqs):
        engine.step()
        for r in reqs:
            if r.output_token_ids and not r.finished:
                seq = r.prompt_token_ids + r.output_token_ids
                held = np.asarray(engine.runner.state.drafts)[r.slot, :width].tolist()
                assert held == expected(seq), f"request {r.request_id} after {len(seq)} tokens"
                checked += 1
    return checked

