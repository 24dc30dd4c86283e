"""XLA flags jaxspec can set before JAX starts a GPU backend (XLA reads XLA_FLAGS once, when the backend starts).

xla_gpu_command_buffer_update_mode is set to SKIP_PROFILED by default (JAXSPEC_COMMAND_BUFFER_UPDATE_MODE names
another mode; "default" or an empty value leaves XLA's own). XLA captures the step as one CUDA graph and
re-records it whenever a buffer it captured has moved. The step's inputs, outputs and state keep their addresses
(jaxspec.decode.runner), but XLA's temporary buffer moves whenever something else was allocated between two steps (the
next step's input transfer, the copy of the previous outputs), and the re-recording, issued behind the running step,
holds the host until that step ends. In this mode XLA learns which allocations move over its first executions and gives
them fixed virtual addresses (VMM remapping): no re-recording after that (the step's host call behind a running step 1.0
ms instead of 2.7 ms on an H100, docs/lab/2026-11-25-graph-rerecording.md). Outputs are bit-identical with and without
it (greedy digests, H100 and H200). On an H100 the loop was bound by the device and ran no faster; on an H200 (a 1.4-1.6
ms device step, Qwen2.5-Coder-1.5B, its tokenizer rendering text every step) batch 1 ran at TPOT 1.44-1.55 ms with it
(three runs) against 1.66-1.72 ms without (two), and batch 8 and 32 within the runs' spread either way
(docs/lab/2026-11-26-h200-side-by-side.md).

Set only where a CUDA plugin is installed, XLA_FLAGS does not already name the option, and jaxlib and the CUDA
plugin (each parses XLA_FLAGS) both know the mode: its names changed between XLA versions, and XLA aborts on an
unknown one. The same flag passed as a per-compile option (jax.jit's compiler_options) is accepted but left the
re-recording as it was on the H100: it has to be in XLA_FLAGS.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import pathlib

# jax[cuda12] / jax[cuda13]'s PJRT plugins: XLA's GPU compiler and runtime live in their shared library
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _libraries() -> list[pathlib.Path]:
    """The shared libraries that parse XLA_FLAGS: jaxlib's and the installed CUDA plugin's."""
    libs = []
    for name in ("jaxlib",) + CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:   # no jax_plugins namespace at all
            spec = None
        if spec is not None and spec.origin is not None:
            libs += pathlib.Path(spec.origin).parent.glob("*.so")
    return libs


def _libraries_name(word: str, libs) -> bool:
    """Whether every one of `libs` carries `word` (an enum value's name): XLA in each parses the flag."""
    def names(lib):
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(word.encode()) >= 0
    xla_libs = [lib for lib in libs if lib.name.startswith(("libjax_common", "xla_cuda_plugin"))]
    return bool(xla_libs) and all(names(lib) for lib in xla_libs)


DEFAULT_UPDATE_MODE = "SKIP_PROFILED"
_added: str | None = None   # the flag configure() added to XLA_FLAGS, if any


def configure() -> str | None:
    """Adds jaxspec's XLA flags to XLA_FLAGS where they apply; returns the update mode set, or None."""
    flags = os.environ.get("XLA_FLAGS", "")
    mode = os.environ.get("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", DEFAULT_UPDATE_MODE)
    if mode in ("", "default") or "xla_gpu_command_buffer_update_mode" in flags:
        return None
    libs = _libraries()
    if not any(lib.name.startswith("xla_cuda_plugin") for lib in libs) or not _libraries_name(mode, libs):
        return None
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_command_buffer_update_mode={mode}".strip()
    global _added
    _added = f"--xla_gpu_command_buffer_update_mode={mode}"
    return mode


def release_update_mode() -> str | None:
    """Takes back the update mode configure() added (not one the user named), before JAX starts its backend: for
    a process that replays no decode step, such as training. Returns the flag removed, or None. On an H100 on
    2026-11-28, EAGLE-3 training under SKIP_PROFILED (whose VMM allocator XLA turns on with it) was killed by a
    segmentation fault at its orbax checkpoint save in both runs that had it; the same runs without it finished."""
    global _added
    flags = os.environ.get("XLA_FLAGS", "").split()
    if _added is None or _added not in flags:
        return None
    removed, _added = _added, None
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f != removed)
    return removed
