"""tests/gpu: checks that only mean something on a GPU (Pallas kernels lowered through Triton, XLA's CUDA graphs,
bf16 engines on the device). Every test here is marked `gpu`; on any other backend it is skipped, so `pytest tests`
on a CPU collects them and moves on.

tests/conftest.py picks the CPU unless JAX_PLATFORMS says otherwise, so the GPU machine names the platform, and
runs them in one process (two workers would share one GPU):

    JAX_PLATFORMS=cuda python -m pytest -q -n 0 tests/gpu
"""
import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend: {jax.default_backend()}); on the GPU machine: "
                                   "JAX_PLATFORMS=cuda python -m pytest -q -n 0 tests/gpu")
    for item in gpu_items:
        item.add_marker(skip)
