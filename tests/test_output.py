"""Output processing: incremental detokenization renders exactly what a whole decode would."""
import pytest

from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.output import append_tokens
from jaxspec.sched.request import Request

TEXT = ("Héllo wörld — naïve café 😀 emojis 👩‍👩‍👧 and 日本語のテキスト, then   spaces,\n"
        "newlines\tand tabs; def f(x):\n    return x ** 2  # code")


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_path):
    from jaxspec.models.gguf_loader import open_gguf, tokenizer_from_gguf
    return tokenizer_from_gguf(smollm2_gguf_path, open_gguf(smollm2_gguf_path))


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_text_equals_whole_decode(tokenizer, chunk):
    ids = tokenizer.encode(TEXT)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids) + 10, ignore_eos=True), 0, (), stream_text=True)
    streamed = ""
    for i in range(0, len(ids), chunk):
        _, delta = append_tokens(req, ids[i:i + chunk], tokenizer, max_model_len=10_000)
        streamed += delta
        whole = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        assert whole.startswith(req.text)                 # never ahead of, nor different from, the truth
    assert req.text == tokenizer.decode(ids, skip_special_tokens=True) == streamed


def test_tokenizer_decode_equals_transformers(tokenizer):
    """The engine's decode (the Rust tokenizer, called directly) renders what transformers' decode does,
    special tokens and partial characters included."""
    ids = tokenizer.encode(TEXT)
    special = list(tokenizer.eos_token_ids)
    for piece in (ids, ids[3:9], special + ids[:5] + special, ids[-7:-1], []):
        for skip in (True, False):
            assert tokenizer.decode(piece, skip_special_tokens=skip) == tokenizer.hf.decode(
                piece, skip_special_tokens=skip)


def test_text_without_a_reader_is_decoded_once_at_the_end(tokenizer):
    """No stream and no stop strings: no text while running, the whole decode when the request ends."""
    ids = tokenizer.encode(TEXT)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True), 0, ())
    for i in range(0, len(ids), 3):
        append_tokens(req, ids[i:i + 3], tokenizer, max_model_len=10_000)
        assert req.text == "" or req.finish_reason == "length"
    assert req.finish_reason == "length" and req.text == tokenizer.decode(ids, skip_special_tokens=True)
