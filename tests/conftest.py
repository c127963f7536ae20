"""Fixtures shared by several test folders."""

import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llama_peer_bin(tmp_path_factory):
    """tests/arena/llama_peer.c, compiled: a peer that knows only flock + doorbell."""
    out = tmp_path_factory.mktemp("cpeer") / "llama_peer"
    src = Path(__file__).parent / "arena" / "llama_peer.c"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-o", str(out), str(src)], check=True)
    return out
