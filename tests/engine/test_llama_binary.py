"""vramd/bench/llama_binary.py: which llama-server the oracle and the benchmarks run."""

import os
import stat

import pytest

from vramd.bench.llama_binary import llama_server_binary
from vramd.errors import UsageError


def _script(path):
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_environment_variable_wins(tmp_path, monkeypatch):
    exe = _script(tmp_path / "my-llama-server")
    monkeypatch.setenv("VRAMD_LLAMA_SERVER", str(exe))
    b = llama_server_binary()
    assert (b.path, b.origin) == (str(exe), "$VRAMD_LLAMA_SERVER")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VRAMD_LLAMA_SERVER", "my-llama-server")   # a command, looked up
    assert llama_server_binary().path == str(exe)


def test_a_bad_environment_variable_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMD_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="VRAMD_LLAMA_SERVER"):
        llama_server_binary()
    (tmp_path / "plain").write_text("not executable")
    monkeypatch.setenv("VRAMD_LLAMA_SERVER", str(tmp_path / "plain"))
    with pytest.raises(UsageError, match="not an executable"):
        llama_server_binary()


def test_without_it_the_native_build_or_the_prebuilt(monkeypatch):
    """setup.sh links the native build only where the prebuilt dies (scripts/setup.sh)."""
    monkeypatch.delenv("VRAMD_LLAMA_SERVER", raising=False)
    b = llama_server_binary()
    want = "native build" if os.path.basename(b.path) == "llama-server-native" else "prebuilt"
    assert b.origin == want and os.access(os.path.realpath(b.path), os.X_OK)
