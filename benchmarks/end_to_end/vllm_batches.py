"""vLLM 0.23 (offline `LLM`) in one process at several batch sizes, on the workload of
benchmarks/end_to_end/tpot_phases.py: for batch B, B random prompts of 128 token ids (numpy seed B, ids below 1000),
256 greedy tokens each with EOS ignored, all submitted at once. Prints and writes per batch the generate call's
wall time, output tok/s and the wall time per output token of a request (wall / 256: the time to first token
included), the numbers tpot_phases.py prints for jaxspec. (vLLM's per-request TPOT needs its stats logging on,
which costs time every step, so it is left off here.)

    PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/end_to_end/vllm_batches.py \
        MODEL_DIR OUT.json [--dummy] [--batches 1 8 32] [--quantization fp8]

MODEL_DIR: a Hugging Face directory (bf16 weights, e.g. benchmarks/end_to_end/gguf_to_hf.py's output); --dummy:
vLLM's random weights of its config (load_format="dummy"). One engine serves every batch size (max_num_seqs = the largest).

Each batch's row also says how alike its requests' outputs are (`distinct_rows`: distinct output sequences;
`agree_frac`: the fraction of output positions where every request has the same token). A mixture of experts
reads the experts its rows are routed to, so requests that decode the same tokens read a batch-1 step's bytes.
vLLM's dummy weights are uniform in [-1e-3, 1e-3] and equal for every parameter of a shape (one seed each), so
every layer is the same; `--dummy-range A` draws them in [-A, A] instead (the engine then runs in this process,
VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the patched initializer is the one that runs).
"""
import argparse
import functools
import json
import os
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--quantization", default=None, help="vLLM's quantization (fp8: its online FP8, per-channel "
                                                        "weights and dynamic per-token activations)")
    p.add_argument("--dummy-range", type=float, help="dummy weights uniform in [-A, A] (vLLM's: 1e-3)")
    a = p.parse_args()
    if a.dummy_range:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.model_executor.model_loader import dummy_loader
        dummy_loader.initialize_dummy_weights = functools.partial(dummy_loader.initialize_dummy_weights,
                                                                  low=-a.dummy_range, high=a.dummy_range)
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=a.model, max_num_seqs=max(a.batches), max_model_len=1024, max_num_batched_tokens=512,
              dtype="bfloat16", seed=0, skip_tokenizer_init=True, gpu_memory_utilization=a.gpu_memory_utilization,
              disable_log_stats=True, quantization=a.quantization, **({"load_format": "dummy"} if a.dummy else {}))
    print(f"vLLM engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True, detokenize=False)
    results = []
    for B in a.batches:
        rng = np.random.default_rng(B)
        prompts = [{"prompt_token_ids": rng.integers(0, 1000, a.input_len).tolist()} for _ in range(B)]
        llm.generate(prompts, params, use_tqdm=False)      # warm-up at this batch size
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        tokens = np.array([o.outputs[0].token_ids for o in outs])
        res = {"batch": B, "output_tokens": n_out, "wall_s": wall, "output_throughput": n_out / wall,
               "wall_ms_per_token": 1e3 * wall / a.output_len,
               "distinct_rows": len({tuple(t) for t in tokens.tolist()}),
               "agree_frac": float((tokens == tokens[:1]).all(0).mean()),
               "distinct_tokens": len(np.unique(tokens))}
        print(f"vLLM batch {B}: {res['output_throughput']:.0f} tok/s ({n_out} tokens in {wall:.3f} s, "
              f"{res['wall_ms_per_token']:.3f} ms per token of a request); {res['distinct_rows']} distinct outputs, "
              f"{res['distinct_tokens']} distinct tokens, all rows agree at {100 * res['agree_frac']:.0f}% of "
              f"positions", flush=True)
        results.append(res)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
