"""Load a llama / qwen2 / qwen3 GGUF file (llama.cpp format) into a `Model`.

The header is parsed by `GGUFFile` (a light reader that skips over the vocabulary arrays instead of
building a numpy view per token, as `gguf.GGUFReader` does); tensors are dequantized from their raw
block bytes by jit-compiled JAX code (`jaxspec.models.dequant`) into the target dtype, one tensor at a
time, renamed to their HF names and handed to `params_from_hf_tensors`. The tokenizer is rebuilt from
the GGUF vocabulary (`jaxspec.models.gguf_tokenizer`); the chat template and bos/eos ids come from the GGUF metadata.
"""
from __future__ import annotations

import dataclasses
import os
import re
import struct
from pathlib import Path

import gguf
import numpy as np

from jaxspec.models import dequant
from jaxspec.models.config import ARCHITECTURES, ModelConfig
from jaxspec.models.errors import CorruptModelFileError, UnsupportedModelError
from jaxspec.models.model import Model
from jaxspec.models.weights import DTYPES, hf_tensor_names, params_from_hf_tensors, resolve_dtype

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Block tensors that change the output when present (a bias, attention sinks, a norm): refused when unread.
_MUST_BE_READ = re.compile(r".*(\.bias|sinks(\.weight)?|norm\.weight)")


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name for a GGUF tensor name, or None for tensors jaxspec does not use."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotate-half layout -> interleaved pairs) for a [rows, ...] tensor.

    llama.cpp's converter maps HF rows, viewed per head as (2, hd/2), to (hd/2, 2); this is the inverse.
    Works for weights [n_heads*hd, D] and biases [n_heads*hd].
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (the inverse of `unpermute_rows`), as its converter applies it."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def check_supported(tensor) -> None:
    """UnsupportedModelError naming the tensor and its type unless jaxspec can dequantize it."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r} has quantization type {tensor.tensor_type.name}; supported: "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}")


def dequantize_tensor(tensor, backend: str = "jax", dtype="float32") -> np.ndarray:
    """Values of a GGUF tensor (a `GGUFTensor` or a `gguf.ReaderTensor`) in numpy order (HF [out, in]
    for a weight matrix), as a host array of `dtype` ('float32' or 'bfloat16').

    backend="jax" dequantizes the raw blocks with jit-compiled JAX code on JAX's default backend;
    backend="numpy" uses the `gguf` package's numpy code (slow; kept as the reference path).
    """
    check_supported(tensor)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    np_dtype = DTYPES[resolve_dtype(dtype)]
    if backend == "jax":
        return dequant.dequantize_raw(tensor.data, tensor.tensor_type, shape, np.dtype(np_dtype).name)
    if backend == "numpy":
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, np.float32).reshape(shape).astype(np_dtype, copy=False)
    raise ValueError(f"unknown dequantization backend {backend!r}; expected 'jax' or 'numpy'")


# ---------------------------------------------------------------- a light GGUF header reader

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                  7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFField:
    """One metadata value; arrays are decoded only when `contents()` is called."""
    name: str
    value_type: int
    value: object = None  # scalars and strings
    sub_type: int | None = None  # arrays: element type, count and where the elements start
    count: int = 0
    offset: int = 0
    buf: object = None

    def __len__(self) -> int:
        return self.count if self.value_type == _ARRAY else 1

    def contents(self):
        """The value as GGUFReader's `ReaderField.contents()` gives it: a python scalar, str, or list."""
        if self.value_type != _ARRAY:
            return self.value
        if self.sub_type == _STRING:
            out, pos = [], self.offset
            for _ in range(self.count):
                (n,) = struct.unpack_from("<Q", self.buf, pos)
                out.append(bytes(self.buf[pos + 8:pos + 8 + n]).decode("utf-8"))
                pos += 8 + n
            return out
        if self.sub_type in _SCALAR_DTYPES:
            return np.frombuffer(self.buf, _SCALAR_DTYPES[self.sub_type], self.count, self.offset).tolist()
        raise CorruptModelFileError(f"GGUF array field {self.name!r} has nested arrays (not supported)")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """A tensor's header entry, with the same attribute names as `gguf.ReaderTensor`."""
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF (reversed) order, like ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # the raw bytes, uint8, a view of the file map


class GGUFFile:
    """A little-endian GGUF v2/v3 file: `fields` (name -> GGUFField), `tensors` (list of GGUFTensor).

    Unlike `gguf.GGUFReader` it does not build per-element views of metadata arrays; a 151k-token
    vocabulary is stepped over (one length read per string) and decoded only on request.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        pos = 0

        def unpack(fmt):
            nonlocal pos
            values = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return values[0] if len(values) == 1 else values

        def string():
            nonlocal pos
            n = unpack("<Q")
            if pos + n > len(buf):
                raise ValueError(f"string of {n} bytes at offset {pos} runs past the end of the file")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8")

        magic, version, n_tensors, n_kv = unpack("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key = string()
            vtype = unpack("<I")
            if vtype == _STRING:
                self.fields[key] = GGUFField(key, vtype, string())
            elif vtype in _SCALARS:
                self.fields[key] = GGUFField(key, vtype, unpack(_SCALARS[vtype]))
            elif vtype == _ARRAY:
                sub, count = unpack("<IQ")
                start = pos
                if sub == _STRING:
                    for _ in range(count):
                        pos += 8 + unpack("<Q")
                elif sub in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[sub])
                else:
                    raise ValueError(f"field {key!r} is an array of type {sub} (not supported)")
                if pos > len(buf):
                    raise ValueError(f"array field {key!r} runs past the end of the file")
                self.fields[key] = GGUFField(key, vtype, None, sub, count, start, buf)
            else:
                raise ValueError(f"field {key!r} has unknown value type {vtype}")
        infos = []
        for _ in range(n_tensors):
            name = string()
            n_dims = unpack("<I")
            dims = unpack(f"<{n_dims}Q") if n_dims else ()
            dims = (dims,) if isinstance(dims, int) else dims
            ttype, offset = unpack("<IQ")
            infos.append((name, dims, ttype, offset))
        align_field = self.fields.get("general.alignment")
        alignment = int(align_field.value) if align_field is not None else 32
        data_start = -(-pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            qtype = gguf.GGMLQuantizationType(ttype)
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n_elements // block_size * type_size
            start = data_start + offset
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, np.uint64), n_elements, n_bytes, start,
                                           self._map[start:start + n_bytes]))

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """A `GGUFFile` over `path`; FileNotFoundError if absent, CorruptModelFileError if truncated or not GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CorruptModelFileError(f"{str(path)!r} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # struct.error/ValueError/... on truncated or malformed headers
        raise CorruptModelFileError(f"GGUF file {str(path)!r} is truncated or corrupt: {type(e).__name__}: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise CorruptModelFileError(
                f"GGUF file {str(path)!r} is truncated: tensor {t.name!r} needs bytes up to "
                f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def metadata(reader, key: str, default=None):
    """The value of a GGUF metadata key (str, number, bool or list), or `default` when absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def _require(reader, key: str):
    value = metadata(reader, key)
    if value is None:
        raise CorruptModelFileError(f"GGUF metadata lacks required key {key!r}")
    return value


def config_from_gguf(reader) -> ModelConfig:
    """ModelConfig from the GGUF metadata (and the embedding/output tensors for vocab size and tying)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CorruptModelFileError("GGUF has no token_embd.weight tensor")
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_heads = int(_require(reader, f"{arch}.attention.head_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // n_heads))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_tokens = None if tokens is None else len(tokens.data) if isinstance(tokens, gguf.ReaderField) else len(tokens)
    vocab_size = int(names["token_embd.weight"].shape[1])  # GGUF dims are reversed: [D, V]
    if n_tokens is not None and n_tokens > vocab_size:
        raise CorruptModelFileError(f"GGUF token list has {n_tokens} entries but token_embd has {vocab_size} rows")
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    refuse_unimplemented_gguf(reader, arch, head_dim)
    config = ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_require(reader, f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length", 4096)),
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        rope_freq_factors=rope_freq_factors_from_gguf(reader, arch, head_dim),
    )
    refuse_unread_tensors(reader, config)
    return config


def refuse_unimplemented_gguf(reader, arch: str, head_dim: int) -> None:
    """UnsupportedModelError naming the metadata key (its value, and what is supported) when the GGUF asks for
    something llama.cpp applies and jaxspec does not implement, rather than run the model as something else."""
    context = int(metadata(reader, f"{arch}.context_length", 4096))
    key = f"{arch}.attention.sliding_window"
    window = metadata(reader, key)
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern")   # per layer: sliding or not
    no_sliding_layer = isinstance(pattern, list) and not any(pattern)
    # 0: no window (llama.cpp's converter writes 0 to disable it). A window of at least context_length never bites:
    # the engine caps max_model_len at it (jaxspec.sched.config), so no query is that far from a key.
    if window and int(window) < context and not no_sliding_layer:
        raise UnsupportedModelError(
            f"GGUF {key}={window} is not supported: jaxspec attends over the whole context, so the model would "
            f"decode wrongly past {window} tokens; supported: no {key}, 0, or at least {arch}.context_length={context}")
    for key in (f"{arch}.attn_logit_softcapping", f"{arch}.final_logit_softcapping"):
        if metadata(reader, key):
            raise UnsupportedModelError(f"GGUF {key}={metadata(reader, key)} is not supported (logit soft-capping "
                                        "is not implemented); supported: no such key")
    experts = metadata(reader, f"{arch}.expert_count")
    if experts:
        raise UnsupportedModelError(f"GGUF {arch}.expert_count={experts} (a mixture of experts) is not supported for "
                                    f"GGUF {arch}; supported: dense models (no {arch}.expert_count, or 0)")
    rotary = metadata(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count={rotary} (partial rotary) is not supported; "
                                    f"supported: the head dimension, {head_dim}")


def refuse_unread_tensors(reader, config: ModelConfig) -> None:
    """UnsupportedModelError naming the first block tensor (a bias, attention sinks, a norm) that jaxspec's model for
    `config` would not read: e.g. llama attn_q.bias or attn_output.bias. Loading without it would run another model."""
    read = set(hf_tensor_names(config))
    for t in reader.tensors:
        m = _BLOCK_RE.fullmatch(t.name)
        if m and _MUST_BE_READ.fullmatch(m.group(2)) and hf_name(t.name) not in read:
            used = sorted(g for g, h in _BLOCK_NAMES.items() if f"model.layers.{m.group(1)}.{h}" in read
                          and _MUST_BE_READ.fullmatch(g))
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} is not used by jaxspec's {config.arch} model (it "
                                        f"would be ignored); supported: a block's biases and norms among "
                                        f"{', '.join(used)}")


def rope_freq_factors_from_gguf(reader, arch: str, head_dim: int) -> tuple[float, ...] | None:
    """The per-frequency rope divisors [head_dim/2] of a GGUF, or None for plain rope.

    llama.cpp's converter stores llama3 rope scaling as a `rope_freqs` tensor (inv_freq / rope_freqs) and
    linear scaling as `rope.scaling.type = linear` with `rope.scaling.factor` (positions / factor, the same
    as inv_freq / factor); llama.cpp applies the factor with both, so both are folded into one tuple here.
    Other scaling types (yarn, ...) raise UnsupportedModelError.
    """
    scaling = metadata(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported; supported: none, linear "
                                    "(and llama3 scaling stored as a rope_freqs tensor)")
    factor = float(metadata(reader, f"{arch}.rope.scaling.factor", 0.0) or 1.0)  # 0/absent: no scaling
    if not np.isfinite(factor) or factor <= 0:
        raise CorruptModelFileError(f"GGUF rope scaling factor {factor!r} is not a positive number")
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None if factor == 1.0 else (factor,) * (head_dim // 2)
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF has a rope_freqs tensor for architecture {arch!r}; jaxspec applies "
                                    "rope_freqs only to llama")
    freqs = dequantize_tensor(tensor, backend="numpy", dtype="float32").ravel()
    if freqs.shape != (head_dim // 2,):
        raise CorruptModelFileError(f"GGUF rope_freqs tensor has {freqs.size} values; expected head_dim/2 = "
                                    f"{head_dim // 2}")
    if not (np.isfinite(freqs).all() and (freqs > 0).all()):
        raise CorruptModelFileError("GGUF rope_freqs tensor has non-positive or non-finite values")
    return tuple(float(f) * factor for f in freqs)


def params_from_gguf(reader, config: ModelConfig, dtype="float32", backend: str = "jax") -> dict:
    """The params pytree from an open GGUF: every used tensor's type is checked before any is dequantized.

    Tensors are dequantized one at a time straight into `dtype` (see `dequantize_tensor` for `backend`)."""
    by_hf_name = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        check_supported(t)
        by_hf_name[name] = t
    permuted = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}

    def get_tensor(name: str) -> np.ndarray:
        value = dequantize_tensor(by_hf_name[name], backend, dtype)
        if config.arch == "llama":
            for proj, heads in permuted.items():
                if f".{proj}." in name:
                    value = unpermute_rows(value, heads)
        return value

    return params_from_hf_tensors(config, get_tensor, dtype)


def hf_tokenizer_from_gguf(path: str | os.PathLike, reader=None):
    """The transformers tokenizer of the GGUF vocabulary at `path` (`reader`: the file already open): built by
    jaxspec from the vocabulary for byte-level BPE files (`gguf_tokenizer`, no torch), by transformers' GGUF path
    for the others."""
    from jaxspec.models import gguf_tokenizer

    path = Path(path).resolve()
    reader = reader if reader is not None else open_gguf(path)
    if gguf_tokenizer.supported(reader):
        return gguf_tokenizer.tokenizer_from_backend(gguf_tokenizer.backend_from_gguf(reader), reader)
    return gguf_tokenizer.transformers_tokenizer(path)


def tokenizer_from_gguf(path: str | os.PathLike, reader):
    """A jaxspec Tokenizer of the GGUF vocabulary (`hf_tokenizer_from_gguf`), with the GGUF chat template and
    bos/eos ids; None when the GGUF carries no vocabulary."""
    from jaxspec.models.tokenizer import Tokenizer

    if reader.get_field("tokenizer.ggml.tokens") is None:
        return None
    hf = hf_tokenizer_from_gguf(path, reader)
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    return Tokenizer(hf, chat_template=metadata(reader, "tokenizer.chat_template"),
                     eos_token_id=None if eos is None else int(eos), bos_token_id=None if bos is None else int(bos))


def load_gguf(path: str | os.PathLike, dtype="bfloat16", with_tokenizer: bool = True, backend: str = "jax") -> Model:
    """Load a GGUF file (llama, qwen2 or qwen3; types F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K; rope plain,
    linear, or llama3 as a llama `rope_freqs` tensor).

    backend: "jax" (default, fast) or "numpy" dequantization (see `dequantize_tensor`)."""
    dtype = resolve_dtype(dtype)
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    params = params_from_gguf(reader, config, dtype, backend)
    tokenizer = tokenizer_from_gguf(path, reader) if with_tokenizer else None
    if tokenizer is not None and tokenizer.eos_token_ids:
        eos_ids = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
        config = dataclasses.replace(config, eos_token_ids=eos_ids)
    return Model(config=config, params=params, tokenizer=tokenizer, name=Path(path).stem, dtype=dtype)

