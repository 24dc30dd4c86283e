"""XLA flags jaxspec can set before JAX starts a GPU backend (XLA reads XLA_FLAGS once, when the backend starts).

JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=SKIP_PROFILED (opt-in) sets xla_gpu_command_buffer_update_mode. XLA captures
the step as one CUDA graph and re-records it whenever a buffer it captured has moved. The step's inputs, outputs and state keep their addresses
(jaxspec.decode.runner), but XLA's temporary buffer moves whenever something else was allocated between two
steps (the next step's input transfer, the copy of the previous outputs), and the re-recording, issued behind
the running step, held the host 1-2 ms per step on an H100. In this mode XLA learns which allocations move over
its first executions and gives them fixed virtual addresses (VMM remapping): no re-recording after that, and
the step's host call behind a running step took 1.0 ms instead of 2.7 ms (docs/benchmarks.md). Not yet the
default: that the engine's outputs are unchanged under it and its effect on the whole loop are unmeasured
(scripts/probes/update_mode_exact.py, scripts/profile_step.py). Set only where a CUDA plugin is installed,
XLA_FLAGS does not already name the option, and the installed jaxlib knows the mode (its names changed between
XLA versions, and XLA aborts on an unknown one).
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import pathlib

CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _jaxlib_names(word: str) -> bool:
    """Whether the installed jaxlib's XLA carries `word` (an enum value name) in its shared library."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return False
    for lib in pathlib.Path(spec.origin).parent.glob("libjax_common*.so"):
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(word.encode()) >= 0:
                return True
    return False


def configure() -> str | None:
    """Adds jaxspec's XLA flags to XLA_FLAGS where they apply; returns the update mode set, or None."""
    flags = os.environ.get("XLA_FLAGS", "")
    mode = os.environ.get("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "")
    if not mode or "xla_gpu_command_buffer_update_mode" in flags:
        return None
    if not any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS) or not _jaxlib_names(mode):
        return None
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_command_buffer_update_mode={mode}".strip()
    return mode
