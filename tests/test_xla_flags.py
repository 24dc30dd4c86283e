"""jaxspec.xla_flags: the command-buffer update mode (SKIP_PROFILED unless named otherwise) reaches XLA_FLAGS only
where it can apply and every XLA that parses the flags knows it (XLA aborts on an unknown name)."""
import os

from jaxspec import xla_flags


def test_the_update_mode_is_set_only_where_it_applies(monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "ALWAYS_UPDATE")   # a name every jaxlib here knows
    assert xla_flags.configure() is None                      # no CUDA plugin installed (the CPU suite)

    # a CUDA plugin library that names the mode, and one from another XLA version that does not
    jaxlib = [lib for lib in xla_flags._libraries() if lib.name.startswith("libjax_common")]
    plugin, old_plugin = tmp_path / "new" / "xla_cuda_plugin.so", tmp_path / "old" / "xla_cuda_plugin.so"
    for path, text in ((plugin, b"\0ALWAYS_UPDATE\0SKIP_PROFILED\0"), (old_plugin, b"\0NEVER_UPDATE\0")):
        path.parent.mkdir()
        path.write_bytes(text)
    monkeypatch.setattr(xla_flags, "_libraries", lambda: jaxlib + [old_plugin])
    assert xla_flags.configure() is None
    monkeypatch.setattr(xla_flags, "_libraries", lambda: jaxlib + [plugin])
    assert xla_flags.configure() == "ALWAYS_UPDATE"
    flags = "--xla_force_host_platform_device_count=4 --xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"
    assert os.environ["XLA_FLAGS"] == flags
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == flags   # already named: left alone

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "NO_SUCH_MODE")    # XLA would abort on it
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == ""
    monkeypatch.setenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", "default")         # XLA's own mode
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == ""

    # unset: SKIP_PROFILED where every XLA names it, nothing where one does not (jaxlib 0.10's names)
    monkeypatch.delenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE")
    old_jaxlib, new_jaxlib = tmp_path / "old" / "libjax_common.so", tmp_path / "new" / "libjax_common.so"
    old_jaxlib.write_bytes(b"\0ALWAYS_UPDATE\0NEVER_UPDATE\0")
    new_jaxlib.write_bytes(b"\0ALWAYS_UPDATE\0SKIP_PROFILED\0")
    monkeypatch.setattr(xla_flags, "_libraries", lambda: [old_jaxlib, plugin])
    assert xla_flags.configure() is None and os.environ["XLA_FLAGS"] == ""
    monkeypatch.setattr(xla_flags, "_libraries", lambda: [new_jaxlib, plugin])
    assert xla_flags.configure() == "SKIP_PROFILED"
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"


def test_training_takes_back_only_the_mode_jaxspec_added(monkeypatch, tmp_path):
    """release_update_mode removes the flag configure() added and nothing else; a mode the user named stays."""
    jaxlib, plugin = tmp_path / "libjax_common.so", tmp_path / "xla_cuda_plugin.so"
    for path in (jaxlib, plugin):
        path.write_bytes(b"\0ALWAYS_UPDATE\0SKIP_PROFILED\0")
    monkeypatch.setattr(xla_flags, "_libraries", lambda: [jaxlib, plugin])
    monkeypatch.setattr(xla_flags, "_added", None)
    monkeypatch.delenv("JAXSPEC_COMMAND_BUFFER_UPDATE_MODE", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert xla_flags.configure() == "SKIP_PROFILED"
    assert xla_flags.release_update_mode() == "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert xla_flags.release_update_mode() is None

    named = "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"   # the user's own: configure adds nothing
    monkeypatch.setenv("XLA_FLAGS", named)
    assert xla_flags.configure() is None and xla_flags.release_update_mode() is None
    assert os.environ["XLA_FLAGS"] == named
