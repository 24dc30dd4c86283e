"""The engine's counters, kept as steps are dispatched and read, and `stats()`: what they and the engine's parts
(runner, scheduler, KV blocks, grammar tables) say, as one dict."""
from __future__ import annotations

import numpy as np


class EngineCounts:
    def __init__(self, num_speculative_tokens: int, adaptive: bool):
        self.K, self.adaptive = num_speculative_tokens, adaptive
        self.counters = {"steps": 0, "scheduled_rows": 0, "padded_tokens": 0, "scheduled_tokens": 0}
        k = num_speculative_tokens
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                     "accepted_per_position": np.zeros(max(k, 1), np.int64), "chosen_k": np.zeros(k + 1, np.int64)}
        # programs compiled on demand (a step waited) before warm-up ended: later ones are recompiles
        self.compiled_at_warmup: int | None = None

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

    def count_proposal(self, k: int):
        """A step read with live sampling rows proposed k drafts each (counted as read: async counts as sync)."""
        self.spec["chosen_k"][k] += 1

    def report(self, *, runner, scheduler, blocks, grammar_tables, grammar_compiler, prefix_cache_disabled_reason,
               async_scheduling: bool) -> dict:
        c, baseline = self.counters, self.compiled_at_warmup
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
            }
        return out
