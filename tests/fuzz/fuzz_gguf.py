#!/usr/bin/env python3
"""Coverage-guided fuzzing of vramd's model and projector file loading (atheris, libFuzzer).

    python tests/fuzz/fuzz_gguf.py [libFuzzer flags] [CORPUS_DIR ...]

Each input is the bytes of one file.  It is written to a memfd and goes,
by path, through everything vramd does with a model or `--mmproj` file
before it touches the GPU (tests/fuzz/loadpath.py: validation, the gguf
reader on what validation passed, the engines' hyper-parameters, the sizes
handed to the residency core, placement, the vocabulary, the chat template,
the projector checks, `vramd plan`).  The property: success, or a one-line
`vramd.errors.ModelError`; anything else raises and libFuzzer saves the
input as crash-<sha1>.  A hang is caught by `-timeout=SECONDS`, a memory
blow-up by `-rss_limit_mb=MB` (both on by default below).

Instrumented: vramd and gguf (the Python reader); not numpy, jinja2 or the
standard library, so coverage means vramd's (and the reader's) branches.

Defaults added unless given: -dict=tests/fuzz/gguf.dict -timeout=20
-rss_limit_mb=2048 -max_len=65536, and tests/fuzz/corpus as a seed corpus
when no corpus directory is named.  libFuzzer writes new inputs into the
*first* corpus directory: name a scratch directory first and the committed
corpus second, e.g.

    mkdir -p /tmp/fuzz-gguf
    nice -n 19 .venv/bin/python tests/fuzz/fuzz_gguf.py -runs=1000000 /tmp/fuzz-gguf tests/fuzz/corpus

Replay one input (no fuzzing):  python tests/fuzz/fuzz_gguf.py crash-<sha1>
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import atheris

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

with atheris.instrument_imports(include=["vramd", "gguf", "tests.fuzz.loadpath"]):
    from tests.fuzz import loadpath
from tests.fuzz import gguf_mutator  # noqa: E402  (not instrumented: it is the fuzzer's, not under test)

_FD = os.memfd_create("fuzz.gguf", os.MFD_CLOEXEC)
_PATH = f"/proc/self/fd/{_FD}"


def test_one_input(data: bytes) -> None:
    os.ftruncate(_FD, 0)
    if data:
        os.pwrite(_FD, data, 0)
    loadpath.exercise(_PATH)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """Half the time a structural edit (tests/fuzz/gguf_mutator.py), else libFuzzer's byte mutations."""
    if seed & 1:
        out = gguf_mutator.mutate(data, max_size, seed >> 1)
        if out is not None:
            return out
    return atheris.Mutate(data, max_size)


def _with_defaults(argv: list[str]) -> list[str]:
    flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("-")}
    extra = []
    for flag, value in (("-dict", str(HERE / "gguf.dict")), ("-timeout", "20"),
                        ("-rss_limit_mb", "2048"), ("-max_len", "65536")):
        if flag not in flags:
            extra.append(f"{flag}={value}")
    paths = [a for a in argv[1:] if not a.startswith("-")]
    if not paths:
        extra.append(str(HERE / "corpus"))
    return [argv[0], *extra, *argv[1:]]


def main() -> None:
    atheris.Setup(_with_defaults(sys.argv), test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
