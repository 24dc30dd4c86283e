"""`jaxspec-bench --baseline hf`: the same prompts through transformers on the same weights, for the ratio.

Settings tried, each reported only if it runs: eager, static cache with torch.compile, and assisted
generation with the draft model (batch 1, as transformers supports it).
"""
from __future__ import annotations

import time


def _gguf_path(spec: str):
    from pathlib import Path
    from jaxspec.models.presets import PRESETS, preset_path
    if spec in PRESETS:
        return preset_path(spec)
    path = Path(spec)
    if path.suffix == ".gguf":
        return path
    return None


def _load(spec: str, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = _gguf_path(spec)
    if gguf is not None:
        kw = dict(gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kw)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(spec)
    return model.to(device).eval(), tok


def run_hf_baseline(args, workload) -> list[dict]:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = _load(args.model, dtype, device)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = [p if isinstance(p, list) else tok.encode(p) for p in workload.prompts]
    out_len = max(workload.output_lens)
    batch = max(1, args.max_concurrency)
    results = []

    def run(label, gen_kwargs, batch_size, max_prompts=None):
        todo = prompts[:max_prompts] if max_prompts else prompts
        n_out, t0 = 0, None
        for warm in (True, False):
            if not warm:
                t0 = time.perf_counter()
            for i in range(0, len(todo) if not warm else min(len(todo), batch_size), batch_size):
                chunk = todo[i:i + batch_size]
                width = max(map(len, chunk))
                ids = torch.tensor([[tok.pad_token_id] * (width - len(c)) + c for c in chunk], device=device)
                mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=device)
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                                         min_new_tokens=out_len, do_sample=False, pad_token_id=tok.pad_token_id,
                                         **gen_kwargs)
                if not warm:
                    n_out += (out.shape[1] - width) * len(chunk)
        if device == "cuda":
            torch.cuda.synchronize()
        duration = time.perf_counter() - t0
        results.append({"label": label, "batch": batch_size, "duration_s": duration, "output_tokens": n_out,
                        "output_throughput": n_out / duration})
        print(f"transformers {label}: {n_out} tokens in {duration:.2f}s = {n_out / duration:.1f} tok/s", flush=True)

    for b in sorted({1, batch}):
        run(f"hf-eager-b{b}", {}, b)
    try:
        compiled = dict(cache_implementation="static", compile_config=None)
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
        run(f"hf-static-compile-b{batch}", {k: v for k, v in compiled.items() if v is not None}, batch)
    except Exception as e:  # noqa: BLE001 - report what transformers could not run, keep the others
        print(f"transformers static cache + torch.compile did not run: {type(e).__name__}: {e}")
    if getattr(args, "draft_model", None):
        try:
            model.forward = model.__class__.forward.__get__(model)
            draft, _ = _load(args.draft_model, dtype, device)
            run("hf-assisted-b1", {"assistant_model": draft}, 1, max_prompts=min(len(prompts), 4))
        except Exception as e:  # noqa: BLE001
            print(f"transformers assisted generation did not run: {type(e).__name__}: {e}")
    return results
