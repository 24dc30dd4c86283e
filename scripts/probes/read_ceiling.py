"""What one kernel can read at the sizes of a decode layer's weights (GPU, PyTorch): the ceiling for the issue's
"small matmuls at >= 85% of copy bandwidth".

For each of Qwen2.5-Coder-1.5B's layer matrices (28 distinct bf16 weights of it, so that L2 holds none of them
between uses), replayed from one CUDA graph back to back: a device-to-device copy of the weight (the fewest bytes a
kernel reading it moves, plus the same bytes written) and cuBLAS's x [M, K] @ W.T at M = 1, 8, 32 tokens.
Reports microseconds per matrix and the rate in TB/s (a copy: bytes read + written; a matmul: the weight's bytes
read). A 2 GiB copy is timed first as a reading of its own: on an H200 it ran at 2.77 TB/s, below the 55 MB copies
here (3.98) and the logits GEMM's read (4.33), so rates are not given as shares of it.

    python3 scripts/probes/read_ceiling.py [OUT.json]
"""
import json
import sys

import torch

LAYERS = 28
MATRICES = {"q/k/v": (2048, 1536), "o": (1536, 1536), "gate/up": (17920, 1536), "down": (1536, 8960)}


def graph_time(fn, replays: int = 20) -> float:
    """Seconds per call of `fn`, captured once in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def main():
    torch.manual_seed(0)
    big = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")    # 2 GiB
    dst = torch.empty_like(big)
    t = min(graph_time(lambda: dst.copy_(big), replays=20) for _ in range(3))   # the first replays ramp the clocks
    copy_bw = 2 * big.numel() * 2 / t
    print(f"2 GiB device copy: {t * 1e3:.3f} ms, {copy_bw / 1e12:.2f} TB/s (read + written)", flush=True)
    del big, dst
    rows = []
    for name, (N, K) in MATRICES.items():
        ws = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        outs = [torch.empty_like(w) for w in ws]
        nbytes = N * K * 2

        def copies():
            for w, o in zip(ws, outs):
                o.copy_(w)
        t = graph_time(copies) / LAYERS
        row = {"matrix": name, "N": N, "K": K, "MB": nbytes / 1e6, "copy_us": t * 1e6, "copy_tb_s": 2 * nbytes / t / 1e12}
        del outs
        for M in (1, 8, 32):
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            ys = [torch.empty(M, N, dtype=torch.bfloat16, device="cuda") for _ in ws]

            def mms():
                for w, y in zip(ws, ys):
                    torch.mm(x, w.t(), out=y)
            t = graph_time(mms) / LAYERS
            row[f"cublas_m{M}_us"] = t * 1e6
            row[f"cublas_m{M}_tb_s"] = nbytes / t / 1e12
        rows.append(row)
        print(f"{name:8s} {row['MB']:6.1f} MB: copy {row['copy_us']:6.2f} us ({row['copy_tb_s']:.2f} TB/s); cuBLAS "
              + ", ".join(f"M={M} {row[f'cublas_m{M}_us']:6.2f} us ({row[f'cublas_m{M}_tb_s']:.2f} TB/s)"
                          for M in (1, 8, 32)), flush=True)
        del ws
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_tb_s": copy_bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
