"""The GGUF tokenizer jaxspec builds (jaxspec.models.gguf_tokenizer) against the one transformers builds from the
same file: the same token ids, decoding, special tokens and chat template; and built with torch unimportable,
as the main job's set-up (no torch) builds it."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf, open_gguf

TEXTS = [
    "Hello", "Hello world", "The capital of France is", "Tell me a story.", "Write a haiku.", "Name three colours.",
    "def f(x):\n    return x ** 2  # ünïcödé 日本",
    'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n    given threshold.\n'
    '    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    """\n',
    "  lots   of\n\n\nspaces\t\ttabs\r\n 12345678 3.14159 1,000,000", "I'm, you're, she'll, they'd, it's, we've",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|endoftext|>text<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "emoji 🤗🚀👩‍👩‍👧 and ÀÉÎõü ß Ωμέγα Привет مرحبا नमस्ते 한국어", '{"a": [1, 2.5, null, true], "b": "\\u00e9"}',
    "", " ", "\n", "a" * 300,
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name three colours."}]


def transformers_gguf_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_tokenizer(ours, theirs):
    for text in TEXTS:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special), \
                (text, special)
        ids = theirs.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in theirs.added_tokens_decoder.items()}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    if theirs.chat_template:
        for generation_prompt in (False, True):
            rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours.apply_chat_template(MESSAGES, tokenize=False,
                                            add_generation_prompt=generation_prompt) == rendered
            assert ours.encode(rendered) == theirs.encode(rendered)


def test_smollm2_tokenizer_equals_transformers(smollm2_gguf_path):
    assert_same_tokenizer(hf_tokenizer_from_gguf(smollm2_gguf_path), transformers_gguf_tokenizer(smollm2_gguf_path))


@pytest.mark.slow
def test_qwen_tokenizer_equals_transformers(qwen_0_5b_gguf_path):
    """Qwen2's pre-tokenizer (single digits), 20 control tokens, user-defined <tool_call> tokens kept as text and
    271 padding entries."""
    assert_same_tokenizer(hf_tokenizer_from_gguf(qwen_0_5b_gguf_path),
                          transformers_gguf_tokenizer(qwen_0_5b_gguf_path))


def rewritten_vocabulary(source, path, **changes):
    """A metadata-only GGUF at `path` with `source`'s tokenizer fields, `changes` applied
    ({key suffix after 'tokenizer.ggml.': value}; a token list edit as `tokens`/`token_type`)."""
    import gguf
    from jaxspec.models.gguf_loader import metadata
    reader = open_gguf(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    fields = {key.removeprefix("tokenizer.ggml."): metadata(reader, key) for key in reader.fields
              if key.startswith("tokenizer.ggml.")}
    fields.update(changes)
    writer.add_tokenizer_model(fields.pop("model"))
    writer.add_tokenizer_pre(fields.pop("pre"))
    writer.add_token_list(fields.pop("tokens"))
    writer.add_token_types(fields.pop("token_type"))
    writer.add_token_merges(fields.pop("merges"))
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
    writer.add_chat_template(metadata(reader, "tokenizer.chat_template"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama3_split_bos_and_token_kinds_equal_transformers(smollm2_gguf_path, tmp_path):
    """SmolLM2's vocabulary under Llama 3's pre-tokenizer (digits in threes) with a BOS added, a user-defined
    token, and a control token spelled outside the byte alphabet (a mislabelled entry: left as a plain token)."""
    reader = open_gguf(smollm2_gguf_path)
    from jaxspec.models.gguf_loader import metadata
    tokens, types = metadata(reader, "tokenizer.ggml.tokens"), metadata(reader, "tokenizer.ggml.token_type")
    tokens[16], types[16] = "<think>", 4       # in place of two control tokens that no merge makes
    tokens[15], types[15] = "<ctrl ☃>", 3
    path = rewritten_vocabulary(smollm2_gguf_path, tmp_path / "llama3.gguf", pre="llama-bpe", add_bos_token=True,
                                tokens=tokens, token_type=types)
    ours, theirs = hf_tokenizer_from_gguf(path), transformers_gguf_tokenizer(path)
    assert ours.encode("12345") == [1, *ours.encode("12345", add_special_tokens=False)]   # BOS
    assert [piece for piece, _ in ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")] == ["123", "45"]
    assert ours.encode("<think>", add_special_tokens=False) == [16]
    assert_same_tokenizer(ours, theirs)


# torch is absent in the child as in the main job's set-up (which installs none): every finder on the meta path is
# asked through one that finds no torch, so `importlib.util.find_spec("torch")` is None, `import torch` fails and
# importlib.metadata knows no torch distribution
NO_TORCH = textwrap.dedent("""
    import importlib.abc, json, sys
    class NoTorch(importlib.abc.MetaPathFinder):
        def __init__(self, finders):
            self.finders = finders
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                return None
            return next(filter(None, (f.find_spec(name, path, target) for f in self.finders
                                      if hasattr(f, "find_spec"))), None)
        def find_distributions(self, *args, **kwargs):   # importlib.metadata's view: no torch either
            for finder in self.finders:
                for dist in getattr(finder, "find_distributions", lambda *a, **k: ())(*args, **kwargs):
                    if dist.metadata["Name"] != "torch":
                        yield dist
    sys.meta_path[:] = [NoTorch(list(sys.meta_path))]
    from jaxspec.models.gguf_loader import open_gguf, tokenizer_from_gguf
""")


def run_without_torch(code: str, cache) -> subprocess.CompletedProcess:
    """`code` run in a child without torch, with an empty jaxspec cache (nothing a run with torch left there)."""
    return subprocess.run([sys.executable, "-c", NO_TORCH + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAXSPEC_CACHE": str(cache)})


def test_the_tokenizer_builds_without_torch(smollm2_gguf_path, tmp_path):
    from jaxspec.models.gguf_loader import tokenizer_from_gguf
    child = run_without_torch("import torch", tmp_path)
    assert "ModuleNotFoundError: No module named 'torch'" in child.stderr, child.stderr   # the blocker holds
    child = run_without_torch(f"""
        path = {str(smollm2_gguf_path)!r}
        tok = tokenizer_from_gguf(path, open_gguf(path))
        texts = {TEXTS!r}
        prompt = tok.apply_chat_template({MESSAGES!r})
        print(json.dumps({{"ids": [tok.encode(t) for t in texts], "prompt": prompt, "eos": tok.eos_token_ids}}))
    """, tmp_path)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.splitlines()[-1])
    tok = tokenizer_from_gguf(smollm2_gguf_path, open_gguf(smollm2_gguf_path))
    assert got == {"ids": [tok.encode(t) for t in TEXTS], "prompt": tok.apply_chat_template(MESSAGES),
                   "eos": list(tok.eos_token_ids)}


def test_a_vocabulary_jaxspec_does_not_build_names_what_to_install(smollm2_gguf_path, tmp_path):
    path = rewritten_vocabulary(smollm2_gguf_path, tmp_path / "spm.gguf", model="llama")
    child = run_without_torch(f"""
        path = {str(path)!r}
        tokenizer_from_gguf(path, open_gguf(path))
    """, tmp_path / "cache")
    assert child.returncode != 0
    assert "UnsupportedModelError" in child.stderr and "pip install torch" in child.stderr, child.stderr
