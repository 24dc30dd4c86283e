"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) read into the layout of the base model's
declared weights.

A LoRA module adds `scaling * B @ A @ x` to a projection `W @ x` (A [r, in], B [out, r]; scaling lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora). jaxspec fuses some HF projections into one weight (q/k/v into `qkv_proj`, its
rows grouped per kv head; gate/up into `gate_up_proj` [F, 2, D]), so an adapter's modules are fused the same way: for
a weight made of n HF tensors, A is their A's stacked [n*r, in] and B is each module's B placed in its own r columns
[out_i, n*r] and combined by the weight's own `TensorRule` (the combine orders rows and carries columns along), so
`B_fused @ A_fused` is each module's `B @ A` in the weight's rows. A module the adapter does not target is zeros. The
scaling is folded into B. Every layer's A and B are stacked per layer kind like the weights: `{kind: {name: (A [n,
R, in], B [n, out..., R])}}`, R = n*max_rank (ranks below max_rank padded with zeros).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from jaxspec.models import families

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json fields that change what the adapter computes and that this reader does not implement, with the
# value that means "not used".
UNSUPPORTED_FIELDS = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
                      "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None, "target_parameters": None,
                      "lora_bias": False, "use_qalora": False, "trainable_token_indices": None}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served over this base model (what is wrong and what would be valid)."""


def read_adapter_config(path: str | os.PathLike) -> dict:
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r} has no {ADAPTER_CONFIG}: a PEFT adapter directory (as "
                           "save_pretrained writes it) holds adapter_config.json and adapter_model.safetensors")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {str(path)!r} is peft_type={cfg['peft_type']!r}; only LORA adapters are served")
    for field, neutral in UNSUPPORTED_FIELDS.items():
        value = cfg.get(field, neutral)
        if value not in (neutral, None) and not (isinstance(neutral, (dict, list)) and not value):
            raise AdapterError(f"adapter {str(path)!r} sets {field}={value!r}, which jaxspec does not implement; "
                               f"adapters with {field}={neutral!r} are served")
    return cfg


def adapter_scaling(cfg: dict) -> float:
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def lora_shapes(model_config, max_rank: int) -> dict[str, dict[str, tuple[tuple, tuple, int]]]:
    """{kind: {weight name: (A's shape [n_layers, R, in], B's shape [n_layers, out..., R], HF modules fused)}} for
    every declared weight of the base model that LoRA can target (a plain projection of the layer, made of HF
    `...proj.weight` tensors by a row-wise combine)."""
    from jaxspec.nn.decoder import Decoder
    schema = Decoder(model_config).param_schema()["layers"]
    out = {}
    for kind, rules in families.LAYER_TENSORS[model_config.arch].items():
        if kind not in schema:
            continue
        for name, rule in rules.items():
            spec = schema[kind].get(name)
            names = rule.names(model_config)
            if (spec is None or not all(n.endswith("proj.weight") for n in names) or len(spec.shape) < 3
                    or (rule.combine is not None and not rule.combine.by_rows)):
                continue
            n, rank = len(names), len(names) * max_rank
            layers, rows, cols = spec.shape[0], spec.shape[1:-1], spec.shape[-1]
            out.setdefault(kind, {})[name] = ((layers, rank, cols), (layers, *rows, rank), n)
    return out


def _modules(model_config) -> dict[str, tuple[str, str, int]]:
    """HF module path inside a layer ("self_attn.q_proj") -> (layer kind, weight name, its place among the weight's
    HF tensors)."""
    out = {}
    for kind, rules in families.LAYER_TENSORS[model_config.arch].items():
        for name, rule in rules.items():
            for i, tensor in enumerate(rule.names(model_config)):
                out[tensor.removesuffix(".weight")] = (kind, name, i)
    return out


def load_adapter(path: str | os.PathLike, model_config, max_rank: int) -> dict:
    """The adapter at `path` as float32 arrays in the base model's layout (module docstring); AdapterError (naming
    the adapter and the fault) for a rank above `max_rank`, a module the base model has no weight for, or shapes
    that do not match the base model."""
    from jaxspec.models.hf_loader import read_tensor_file   # (a file format: only where an adapter is read)
    cfg = read_adapter_config(path)
    r = int(cfg["r"])
    if not 0 < r <= max_rank:
        raise AdapterError(f"adapter {str(path)!r} has rank r={r}, above max_lora_rank={max_rank}; raise "
                           f"max_lora_rank to at least {r}")
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise AdapterError(f"adapter {str(path)!r} has no {ADAPTER_WEIGHTS} (a .bin adapter is not read: "
                           "save it with safe_serialization=True)")
    shapes, modules = lora_shapes(model_config, max_rank), _modules(model_config)
    layers_of_kind = _layer_numbers(model_config)
    scaling = adapter_scaling(cfg)
    parts: dict[tuple, dict[str, np.ndarray]] = {}   # (kind, name, layer in kind, place) -> {"A": .., "B": ..}
    for key, value in read_tensor_file(file).items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {str(path)!r} holds tensor {key!r}, which is no LoRA A/B of a decoder layer "
                               "projection; adapters of the embedding, the LM head or other modules are not served")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        target = modules.get(module)
        if target is None or target[0] not in shapes or target[1] not in shapes[target[0]]:
            valid = sorted(mod for mod, (k, n, _) in modules.items() if n in shapes.get(k, {}))
            raise AdapterError(f"adapter {str(path)!r} targets module {module!r}, which this base model has no "
                               f"LoRA-able weight for; valid: {', '.join(valid)}")
        kind, name, place = target
        if layer >= model_config.num_layers or layers_of_kind[layer][0] != kind:
            raise AdapterError(f"adapter {str(path)!r} has tensor {key!r} for layer {layer}, which is not a "
                               f"{kind!r} layer of this {model_config.num_layers}-layer base model")
        parts.setdefault((kind, name, layers_of_kind[layer][1], place), {})[ab] = np.asarray(value, np.float32)
    rules = families.LAYER_TENSORS[model_config.arch]
    out = {kind: {name: [np.zeros(a, np.float32), np.zeros(b, np.float32)] for name, (a, b, _) in names.items()}
           for kind, names in shapes.items()}
    for (kind, name, index, place), ab in parts.items():
        a_shape, b_shape, n = shapes[kind][name]
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {str(path)!r}: weight {name!r} of layer {index} has lora_{''.join(ab)} "
                               "alone; a LoRA module needs both A and B")
        A, B = ab["A"], ab["B"]
        tensors = rules[kind][name].names(model_config)
        if A.shape != (r, a_shape[-1]) or B.shape[1] != r:
            raise AdapterError(f"adapter {str(path)!r}: {tensors[place]} of layer {index} has A {A.shape} and B "
                               f"{B.shape}; this base model needs A ({r}, {a_shape[-1]}) and B (out, {r})")
        out[kind][name][0][index, place * max_rank:place * max_rank + r] = A
        out[kind][name][1][index] += _place_b(model_config, rules[kind][name], B * scaling, place, n, max_rank,
                                              b_shape[1:], path, tensors[place], index)
    return {kind: {name: (a, b) for name, (a, b) in names.items()} for kind, names in out.items()}


def _place_b(model_config, rule, B, place: int, n: int, max_rank: int, shape: tuple, path, tensor: str, layer: int):
    """B [out_i, r] of the weight's `place`-th HF tensor in its columns of [out..., n*max_rank], the others zero (the
    weight's combine orders their rows)."""
    counts = [B.shape[0]] if rule.combine is None else _row_counts(model_config, rule)
    if B.shape[0] != counts[place]:
        raise AdapterError(f"adapter {str(path)!r}: {tensor} of layer {layer} has B with {B.shape[0]} rows; this "
                           f"base model's has {counts[place]}")
    wide = [np.zeros((c, n * max_rank), np.float32) for c in counts]   # the other tensors' rows: zeros
    wide[place][:, place * max_rank:place * max_rank + B.shape[1]] = B
    fused = wide[0] if rule.combine is None else rule.combine(model_config, *wide)
    if fused.shape != shape:
        raise AdapterError(f"adapter {str(path)!r}: {tensor} of layer {layer} gives B of shape {fused.shape[:-1]} "
                           f"rows; this base model's weight has {shape[:-1]}")
    return fused


def _row_counts(model_config, rule) -> list[int]:
    """The rows of each HF tensor a row-wise combine fuses, found by combining row-index columns."""
    c = model_config
    per_tensor = {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
                  "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": c.intermediate_size,
                  "up_proj": c.intermediate_size}
    counts = []
    for tensor in rule.names(c):
        module = tensor.removesuffix(".weight").rsplit(".", 1)[-1]
        if module not in per_tensor:
            raise AdapterError(f"LoRA on the fused weight of {tensor!r} is not implemented")
        counts.append(per_tensor[module])
    return counts


def _layer_numbers(model_config) -> list[tuple[str, int]]:
    """Each global layer's (kind, index among its kind's stacked weights)."""
    types = model_config.layer_types or ("attention",) * model_config.num_layers
    seen: dict[str, int] = {}
    out = []
    for kind in types:
        out.append((kind, seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return out


def write_random_adapter(model_config, path: str | os.PathLike, rank: int, seed: int = 0, alpha: float | None = None,
                         scale: float = 0.02) -> Path:
    """A PEFT LoRA adapter of random A and B (normal, std `scale`) on every projection LoRA can target, for this base
    model's shapes, written at `path` as peft's save_pretrained lays it out: benchmarks over random weights have no
    adapters to download."""
    from safetensors.numpy import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    modules, tensors = set(), {}
    rules = families.LAYER_TENSORS[model_config.arch]
    shapes = lora_shapes(model_config, rank)
    for layer, (kind, _) in enumerate(_layer_numbers(model_config)):
        for name, (a_shape, b_shape, n) in shapes.get(kind, {}).items():
            rule = rules[kind][name]
            counts = [b_shape[1]] if rule.combine is None else _row_counts(model_config, rule)
            for tensor, rows in zip(rule.names(model_config), counts):
                module = tensor.removesuffix(".weight")
                modules.add(module.rsplit(".", 1)[-1])
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[key + ".lora_A.weight"] = (scale * rng.standard_normal((rank, a_shape[-1]))).astype(np.float32)
                tensors[key + ".lora_B.weight"] = (scale * rng.standard_normal((rows, rank))).astype(np.float32)
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or rank, "target_modules": sorted(modules),
              "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return path
