"""Helpers for tests: write small GGUF files and dequantize GGML blocks by the format's definition.

The reference dequantizers follow the block layouts of ggml's `block_q*` structs one scalar at a
time; they are deliberately written independently of the vectorized code in the `gguf` package.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, np.float16)[0])


def _k_scale_min(j: int, s: bytes) -> tuple[int, int]:
    """ggml's get_scale_min_k4: the j-th 6-bit (scale, min) pair of a 12-byte K-quant scales field."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def reference_dequantize_block(qtype, b: bytes) -> list[float]:
    """The float values of one GGML block of type `qtype`, computed element by element."""
    if qtype == Q.Q4_0:
        d, qs = _f16(b[0:2]), b[2:18]
        return [((qs[j] & 0x0F) - 8) * d for j in range(16)] + [((qs[j] >> 4) - 8) * d for j in range(16)]
    if qtype == Q.Q4_1:
        d, m, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:20]
        return [(qs[j] & 0x0F) * d + m for j in range(16)] + [(qs[j] >> 4) * d + m for j in range(16)]
    if qtype == Q.Q5_0:
        d, qh, qs = _f16(b[0:2]), int.from_bytes(b[2:6], "little"), b[6:22]
        lo = [(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16) * d for j in range(16)]
        hi = [(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * d for j in range(16)]
        return lo + hi
    if qtype == Q.Q8_0:
        d = _f16(b[0:2])
        return [int(v) * d for v in np.frombuffer(b[2:34], np.int8)]
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if qtype == Q.Q5_K else bytes(32)
        qs = b[48:176] if qtype == Q.Q5_K else b[16:144]
        out = []
        for chunk in range(4):  # 64 values per chunk: low nibbles then high nibbles of 32 bytes
            for half in range(2):
                sc, mn = _k_scale_min(2 * chunk + half, scales)
                bit = 2 * chunk + half
                for l in range(32):
                    q = (qs[32 * chunk + l] >> (4 * half)) & 0x0F
                    q += 16 * ((qh[l] >> bit) & 1) if qtype == Q.Q5_K else 0
                    out.append(d * sc * q - dmin * mn)
        return out
    if qtype == Q.Q6_K:
        ql, qh, scales, d = b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8), _f16(b[208:210])
        out = [0.0] * 256
        for n in range(2):  # two halves of 128 values
            for l in range(32):
                base_ql, base_qh, base_sc = 64 * n, 32 * n, 8 * n
                q1 = ((ql[base_ql + l] & 0x0F) | (((qh[base_qh + l] >> 0) & 3) << 4)) - 32
                q2 = ((ql[base_ql + l + 32] & 0x0F) | (((qh[base_qh + l] >> 2) & 3) << 4)) - 32
                q3 = ((ql[base_ql + l] >> 4) | (((qh[base_qh + l] >> 4) & 3) << 4)) - 32
                q4 = ((ql[base_ql + l + 32] >> 4) | (((qh[base_qh + l] >> 6) & 3) << 4)) - 32
                s = base_sc + l // 16
                out[128 * n + l] = d * scales[s] * q1
                out[128 * n + l + 32] = d * scales[s + 2] * q2
                out[128 * n + l + 64] = d * scales[s + 4] * q3
                out[128 * n + l + 96] = d * scales[s + 6] * q4
        return out
    raise ValueError(f"no reference for {qtype!r}")


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random blocks of `qtype` as uint8 [n_blocks, type_size], with small finite f16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scale_offsets = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
                     Q.Q6_K: [type_size - 2]}[qtype]
    for off in scale_offsets:
        raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], metadata: dict | None = None):
    """Write a GGUF file: `tensors` maps a name to (array in numpy order, raw GGML type or None)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_architecture()
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def llama3_rope_freq_factors(rope_theta: float, head_dim: int, factor: float, low_freq_factor: float,
                             high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for llama3 rope scaling: per-frequency divisors
    of the base inverse frequencies (1 for short wavelengths, `factor` for long ones, a smooth ramp between)."""
    old_len = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    base = 1.0 / (np.float32(rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    out = []
    for freq in base.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def gguf_from_hf_dir(hf_dir, out_path, arch: str | None = None):
    """Convert a tiny float32 HF safetensors checkpoint to a F32 GGUF the way llama.cpp lays it out
    (its names, its q/k row permutation for llama, metadata keys; llama3 rope scaling as a `rope_freqs`
    tensor, linear rope scaling as rope.scaling.type/factor metadata); no tokenizer."""
    from safetensors.numpy import load_file

    from jaxspec.models.gguf_loader import permute_rows

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    state = load_file(str(hf_dir / "model.safetensors"))
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    rope_theta = float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    tensors, rope_meta = {}, {}
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        tensors["rope_freqs.weight"] = (llama3_rope_freq_factors(rope_theta, head_dim, *(rope[k] for k in keys)), None)
    elif rope_type == "linear":
        rope_meta = {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": float(rope["factor"])}
    elif rope_type != "default":
        raise ValueError(f"no GGUF layout for rope type {rope_type!r}")
    for name, value in state.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{block[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                value = permute_rows(value, n_heads if "q_proj" in rest else n_kv)
        elif name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        else:
            gname = names[name]
        tensors[gname] = (np.ascontiguousarray(value, np.float32), None)
    meta = {
        f"{arch}.context_length": cfg["max_position_embeddings"], f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"], f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.attention.head_count": n_heads, f"{arch}.attention.head_count_kv": n_kv,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        f"{arch}.rope.freq_base": rope_theta, **rope_meta,
    }
    return write_gguf(out_path, arch, tensors, meta)
