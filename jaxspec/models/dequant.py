"""GGML block dequantization in JAX, from the raw bytes of a GGUF tensor.

Each supported type has a function from its blocks, uint8 [n_blocks, type_size], to float32
[n_blocks, block_size] written with JAX integer/bit ops, following ggml's `block_*` layouts (the order
of float operations matches the `gguf` package's numpy code, so results agree with it to the bit on
backends that do not fuse multiply-adds). `dequantize_raw` jit-compiles one program per
(type, number of blocks, output dtype): the layers of one model share a handful of compiles. It runs
on JAX's default backend (the GPU when there is one) and returns a numpy array on the host.
"""
from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np

Q = gguf.GGMLQuantizationType
JAX_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16(blocks: jax.Array, offset: int) -> jax.Array:
    """The float16 at byte `offset` of every block, as float32 [n_blocks, 1]."""
    return jax.lax.bitcast_convert_type(blocks[:, offset:offset + 2], jnp.float16).astype(jnp.float32)[:, None]


def _nibbles(qs: jax.Array) -> jax.Array:
    """[..., k] bytes -> [..., 2k]: the low nibbles of all k bytes, then their high nibbles."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).astype(jnp.int8) - 8
    return d * q.astype(jnp.float32)


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _nibbles(b[:, 4:20]).astype(jnp.float32) + m


def _q5_0(b):
    d = _f16(b, 0)
    # qh is a little-endian uint32: bit j of it is bit (j % 8) of byte j // 8.
    qh = (b[:, 2:6, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    qh = qh.reshape(b.shape[0], 32)
    q = (_nibbles(b[:, 6:22]) | (qh << 4)).astype(jnp.int8) - 16
    return d * q.astype(jnp.float32)


def _q8_0(b):
    d = _f16(b, 0)
    q = jax.lax.bitcast_convert_type(b[:, 2:34], jnp.int8)
    return q.astype(jnp.float32) * d


def _k_scales_mins(s):
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 scale bytes [n, 12] -> (scales, mins) uint8 [n, 8]."""
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = jnp.concatenate([s0 & 63, (s2 & 0x0F) | ((s0 >> 6) << 4)], axis=-1)
    mn = jnp.concatenate([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], axis=-1)
    return sc, mn


def _k_quant(b, qs, qh=None):
    """Q4_K / Q5_K: 8 sub-blocks of 32; sub-block 2c+h holds nibble h of qs bytes [32c, 32c+32) (+ bit 2c+h of qh)."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    q = qs.reshape(n, 4, 1, 32) >> jnp.array([0, 4], jnp.uint8).reshape(1, 1, 2, 1)
    q = (q & 0x0F).reshape(n, 8, 32)
    if qh is not None:
        q = q | (((qh[:, None, :] >> jnp.arange(8, dtype=jnp.uint8)[None, :, None]) & 1) << 4)
    dl = (d * sc.astype(jnp.float32))[:, :, None]
    ml = (dmin * mn.astype(jnp.float32))[:, :, None]
    return (dl * q.astype(jnp.float32) - ml).reshape(n, 256)


def _q4_k(b):
    return _k_quant(b, b[:, 16:144])


def _q5_k(b):
    return _k_quant(b, b[:, 48:176], b[:, 16:48])


def _q6_k(b):
    """Q6_K: two halves of 128; in half n, output 32k + l takes nibble (k // 2) of ql[64n + 32(k % 2) + l]
    and bits 2k..2k+1 of qh[32n + l]; each run of 16 outputs has its own int8 scale."""
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = jax.lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(jnp.float32)
    d = _f16(b, 208)
    dl = (d * scales).reshape(n, 16, 1)
    lo = ql.reshape(n, 2, 1, 64) >> jnp.array([0, 4], jnp.uint8).reshape(1, 1, 2, 1)
    lo = (lo & 0x0F).reshape(n, 2, 4, 32)
    hi = qh.reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
    hi = hi & 0x03
    q = (lo | (hi << 4)).astype(jnp.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(jnp.float32)).reshape(n, 256)


def _float(dtype):
    def convert(b):
        return jax.lax.bitcast_convert_type(b, dtype).astype(jnp.float32)
    return convert


_KERNELS = {
    Q.F32: _float(jnp.float32), Q.F16: _float(jnp.float16), Q.BF16: _float(jnp.bfloat16),
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dequantize_blocks(blocks: jax.Array, qtype: int, out_dtype: str) -> jax.Array:
    """uint8 [n_blocks, type_size] -> out_dtype [n_blocks * block_size]."""
    return _KERNELS[Q(qtype)](blocks).astype(out_dtype).reshape(-1)


def dequantize_raw(raw: np.ndarray, qtype, shape: tuple[int, ...], out_dtype="float32") -> np.ndarray:
    """Dequantize the raw bytes of a GGML tensor of type `qtype` to a host array of `shape` (numpy order).

    `raw` is the tensor's data (any dtype/shape; only its bytes are used, e.g. a `ReaderTensor.data` memmap).
    `out_dtype` ('float32' or 'bfloat16') is applied on the device, so the copy back is in that dtype.
    """
    qtype = Q(qtype)
    if qtype not in _KERNELS:
        raise ValueError(f"no JAX dequantizer for GGML type {qtype.name}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_values = int(np.prod(shape))
    if n_values % block_size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} is not a whole number of {block_size}-value blocks")
    n_blocks = n_values // block_size
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != n_blocks * type_size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {data.size}")
    out = _dequantize_blocks(jnp.asarray(data.reshape(n_blocks, type_size)), int(qtype), jnp.dtype(out_dtype).name)
    return np.asarray(out).reshape(shape)


# ---- MXFP4 (GPT-OSS's experts) -----------------------------------------------------------------------------------
# OCP microscaling FP4: values in e2m1 (1 sign, 2 exponent, 1 mantissa bit), two per byte (the low nibble first),
# and one e8m0 scale per 32 values (a power of two, 2^(byte - 127)). An e2m1 code's magnitude (codes 1-7: 0.5, 1,
# 1.5, 2, 3, 4, 6) is (1 + half / 2) * 2^exponent:
_E2M1_EXPONENT = (0, -1, 0, 0, 1, 1, 2, 2)
_E2M1_HALF = (0, 0, 0, 1, 0, 1, 0, 1)
MXFP4_BLOCK = 32
_E8M0_NAN = 255
# Output dtypes whose bits are built directly (both with an 8-bit exponent): total bits, mantissa bits.
_MXFP4_FORMATS = {"float32": (32, 23), "bfloat16": (16, 7)}


@functools.partial(jax.jit, static_argnums=2)
def _mxfp4_to(blocks: jax.Array, scales: jax.Array, out_dtype: str) -> jax.Array:
    """uint8 blocks [R, G, 16] and scales [R, G] -> out_dtype [G*32, R]. Each value's bits are built from its code and
    scale with integer operations (sign, exponent, the 0.5 mantissa bit; subnormal below 2^-126, infinite above the
    dtype's range), never a float multiply: exact on any backend, subnormals too (XLA flushes them in arithmetic)."""
    total, mantissa = _MXFP4_FORMATS[out_dtype]
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)   # [R, G, 32]
    sign = (codes >> 3).astype(jnp.uint32)
    code = (codes & 7).astype(jnp.int32)
    exponent = scales.astype(jnp.int32)[..., None] - 127 + jnp.asarray(_E2M1_EXPONENT, jnp.int32)[code]
    half = jnp.asarray(_E2M1_HALF, jnp.uint32)[code]
    significand = (jnp.uint32(1) << mantissa) | (half << (mantissa - 1))
    normal = ((exponent + 127).astype(jnp.uint32) << mantissa) | (half << (mantissa - 1))
    subnormal = significand >> jnp.clip(-126 - exponent, 0, mantissa + 1).astype(jnp.uint32)
    infinite = jnp.uint32(255 << mantissa)
    magnitude = jnp.where(code == 0, jnp.uint32(0),
                          jnp.where(exponent > 127, infinite, jnp.where(exponent >= -126, normal, subnormal)))
    bits = ((sign << (total - 1)) | magnitude).astype(jnp.uint32 if total == 32 else jnp.uint16)
    values = jax.lax.bitcast_convert_type(bits, jnp.dtype(out_dtype))
    return values.reshape(blocks.shape[0], -1).T


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, out_dtype="float32", name: str = "") -> np.ndarray:
    """MXFP4 experts -> host array in the layout transformers' GPT-OSS uses (`convert_moe_packed_tensors`): blocks
    uint8 [E, R, G, 16] (32 values of row r, columns 32g.. each) and scales uint8 [E, R, G] -> [E, G*32, R] (the
    grouped matmul's [E, K, N]). The values equal transformers' to the bit. A scale of 255 (e8m0's NaN) is refused
    as corrupt, naming the tensor `name`. Experts are converted one at a time (on the default backend)."""
    from jaxspec.models.errors import CorruptModelFileError
    out_dtype = jnp.dtype(out_dtype).name
    if out_dtype not in _MXFP4_FORMATS:
        raise ValueError(f"MXFP4 dequantizes to {', '.join(_MXFP4_FORMATS)}; got out_dtype={out_dtype!r}")
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim != 4 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise CorruptModelFileError(f"MXFP4 tensor {name!r}: blocks {blocks.dtype}{list(blocks.shape)} and scales "
                                    f"{scales.dtype}{list(scales.shape)}; expected uint8 blocks [E, R, G, 16] and "
                                    "uint8 scales [E, R, G]")
    if (scales == _E8M0_NAN).any():
        raise CorruptModelFileError(f"MXFP4 tensor {name!r} has a scale of {_E8M0_NAN} (NaN in e8m0)")
    E, R, G, _ = blocks.shape
    out = np.empty((E, G * MXFP4_BLOCK, R), jnp.dtype(out_dtype))
    for e in range(E):
        out[e] = np.asarray(_mxfp4_to(jnp.asarray(blocks[e]), jnp.asarray(scales[e]), out_dtype))
    return out
