"""A test-only kernel: one step of a toy recurrent state (tests/gpu/shaders/state_step.comp).

The residency tests run it between release and restore cycles to prove that
state written by compute survives eviction (numpy computes the same words).
It ships nowhere: the shader is compiled into tests/gpu/shaders/ and checked
against its source by test_shaders.py with the package's shaders.
"""
import struct
from pathlib import Path

from vramd.gpu.kernels import Kernel

SHADERS = Path(__file__).resolve().parent / "shaders"


class StateStep(Kernel):
    """words = words * mul + add (uint32), over a whole tensor."""

    def __init__(self, residency):
        super().__init__(residency, "state_step", n_buffers=1, push_bytes=12, spv=SHADERS / "state_step.spv")

    def __call__(self, tensor, mul: int, add: int) -> None:
        """One step over the whole tensor, one dispatch per storage view."""
        for view in tensor.views():
            words = view[2] // 4
            self.dispatch([view], struct.pack("<III", words, mul & 0xFFFFFFFF, add & 0xFFFFFFFF), words)
