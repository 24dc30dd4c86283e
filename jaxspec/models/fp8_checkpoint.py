"""Checkpoints stored in FP8, loaded as they are (as vLLM loads them): no bf16 copy needed, no second rounding.

Two formats, named by config.json's `quantization_config`:

    "compressed-tensors"  (RedHatAI "FP8-dynamic" and "FP8-block" models, llm-compressor): `X.weight` e4m3 [N, K]
                          and `X.weight_scale`: [N, 1] or [N] (weights strategy "channel"), one value ("tensor"),
                          or [ceil(N/bn), ceil(K/bk)] ("block", block_structure [bn, bk]).
    "fp8"                 (Qwen3-FP8, DeepSeek-V3; transformers' finegrained FP8): `X.weight` e4m3 [N, K] and
                          `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (weight_block_size [bn, bk]; none: one value).

In both the weight is `X.weight * scale`, the scale repeated over its block (`weight_scale_inv` is multiplied too,
whatever its name says: transformers' finegrained_fp8 and vLLM do). Scales may be stored in f32, bf16 or f16.

What the params hold (jaxspec.nn.quant): the layers' projections (quant.QUANTIZED) keep their e4m3 values; their
scales become quant's per-channel `name_scale` f32[..., N] (a tensor's one value repeated on its rows), or, for block
scales, f32[..., N, ceil(K/128)] expanded over rows (quant.FP8_BLOCK_K), so that q/k/v and gate/up fuse by
concatenating rows and scales alike wherever the checkpoint's row blocks end. A part of a fused projection that the
checkpoint keeps unquantized (Qwen3.5's in_proj_a/b beside its e4m3 in_proj_qkv/z, a module in `ignore`) is
quantized per row, as the engine quantizes a bf16 checkpoint (`Fp8Tensors.requantized` names them). Every other e4m3
tensor (MoE experts, an lm_head the checkpoint did quantize) is dequantized to the model's dtype.

Activations are the engine's choice (W8A16, or W8A8 with e4m3 activations per token: jaxspec.nn.ops), computed at
run time: a checkpoint's dynamic activation scheme is that already. Static activation scales (`input_scale` per
layer) and any other scheme are refused by name, never misread.
"""
from __future__ import annotations

import dataclasses
import math
import re

import ml_dtypes
import numpy as np

from jaxspec.models.errors import CorruptModelFileError

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_BLOCK_K = 128   # = jaxspec.nn.quant.FP8_BLOCK_K (not imported: this module is read without JAX)
SCALE = "_scale"    # = jaxspec.nn.quant.SCALE
METHODS = ("compressed-tensors", "fp8")
SUPPORTED = ("'compressed-tensors' (float8 e4m3 weights with channel, tensor or block scales, dynamic or no "
             "activation quantization) and 'fp8' (e4m3 weights, weight_block_size [bn, bk] with bk a multiple of "
             f"{FP8_BLOCK_K}, activation_scheme 'dynamic')")
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint stores its FP8 weights."""
    method: str                      # "compressed-tensors" or "fp8"
    scale_suffix: str                # the scale of `X.weight` is `X.weight` + this
    block: tuple[int, int] | None    # (rows, columns) of one scale's block; None: per channel or per tensor

    def describe(self) -> str:
        layout = (f"one scale per {self.block[0]}x{self.block[1]} block (kept as f32[N, K/{FP8_BLOCK_K}], expanded "
                  "over rows)" if self.block else "one float32 scale per output channel (a tensor's repeated)")
        return f"float8_e4m3fn from the checkpoint ({self.method}), {layout}"


def quantization_config_of(hf: dict):
    """config.json's quantization_config (a vision-language checkpoint's may sit in its text_config), or None."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    return hf.get("quantization_config") or text.get("quantization_config") or None


def checkpoint_format(qc) -> Fp8Format:
    """quantization_config -> the FP8 format it describes; a ValueError naming the field, its value and what is
    supported for anything else."""
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method == "fp8":
        return _finegrained_format(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    scheme = _scheme(qc) if isinstance(qc, dict) else f"quantization_config={qc!r}"
    raise ValueError(f"{scheme} is not supported; supported: {SUPPORTED}. Or load the model's bf16 checkpoint with "
                     "quantization='fp8' (--quantization fp8)")


def _scheme(qc: dict) -> str:
    detail = qc.get("format") or qc.get("fmt")
    return f"quantization_config quant_method={qc.get('quant_method')!r}{f' ({detail})' if detail else ''}"


def _refuse(qc: dict, field: str, value, supported: str):
    raise ValueError(f"{_scheme(qc)}: {field}={value!r} is not supported; supported: {supported}")


def _block(qc: dict, field: str, value) -> tuple[int, int]:
    """A [rows, columns] block size; columns a multiple of FP8_BLOCK_K (the matmul's scale granularity along K)."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
          and value[1] % FP8_BLOCK_K == 0)
    if not ok:
        _refuse(qc, field, value, f"[rows, columns] with columns a multiple of {FP8_BLOCK_K}, e.g. [128, 128]")
    return int(value[0]), int(value[1])


def _finegrained_format(qc: dict) -> Fp8Format:
    if qc.get("fmt", "e4m3") != "e4m3":
        _refuse(qc, "fmt", qc["fmt"], "'e4m3'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        _refuse(qc, "activation_scheme", qc["activation_scheme"], "'dynamic' (static input scales are not read)")
    block = qc.get("weight_block_size")
    return Fp8Format("fp8", "_scale_inv", None if block is None else _block(qc, "weight_block_size", block))


def _compressed_tensors_format(qc: dict) -> Fp8Format:
    for field, ok in (("format", (None, "float-quantized")), ("quantization_status", (None, "compressed"))):
        if qc.get(field) not in ok:
            _refuse(qc, field, qc[field], repr(ok[1]))
    for field in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(field):
            _refuse(qc, field, qc[field], "none (null)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse(qc, "config_groups", groups, "a dict of quantization groups")
    blocks = {_group_block(qc, name, group) for name, group in groups.items()}
    if len(blocks) > 1:
        _refuse(qc, "config_groups' block_structure", sorted(blocks, key=str), "one block size for every group")
    return Fp8Format("compressed-tensors", SCALE, blocks.pop())


def _group_block(qc: dict, name: str, group: dict):
    """One config group checked: its block size, or None (channel or tensor scales)."""
    where = f"config_groups.{name}"
    weights = group.get("weights") or {}
    for field, want in (("type", "float"), ("num_bits", 8), ("dynamic", False), ("symmetric", True)):
        if weights.get(field, want) != want:
            _refuse(qc, f"{where}.weights.{field}", weights.get(field), repr(want))
    if weights.get("format") not in (None, "float-quantized"):
        _refuse(qc, f"{where}.weights.format", weights["format"], "'float-quantized'")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        _refuse(qc, f"{where}.weights.strategy", strategy, "'channel', 'tensor', 'block'")
    acts = group.get("input_activations")
    if acts:
        if acts.get("dynamic") is not True:
            _refuse(qc, f"{where}.input_activations.dynamic", acts.get("dynamic"),
                    "True (activations quantized at run time); static input_scale tensors are not read")
        for field, want in (("type", "float"), ("num_bits", 8)):
            if acts.get(field, want) != want:
                _refuse(qc, f"{where}.input_activations.{field}", acts.get(field), repr(want))
    if group.get("output_activations"):
        _refuse(qc, f"{where}.output_activations", group["output_activations"], "none (null)")
    if strategy == "block":
        return _block(qc, f"{where}.weights.block_structure", weights.get("block_structure"))
    return None


def _summary(names) -> list[str]:
    """HF tensor names with their layer and expert numbers dropped, each once
    ('model.layers.*.mlp.experts.*.up_proj.weight')."""
    return sorted({re.sub(r"\.(layers|experts)\.\d+\.", r".\1.*.", n) for n in names})


class Fp8Tensors:
    """A checkpoint's tensors by HF name (`get_raw`: as stored, e4m3 included), read in the format `fmt`: the
    layers' projections as e4m3 values with scales (`read_layer`, `params_from_hf_tensors`' hook), everything else
    dequantized to the model's dtype (`dequantized`, its get_tensor)."""

    def __init__(self, get_raw, fmt: Fp8Format):
        self.get_raw, self.fmt = get_raw, fmt
        self.requantized: set[str] = set()   # parts of quantized projections stored unquantized: quantized per row
        self.dequantized_names: set[str] = set()   # e4m3 tensors kept in the model's dtype
        self.rescaled: set[str] = set()   # e4m3 tensors dequantized and quantized again per output channel

    def scale(self, name: str) -> np.ndarray:
        """The f32 scale(s) of the e4m3 tensor `name`."""
        scale_name = name + self.fmt.scale_suffix
        try:
            scale = np.asarray(self.get_raw(scale_name))
        except KeyError:
            raise CorruptModelFileError(f"the checkpoint has no {scale_name!r}, the scale of the float8 tensor "
                                        f"{name!r} ({self.fmt.method} format)") from None
        if scale.dtype not in _SCALE_DTYPES:
            raise CorruptModelFileError(f"{scale_name!r} is {scale.dtype}; supported scale dtypes: float32, "
                                        "bfloat16, float16")
        return scale.astype(np.float32)

    def row_scales(self, name: str, shape) -> np.ndarray:
        """f32[..., N, Kb] scales of the e4m3 tensor `name` [..., N, K], one per row and per FP8_BLOCK_K columns
        (Kb = ceil(K / FP8_BLOCK_K)), or per row only (Kb = 1) for channel and tensor scales."""
        scale = self.scale(name)
        *lead, n, k = shape
        scale_name = name + self.fmt.scale_suffix
        if self.fmt.block is None:
            if scale.size == 1:
                return np.full((*lead, n, 1), scale.reshape(()), np.float32)
            if scale.size == math.prod(lead) * n and scale.shape[len(lead)] == n:
                return scale.reshape(*lead, n, 1)
            raise CorruptModelFileError(f"{scale_name!r} has shape {list(scale.shape)}; {name!r} {list(shape)} "
                                        f"needs one scale per row ([{n}] or [{n}, 1]) or one in all")
        bn, bk = self.fmt.block
        want = (*lead, -(-n // bn), -(-k // bk))
        if scale.shape != want:
            raise CorruptModelFileError(f"{scale_name!r} has shape {list(scale.shape)}; {name!r} {list(shape)} in "
                                        f"{bn}x{bk} blocks needs {list(want)}")
        rows = np.repeat(scale, bn, axis=-2)[..., :n, :]
        return np.repeat(rows, bk // FP8_BLOCK_K, axis=-1)[..., :-(-k // FP8_BLOCK_K)]

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor `name` as its values: an e4m3 one times its scales (float32), any other as stored."""
        value = np.asarray(self.get_raw(name))
        if value.dtype != E4M3:
            return value
        self.dequantized_names.add(name)
        rows = self.row_scales(name, value.shape)
        k = value.shape[-1]
        expanded = rows if rows.shape[-1] == 1 else np.repeat(rows, FP8_BLOCK_K, axis=-1)[..., :k]
        return value.astype(np.float32) * expanded

    def quantized(self, name: str, k_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 [N, K], f32 scales [N, k_blocks]) of the tensor `name`: its own, or, where the checkpoint keeps it
        unquantized, per row as the engine quantizes a bf16 checkpoint (quant.quantize_fp8)."""
        value = np.asarray(self.get_raw(name))
        if value.dtype == E4M3:
            rows = self.row_scales(name, value.shape)
        else:
            from jaxspec.nn import quant
            self.requantized.add(name)
            q, s = quant.quantize_fp8(value.astype(np.float32))
            value, rows = np.asarray(q), np.asarray(s)[..., None]
        if rows.shape[-1] != k_blocks:
            rows = np.broadcast_to(rows, (*rows.shape[:-1], k_blocks))
        return value, rows

    def read_projection(self, kind: str, name: str, prefix: str, config, shape, scale_shape):
        """One quantized projection (e4m3 `shape`, its scales in quant's layout) assembled from its HF tensors:
        values and row scales through the same combine, so fused rows keep their scales."""
        from jaxspec.models import weights
        combine = weights.HF_LAYER_TENSORS[kind][name][1]
        names = [prefix + s for s in weights.layer_sources(kind, name, config)]
        k_blocks = -(-shape[-1] // FP8_BLOCK_K) if self.fmt.block else 1
        parts = [self.quantized(n, k_blocks) for n in names]
        value = weights.combine_parts(combine, [p[0] for p in parts], config)
        rows = weights.combine_parts(combine, [p[1] for p in parts], config)
        want = (*scale_shape, k_blocks) if self.fmt.block else tuple(scale_shape)
        scale = rows if self.fmt.block else rows[..., 0]
        if tuple(value.shape) != tuple(shape) or tuple(scale.shape) != want:
            shown = ", ".join(f"{n} {list(p[0].shape)}" for n, p in list(zip(names, parts))[:4])
            raise CorruptModelFileError(f"{shown}: give {name} {list(value.shape)} with scales {list(scale.shape)}; "
                                        f"the config implies {list(shape)} with {list(want)}")
        return value, np.ascontiguousarray(scale, np.float32)

    def read_layer(self, get_tensor, kind: str, prefix: str, config, specs: dict, np_dtype) -> dict:
        """One layer's declared weights (`specs`: the kind's stacked Specs of the fp8 schema), `read_layer_weights`'
        signature: projections kept e4m3 with their scales, the rest in np_dtype."""
        from jaxspec.models import weights
        out = {}
        for name, spec in specs.items():
            if name.endswith(SCALE) and name[:-len(SCALE)] in specs:
                continue   # read with its weight
            if name + SCALE not in specs:
                out[name] = weights.read_layer_weight(get_tensor, kind, name, prefix, config, spec.shape[1:],
                                                      weights.declared_dtype(spec, np_dtype))
            elif weights.HF_LAYER_TENSORS[kind][name][1] in weights.ROW_COMBINES:
                out[name], out[name + SCALE] = self.read_projection(kind, name, prefix, config, spec.shape[1:],
                                                                    specs[name + SCALE].shape[1:])
            else:
                out[name], out[name + SCALE] = self.read_rescaled(get_tensor, kind, name, prefix, config, spec)
        return out

    def read_rescaled(self, get_tensor, kind: str, name: str, prefix: str, config, spec):
        """A quantized weight assembled otherwise than by rows (MoE experts [E, K, F, 2] for the grouped matmul,
        which knows per-channel scales only): dequantized, then quantized per output channel as the engine quantizes
        a bf16 checkpoint (quant.quantize_params): rounded twice where its scales were not per channel."""
        from jaxspec.models import weights
        from jaxspec.nn import quant
        before = set(self.dequantized_names)
        value = weights.read_layer_weight(get_tensor, kind, name, prefix, config, spec.shape[1:], np.float32)
        self.rescaled |= self.dequantized_names - before
        self.dequantized_names = before
        q = quant.quantize_params({name: value})
        return np.asarray(q[name]), np.asarray(q[name + SCALE])

    def describe(self) -> str:
        """The format, and what was not taken as stored (for stats()["quantization"])."""
        text = self.fmt.describe()
        if self.requantized:
            text += f"; stored unquantized, quantized per row on load: {', '.join(_summary(self.requantized))}"
        if self.rescaled:
            text += f"; dequantized and quantized per output channel again: {', '.join(_summary(self.rescaled))}"
        if self.dequantized_names:
            text += f"; dequantized to the model's dtype: {', '.join(_summary(self.dequantized_names))}"
        return text


def load_fp8_params(config, get_raw, fmt: Fp8Format, dtype) -> tuple[dict, str]:
    """(params, description) of an FP8 checkpoint (`get_raw`: its tensors by HF name, e4m3 ones as stored): the
    fp8 schema's params (jaxspec.nn.quant), the projections' e4m3 values as stored."""
    from jaxspec.models.weights import params_from_hf_tensors
    tensors = Fp8Tensors(get_raw, fmt)
    params = params_from_hf_tensors(config, tensors.dequantized, dtype, read_layer=tensors.read_layer,
                                    quantization="fp8")
    return params, tensors.describe()
