"""HF-named tensors into the declared params (`jaxspec.nn`'s schemas).

Every loader (GGUF, safetensors directory, EAGLE heads) ends here: it supplies `get_tensor(hf_name) ->
np.ndarray`; this module reads, for every declared weight, the HF tensors it is made of, assembles them into
the declared layout (q/k/v grouped by kv head, gate/up interleaved), checks the declared shape, casts, and
stacks the layers of each kind.
"""
from __future__ import annotations

from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jaxspec.models import families
from jaxspec.models.errors import CorruptModelFileError
from jaxspec.models.families.tensors import TOP_TENSORS as STANDARD_TOP_TENSORS
from jaxspec.models.families.tensors import Combine, TensorRule, plus_one  # noqa: F401 (plus_one: public here)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}

# The HF names of the top-level weights as most families store them (a config's own: `top_rule`).
TOP_TENSORS = {key: rule.sources[0] for key, rule in STANDARD_TOP_TENSORS.items()}


def top_rule(config, key: str) -> TensorRule:
    """How the top-level weight `key` (embed, final_norm, lm_head) of a model of this config is read."""
    return families.TOP_TENSORS[config.arch][key]


def layer_rule(config, kind: str, name: str) -> TensorRule:
    """How the declared weight `name` of a layer of `kind` is read for this config: as its architecture's families
    declare it, or where none of them has layers of that kind (a GGUF of another architecture read as Llama layers),
    as the families that have them do (`HF_LAYER_TENSORS`)."""
    tables = families.LAYER_TENSORS.get(config.arch, {})
    return tables[kind][name] if kind in tables else HF_LAYER_TENSORS[kind][name]


def _rules_by_kind() -> dict[str, dict[str, TensorRule]]:
    """Each layer kind's rules, whatever the architecture (`HF_LAYER_TENSORS`): a weight whose rule differs between
    architectures (Qwen3-Next's and Qwen3.5's linear-attention input) gets `_rule_by_architecture`."""
    rules: dict[str, dict[str, dict[str, TensorRule]]] = {}
    for arch, tables in families.LAYER_TENSORS.items():
        for kind, table in tables.items():
            for name, rule in table.items():
                rules.setdefault(kind, {}).setdefault(name, {})[arch] = rule
    by_kind: dict[str, dict[str, TensorRule]] = {}
    for kind, names in rules.items():
        by_kind[kind] = {}
        for name, by_arch in names.items():
            distinct = list(dict.fromkeys(by_arch.values()))
            by_kind[kind][name] = distinct[0] if len(distinct) == 1 else _rule_by_architecture(kind, name, distinct)
    return by_kind


def _rule_by_architecture(kind: str, name: str, rules: list[TensorRule]) -> TensorRule:
    """A rule for weight `name` of `kind` that reads the config's architecture's own (one of `rules`); its combine
    is `by_rows` where all of theirs are."""
    def own(c) -> TensorRule:
        return families.LAYER_TENSORS[c.arch][kind][name]

    def names(c):
        return own(c).names(c)

    def assemble(c, *parts):
        return combine_parts(own(c).combine, list(parts), c)
    return TensorRule(names, Combine(assemble, all(r.combine is None or r.combine.by_rows for r in rules)))


# For each layer kind: declared weight -> (the HF tensors inside a layer it is made of, how they combine), as the
# families declare them (jaxspec.models.families); readers with a config use `layer_rule`.
HF_LAYER_TENSORS: dict[str, dict[str, TensorRule]] = _rules_by_kind()
# Combines that only order, group and concatenate their tensors' rows (the last axis carried along): a per-row
# array of each tensor (an FP8 checkpoint's scales, jaxspec.models.fp8_checkpoint) combines into the weight's rows.
ROW_COMBINES = {None} | {rule.combine for tables in (*families.LAYER_TENSORS.values(), HF_LAYER_TENSORS)
                         for table in tables.values() for rule in table.values()
                         if rule.combine is not None and rule.combine.by_rows}


def layer_sources(kind: str, name: str, config) -> tuple[str, ...]:
    return layer_rule(config, kind, name).names(config)


def resolve_dtype(dtype) -> str:
    """'bfloat16' or 'float32' from a name ('bf16', 'fp32' too; 'auto': bfloat16 on a GPU, float32 elsewhere) or a
    numpy/jax dtype; ValueError otherwise."""
    if dtype == "auto":
        import jax
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: 'auto', 'bfloat16', 'float32' (or jnp.bfloat16, "
                         "jnp.float32)")
    return name


def _read(get_tensor: Callable[[str], np.ndarray], name: str) -> np.ndarray:
    try:
        return np.asarray(get_tensor(name))
    except KeyError:
        raise CorruptModelFileError(f"the checkpoint has no tensor {name!r} (needed for this model config)") from None


def read_layer_weight(get_tensor, kind: str, name: str, prefix: str, config, shape, np_dtype,
                      optional: bool = False) -> np.ndarray | None:
    """One declared weight of one layer (HF names under `prefix`), assembled, shape-checked against the
    declaration and cast. `optional`: None when its HF tensors are absent (EAGLE-1's first layer norm)."""
    combine = layer_rule(config, kind, name).combine
    names = [prefix + s for s in layer_sources(kind, name, config)]
    if optional and not all(_has(get_tensor, n) for n in names):
        return None
    parts = [_read(get_tensor, n) for n in names]
    value = combine_parts(combine, parts, config)
    if tuple(value.shape) != tuple(shape):
        shown = ", ".join(f"{n} {tuple(p.shape)}" for n, p in list(zip(names, parts))[:4])
        raise CorruptModelFileError(f"{shown}: give {name} of shape {tuple(value.shape)}; the config implies "
                                    f"{tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def combine_parts(combine: Combine | None, parts: list, config) -> np.ndarray:
    """The HF tensors of one declared weight combined as its rule says (None: the one tensor as it is)."""
    return combine(config, *parts) if combine else parts[0]


def read_layer_weights(get_tensor, kind: str, prefix: str, config, specs: dict, np_dtype) -> dict:
    """One layer's declared weights ({name: array}, `specs` the kind's stacked Specs), each as `read_layer_weight`
    reads it, in its declared dtype (np_dtype where it declares none)."""
    return {name: read_layer_weight(get_tensor, kind, name, prefix, config, spec.shape[1:],
                                    declared_dtype(spec, np_dtype))
            for name, spec in specs.items()}


def declared_dtype(spec, np_dtype):
    """The dtype a weight is declared in (Gemma 3's float32 norms), or the model's, np_dtype."""
    return np_dtype if spec.dtype is None else np.dtype(spec.dtype)


def _has(get_tensor, name: str) -> bool:
    try:
        get_tensor(name)
        return True
    except KeyError:
        return False


def read_top_weight(get_tensor, hf_name: str, shape, np_dtype) -> np.ndarray:
    value = _read(get_tensor, hf_name)
    if tuple(value.shape) != tuple(shape):
        raise CorruptModelFileError(f"tensor {hf_name!r} has shape {tuple(value.shape)}; the config implies {tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def hf_tensor_names(config) -> list[str]:
    """The HF tensor names `params_from_hf_tensors` reads for this config, in reading order."""
    from jaxspec.nn.decoder import Decoder
    decoder = Decoder(config)
    schema = decoder.param_schema()
    names = list(top_rule(config, "embed").names(config))
    for i, kind in enumerate(decoder.layer_types):
        for name in schema["layers"][kind]:
            names += [f"model.layers.{i}.{s}" for s in layer_sources(kind, name, config)]
    names += top_rule(config, "final_norm").names(config)
    if "lm_head" in schema:
        names += top_rule(config, "lm_head").names(config)
    return names


def params_from_hf_tensors(config, get_tensor: Callable[[str], np.ndarray], dtype="float32",
                           read_layer: Callable = read_layer_weights, quantization: str | None = None) -> dict:
    """The declared params (jnp arrays in `dtype`) from tensors fetched one at a time by HF name.

    Tensors are converted one by one into host buffers (allocated from the first layer of each kind), so peak
    host memory is about the model in `dtype` plus one layer's source tensors. A missing tensor or a shape that
    does not match `config` raises `CorruptModelFileError` naming the tensor. `read_layer` reads one layer's
    weights (`read_layer_weights`' signature) against the schema of `quantization` (None: the model's dtype); a
    checkpoint stored in FP8 passes its own (jaxspec.models.fp8_checkpoint), which keeps its e4m3 values.
    """
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.ops import Ops
    np_dtype = DTYPES[resolve_dtype(dtype)]
    decoder = Decoder(config, Ops(quantization=quantization))
    schema = decoder.param_schema()
    params: dict = {"layers": {}}
    for key in ("embed", "final_norm", "lm_head"):
        if key in schema:
            dtype_of_key = declared_dtype(schema[key], np_dtype)
            rule = top_rule(config, key)
            (hf_name,) = rule.names(config)
            value = read_top_weight(get_tensor, hf_name, schema[key].shape, dtype_of_key)
            if rule.combine is not None:   # (a zero-centred final norm: the hybrids', Gemma 3's in float32)
                value = rule.combine(config, value).astype(dtype_of_key)
            params[key] = jax.device_put(value)
    index_in_kind: dict[str, int] = {}
    counts = {kind: decoder.layer_types.count(kind) for kind in decoder.kinds}
    stacked: dict = {kind: {} for kind in schema["layers"]}
    for i, kind in enumerate(decoder.layer_types):
        j = index_in_kind.get(kind, 0)
        index_in_kind[kind] = j + 1
        prefix = f"model.layers.{i}."
        for name, value in read_layer(get_tensor, kind, prefix, config, schema["layers"][kind], np_dtype).items():
            if name not in stacked[kind]:
                stacked[kind][name] = np.empty((counts[kind], *value.shape), value.dtype)
            buf = stacked[kind][name]
            if buf.shape[1:] != value.shape or buf.dtype != value.dtype:
                raise CorruptModelFileError(f"{prefix}: {name} is {value.dtype}{list(value.shape)}, where the first "
                                            f"layer of its kind gave {buf.dtype}{list(buf.shape[1:])}")
            buf[j] = value
    for kind, bufs in stacked.items():   # to the device weight kind by weight kind, dropping each host buffer
        params["layers"][kind] = {name: jax.device_put(bufs.pop(name)) for name in list(bufs)}
    return params
