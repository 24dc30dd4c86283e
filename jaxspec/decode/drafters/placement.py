"""Where a drafter runs under tensor parallelism: split over the devices as the target is, or (a draft model only)
whole on each device.

A draft model split as the target is reads 1/N of its weights per forward and adds two all-reduces per layer; whole on
each device it reads all of them and adds none. Unset (SpeculativeConfig.draft_tensor_parallel_size), it runs whole
where the reads that adds take less time than the all-reduces it saves. The constants are measured: an all-reduce with
the idle around it, ~19 us at TP=2 (an H100 pair's trace, docs/lab/2026-11-27-tp-ray.md) and ~23 us at TP=4 (four
H100s' steps, docs/lab/2026-11-27-tp4.md; three or more devices are priced as four); ~3e12 bytes/s of copy bandwidth
(an H100's 2.98, an H200's 3.67 TB/s). A Llama-3.2-1B draft (2.5 GB, 16 layers) at TP=2: 0.41 ms of reads against
0.61 ms of all-reduces per forward, so whole; measured on two H200s, its four forwards a step took 0.82 ms less whole
than split (0.91x the step at batch 1, docs/lab/2026-11-28-tp-draft-h200.md). An 8B draft (16 GB, 32 layers): 2.7
against 1.2 ms, so split. EAGLE and MTP heads read the target's split embedding and lm_head: always split.
"""
from __future__ import annotations

import jax

DRAFT_ALL_REDUCE_S = {2: 19e-6, 4: 23e-6}
DRAFT_HBM_BYTES_PER_S = 3e12


def draft_runs_whole(weight_bytes: int, num_layers: int, tensor_parallel_size: int) -> bool:
    """Whether a draft model of these weights and layers runs faster whole on each of the devices than split."""
    all_reduce_s = DRAFT_ALL_REDUCE_S[2 if tensor_parallel_size == 2 else 4]
    reads_added = weight_bytes * (1 - 1 / tensor_parallel_size) / DRAFT_HBM_BYTES_PER_S
    return reads_added < 2 * num_layers * all_reduce_s


def whole_on_each_device(spec, tensor_parallel_size: int, drafter=None, drafter_params=None) -> bool:
    """Whether the drafter runs whole on every device (SpeculativeConfig.draft_tensor_parallel_size=1 under tensor
    parallelism); a ValueError names a placement that is not offered. Unset, a draft model runs whole where that is
    the faster placement (`draft_runs_whole`)."""
    d = spec.draft_tensor_parallel_size
    if d is None:
        if spec.method != "draft_model" or tensor_parallel_size == 1:
            return False
        weight_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(drafter_params))
        return draft_runs_whole(weight_bytes, drafter.config.num_layers, tensor_parallel_size)
    if d == tensor_parallel_size:
        return False
    if d != 1:
        split = f" or {tensor_parallel_size} (split as the target is)" if tensor_parallel_size > 1 else ""
        raise ValueError(f"draft_tensor_parallel_size={d} is invalid with tensor_parallel_size="
                         f"{tensor_parallel_size}; give 1 (the draft model whole on every device){split}, or "
                         "leave it unset")
    if spec.method != "draft_model":
        raise ValueError(f"draft_tensor_parallel_size=1 is implemented for method 'draft_model' only, not "
                         f"{spec.method!r} (an EAGLE or MTP head reads the target's split embedding and lm_head; "
                         f"n-gram lookup has no model): give {tensor_parallel_size} or leave it unset")
    return True
