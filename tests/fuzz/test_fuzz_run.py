"""A bounded coverage-guided fuzz run in CI: tests/fuzz/fuzz_gguf.py for a
fixed number of inputs, seeded from the committed corpus, must finish with no
crash, hang (-timeout) or memory blow-up (-rss_limit_mb).  The longer run and
how to make it: tests/fuzz/README.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNS = 2000
# libFuzzer's -rss_limit_mb reads getrusage's ru_maxrss, and Linux carries a
# process's peak RSS across execve into the program it becomes: a fuzzer
# spawned straight from this pytest process (hundreds of tests in, ~2.5 GB of
# lavapipe buffers at its peak) starts "over the limit".  A small Python
# process in between spawns it, so the fuzzer's own peak is what counts.
LAUNCH = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


@pytest.mark.timeout(600)
def test_bounded_fuzz_run_finds_nothing(tmp_path):
    pytest.importorskip("atheris")
    work = tmp_path / "corpus"          # libFuzzer adds what it finds to the first directory only
    work.mkdir()
    cmd = [sys.executable, "-c", LAUNCH, sys.executable, str(HERE / "fuzz_gguf.py"), f"-runs={RUNS}", "-seed=1",
           "-timeout=30",
           "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}/", str(work), str(HERE / "corpus")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=580,
                       env=dict(os.environ, PYTHONHASHSEED="0"))
    tail = r.stderr[-4000:]
    assert r.returncode == 0, tail
    assert re.search(rf"Done {RUNS} runs in \d+ second", r.stderr), tail
    assert not any(p.name.startswith(("crash-", "timeout-", "oom-", "leak-")) for p in tmp_path.iterdir()), tail
