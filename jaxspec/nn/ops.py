"""The operations every layer shares (RMSNorm, rotary embedding, paged attention), and `Ops`: the swappable
choices (which matmul, attention and delta-rule kernels, unrolled or scanned layers), made once per engine in one
place. Every projection of every layer, head and drafter is one call of `Ops.linear`.

Shapes: T tokens in this step (a ragged mix of prefill chunks, decode tokens and verify segments of
different requests), R request rows, MB blocks per row, S = num_blocks * block_size flat KV slots, L layers,
Hq/Hkv query/kv heads of width hd.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.nn import kernels, quant
from jaxspec.pallas import paged_attention as pa


class ForwardBatch(NamedTuple):
    token_ids: jax.Array       # i32[T]
    positions: jax.Array       # i32[T]   position of each token in its sequence
    slot_mapping: jax.Array    # i32[T]   flat KV slot each token's k/v is written to; >= S drops (padding)
    row_of_token: jax.Array    # i32[T]   row of block_tables the token belongs to
    block_tables: jax.Array    # i32[R, MB]
    logits_indices: jax.Array  # i32[N]   tokens whose logits are wanted
    slot_of_row: jax.Array | None = None         # i32[R] request slot of each row (per-slot layer state)
    first_token_of_row: jax.Array | None = None  # i32[R] index in T of each row's first token
    # bool[T] tokens that extend their sequence: their per-slot state is kept (as a KV slot < S keeps their KV);
    # false for padding and for drafts past a drafter's emitted token. None: every token.
    writes_state: jax.Array | None = None
    # i32[T] index in T of the first of the token's row's tokens in this step, where each row's tokens are
    # contiguous at consecutive positions and all write their KV: then a token's keys from that first position
    # on are the step's own k/v, and the fused attention kernel reads them there instead of from the pool
    # (jaxspec.pallas.paged_attention). None: not so, and attention reads every key from the pool.
    first_in_step: jax.Array | None = None
    # i32[T] each token's LoRA adapter slot (0: none; jaxspec.lora.slots), read by the layers' projections where the
    # params hold adapters. None: no adapters.
    lora_of_token: jax.Array | None = None
    # bool[T, T] dense attention only (Ops.attention "dense"): which keys each token may see, within its row and
    # its window; None: the keys at or before its position (causal). A training forward's own layout
    # (Decoder.dense_forward's attention_mask: the parallel draft model's mask blocks, jaxspec.train.pard).
    dense_mask: jax.Array | None = None


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_inv_freq(config, local: bool = False) -> jax.Array:
    """The rotary inverse frequencies [hd/2]. local: those of Gemma 3's local layers (`local_rope_theta`, no
    scaling)."""
    hd = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if local:
        return inv_freq
    if config.rope_freq_factors is not None:  # per-frequency divisors (GGUF rope_freqs), as llama.cpp applies them
        return inv_freq / jnp.asarray(config.rope_freq_factors, jnp.float32)
    scaling = config.rope_scaling_dict
    if scaling and scaling.get("rope_type") == "linear":   # positions divided by `factor` (Gemma 3's global layers)
        return inv_freq / scaling["factor"]
    if config.rope_type == "yarn":
        return yarn_inv_freq(config.rope_theta, hd, scaling)
    if scaling:  # llama3: long wavelengths slowed by `factor`, a smooth ramp between the two cut-offs
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def yarn_inv_freq(theta: float, dim: int, scaling: dict) -> jax.Array:
    """YaRN's frequencies (transformers' _compute_yarn_parameters): dimensions that turn fewer than beta_slow times
    over the original context are interpolated (divided by `factor`), those that turn more than beta_fast times kept,
    a linear ramp between (its bounds rounded outwards when `truncate`)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension_turning(turns):   # the dimension whose wavelength fits `turns` times in the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(scaling["beta_fast"]), dimension_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # (transformers' guard against a zero-width ramp)
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp                                     # 1: extrapolated (as trained), 0: interpolated
    return (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def rope_attention_scale(config) -> float:
    """The factor rotary multiplies cos and sin by (so q.k by its square): YaRN's 0.1 ln(factor) + 1 (transformers'
    attention_factor, as it infers it from `factor`), 1 for every other rope."""
    if config.rope_type != "yarn" or config.rope_scaling_dict["factor"] <= 1:
        return 1.0
    return 0.1 * math.log(config.rope_scaling_dict["factor"]) + 1.0


def rope_cos_sin(positions, inv_freq, scale: float = 1.0):
    """f32 cos and sin [T, hd/2] of each position's rotary angles, times `scale` (`rope_attention_scale`); the fused
    attention kernel takes these."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]     # [T, hd/2]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x, positions, inv_freq, scale: float = 1.0):
    """x [T, H, hd] rotated by position (the rotate-half layout of HF checkpoints), times `scale`
    (`rope_attention_scale`)."""
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    cos = jnp.concatenate([cos] * 2, axis=-1)[:, None, :]                   # [T, 1, hd]
    sin = jnp.concatenate([sin] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _attend(q, k, v, mask, scale, sinks=None):
    """q [T, Hkv, G, hd]; k/v [T, C, Hkv, hd] (per-token context) or [C, Hkv, hd] (shared); mask [T, C]; sinks
    [Hkv*G] f32 or None: a learned logit per query head that joins the softmax's sum and attends to nothing
    (GPT-OSS's attention sinks)."""
    ctx = "tckd" if k.ndim == 4 else "ckd"
    s = jnp.einsum(f"tkgd,{ctx}->tkgc", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, *q.shape[1:3], 1), (*s.shape[:3], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(f"tkgc,{ctx}->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(q.shape[0], -1)


def in_window(key_positions, positions, window: int | None):
    """Which keys a token at `positions` sees: those at or before it, and with a sliding window only the
    `window` - 1 before it too (transformers' sliding-window mask: key > position - window)."""
    seen = key_positions <= positions
    return seen if window is None else seen & (key_positions > positions - window)


# Keys each tile of the reference attention gathers per token: the step's memory is its tokens times this, and a
# token's context is read only as far as the furthest position of the step reaches, however long max_model_len is.
# Gathered whole (every token's max_model_len keys at once), a 4,096-token prefill chunk of SmolLM2-135M at a 4,096
# context asked for 26 GB, and each decode step read max_model_len keys per token (issue #62).
REFERENCE_TILE_KEYS = 256


def paged_attention_reference(q, k_pool, v_pool, layer, batch: ForwardBatch, block_size: int,
                              window: int | None = None, sinks=None):
    """Each token attends to its own row's blocks up to its position (within `window` keys of it, if given), a tile of
    REFERENCE_TILE_KEYS keys at a time with an online softmax, over the tiles the step's tokens reach (a loop of
    dynamic length: the furthest position in the step decides it; a context of one tile is gathered whole).
    q [T, Hq, hd]; k/v_pool [L, S, Hkv, hd] (this step's k/v already written) -> [T, Hq*hd] float32."""
    T, Hq, hd = q.shape
    L, S, Hkv, _ = k_pool.shape
    # Keys are gathered from the pools viewed as [L*S, Hkv, hd], the layer's slots offset: `k_pool[layer]` of a
    # scanned layer's traced index is a copy of that layer's pool, which made every CPU step copy the whole pool
    # (TPOT doubled at a 4x larger max_model_len).
    flat = k_pool.reshape(L * S, Hkv, hd), v_pool.reshape(L * S, Hkv, hd)

    def gather(slots):
        index = jnp.clip(slots, 0, S - 1) + layer * S
        return (jnp.take(pool, index, axis=0, mode="clip").astype(q.dtype) for pool in flat)   # (fp8 read back)
    per_tile = max(1, REFERENCE_TILE_KEYS // block_size)                          # blocks per tile
    tables = batch.block_tables[batch.row_of_token]                               # [T, MB]
    scale = 1.0 / math.sqrt(hd)
    if tables.shape[1] <= per_tile:   # the whole context is one tile: gathered at once, no loop to fuse across
        slots = (tables[:, :, None] * block_size + jnp.arange(block_size)).reshape(T, -1)   # [T, C]
        k, v = gather(slots)                                                              # [T, C, Hkv, hd]
        mask = in_window(jnp.arange(slots.shape[1])[None, :], batch.positions[:, None], window)
        return _attend(q.reshape(T, Hkv, Hq // Hkv, hd), k, v, mask, scale, sinks)
    num_tiles = -(-tables.shape[1] // per_tile)
    tables = jnp.pad(tables, ((0, 0), (0, num_tiles * per_tile - tables.shape[1])))   # keys past MB: masked
    keys = per_tile * block_size
    positions = batch.positions[:, None]
    qg = q.reshape(T, Hkv, Hq // Hkv, hd)
    # the tiles some token reaches: from the first a window lets the nearest token see, to its furthest position's
    last = jnp.clip(jnp.max(batch.positions) // keys + 1, 1, num_tiles)
    first = 0 if window is None else jnp.clip((jnp.min(batch.positions) - window + 1) // keys, 0, last - 1)

    def tile(i, carry):
        o, m, l = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, i * per_tile, per_tile, axis=1)           # [T, per_tile]
        slots = (blocks[:, :, None] * block_size + jnp.arange(block_size)).reshape(T, keys)
        k, v = gather(slots)                                                                  # [T, keys, Hkv, hd]
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k, preferred_element_type=jnp.float32) * scale
        visible = in_window(i * keys + jnp.arange(keys)[None, :], positions, window)          # [T, keys]
        m_new = jnp.maximum(m, jnp.max(jnp.where(visible[:, None, None], s, -1e30), axis=-1))
        p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        o = o * correction[..., None] + jnp.einsum("tkgc,tckd->tkgd", p.astype(v.dtype), v,
                                                   preferred_element_type=jnp.float32)
        return o, m_new, l * correction + jnp.sum(p, axis=-1)

    o0 = jnp.zeros(qg.shape, jnp.float32)
    if sinks is None:
        m0, l0 = jnp.full(qg.shape[:3], -1e30, jnp.float32), jnp.zeros(qg.shape[:3], jnp.float32)
    else:   # a learned logit per query head joins the softmax's sum and attends to nothing (GPT-OSS's sinks)
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, Hkv, -1), qg.shape[:3])
        l0 = jnp.ones(qg.shape[:3], jnp.float32)
    o, _, l = jax.lax.fori_loop(first, last, tile, (o0, m0, l0))
    return (o / jnp.maximum(l, 1e-30)[..., None]).reshape(T, Hq * hd)


def dense_causal_attention(q, k_pool, v_pool, layer, batch: ForwardBatch, block_size: int,
                           window: int | None = None, sinks=None):
    """One sequence whose token t sits at KV slot t: plain causal attention (no pages). Tokens of other rows
    (`row_of_token`: sequences packed end to end, Decoder.dense_forward) are not seen, nor keys that
    `batch.dense_mask` (when given) hides."""
    T, Hq, hd = q.shape
    k, v = k_pool[layer][:T].astype(q.dtype), v_pool[layer][:T].astype(q.dtype)
    mask = in_window(batch.positions[None, :], batch.positions[:, None], window)
    mask &= batch.row_of_token[None, :] == batch.row_of_token[:, None]
    if batch.dense_mask is not None:
        mask &= batch.dense_mask
    return _attend(q.reshape(T, k.shape[1], -1, hd), k, v, mask, 1.0 / math.sqrt(hd), sinks)


# Steps of at most this many tokens run the matmuls named in `Ops.gemv` as GEMV kernels (measured at 8 and 16);
# with FP8 weights up to 32, where the kernel still beats XLA's FP8 matmuls (docs/lab/2026-11-27-fp8.md).
GEMV_MAX_TOKENS = 16
GEMV_MAX_TOKENS_FP8 = 32
# What JAXSPEC_GEMV may name: a dense layer's matmuls by short name.
GEMV_MATMULS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
# The activations of a gated MLP's gate (`Ops.linear` of a gate/up pair weight): act(gate) * up.
GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}
# Steps of at least this many tokens compile their matmuls to cuBLAS on a GPU (Ops.compiler_options).
CUBLAS_FROM_TOKENS = 128


# A weight's LoRA adapters in a layer's params: `<name>_lora_a`, `<name>_lora_b` (jaxspec.lora.slots).
LORA_A, LORA_B = "_lora_a", "_lora_b"


def lora_delta(x, a, b, slot_of_row):
    """Each row's adapter product: x [T, K], a [N, R, K] and b [N, ..., R] the adapter slots' A and B (the scaling in
    B), slot_of_row i32[T] -> f32 [T, prod(...)], row t's b[s] @ a[s] @ x[t] with s = slot_of_row[t]. Every slot's
    x @ A (N x R columns: a few hundred) then one product with the slots' B stacked, the other slots' columns zeroed:
    two dense matmuls, no per-row gather of B (a prefill chunk's rows times B's size). Slot 0 (no adapter) is zeros:
    it is left out of both, so a step reads the max_loras adapters' A and B and nothing more."""
    a, b = a[1:], b[1:]
    N, R = a.shape[0], a.shape[1]
    xa = jnp.einsum("tk,nrk->tnr", x, a, preferred_element_type=jnp.float32)                # [T, N, R]
    mine = slot_of_row[:, None, None] == jnp.arange(1, N + 1, dtype=slot_of_row.dtype)[None, :, None]
    xa = jnp.where(mine, xa, 0.0).reshape(x.shape[0], N * R)
    b = jnp.transpose(b.reshape(N, -1, R), (0, 2, 1)).reshape(N * R, -1)                # [N*R, out]
    return jnp.dot(xa, b.astype(jnp.float32))


# Steps of at least this many tokens attend with the prefill kernel on a GPU (`Ops.prefill_attention_from_tokens`).
# Measured on an H100 (Qwen2.5-Coder-1.5B shapes, 2,048-token chunks, docs/lab/2026-12-07-long-prompts-gpu.md): time
# to first token 0.033 -> 0.016 s at 2k prompt tokens, 0.402 -> 0.076 s at 8k, 6.05 -> 0.60 s at 32k; one chunk's
# attention 3-21x faster than the per-token kernel's. JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS=0 turns it off.
PREFILL_ATTENTION_FROM_TOKENS = 256


def prefill_attention_from_tokens(gpu: bool) -> int | None:
    """The step size from which the prefill kernel attends: PREFILL_ATTENTION_FROM_TOKENS on a GPU, None elsewhere
    (the CPU's reference attention is tiled already). JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS sets it (0: never)."""
    value = os.environ.get("JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS")
    if value is None:
        return PREFILL_ATTENTION_FROM_TOKENS if gpu else None
    if not value.isdigit():
        raise ValueError(f"JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS={value!r} is invalid; give a token count (0: never)")
    return int(value) or None


def gemv_matmuls(spec: str) -> frozenset:
    """JAXSPEC_GEMV's value -> the weight names whose matmuls run as GEMV kernels: "" none, "all", or a comma list
    of qkv, o, gate_up, down."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return frozenset(GEMV_MATMULS.values())
    bad = [n for n in names if n not in GEMV_MATMULS]
    if bad:
        raise ValueError(f"JAXSPEC_GEMV={spec!r}: {bad} are not matmuls; valid: 'all' or a comma list of "
                         f"{', '.join(GEMV_MATMULS)}")
    return frozenset(GEMV_MATMULS[n] for n in names)


def grouped_matmul_choice(gpu: bool) -> str:
    """JAXSPEC_GROUPED_MATMUL, "pallas" or "xla" (Ops.grouped_matmul); by default the kernel on a GPU."""
    value = os.environ.get("JAXSPEC_GROUPED_MATMUL", "pallas" if gpu else "xla")
    if value not in ("pallas", "xla"):
        raise ValueError(f"JAXSPEC_GROUPED_MATMUL={value!r}; valid: 'pallas' or 'xla'")
    return value


def w8a8_from_tokens(quantization: str | None, gpu: bool) -> int | None:
    """FP8 weights: the smallest step (tokens) whose XLA matmuls quantize activations too. JAXSPEC_FP8_W8A8_FROM: a
    token count, or "never" (W8A16 at every size). Measured on an H100 (docs/lab/2026-11-27-fp8.md): XLA's W8A16
    reads the weight at 220-450 GB/s, its W8A8 (cuBLASLt's FP8 GEMM) at 350-610 GB/s, at 8 to 256 tokens: W8A8 at
    every size on a GPU (decode-sized steps run the gemv kernel instead, Ops.gemv). A CPU runs W8A16 faster."""
    if quantization is None:
        return None
    value = os.environ.get("JAXSPEC_FP8_W8A8_FROM", "1" if gpu else "never")
    if value == "never":
        return None
    if not value.isdigit():
        raise ValueError(f"JAXSPEC_FP8_W8A8_FROM={value!r}; valid: a token count or 'never'")
    return int(value)


def use_compile_cache(path, min_compile_seconds: float = 1.0) -> bool:
    """Keep compiled steps on disk (JAX's persistent compilation cache), so that the next process that builds
    an engine of the same shapes loads its steps instead of compiling them (a GPU step compiles in 4-40 s,
    docs/lab/2026-11-23-compile-time-gemm-backend.md). Steps are keyed by their HLO, shapes and compile options, not by weight values. Left
    alone when the user configured a cache directory; JAXSPEC_COMPILE_CACHE=0 turns it off."""
    if os.environ.get("JAXSPEC_COMPILE_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return True


@dataclasses.dataclass(frozen=True)
class Ops:
    """How an engine computes, chosen once (`Ops.for_backend`) and read by every layer, head and drafter.

    attention: "pallas" (the kernel that reads KV pages in place), "reference" (jnp gather of the pages) or
    "dense" (one unpaged sequence: `Decoder.score`). unroll: layers unrolled with their stacked weights
    indexed statically (GPU: each matmul reads its weight in place), or scanned over runs of one layer kind
    (CPU: one layer body to compile). delta_rule: the Gated DeltaNet recurrence as "reference" (a JAX scan over
    the step's tokens) or "pallas" (jaxspec.pallas.delta_rule: a recurrent kernel, one program per row and
    head, for decode and verify rows and a prefill row's last k+1 tokens; chunked kernels for the tokens before
    those), "auto" in `for_backend`: the kernels on a GPU (H100, Qwen3-Next's shapes: the recurrent one 1.1-6x
    faster than the scan for decode and verify rows; with the chunked ones a 512-token prefill chunk 4x faster
    than the recurrent kernel alone, docs/lab/2026-11-24-delta-rule-chunked.md), the scan on a CPU.
    """
    attention: str = "reference"
    block_size: int = 16
    unroll: bool = False
    tp: Any = None          # nn.sharding.TensorParallel: the mesh the step runs on, or None (one device)
    # GPU compiles: steps of at least this many tokens use cuBLAS for their matmuls instead of XLA's autotuned
    # Triton GEMMs, and autotuning results persist in this directory (None: XLA's defaults).
    cublas_from_tokens: int | None = None
    autotune_cache_dir: str | None = None
    delta_rule: str = "reference"
    # The matmuls (weight names) that steps of at most GEMV_MAX_TOKENS tokens run as jaxspec.pallas.gemv
    # kernels, the norm, SwiGLU or residual add next to each inside it (`linear`; one device: a split model keeps
    # XLA's sharded matmuls, `use_gemv`). On a GPU down alone by default (JAXSPEC_GEMV): on an H100 it is the one
    # the kernel wins (the 1.5B's step 4% faster); XLA's GEMMs are faster on q/k/v, o and gate/up, and the whole
    # set is 12% slower (docs/lab/2026-11-24-gemv-kernels.md).
    gemv: frozenset = frozenset()
    # The Pallas attention with the q/k rotary embedding and the KV write inside (`fuses_kv_write`): one kernel
    # instead of five per layer. JAXSPEC_FUSED_ATTENTION=0 keeps them apart (for measuring).
    fused_attention: bool = True
    # Steps of at least this many tokens (their rows contiguous: `ForwardBatch.first_in_step`) attend with the
    # prefill kernel's query tiles (jaxspec.pallas.prefill_attention: a row's KV read once per tile of its tokens,
    # not once per token), their k/v written by XLA's scatter before it. None: never.
    prefill_attention_from_tokens: int | None = None
    # FP8 weights (jaxspec.nn.quant): "fp8" declares the layers' projections as e4m3 with per-channel scales. Steps
    # of at least w8a8_from_tokens tokens quantize the activations too (an FP8 GEMM); smaller ones convert the
    # weight inside the matmul (W8A16). None: W8A16 at every size.
    quantization: str | None = None
    w8a8_from_tokens: int | None = None
    # FP8 weights on the gemv kernel: "plain" (the kernel's product alone, the input norm, SwiGLU and residual as XLA
    # ops) or "fused" (those inside the kernel, as bf16's). Measured on an H100 (1.5B shapes, docs/lab/2026-11-27-fp8.md):
    # the decode step 1.473 ms plain against 1.912 ms fused (bf16: 1.702). JAXSPEC_FP8_GEMV.
    fp8_gemv: str = "plain"
    # The experts' grouped matmul (MoE layers): "pallas" (jaxspec.pallas.grouped_matmul: only the experts rows were
    # routed to are read) or "xla" (jax.lax.ragged_dot, which XLA lowers on a GPU to a product with every expert).
    # On a GPU the kernel by default (one device; bf16, f32 or FP8 experts); JAXSPEC_GROUPED_MATMUL=xla to compare.
    grouped_matmul: str = "xla"

    def use_gemv(self, num_tokens: int) -> bool:
        limit = GEMV_MAX_TOKENS_FP8 if self.quantization is not None else GEMV_MAX_TOKENS
        return bool(self.gemv) and self.tp is None and num_tokens <= limit

    def linear(self, x, lp, name: str, *, norm: str | None = None, eps: float | None = None, residual=None,
               group_sizes=None, out_dtype=None, activation: str = "silu", lora=None):
        """One projection: x [..., K] @ lp[name].T -> [..., N], the one function every matmul against a weight
        goes through (layers, heads, drafters, training), so that a kernel or a weight format is chosen here once.

        norm, eps: the rms_norm of x by the weight lp[norm] first (a layer's input norm). residual [..., N]: added
        after. A gate/up pair weight [F, 2, K] gives act(gate) * up [..., F], act the GATE_ACTIVATIONS entry
        `activation` (the gemv kernel computes silu alone: another runs XLA's matmul, or the kernel's bare product
        where FP8 weights take it). group_sizes i32[E]: x's rows are
        grouped by expert (the first group_sizes[0] rows go to expert 0, ...) and lp[name] holds the experts'
        weights [E, K, N] (pairs [E, K, F, 2]; FP8: scales [E, N] beside them): one grouped matmul. out_dtype: the
        product's dtype (float32 logits from bf16 weights); None: the operands'. The weight is named, not passed, so
        that a kernel can read the whole stacked weight in place (`kernels.LayerWeights`).

        lora i32[T]: each row of x's LoRA adapter slot, where lp holds the weight's adapters (`<name>_lora_a` [N, R,
        K], `<name>_lora_b` [N, ..., R]: jaxspec.lora.slots, slot 0 zeros): the row's B @ A @ x is added to the
        product before the activation and the residual (`lora_delta`).

        Steps of at most GEMV_MAX_TOKENS tokens run the weights named in `gemv` as gemv kernels with the norm,
        SwiGLU and residual inside; everything else is XLA's dot, with the norm, SwiGLU and residual as XLA ops."""
        if (norm is None) != (eps is None):
            raise ValueError(f"norm={norm!r} and eps={eps!r}: an input norm needs both its weight's name and eps")
        scale = lp.get(name + quant.SCALE)   # an FP8 weight's per-channel scales (or block-wise: quant.is_blockwise)
        blockwise = group_sizes is None and quant.is_blockwise(lp[name], scale)   # the kernels know per-channel only
        adapters = lora is not None and name + LORA_A in lp
        on_kernel = (name in self.gemv and group_sizes is None and out_dtype is None and x.ndim == 2
                     and self.use_gemv(x.shape[0]) and not blockwise and not adapters)
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is unknown; valid: {', '.join(GATE_ACTIVATIONS)}")
        kernel_activation = activation == "silu" or lp[name].ndim == 2   # (a pair weight is [F, 2, K])
        if on_kernel and (scale is None or self.fp8_gemv == "fused") and kernel_activation:
            y = kernels.gemv_linear(x, lp, name, norm=norm, eps=eps, residual=residual)
            if y is not None:   # None: no kernel tiling divides this weight
                return y
        w = lp[name]
        if norm is not None:
            x = rms_norm(x, lp[norm], eps)
        if group_sizes is not None:
            pairs = w.ndim == 4
            w = w.reshape(*w.shape[:2], -1)     # [E, K, N] (pairs: gate and up columns interleaved)
            kernel = self.grouped_matmul == "pallas" and self.tp is None and x.ndim == 2
            y = kernels.grouped_linear(x, lp, name, group_sizes, out_dtype) if kernel else None   # None: no tiling
            if y is None and scale is not None:   # FP8 experts: each expert's per-output-channel scales [E, N], W8A16
                y = quant.fp8_ragged_dot(x, w, scale.reshape(w.shape[0], -1), group_sizes, out_dtype=out_dtype)
            elif y is None:
                y = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out_dtype)
        else:
            pairs = w.ndim == 3
            w = w.reshape(-1, w.shape[-1])      # pairs [F, 2, K]: gate and up rows interleaved, [2F, K]
            plain = on_kernel and scale is not None and self.fp8_gemv == "plain"
            y = kernels.gemv_matmul(x, lp, name) if plain else None   # None: no tiling fits, XLA's matmul
            if y is None and blockwise:
                y = quant.fp8_block_matmul(x, w, scale.reshape(-1, scale.shape[-1]), w8a8=self.uses_w8a8(x),
                                           out_dtype=out_dtype)
            elif y is None and scale is not None:
                y = quant.fp8_matmul(x, w, scale.reshape(-1), w8a8=self.uses_w8a8(x), out_dtype=out_dtype)
            elif y is None:
                y = x @ w.T if out_dtype is None else jnp.einsum("...k,nk->...n", x, w, preferred_element_type=out_dtype)
        if adapters:
            y = y + lora_delta(x, lp[name + LORA_A], lp[name + LORA_B], lora).astype(y.dtype)
        if pairs:
            y = y.reshape(*y.shape[:-1], -1, 2)
            y = GATE_ACTIVATIONS[activation](y[..., 0]) * y[..., 1]
        return y if residual is None else residual + y

    def uses_w8a8(self, x) -> bool:
        """Whether an FP8 weight's matmul with x [..., K] quantizes x too (by the step's token count)."""
        return self.w8a8_from_tokens is not None and math.prod(x.shape[:-1]) >= self.w8a8_from_tokens

    def __post_init__(self):
        quant.check_scheme(self.quantization)
        if self.fp8_gemv not in ("fused", "plain"):
            raise ValueError(f"fp8_gemv={self.fp8_gemv!r} (JAXSPEC_FP8_GEMV) is unknown; choose 'fused' or 'plain'")
        if self.attention not in ("pallas", "reference", "dense"):
            raise ValueError(f"attention={self.attention!r} is unknown; choose 'pallas' or 'reference'")
        if self.delta_rule not in ("pallas", "reference"):
            raise ValueError(f"delta_rule={self.delta_rule!r} is unknown; choose 'pallas' or 'reference'")

    @staticmethod
    def for_backend(block_size: int, attention: str = "auto", unroll: bool | None = None, tp=None,
                    delta_rule: str = "auto", quantization: str | None = None) -> "Ops":
        """The measured choices for this device (docs/lab/2026-11-22-first-round-step.md): on a GPU the Pallas kernel and unrolled
        layers, on a CPU the reference attention and scanned layers (fast compiles)."""
        gpu = jax.default_backend() == "gpu"
        if attention == "auto":
            attention = "pallas" if gpu else "reference"
        if delta_rule == "auto":
            delta_rule = "pallas" if gpu else "reference"
        autotune_cache = None
        if gpu:
            from jaxspec.cache import cache_dir
            autotune_cache = str(cache_dir() / "xla-autotune")
            use_compile_cache(cache_dir() / "jax-compile")
        return Ops(attention=attention, block_size=block_size, unroll=gpu if unroll is None else unroll, tp=tp,
                   cublas_from_tokens=CUBLAS_FROM_TOKENS if gpu else None, autotune_cache_dir=autotune_cache,
                   delta_rule=delta_rule, gemv=gemv_matmuls(os.environ.get(
                       "JAXSPEC_GEMV", ("all" if quantization else "down") if gpu else "")),
                   fused_attention=os.environ.get("JAXSPEC_FUSED_ATTENTION", "1") != "0",
                   prefill_attention_from_tokens=prefill_attention_from_tokens(gpu),
                   quantization=quantization, w8a8_from_tokens=w8a8_from_tokens(quantization, gpu),
                   fp8_gemv=os.environ.get("JAXSPEC_FP8_GEMV", "plain"),
                   grouped_matmul=grouped_matmul_choice(gpu))

    def compiler_options(self, num_tokens: int, tier: str = "tuned") -> dict:
        """XLA options for the compile of a step of `num_tokens` tokens. "tuned": measured on an H100 (Qwen2.5-1.5B,
        docs/lab/2026-11-23-compile-time-gemm-backend.md): autotuned Triton GEMMs run the small matmuls of decode
        steps faster (2.24 vs 2.75 ms at 8 tokens) but cost ~25-40 s of autotuning per bucket; cuBLAS is faster from
        128 tokens (3.25 vs 3.88 ms at 256) and compiles in ~4 s. The autotuning results are kept on disk: the next
        process that compiles the same bucket takes ~6 s. "fast": cuBLAS GEMMs and no autotuning at all (XLA's
        heuristic picks), a compile of seconds that times nothing on the device (jaxspec.decode.compiler)."""
        if tier not in ("fast", "tuned"):
            raise ValueError(f"tier={tier!r} is invalid; choose 'fast' or 'tuned'")
        opts = {}
        if self.cublas_from_tokens is None:   # not a GPU: no GEMM choice, nothing autotuned
            return opts
        if tier == "fast":
            return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
        if num_tokens >= self.cublas_from_tokens:
            opts["xla_gpu_enable_triton_gemm"] = False
        if self.autotune_cache_dir is not None:
            opts["xla_gpu_per_fusion_autotune_cache_dir"] = self.autotune_cache_dir
        return opts

    def fuses_kv_write(self, batch: ForwardBatch) -> bool:
        """Whether `attend_qkv` runs the kernel with the rotary embedding and the KV write inside: the Pallas
        attention on one device, and a batch that says where each row's step begins. A NUM_SPLITS other than 1
        (the unfused kernel's, set by profile_step's --attention-splits to measure it) keeps the unfused one."""
        return (self.fused_attention and self.attention == "pallas" and self.tp is None and pa.NUM_SPLITS == 1
                and batch.first_in_step is not None and not self.uses_prefill_kernel(batch))

    def uses_prefill_kernel(self, batch: ForwardBatch) -> bool:
        """Whether the step attends with the prefill kernel's query tiles (`prefill_attention_from_tokens`)."""
        return (self.attention == "pallas" and self.prefill_attention_from_tokens is not None
                and batch.first_in_step is not None
                and batch.positions.shape[0] >= self.prefill_attention_from_tokens)

    def attend(self, q, k_pool, v_pool, layer, batch: ForwardBatch, window: int | None = None, sinks=None):
        """q [T, Hq, hd] against the pools [L, S, Hkv, hd] of layer `layer` (each token within `window` keys of
        itself, if given; `sinks` [Hq]: attention-sink logits) -> [T, Hq*hd]; under tensor parallelism each device
        attends with its own heads and KV pages."""
        if sinks is not None and self.tp is not None and self.tp.shard_attention and self.attention != "dense":
            raise NotImplementedError("attention sinks with the heads split over devices (tensor_parallel_size="
                                      f"{self.tp.size}) are not implemented; run with tensor_parallel_size=1")
        local = functools.partial(self._attend_local, window=window, sinks=sinks)
        fn = local if self.tp is None or self.attention == "dense" else self.tp.attention(local)
        return fn(q, k_pool, v_pool, layer, batch)

    def _attend_local(self, q, k_pool, v_pool, layer, batch: ForwardBatch, window: int | None = None, sinks=None):
        if self.uses_prefill_kernel(batch):
            return kernels.prefill_attention_fn(q, k_pool, v_pool, layer, batch, self.block_size, window, sinks)
        if self.attention == "pallas":
            return kernels.paged_attention_fn(q, k_pool, v_pool, layer, batch, self.block_size, window, sinks)
        if self.attention == "dense":
            return dense_causal_attention(q, k_pool, v_pool, layer, batch, self.block_size, window, sinks)
        return paged_attention_reference(q, k_pool, v_pool, layer, batch, self.block_size, window, sinks)
