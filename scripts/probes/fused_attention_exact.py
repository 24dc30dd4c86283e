"""The fused attention kernel against the separate rotary, KV write and attention kernels on the GPU, in bf16 and
in float32, on the ragged step of tests/test_paged_attention.py (a prefill chunk after a cached prefix, a verify
segment, decode tokens, padding): the largest output difference and whether the written pools are equal.

    python3 scripts/probes/fused_attention_exact.py
"""
import itertools
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from test_paged_attention import _fused_case  # noqa: E402

from jaxspec.nn.layers import split_qkv, write_kv  # noqa: E402
from jaxspec.pallas.gemv import LayerWeights  # noqa: E402
from jaxspec.pallas.paged_attention import fused_attention_fn, paged_attention_fn  # noqa: E402

# the engine's block size and a real head width (the GPU's dots want tiles of >= 16 keys: 16-token pages)
for dtype, (bias, norm), splits in itertools.product((jnp.bfloat16, jnp.float32), ((True, False), (False, True)),
                                                    (None, 1)):
        cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(bias, norm, block_size=16, head_dim=128)
        stacks = {k: v.astype(dtype) for k, v in stacks.items()}
        qkv, k_pool, v_pool = qkv.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype)
        lp = LayerWeights(stacks, 1)
        q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
        kv = write_kv({"k": k_pool, "v": v_pool}, 1, batch, k, v)
        want = paged_attention_fn(q, kv["k"], kv["v"], 1, batch, bs)
        out, k_new, v_new = fused_attention_fn(cfg, lp, qkv, k_pool, v_pool, 1, batch, bs, splits)
        d = np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32))
        dk = np.abs(np.asarray(k_new, np.float32) - np.asarray(kv["k"], np.float32))
        print(f"{jnp.dtype(dtype).name} bias={bias} qk_norm={norm} splits={splits or 'auto'}: "
              f"output max |diff| {d.max():.3g} (mean "
              f"{d.mean():.3g}, output mean |x| {np.abs(np.asarray(want, np.float32)).mean():.3g}); k pool max |diff| "
              f"{dk.max():.3g}, {int((dk > 0).sum())} entries differ; v pool equal: "
              f"{bool(np.array_equal(np.asarray(v_new), np.asarray(kv['v'])))}", flush=True)
