"""Write a GGUF checkpoint out as a Hugging Face directory (config.json, bf16 safetensors, tokenizer), dequantized
by transformers: what engines that do not read GGUF (vLLM's bf16 path) load, so that both sides of a comparison
run the same weights in the same dtype.

    python3 benchmarks/end_to_end/gguf_to_hf.py /tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf /tmp/models/qwen15-hf
"""
import os
import sys
import time


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    folder, name = os.path.split(os.path.abspath(src))
    from safetensors.torch import save_file
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF: the tensors (already dequantized) and the config are
    # written as they are, without the GGUF marker
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = None
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    import json
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
