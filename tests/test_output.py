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


def test_one_render_for_many_requests_equals_each_whole_decode(tokenizer):
    """A step renders all its requests' new text in one tokenizer call: each request, fed its own chunks
    (one streamed, one with a stop string that never occurs, one unread until its end), gets exactly its whole
    decode, and the unread one no text before it ends."""
    from jaxspec.sched.output import confirm_tokens, render_texts
    ids = tokenizer.encode(TEXT)
    streamed = Request("a", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True), 0, (), stream_text=True)
    stopped = Request("b", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=["<never>"]), 0, ())
    unread = Request("c", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True), 0, ())
    fed = {streamed: ids[::-1], stopped: ids, unread: ids[5:] + ids[:5]}
    chunk = {streamed: 1, stopped: 2, unread: 3}
    step = 0
    while not all(r.finish_reason for r in fed):
        reqs = [r for r in fed if not r.finish_reason]
        for r in reqs:
            n = len(r.output_token_ids)
            confirm_tokens(r, fed[r][n:n + chunk[r] + step % 2], 10_000, None, float(step))
        render_texts(reqs, tokenizer)
        assert unread.text == "" or unread.finish_reason == "length"
        step += 1
    for r, want in fed.items():
        assert r.finish_reason == "length" and r.text == tokenizer.decode(want, skip_special_tokens=True)


def test_inter_token_latencies_are_the_gaps_between_token_times(tokenizer):
    """Kept as tokens arrive (a step's tokens share one arrival time): the gaps of the whole history."""
    from jaxspec.sched.output import confirm_tokens, request_metrics
    req = Request("r", [1], SamplingParams(max_tokens=100, ignore_eos=True), 0, ())
    for now, chunk in ((1.0, [5, 6, 7]), (1.5, [8]), (3.25, [9, 10])):
        confirm_tokens(req, chunk, 10_000, None, now)
    times = req.token_times
    assert times == [1.0] * 3 + [1.5] + [3.25] * 2
    assert request_metrics(req)["inter_token_latencies"] == [b - a for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("chunk", [3, 4])
def test_a_stop_string_completed_mid_step_keeps_what_one_token_a_step_keeps(tokenizer, chunk):
    """A step that confirms several tokens at once (speculation) and completes a stop string before its last one:
    the request ends with the tokens, logprobs, times and text that one token a step gives, the stop string's
    last token the last kept (the step's later tokens dropped)."""
    ids = tokenizer.encode(TEXT)
    stop = tokenizer.decode(ids[8:10])             # completed by token 9: mid-step for chunks of 3 and 4

    def run(n):
        req = Request("r", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=[stop]), 0, ())
        for i in range(0, len(ids), n):
            lps = [{"logprob": -float(j), "top": []} for j in range(i, i + n)]
            append_tokens(req, ids[i:i + n], tokenizer, 10_000, logprobs=lps)
            if req.finish_reason:
                return req

    one, many = run(1), run(chunk)
    assert len(one.output_token_ids) == 10 and one.finish_reason == many.finish_reason == "stop"
    assert many.output_token_ids == one.output_token_ids and many.text == one.text
    assert many.logprobs == one.logprobs
    assert len(many.token_times) == len(many.inter_token_latencies) + 1 == 10
