"""Orbax checkpoints of a params pytree, with the ModelConfig (and optionally the tokenizer) beside it.

Layout of a checkpoint directory:
    jaxspec_config.json   {"config": ModelConfig fields, "dtype": ..., "tokenizer": {...} | null}
    params/               orbax StandardCheckpointer tree
    tokenizer/            transformers tokenizer files (only when saved with a tokenizer)
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.errors import CorruptModelFileError
from jaxspec.models.model import Model
from jaxspec.models.weights import DTYPES, resolve_dtype
from jaxspec.nn import schema
from jaxspec.nn.decoder import Decoder

CONFIG_FILE = "jaxspec_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / PARAMS_DIR).is_dir()


def config_to_dict(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    d["rope_scaling"] = [list(kv) for kv in config.rope_scaling] if config.rope_scaling else None
    d["eos_token_ids"] = list(config.eos_token_ids)
    if config.layer_types is not None:
        d["layer_types"] = list(config.layer_types)
    return d


def config_from_dict(d: dict) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CorruptModelFileError(f"{CONFIG_FILE} has unknown ModelConfig field(s): {', '.join(unknown)}")
    d = dict(d)
    if d.get("rope_scaling"):
        d["rope_scaling"] = tuple((k, v) for k, v in d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    try:
        return ModelConfig(**d)
    except TypeError as e:  # a missing required field
        raise CorruptModelFileError(f"{CONFIG_FILE} is incomplete: {e}") from e


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def save_params(path: str | os.PathLike, params: dict, config: ModelConfig, tokenizer=None,
                overwrite: bool = False) -> Path:
    """Save `params` with orbax under `path/params` and the config as JSON beside it; returns `path`."""
    path = Path(path).absolute()
    if (path / PARAMS_DIR).exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} already holds a checkpoint; pass overwrite=True to replace it")
    path.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(jax.tree.leaves(params)[0].dtype)
    checkpointer = _checkpointer()
    checkpointer.save(path / PARAMS_DIR, params, force=overwrite)
    checkpointer.wait_until_finished()
    tok_meta = None
    if tokenizer is not None:
        tokenizer.hf.save_pretrained(str(path / TOKENIZER_DIR))
        tok_meta = {"chat_template": tokenizer.chat_template, "bos_token_id": tokenizer.bos_token_id,
                    "eos_token_ids": list(tokenizer.eos_token_ids)}
    meta = {"config": config_to_dict(config), "dtype": dtype, "tokenizer": tok_meta}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    return path


def _read_meta(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {str(path)!r}: not a jaxspec checkpoint directory")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelFileError(f"{str(config_path)!r} is not valid JSON: {e}") from e


def restore_params(path: str | os.PathLike, dtype=None) -> tuple[dict, ModelConfig]:
    """(params, config) from a directory written by `save_params`; params cast to `dtype` when given."""
    path = Path(path).absolute()
    meta = _read_meta(path)
    config = config_from_dict(meta["config"])
    saved = DTYPES[resolve_dtype(meta["dtype"])]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = schema.abstract(Decoder(config).param_schema(), saved, sharding=sharding)
    try:
        params = _checkpointer().restore(path / PARAMS_DIR, target)
    except Exception as e:
        raise CorruptModelFileError(f"cannot restore the orbax params in {str(path / PARAMS_DIR)!r}: {e}") from e
    if dtype is not None and resolve_dtype(dtype) != np.dtype(saved).name:
        want = DTYPES[resolve_dtype(dtype)]
        params = jax.tree.map(lambda x: x.astype(want), params)
    return params, config


def load_checkpoint(path: str | os.PathLike, dtype="bfloat16") -> Model:
    """A `Model` from a `save_params` directory, with its tokenizer when one was saved."""
    dtype = resolve_dtype(dtype)
    path = Path(path)
    params, config = restore_params(path, dtype)
    tokenizer = None
    tok_meta = _read_meta(path.absolute()).get("tokenizer")
    if tok_meta is not None and (path / TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer

        from jaxspec.models.tokenizer import Tokenizer
        eos = tok_meta["eos_token_ids"]
        tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR)),
                              chat_template=tok_meta["chat_template"], bos_token_id=tok_meta["bos_token_id"],
                              eos_token_id=eos[0] if eos else None)
    return Model(config=config, params=params, tokenizer=tokenizer, name=path.name, dtype=dtype)
