"""jaxspec.xla_flags: the command-buffer update mode reaches XLA_FLAGS only where it can apply and is known."""
import importlib.util
import os

from jaxspec import xla_flags


def test_the_update_mode_is_set_only_where_it_applies(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "ALWAYS_UPDATE")   # a name every jaxlib here knows
    assert xla_flags.configure() is None                      # no CUDA plugin installed (the CPU suite)

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name in xla_flags.CUDA_PLUGINS else real_find_spec(name))
    assert xla_flags.configure() == "ALWAYS_UPDATE"
    flags = "--xla_force_host_platform_device_count=4 --xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"

    assert os.environ["XLA_FLAGS"] == flags
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == flags   # already named: left alone

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "NO_SUCH_MODE")    # XLA would abort on it
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == ""
    monkeypatch.delenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE")                    # opt-in: nothing by default
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == ""
