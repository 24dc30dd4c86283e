"""A trained EAGLE-3 head in bfloat16, for carrying it off and back onto the GPU machine in later sessions.

A head of Qwen2.5-Coder-1.5B is ~420 MB as the trainer writes it (float32). Training it again costs ~4.5 minutes of
device time a session; a bfloat16 copy (~210 MB) leaves in ~14 files of 15 MiB and comes back in ~4 staged
chunks. An engine in bfloat16 casts a head's weights to bfloat16 when it loads them (round to nearest even, as
here), so it serves the copy exactly as the original; vLLM reads it as a published head.

    python3 benchmarks/end_to_end/head_transfer.py bf16 /tmp/gpu/chain /tmp/send/chain
    python3 benchmarks/end_to_end/head_transfer.py check /tmp/gpu/chain /tmp/send/chain   # same weights in bf16

Files besides model.safetensors (config.json, training.json) are copied; checkpoints/ is not.
"""
import argparse
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open


def read_tensors(path: Path) -> dict:
    with safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def to_bf16(src: Path, dst: Path):
    dst.mkdir(parents=True, exist_ok=True)
    for extra in src.iterdir():
        if extra.is_file() and extra.name != "model.safetensors":
            shutil.copy2(extra, dst / extra.name)
    import torch   # numpy has no bfloat16 for safetensors' numpy writer (gguf_to_hf.py writes through torch too)
    from safetensors.torch import save_file
    save_file({name: torch.from_numpy(a).to(torch.bfloat16) if a.dtype == np.float32 else torch.from_numpy(a)
               for name, a in read_tensors(src / "model.safetensors").items()}, str(dst / "model.safetensors"))


def check(src: Path, dst: Path) -> bool:
    """Every tensor of dst equals src's, float32 ones rounded to bfloat16."""
    a, b = read_tensors(src / "model.safetensors"), read_tensors(dst / "model.safetensors")
    if a.keys() != b.keys():
        print(f"tensor names differ: {sorted(a.keys() ^ b.keys())}")
        return False
    bad = [n for n in a if not np.array_equal(
        (a[n].astype(ml_dtypes.bfloat16) if a[n].dtype == np.float32 else a[n]).view(np.uint8), b[n].view(np.uint8))]
    print(f"{len(a) - len(bad)}/{len(a)} tensors equal" + (f"; differ: {bad}" if bad else ""))
    return not bad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["bf16", "check"])
    p.add_argument("src", type=Path, help="the head's directory as the trainer wrote it")
    p.add_argument("dst", type=Path, help="the bfloat16 copy's directory")
    args = p.parse_args()
    if args.command == "bf16":
        to_bf16(args.src, args.dst)
        print(f"{args.dst}: {(args.dst / 'model.safetensors').stat().st_size / 2**20:.1f} MiB")
    sys.exit(0 if check(args.src, args.dst) else 1)


if __name__ == "__main__":
    main()
