"""The tokenizer a GGUF file describes, built from its metadata by the `tokenizers` library alone.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, the merges, each token's type and the
special ids under `tokenizer.ggml.*`, and names the pre-tokenizer the merges were learned with in
`tokenizer.ggml.pre`. jaxspec rebuilds the byte-level BPE tokenizer those describe (`tokenizer.ggml.model` =
"gpt2": Llama 3, SmolLM2, Qwen2/2.5/3) itself, so loading a GGUF needs no torch: transformers' own GGUF path
imports torch from 5.25 on, and the main job's set-up installs none. The result equals the tokenizer
transformers builds from the same file (tests/test_gguf_tokenizer.py compares them on the suite's texts, special
tokens, decoding and the chat template), wrapped in transformers' `PreTrainedTokenizerFast`, which needs no torch.

Any other vocabulary (sentencepiece "llama", "t5", a pre-tokenizer not named below) goes to transformers' GGUF
path, which needs torch; where torch is missing the error says so.
"""
from __future__ import annotations

import functools

from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.gguf_loader import metadata

# The split each `tokenizer.ggml.pre` names, as llama.cpp applies it before the byte-level BPE. None: GPT-2's
# own pattern, which `ByteLevel(use_regex=True)` applies.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with single digits
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZER_SPLITS = {
    "gpt-2": None, "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
    """The printable character byte-level BPE spells each byte with (GPT-2's scheme): bytes that are printable
    Latin-1 stand for themselves, the others are moved up past 255 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(shifted)) for b in range(256))


def spelled(token: str, alphabet: frozenset[str]) -> str:
    """`token` in the byte alphabet: as it is when every character already belongs to it (what GGUF stores for
    byte-level vocabularies), else each of its UTF-8 bytes spelled."""
    if set(token) <= alphabet:
        return token
    letters = byte_alphabet()
    return "".join(letters[b] for b in token.encode("utf-8"))


def supported(reader) -> bool:
    """Whether jaxspec builds this GGUF's tokenizer itself (else transformers' GGUF path, which needs torch)."""
    return (metadata(reader, "tokenizer.ggml.model") == "gpt2"
            and metadata(reader, "tokenizer.ggml.pre", "gpt-2") in PRE_TOKENIZER_SPLITS)


def backend_from_gguf(reader):
    """The `tokenizers.Tokenizer` of a byte-level BPE GGUF vocabulary (`supported(reader)`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type") or [0] * len(tokens)
    merges = [tuple(merge.split(" ")) for merge in metadata(reader, "tokenizer.ggml.merges", [])]
    alphabet = frozenset(byte_alphabet())
    vocab = {spelled(token, alphabet): i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS[metadata(reader, "tokenizer.ggml.pre", "gpt-2")]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>, ...) stay whole and are special (skipped when decoding); a control token spelled
    # outside the byte alphabet is a mislabelled vocabulary entry, left as a plain token. User-defined tokens
    # (<tool_call>) stay whole too but are text.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in zip(tokens, types)
                                if kind == CONTROL and set(token) <= alphabet])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in zip(tokens, types) if kind == USER_DEFINED and token in vocab])
    return backend


def special_tokens(reader) -> dict[str, str | None]:
    """bos/eos/unk/pad as token strings, from the GGUF's ids."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
           "pad_token": "padding_token_id"}
    out = {}
    for name, key in ids.items():
        token_id = metadata(reader, f"tokenizer.ggml.{key}")
        out[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    return out


def tokenizer_from_backend(backend, reader):
    """transformers' `PreTrainedTokenizerFast` over `backend`, with the GGUF's special tokens, bos/eos flags (it
    adds them when asked for special tokens) and chat template (what `apply_chat_template` and the server use)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, **special_tokens(reader),
        chat_template=metadata(reader, "tokenizer.chat_template"),
        add_bos_token=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata(reader, "tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False)


def transformers_tokenizer(path) -> object:
    """transformers' own tokenizer of the GGUF at `path`, for the vocabularies jaxspec does not build; its GGUF
    path imports torch, so a missing torch is named with what to install."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        hint = ""
        try:
            import torch  # noqa: F401
        except ImportError:
            hint = (" jaxspec builds byte-level BPE vocabularies (tokenizer.ggml.model 'gpt2' with tokenizer.ggml.pre "
                    f"one of {', '.join(PRE_TOKENIZER_SPLITS)}) itself; for this one transformers needs torch: "
                    "pip install torch (or give a directory with a tokenizer.json)")
        raise UnsupportedModelError(f"transformers could not build a tokenizer from {str(path)!r}: {e}.{hint}") from e
