"""The engine's counters, kept as steps are dispatched and read, and `stats()`: what they and the engine's parts
(runner, scheduler, KV blocks, grammar tables) say, as one dict; and which weights are quantized, and how."""
from __future__ import annotations

import numpy as np


class EngineCounts:
    def __init__(self, num_speculative_tokens: int, adaptive: bool):
        self.K, self.adaptive = num_speculative_tokens, adaptive
        self.counters = {"steps": 0, "scheduled_rows": 0, "padded_tokens": 0, "scheduled_tokens": 0}
        k = num_speculative_tokens
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                     "accepted_per_position": np.zeros(max(k, 1), np.int64), "chosen_k": np.zeros(k + 1, np.int64),
                     "opted_out_requests": 0, "opted_out_tokens": 0}

    @property
    def steps(self) -> int:
        return self.counters["steps"]

    def count_step(self, num_rows: int, num_tokens: int, bucket: int):
        c = self.counters
        c["steps"] += 1
        c["scheduled_rows"] += num_rows
        c["scheduled_tokens"] += num_tokens
        c["padded_tokens"] += bucket

    def count_drafts(self, req, num_drafts: int, num_accepted: int):
        """A row verified `num_drafts` drafts and accepted the first `num_accepted`."""
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        s = self.spec
        s["drafts"] += 1
        s["draft_tokens"] += num_drafts
        s["accepted_tokens"] += num_accepted
        s["accepted_per_position"][:num_accepted] += 1

    def count_opted_out_request(self):
        """A request that does not speculate (SamplingParams.speculative false) entered the engine."""
        self.spec["opted_out_requests"] += 1

    def count_opted_out_tokens(self, num_tokens: int):
        """A row of a request that does not speculate confirmed `num_tokens` tokens (drafting none)."""
        self.spec["opted_out_tokens"] += num_tokens

    def count_proposal(self, k: int):
        """A step read with live sampling rows proposed k drafts each (counted as read: async counts as sync)."""
        self.spec["chosen_k"][k] += 1

    def report(self, *, runner, scheduler, blocks, grammar_tables, grammar_compiler, prefix_cache_disabled_reason,
               async_scheduling: bool, compiled_before_warmup_ended: int | None) -> dict:
        """`compiled_before_warmup_ended`: the programs steps compiled on demand before warm-up ended (later ones are
        recompiles), None where there was no warm-up."""
        c, baseline = self.counters, compiled_before_warmup_ended
        compiled = runner.num_compiled()
        out = {
            "steps": c["steps"],
            "token_buckets": list(runner.token_buckets),
            "compiled_steps": compiled,   # (bucket, variant) pairs compiled so far
            # programs a step waited for after warm-up (a variant or grammar shape not compiled ahead)
            "recompiles": runner.compiled_on_demand - baseline if baseline is not None else None,
            "compile": runner.programs.stats(),
            "argument_buffers": runner.argument_buffers(),
            "scheduled_rows": c["scheduled_rows"],
            "scheduled_tokens": c["scheduled_tokens"],
            "padded_tokens": c["padded_tokens"],
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_preemptions": scheduler.num_preemptions,
            "num_kv_blocks": blocks.num_blocks,
            "free_kv_blocks": blocks.num_free_blocks,
            "prefix_cache": {**blocks.stats(), "disabled_reason": prefix_cache_disabled_reason},
            "async_scheduling": async_scheduling,
            "structured_outputs": {**grammar_tables.stats(), "compiled": (
                len(grammar_compiler) if grammar_compiler is not None else 0)},
        }
        if self.K:
            s, k = self.spec, self.K
            drafts, dt, acc = s["drafts"], s["draft_tokens"], s["accepted_tokens"]
            out["spec"] = {
                "num_speculative_tokens": k,
                "drafts": drafts, "draft_tokens": dt, "accepted_tokens": acc,
                "acceptance_rate": acc / dt if dt else 0.0,
                "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
                "per_position_acceptance": (s["accepted_per_position"] / drafts).tolist() if drafts else [0.0] * k,
                "adaptive": self.adaptive,
                "chosen_k": s["chosen_k"].tolist(),   # steps that proposed k drafts, k = 0..K
                # requests with SamplingParams.speculative false, and the tokens they generated without drafts
                "opted_out_requests": s["opted_out_requests"], "opted_out_tokens": s["opted_out_tokens"],
            }
        return out


def quantization_report(scheme: str | None, runner, weights_detail: str | None = None) -> dict | None:
    """Which weights are quantized, how, and how each step multiplies them (None: not quantized). `weights_detail`:
    how a quantized checkpoint stored them (its format, its scales), where it says."""
    if scheme is None:
        return None
    from jaxspec.nn import quant
    target = quant.quantized_names(runner.params)
    drafter = quant.quantized_names(runner.drafter_params) if isinstance(runner.drafter_params, dict) else []
    experts = any(".experts_" in name for name in target + drafter)
    return {"scheme": scheme, "weights": weights_detail or "float8_e4m3fn, one float32 scale per output channel",
            "activations": _activation_scheme(runner.ops)
            + ("; MoE experts W8A16 at every size (a grouped matmul)" if experts else ""),
            "target": target, "drafter": drafter,
            "kept": "embeddings, norms, biases, lm_heads (the target's, an EAGLE-3 head's), routers and gates"}


def _activation_scheme(ops) -> str:
    """How a step of each size multiplies the FP8 weights: the gemv kernel converts them (W8A16) up to its token limit;
    XLA's matmuls quantize the activations per token from w8a8_from_tokens (W8A8), convert below."""
    from jaxspec.nn.ops import GEMV_MAX_TOKENS_FP8
    xla = ("W8A16 (weights converted inside the matmul)" if ops.w8a8_from_tokens is None else
           "W8A8 (activations quantized per token to e4m3)" if ops.w8a8_from_tokens <= 1 else
           f"W8A16 below {ops.w8a8_from_tokens} tokens a step, W8A8 (per-token e4m3) from there")
    if not ops.gemv or ops.tp is not None:
        return xla
    return (f"steps of up to {GEMV_MAX_TOKENS_FP8} tokens: the gemv kernel over e4m3 tiles (W8A16) for "
            f"{', '.join(sorted(ops.gemv))}; larger steps: {xla}")
