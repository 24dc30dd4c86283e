"""The engine and requests tests/test_distributed.py runs in one process and across two (distributed_worker.py)."""
from conftest import random_model
from jaxspec import SamplingParams

# chunked prefill and n-gram drafts (prompt lookup reads the device history a prefix-cache hit writes)
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4,
              warmup=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1})
REPEATING = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9]


def model():
    return random_model(3, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128, attn_gain=0.3)


def run(llm) -> list[list[int]]:
    """Two rounds: greedy prompts and a seeded sampled one with a logit bias; then a prompt that starts with the
    first one's blocks (a prefix-cache hit)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logit_bias={11: 3.0})
    first = llm.generate([REPEATING + [17, 21], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7] * 9],
                         [greedy, greedy, sampled], use_tqdm=False)
    second = llm.generate([REPEATING + [40, 41, 42]], greedy, use_tqdm=False)
    return [o.token_ids for o in first + second]
