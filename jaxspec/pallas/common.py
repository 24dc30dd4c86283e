"""What the Pallas kernels share: block sizes rounded to powers of two, whether a kernel is interpreted, and the online
softmax's update."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def interpreted(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: None is the default, interpreted everywhere but on a GPU (the tests' CPU)."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def softmax_update(m, l, s):
    """One step of the online softmax over a tile of scores s [rows, n] (masked keys at -1e30), from the running max m
    and sum l [rows] -> (new max, the factor the running output is scaled by, the tile's weights p [rows, n], new
    sum). The caller adds p @ v to its output scaled by the factor."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, correction, p, l * correction + jnp.sum(p, axis=1)
