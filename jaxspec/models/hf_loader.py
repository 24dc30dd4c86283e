"""Load a HF transformers checkpoint directory (config.json + safetensors) into a `Model`."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxspec.models import families
from jaxspec.models.config import ModelConfig, is_mxfp4
from jaxspec.models.dequant import dequantize_mxfp4
from jaxspec.models.errors import CorruptModelFileError, UnsupportedModelError
from jaxspec.models.fp8_checkpoint import checkpoint_format, load_fp8_params, quantization_config_of
from jaxspec.models.model import Model
from jaxspec.models.weights import hf_tensor_names, params_from_hf_tensors, resolve_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn}
_NOT_IN_NUMPY = ("BF16", "F8_E4M3")   # dtypes safetensors' numpy backend cannot give
# Layer tensors that change the output when present: a bias, attention sinks (GPT-OSS), a norm. One of these that
# the config's model does not read is refused (`refuse_unread_tensors`) rather than dropped.
_LAYER_TENSOR = re.compile(r"(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\.(.+)")
_MUST_BE_READ = re.compile(r".*(\.bias|sinks|norm\.weight)")


def read_hf_json(path: str | os.PathLike) -> dict:
    """`path/config.json` as a dict; FileNotFoundError if absent, CorruptModelFileError if not JSON."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r} (a HF model directory needs one)")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelFileError(f"{str(config_path)!r} is not valid JSON: {e}") from e


def read_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from `path/config.json`; FileNotFoundError if absent, ValueError if invalid or incomplete."""
    hf = read_hf_json(path)
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise type(e)(f"{Path(path) / 'config.json'}: {e}") from e


class SafetensorsDir:
    """Lazy tensor access by name across the safetensors file(s) of a HF directory (single or sharded)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: path / shard for name, shard in weight_map.items()}
        elif single.is_file():
            self.file_of = None
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {str(path)!r}")
        self._handles: dict[Path, object] = {}
        if self.file_of is None:
            self.file_of = {name: single for name in self._open(single).keys()}
        for shard in set(self.file_of.values()):
            if not shard.is_file():
                raise FileNotFoundError(f"safetensors shard {str(shard)!r} listed in the index is missing")

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except Exception as e:
                raise CorruptModelFileError(f"cannot read safetensors file {str(file)!r}: {e}") from e
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as a numpy array (bf16 as ml_dtypes.bfloat16); KeyError if absent. A float8 tensor is
        refused: its values need their scales (`get_raw`, jaxspec.models.fp8_checkpoint)."""
        value = self.get_raw(name)
        if value.dtype == ml_dtypes.float8_e4m3fn:
            raise CorruptModelFileError(f"tensor {name!r} is stored in float8_e4m3fn, which this loader does not "
                                        "read (FP8 checkpoints load their layers' weights with their scales)")
        return value

    def get_raw(self, name: str) -> np.ndarray:
        """The tensor `name` as stored (bf16 as ml_dtypes.bfloat16, float8 e4m3 as ml_dtypes.float8_e4m3fn);
        KeyError if absent."""
        file = self.file_of[name]
        handle = self._open(file)
        if handle.get_slice(name).get_dtype() in _NOT_IN_NUMPY:
            return _read_raw(file, name)
        return handle.get_tensor(name)


def _read_raw(file: Path, name: str) -> np.ndarray:
    """Read one tensor straight from the safetensors layout: u64 header size, JSON header, raw data."""
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_size + start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise CorruptModelFileError(f"safetensors file {str(file)!r} is truncated in tensor {name!r}")
    return np.frombuffer(data, _RAW_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_tensor_file(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, as stored (bf16 as ml_dtypes.bfloat16)."""
    file = Path(file)
    try:
        handle = safe_open(str(file), framework="numpy")
    except Exception as e:
        raise CorruptModelFileError(f"cannot read safetensors file {str(file)!r}: {e}") from e
    return {name: _read_raw(file, name) if handle.get_slice(name).get_dtype() in _NOT_IN_NUMPY
            else handle.get_tensor(name) for name in handle.keys()}


def refuse_unread_tensors(config: ModelConfig, names) -> None:
    """UnsupportedModelError naming the first layer tensor among `names` (a bias, attention sinks, a norm) that
    jaxspec's model for `config` would not read: e.g. Llama q/k/v/o biases (its config lacking attention_bias), an
    o_proj bias, GPT-OSS's self_attn.sinks. Loading without it would run another model."""
    read = set(hf_tensor_names(config))
    used = {m.group(2) for m in map(_LAYER_TENSOR.fullmatch, read) if m and _MUST_BE_READ.fullmatch(m.group(2))}
    for name in sorted(names):
        m = _LAYER_TENSOR.fullmatch(name)
        if m and _MUST_BE_READ.fullmatch(m.group(2)) and f"model.layers.{m.group(1)}.{m.group(2)}" not in read:
            raise UnsupportedModelError(
                f"the checkpoint has tensor {name!r}, which jaxspec's {config.arch} model for this config does not "
                f"use (it would be ignored); supported: a layer's biases and norms among "
                f"{', '.join(sorted(used)) or 'none'}")


def text_model_tensors(tensors: SafetensorsDir, get_tensor):
    """`get_tensor` by the text model's HF names: as it is, or for a vision-language checkpoint (`tensors` has its
    text model's embedding where a family keeps it, jaxspec.models.families.TEXT_MODEL_PREFIXES; its vision tower is
    not read) reading each name under that prefix."""
    renames = next((r for embed, r in families.TEXT_MODEL_PREFIXES.items() if embed in tensors), None)
    if renames is None:
        return get_tensor

    def get_text_tensor(name):
        for plain, stored in renames:
            if name.startswith(plain):
                return get_tensor(stored + name[len(plain):])
        return get_tensor(name)
    return get_text_tensor


def with_mxfp4_dequantized(get_tensor, names, dtype: str):
    """`get_tensor` where a tensor stored in MXFP4 (GPT-OSS's experts: `<name>_blocks` and `<name>_scales` in place of
    `<name>`) comes back dequantized to `dtype`, in the layout transformers gives it."""
    def get(name: str):
        if name not in names and name + "_blocks" in names:
            return dequantize_mxfp4(get_tensor(name + "_blocks"), get_tensor(name + "_scales"), dtype, name)
        return get_tensor(name)
    return get


def load_tokenizer_dir(path: str | os.PathLike):
    """A jaxspec Tokenizer from the tokenizer files in `path`, or None when there are none."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    from jaxspec.models.tokenizer import Tokenizer
    return Tokenizer(AutoTokenizer.from_pretrained(str(path)))


def load_hf_dir(path: str | os.PathLike, dtype="bfloat16") -> Model:
    """Load a HF directory of a model_type jaxspec.models.families reads: config.json, safetensors weights, tokenizer
    if present (a vision-language checkpoint: its text model alone, `text_model_tensors`; GPT-OSS's MXFP4 experts
    dequantized to `dtype`). A checkpoint stored in FP8
    (jaxspec.models.fp8_checkpoint) keeps its e4m3 weights: the Model comes back
    with quantization="fp8" and its format in quantization_detail."""
    dtype = resolve_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"HF model directory not found: {str(path)!r}")
    config = read_config(path)
    quantized = quantization_config_of(read_hf_json(path))   # checked by read_config: an FP8 format, or MXFP4
    tensors = SafetensorsDir(path)
    refuse_unread_tensors(config, tensors.file_of)
    get_tensor = tensors.get_raw if quantized else tensors.get_tensor
    if is_mxfp4(quantized):   # GPT-OSS's experts: dequantized on load, the model then loads as an unquantized one
        quantized, get_tensor = None, with_mxfp4_dequantized(tensors.get_tensor, tensors.file_of, dtype)
    get_tensor = text_model_tensors(tensors, get_tensor)
    quantization = detail = None
    if quantized:   # stored in FP8: its e4m3 weights kept as they are (the engine runs it as quantization="fp8")
        params, detail = load_fp8_params(config, get_tensor, checkpoint_format(quantized), dtype)
        quantization = "fp8"
    else:
        params = params_from_hf_tensors(config, get_tensor, dtype)
    tokenizer = load_tokenizer_dir(path)
    if tokenizer is not None:
        eos_ids = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
        config = dataclasses.replace(config, eos_token_ids=eos_ids)
    return Model(config=config, params=params, tokenizer=tokenizer, name=path.name, dtype=dtype, source=str(path),
                 quantization=quantization, quantization_detail=detail)
