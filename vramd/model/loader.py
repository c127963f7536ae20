"""From a validated GGUF file to residency regions: weights, KV cache, scratch.

The file is validated first (gguf_check), then every tensor's bytes are read
once, straight from the file into the region's host shadow (pread into the
shadow's memory: no intermediate copy), so a restore is one DMA from memory
the device reads directly.  The KV cache (a `state` region) and the compute
scratch are sized from the model's metadata and --ctx.  Nothing touches the
device here: the daemon takes the token before the first upload.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vramd.engine.kvcache import KVLayout
from vramd.errors import ModelError
from vramd.model.gguf_check import ModelFile, validate_gguf

SCRATCH_BATCH = 512       # tokens a prefill step processes at once


@dataclass
class LoadedModel:
    file: ModelFile
    weights: object              # vramd.gpu.residency.Region
    kv: object | None
    scratch: object
    kv_shape: KVLayout | None        # the KV cache's geometry (vramd/engine/kvcache.py)
    load_seconds: float = 0.0
    regions: list = field(default_factory=list)
    # Tensors placed on the host (--n-cpu-moe): raw bytes in plain memory,
    # computed on the CPU; never part of the residency swap.
    host: dict = field(default_factory=dict)


def arch_int(mf: ModelFile, key: str, default: int | None = None) -> int | None:
    """`<architecture>.<key>` through the engine's one metadata reader
    (vramd/engine/arch/hparams.py: bounded, so the KV cache and scratch sized
    from it stay within 64 bits); None when absent without a default."""
    from vramd.engine.arch.hparams import Hparams
    if default is None and f"{mf.architecture}.{key}" not in mf.metadata:
        return None
    return Hparams(mf).get(key, default)


def kv_shape(mf: ModelFile, ctx: int, n_seq: int = 1) -> KVLayout | None:
    """KV cache geometry from the metadata, for `n_seq` sequences of ctx positions each
    (parallel slots; the one place n_seq is given: the engine reads it back from the
    loaded layout); None if the model does not say.  Where the
    geometry differs per layer (head_count_kv an array, a key_length_swa: gemma4's
    sliding and global layers; gemma4 E-models' KV-sharing layers, which keep none), no one
    pair of keys gives it: the engine's spec does."""
    from vramd.engine.arch import spec_for, supported
    from vramd.errors import VramdError
    a, md = mf.architecture, mf.metadata
    if (supported(a) and (isinstance(md.get(f"{a}.attention.head_count_kv"), list)
                          or f"{a}.attention.key_length_swa" in md or md.get(f"{a}.attention.shared_kv_layers"))) \
            or f"{a}.ssm.state_size" in md:
        # per-layer geometry (gemma4) or a recurrent state beside K/V (qwen35): the spec's
        try:
            return KVLayout.for_spec(spec_for(mf), ctx, n_seq)
        except VramdError:
            pass   # not runnable (vramd plan still shows the estimate below): K/V from the keys
    layers = arch_int(mf, "block_count")
    n_embd = arch_int(mf, "embedding_length")
    n_head = arch_int(mf, "attention.head_count")
    if layers is None or n_embd is None or n_head is None:
        return None
    per_layer = md.get(f"{a}.attention.head_count_kv")
    n_head_kv = max(int(v) for v in per_layer) if isinstance(per_layer, list) and per_layer \
        else arch_int(mf, "attention.head_count_kv", n_head)   # an array (gemma4): the widest layer's
    k_dim = arch_int(mf, "attention.key_length", n_embd // n_head or 1)
    v_dim = arch_int(mf, "attention.value_length", n_embd // n_head or 1)
    return KVLayout(layers, ctx, k_dim * n_head_kv, v_dim * n_head_kv, n_seq)


def kv_layout(shape: KVLayout) -> list[tuple[str, int]]:
    """The KV cache region's tensors, [(name, nbytes)]: one K and one V per layer."""
    return shape.tensors()


def scratch_bytes(mf: ModelFile) -> int:
    """Compute buffers for one prefill batch: activations plus logits (an estimate
    until the engine sizes its own; it is what the breakdown shows meanwhile)."""
    n_embd = arch_int(mf, "embedding_length", 1)
    n_ff = arch_int(mf, "feed_forward_length", 4 * n_embd)
    vocab = len(mf.metadata.get("tokenizer.ggml.tokens", ())) or 32000
    return 4 * (SCRATCH_BATCH * (3 * n_embd + 2 * n_ff) + vocab)


def load(path: str | os.PathLike, residency, ctx: int, *, name: str = "model",
         progress: bool | None = None, scratch=None, mf: ModelFile | None = None,
         host_tensors=(), n_seq: int = 1) -> LoadedModel:
    """Validate `path`, lay out its regions, read its tensors into the host shadows.

    `scratch`: the compute buffers as [(name, nbytes)] (the engine knows
    them); without it one buffer of an estimated size stands in.  `progress`:
    True for a bar on stderr (the default when it is a terminal), or a
    callable given (bytes read, bytes in all) after each tensor.  `n_seq`: sequences the
    KV cache holds (kv_shape).
    """
    t0 = time.monotonic()
    mf = mf or validate_gguf(path)
    on_host = set(host_tensors)
    weights = residency.region("weights", f"{name}/weights",
                               [(t.name, t.nbytes) for t in mf.tensors if t.name not in on_host])
    regions = [weights]
    try:
        shape = kv_shape(mf, ctx, n_seq)
        kv = None
        if shape is not None:
            kv = residency.region("state", f"{name}/kv", kv_layout(shape))
            regions.append(kv)
        scratch = residency.region("scratch", f"{name}/scratch", scratch or [("compute", scratch_bytes(mf))])
        regions.append(scratch)
        read_tensors(mf, weights, progress=sys.stderr.isatty() if progress is None else progress,
                     host=(host := {}), on_host=on_host)
    except BaseException:
        for region in reversed(regions):  # nothing half-loaded
            region.destroy()
        raise
    return LoadedModel(mf, weights, kv, scratch, shape, time.monotonic() - t0, regions, host)


def read_tensors(mf: ModelFile, region, progress=False, host: dict | None = None,
                 on_host=frozenset()) -> None:
    """pread every tensor into its shadow (or, if in `on_host`, into a plain array in `host`);
    check the file did not change since validation."""
    total = sum(t.nbytes for t in mf.tensors)
    done = 0
    fd = os.open(mf.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != tuple(mf.identity):
            raise ModelError(f"{mf.path}: the file changed while it was being loaded")
        bar = progress if callable(progress) else _Progress(Path(mf.path).name, total) if progress else None
        for t in mf.tensors:
            if t.name in on_host:
                host[t.name] = np.empty(t.nbytes, dtype=np.uint8)
                dest = memoryview(host[t.name])
            else:
                dest = memoryview(region.tensors[t.name].host())
            got = 0
            while got < t.nbytes:
                n = os.preadv(fd, [dest[got:]], t.offset + got)
                if n <= 0:
                    raise ModelError(f"{mf.path}: truncated while reading tensor {t.name!r}")
                got += n
            done += t.nbytes
            if callable(bar):
                bar(done, total)
            elif bar:
                bar.update(done)
        if bar and not callable(bar):
            bar.finish()
    finally:
        os.close(fd)


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.t0, self.last = label, max(total, 1), time.monotonic(), 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < self.total:
            return
        self.last = now
        frac = done / self.total
        rate = done / max(now - self.t0, 1e-9) / 2**30
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\rloading {self.label} [{bar:<30}] {frac:6.1%} {rate:5.2f} GiB/s")
        sys.stderr.flush()

    def finish(self) -> None:
        self.update(self.total)
        sys.stderr.write("\n")
