"""A Hugging Face checkpoint of random weights for a preset's shapes, written by transformers itself (its own
initialisation, normal with std 0.02, and its own save_pretrained layout), so that jaxspec and vLLM load the same
weights and decode the same tokens:

    python3 benchmarks/end_to_end/random_hf_checkpoint.py gpt-oss-20b /tmp/ckpt [--device cuda]    # -> /tmp/ckpt/gpt-oss-20b

Why: vLLM's dummy weights (uniform in [-1e-3, 1e-3], the same values in every layer) make every request of a batch
repeat one token, so a mixture of experts routes a handful of tokens and reads a fraction of its experts, while
jaxspec's random weights route every row on its own (docs/lab/2026-11-27-moe-routing-vllm.md). With one checkpoint
both engines route alike. The model is built on `--device` (the GPU: GPT-OSS-20B's 42 GB initialise in seconds),
then saved in 5 GB shards.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("preset", help="a KNOWN_SHAPES name (jaxspec.models.random)")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="keep the first N layers (a checkpoint that fits the disk, per-layer "
                                              "costs unchanged); written under OUT/PRESET-Nl")
    a = p.parse_args()
    import torch
    import transformers

    import vllm_startup
    t0 = time.perf_counter()
    config_dir = vllm_startup.model_dir(a.preset, a.out)          # writes OUT/PRESET/config.json
    if a.layers:
        with open(os.path.join(config_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"] = a.layers
        for key in ("layer_types",):
            if cfg.get(key):
                cfg[key] = cfg[key][:a.layers]
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = a.layers
        shutil.rmtree(config_dir)
        config_dir = os.path.join(a.out, f"{a.preset}-{a.layers}l")
        os.makedirs(config_dir, exist_ok=True)
        with open(os.path.join(config_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    print(f"{a.preset}: {sum(t.numel() for t in model.parameters()) / 1e9:.2f}B parameters initialised on "
          f"{a.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    model.save_pretrained(config_dir, max_shard_size="5GB")
    print(f"written to {config_dir} in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
