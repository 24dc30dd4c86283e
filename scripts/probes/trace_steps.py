"""Per-step device time of each kernel kind in a jax.profiler trace (GPU): which steps of a traced run are slow.
    python3 scripts/probes/trace_steps.py TRACE_DIR [kernel-prefix ...]"""
import collections
import glob
import sys

from jax.profiler import ProfileData

path = sorted(glob.glob(f"{sys.argv[1]}/**/*.xplane.pb", recursive=True))[-1]
prefixes = sys.argv[2:] or ["paged_attention", "gemv", "gemm_fusion_dot_general_169"]
evs = []
for plane in ProfileData.from_file(path).planes:
    if "GPU" in plane.name:
        for line in plane.lines:
            evs += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
evs.sort()
steps, cur, start = [], collections.Counter(), None
for s, d, name in evs:
    start = s if start is None else start
    for p in prefixes:
        if name.startswith(p):
            cur[p] += d
            cur[p + " n"] += 1
    cur["all"] += d
    if name.startswith("gemm_fusion_dot_general_169"):   # the logits matmul ends a step
        steps.append((start, cur))
        cur, start = collections.Counter(), None
t0 = steps[0][0] if steps else 0
for s, c in steps:
    print(f"{(s - t0) / 1e3:10.1f} us  all {c['all'] / 1e3:8.1f} us  " + "  ".join(
        f"{p[:16]} {c[p] / 1e3:7.1f} us x{c[p + ' n']}" for p in prefixes))
