"""What vramd does with a model or projector file before it touches the GPU,
called through vramd's own functions: the code under fuzzing and under the
corpus replay.

`vramd serve MODEL [--mmproj P]` and `vramd plan MODEL`, up to the device:

  validate_gguf(MODEL)                  the bounded header parser (gguf_check)
  spec_for(mf)                          the architecture's spec (vramd/engine/arch: every metadata read)
  scratch_layout(spec)                  the compute buffers it asks the residency for
  loader.kv_shape / scratch_bytes       the KV cache it asks for
  footprint(mf, ctx, n_cpu_moe=...)     --n-cpu-moe, --vram-budget (placement.plan / smallest_fit)
  Engine.text_front(mf)                 the vocabulary (Tokenizer.from_metadata, when
                                        tokenizer.ggml.model is set) and the chat template
                                        (ChatTemplate.from_metadata, compiled): in the
                                        daemon's setup, before the device
  validate_gguf(P) + load_mmproj(mf)    the projector file: its metadata and tensors

`check_model` and `check_projector` run these in the order vramd does and
raise the first refusal (a `ModelError`).  `exercise` is the fuzzer's
property: every stage runs on its own (a refusal by one does not hide the
next from the fuzzer), and anything but success or a one-line ModelError is
a `LoaderBug`.  On files that validate it also checks that

  * the reference reader `gguf.GGUFReader` reads them without error and finds
    the same tensors at the same offsets (validation is the only guard the
    reader gets: brief §9, it hung on an array length of 2^63 and recursed on
    nested arrays);
  * every byte count the load path would hand to the residency core is an
    integer in 1..2^63-1 (the native core takes a uint64 and rounds it up);
  * `vramd plan MODEL` (in this process) exits 0 or with ModelError's code
    and one line on stderr.
"""

from __future__ import annotations

import contextlib
import io

from vramd.errors import ModelError, UsageError

# Imported at module level so that the fuzzer instruments them (atheris.instrument_imports).
import gguf
from vramd import cli
from vramd.engine import runner
from vramd.engine.arch import spec_for
from vramd.engine.scratch import scratch_layout
from vramd.engine.chat import ChatTemplate
from vramd.engine.tokenizer import Tokenizer
from vramd.model import loader
from vramd.model.footprint import footprint
from vramd.model.gguf_check import ModelFile, validate_gguf
from vramd.model.mmproj import load_mmproj

CTX = 4096                      # `vramd serve`'s default --ctx
MAX_BYTES = (1 << 63) - 1       # what a byte count handed to the native core must not exceed


class LoaderBug(AssertionError):
    """The load path did something other than succeed or refuse with a one-line ModelError."""


# --- the paths as vramd runs them --------------------------------------------------------

def check_model(path: str) -> ModelFile:
    """`vramd serve MODEL` up to the device: raise the first ModelError."""
    mf = validate_gguf(path)
    cfg = spec_for(mf)
    _sizes(scratch_layout(cfg), "scratch")
    _kv_sizes(mf)
    runner.Engine.text_front(mf)                  # the vocabulary and chat template, as the daemon's setup
    return mf


def check_projector(path: str):
    """`--mmproj P` up to the device: raise the first ModelError."""
    return load_mmproj(validate_gguf(path))


# --- the fuzzer's property ------------------------------------------------------------------

def exercise(path: str) -> None:
    """Every stage of both paths on the file at `path`; LoaderBug if one misbehaves."""
    mf = _stage("validate_gguf", validate_gguf, path)
    if mf is None:
        return
    _reference_reader(path, mf)
    _stage("load_mmproj", load_mmproj, mf)
    cfg = _stage("spec_for", spec_for, mf)
    if cfg is not None:
        _stage("scratch_layout", lambda: _sizes(scratch_layout(cfg), "scratch"))
    _stage("kv_shape", _kv_sizes, mf)
    _stage("scratch_bytes", lambda: _sizes([("compute", loader.scratch_bytes(mf))], "scratch"))
    _stage("placement", _placement, mf)
    if "tokenizer.ggml.model" in mf.metadata:
        tokenizer = _stage("Tokenizer.from_metadata", Tokenizer.from_metadata, mf.metadata)
        if tokenizer is not None and _new_template(mf.metadata, tokenizer):
            _stage("ChatTemplate.from_metadata", ChatTemplate.from_metadata, mf.metadata, tokenizer)
    _cli_plan(path, *(("--vram-budget", "64M") if mf.file_size % 2 else ()),
              allowed_usage="even with every expert on the host")


def _stage(name: str, fn, *args):
    """fn(*args), or None if it refused with a one-line ModelError; LoaderBug otherwise."""
    try:
        return fn(*args)
    except ModelError as e:
        message = str(e)
        if not message or "\n" in message:
            raise LoaderBug(f"{name}: ModelError message is not one line: {message!r}") from e
        return None
    except LoaderBug:
        raise
    except Exception as e:      # noqa: BLE001 - the property under test
        raise LoaderBug(f"{name}: {type(e).__name__}: {e}") from e


_TEMPLATES_SEEN: dict[tuple, None] = {}


def _new_template(md, tokenizer) -> bool:
    """False if the template ChatTemplate.from_metadata would compile was compiled before.

    Compiling is the costliest stage (milliseconds) and a template's outcome
    depends on its source alone: the file's, or the default chosen from the
    architecture and a few tokens (chat.default_template).  The fuzzer mostly
    mutates elsewhere and keeps the template, so each source is compiled once."""
    source = md.get("tokenizer.chat_template")
    key = (source if isinstance(source, str) and source.strip() else None, md.get("general.architecture"),
           tokenizer.kind, *(tokenizer.token_id(t) is not None
                             for t in ("<start_of_turn>", "<|start_header_id|>", "<|im_start|>")))
    if key in _TEMPLATES_SEEN:
        return False
    if len(_TEMPLATES_SEEN) >= 4096:
        _TEMPLATES_SEEN.clear()
    _TEMPLATES_SEEN[key] = None
    return True


def _sizes(layout, what: str) -> None:
    for name, nbytes in layout:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 1 <= nbytes <= MAX_BYTES:
            raise LoaderBug(f"{what} buffer {name!r} would be {nbytes!r} bytes")


def _kv_sizes(mf: ModelFile) -> None:
    shape = loader.kv_shape(mf, CTX)
    if shape is not None:
        _sizes(shape.tensors()[:2], "KV cache")


def _placement(mf: ModelFile) -> None:
    for n in (0.0, 4 / 3, 2.5):
        footprint(mf, CTX, n_cpu_moe=n)
    for budget in (0, 1 << 40):
        try:
            footprint(mf, CTX, n_cpu_moe="auto", budget=budget)
        except UsageError as e:
            if "even with every expert on the host" not in str(e):
                raise


def _reference_reader(path: str, mf: ModelFile) -> None:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:      # noqa: BLE001
        raise LoaderBug(f"gguf.GGUFReader refused a file validate_gguf accepted: "
                        f"{type(e).__name__}: {e}") from e
    ours = [(t.name, int(t.type), t.offset, t.nbytes) for t in mf.tensors]
    theirs = [(t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    same_keys = set(mf.metadata) <= {k for k in reader.fields if not k.startswith("GGUF.")}
    del reader
    if ours != theirs:
        raise LoaderBug(f"gguf.GGUFReader and validate_gguf disagree on the tensors: {theirs} != {ours}")
    if not same_keys:
        raise LoaderBug("validate_gguf found metadata keys gguf.GGUFReader did not")


def _cli_plan(path: str, *flags: str, allowed_usage: str | None = None) -> None:
    """`vramd plan PATH FLAGS` in this process: exit 0, or ModelError's code with one line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(["plan", path, *flags])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:      # noqa: BLE001 - main lets it through: a traceback for the user
        raise LoaderBug(f"vramd plan {' '.join(flags)}: {type(e).__name__}: {e}") from e
    lines = err.getvalue().splitlines()
    if code == 0:
        return
    usage_ok = (code == UsageError.exit_code and allowed_usage is not None
                and allowed_usage in err.getvalue())
    if code != ModelError.exit_code and not usage_ok:
        raise LoaderBug(f"vramd plan {' '.join(flags)} exited {code}: {err.getvalue()!r}")
    if len(lines) != 1 or not lines[0].startswith("vramd: "):
        raise LoaderBug(f"vramd plan {' '.join(flags)}: stderr is not one line: {err.getvalue()!r}")

