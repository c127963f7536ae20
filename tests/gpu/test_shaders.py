"""The committed .spv files are what glslc makes of their sources."""
import shutil
import subprocess
from pathlib import Path

import pytest

from vramd.gpu.kernels import glslc_command

SHADERS = Path(__file__).resolve().parents[2] / "native" / "shaders"
SOURCES = sorted(SHADERS.glob("*.comp"))


def test_there_are_shaders():
    assert SOURCES, SHADERS


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_spv_matches_its_source(source, tmp_path):
    if shutil.which("glslc") is None:
        pytest.fail("glslc is missing: apt install glslc (scripts/setup.sh does)")
    out = tmp_path / (source.stem + ".spv")
    subprocess.run(glslc_command(source, out), check=True)
    committed = source.with_suffix(".spv")
    assert committed.read_bytes() == out.read_bytes(), (
        f"{committed.name} is stale: run {' '.join(glslc_command(source, committed))}")
