"""The vision encoder (mmproj): image pixels -> the embeddings the language model receives.

Owns: `VisionEncoder`, built from an mmproj GGUF (checked by
vramd/model/mmproj.py): its tensors go into a residency `encoder` region —
kept in host memory, brought to the device just in time for an encode and
released right after — and its activations into a `scratch` region freed
after each encode.  `last_phases` holds the times of the last encode's
restore, graph and release (vramd bench encode reports them).
`encode(pixels)` runs inside `session()`:
if the encoder (and its activations) do not fit next to the language model, the backbone
weights are released first (no copy: their shadow is read-only), the KV
cache stays, and the encoder is freed before the weights come back, so the
peak stays within the budget.

The graph is clip.cpp's for the two projectors vramd supports (see
tests/engine/reference_vision.py, the specification): patch embedding,
position embedding, optional class token and pre/post LayerNorm, ViT
layers (LayerNorm, non-causal attention, FFN with the file's activation),
then the LLaVA MLP projector or Gemma 3's pool + RMSNorm + projection.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
from gguf import GGMLQuantizationType as Q

from vramd.engine.ops import Weight, view
from vramd.engine.vision_ops import VisionOps
from vramd.errors import ModelError, OutOfDeviceMemory
from vramd.failpoints import failpoint


def n_positions(cfg, info) -> int:
    """Positions the ViT runs over: the patches, and the class token if the file has one."""
    return cfg.n_patches + (1 if info.has_class_embd else 0)


def layouts(mf, cfg, info) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The encoder region's tensors and its activations' (the scratch region) as [(name, nbytes)]:
    what `VisionEncoder` allocates, and what vramd/model/footprint.py counts."""
    weights = [(n, mf.tensor(n).nbytes) for n in info.names]
    e, n, text, s = cfg.n_embd, n_positions(cfg, info), info.n_embd_text, cfg.image_size
    act = [("img", 4 * 3 * s * s), ("x", 4 * n * e), ("h", 4 * n * e), ("q", 4 * n * e), ("k", 4 * n * e),
           ("v", 4 * n * e), ("a", 4 * n * e), ("f", 4 * n * cfg.n_ff), ("pooled", 4 * cfg.n_patches * e),
           ("m", 4 * n * text), ("y", 4 * n * text)]
    return weights, act


class VisionEncoder:
    def __init__(self, path: str, residency, name: str = "mmproj", resident: bool = False):
        from vramd.model.gguf_check import validate_gguf
        from vramd.model.mmproj import load_mmproj

        self.path = path
        self.residency = residency
        self.resident = resident   # --mmproj-resident: stays on the device after an encode
        # The benchmark's: wait for the upload to finish before the graph, so
        # restore and encode are timed apart (serving overlaps the two).
        self.wait_for_restore = False
        self.last_phases: dict = {}
        self.file = mf = validate_gguf(path)
        self.cfg, self.info = cfg, info = load_mmproj(mf)
        self._types = {n: mf.tensor(n).type for n in info.names}
        self._shapes = {n: tuple(mf.tensor(n).shape) for n in info.names}
        if cfg.projector == "gemma3":
            # llama.cpp multiplies mm.input_projection transposed (y = x W): it is
            # placed transposed once, so the ordinary matvec applies.
            p = "mm.input_projection.weight"
            if self._types[p] not in (Q.F16, Q.F32):
                raise ModelError(f"{path}: {p} must be F16 or F32 (it is stored transposed)")
            self._shapes[p] = tuple(reversed(self._shapes[p]))
        weights, act = layouts(mf, cfg, info)
        self.region = residency.region("encoder", f"{name}/encoder", weights)
        self.act = residency.region("scratch", f"{name}/act", act)
        try:
            self._read_shadows()
        except BaseException:
            self.close()
            raise
        self.ops = VisionOps(residency)

    @property
    def n_positions(self) -> int:
        return n_positions(self.cfg, self.info)

    @property
    def n_tokens(self) -> int:
        """Embeddings one image becomes in the language model's prompt."""
        return self.cfg.n_tokens

    def _read_shadows(self) -> None:
        with open(self.path, "rb") as f:
            for name in self.info.names:
                ti = self.file.tensor(name)
                f.seek(ti.offset)
                raw = np.frombuffer(f.read(ti.nbytes), np.uint8)
                if len(raw) != ti.nbytes:
                    raise ModelError(f"{self.path}: truncated while reading {name!r}")
                if self.cfg.projector == "gemma3" and name == "mm.input_projection.weight":
                    dt = np.float16 if self._types[name] == Q.F16 else np.float32
                    w = raw.view(dt).reshape(tuple(reversed(self.file.tensor(name).shape)))
                    raw = np.ascontiguousarray(w.T).view(np.uint8).reshape(-1)
                self.region.tensors[name].host()[:] = raw

    def _t(self, name: str):
        return self.region.tensors[name] if name in self.region.tensors else None

    def _w(self, name: str) -> Weight:
        shape = self._shapes[name]
        return Weight(self._t(name), self._types[name], int(np.prod(shape[1:])), shape[0])

    def _linear(self, name: str, src, dst, n_tok: int) -> None:
        w = self._w(name + ".weight")
        self.ops.matvec(w, src, dst, n_tok)
        if self._t(name + ".bias") is not None:
            self.ops.add(dst, self._t(name + ".bias"), dst, n_tok * w.rows, b_len=w.rows)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """float32 [3, S, S] (vramd/model/image.py) -> [n_tokens, n_embd_text] embeddings."""
        s = self.cfg.image_size
        if pixels.shape != (3, s, s):
            raise ModelError(f"{self.path}: an image must be preprocessed to 3 x {s} x {s}, got {pixels.shape}")
        with self.session() as phases:
            t0 = time.perf_counter()
            self.act.tensors["img"].write(np.ascontiguousarray(pixels, dtype=np.float32))
            self._graph()
            failpoint("encode.mid")   # the graph is submitted and running
            self.ops.sync()
            out = self.act.tensors["y"].read(np.float32, 0, 4 * self.n_tokens * self.info.n_embd_text) \
                .reshape(self.n_tokens, self.info.n_embd_text).copy()
            phases["encode_s"] = time.perf_counter() - t0
            return out

    @contextlib.contextmanager
    def session(self):
        """The encoder and its activations on the device for one encode, then freed.

        If they do not fit, the backbone weights go first (no copy: their
        shadow is read-only) while the KV cache stays; on the way back the
        encoder is freed before the weights return, so the peak stays within
        the budget.  If even that does not fit: the weights come back, the
        error goes up, and text requests go on as before.  If the weights
        themselves cannot come back (the memory was taken meanwhile), the
        error goes up with them released: the daemon then goes cold (every
        buffer released, the token dropped; `Daemon._cold_unless_whole`), so
        the next request restores them, or is refused with a 503 until the
        memory is back.

        Yields `last_phases`: restore_s (bringing it in, weights' release
        included), restore_bytes (what the upload copied: 0 when resident),
        evicted_weights; release_s (sending it out and the weights back) is
        added on the way out."""
        res = self.residency
        phases = self.last_phases = {"evicted_weights": False}
        t0 = time.perf_counter()
        evicted = False
        try:
            copied = self._bring_in()
        except OutOfDeviceMemory:
            self._send_out()
            if not any(r.kind == "weights" and r.resident for r in res.regions):
                raise
            res.release(["weights"])
            res.drain()
            evicted = phases["evicted_weights"] = True
            try:
                copied = self._bring_in()
            except BaseException:  # whatever failed, the encoder leaves and the weights come back
                self._send_out()
                res.restore(["weights"])
                raise
        except BaseException:
            self._send_out()   # a failure other than "does not fit": the encoder does not stay either
            raise
        if self.wait_for_restore:
            res.sync()
        phases["restore_s"] = time.perf_counter() - t0
        phases["restore_bytes"] = copied
        try:
            yield phases
        finally:
            t0 = time.perf_counter()
            self.ops.sync()
            if evicted or not self.resident:
                self._send_out()
            if evicted:
                res.restore(["weights"])
            phases["release_s"] = time.perf_counter() - t0

    def _bring_in(self) -> int:
        """Returns the bytes the encoder's upload copied (0: it was resident)."""
        was_resident = self.region.resident
        self.region.restore()
        # Read now: allocating the scratch below is a restore too, of no bytes.
        copied = 0 if was_resident else self.residency.stats()["restore_bytes"]
        self.act.tensors["x"].buffer()   # scratch is allocated on first use: use it now, inside the plan
        return copied

    def _send_out(self) -> None:
        self.act.release()
        self.region.release()
        self.residency.drain()   # the memory is back with the driver before anything else allocates

    def _graph(self) -> None:
        cfg, info, ops, t = self.cfg, self.info, self.ops, self.act.tensors
        e, side, p, n = cfg.n_embd, cfg.patches_per_side, cfg.patch_size, self.n_positions
        cls = 1 if info.has_class_embd else 0
        text = info.n_embd_text
        with ops.batch():
            if cls:
                ops.copy(self._t("v.class_embd"), t["x"], 4 * e)
            ops.patch_embed(t["img"], Weight(self._t("v.patch_embd.weight"), self._types["v.patch_embd.weight"], e,
                                             3 * p * p),
                            self._t("v.patch_embd.bias"), view(t["x"], 4 * e * cls), 3, cfg.image_size,
                            cfg.image_size, p)
            ops.add(t["x"], self._t("v.position_embd.weight"), t["x"], n * e)
            if info.has_pre_ln:
                ops.layer_norm(t["x"], self._t("v.pre_ln.weight"), self._t("v.pre_ln.bias"), t["x"], cfg.eps, n, e)
            for i in range(cfg.n_layer_run):
                b = f"v.blk.{i}."
                ops.layer_norm(t["x"], self._t(b + "ln1.weight"), self._t(b + "ln1.bias"), t["h"], cfg.eps, n, e)
                with ops.parallel():
                    for m in "qkv":
                        self._linear(b + "attn_" + m, t["h"], t[m], n)
                ops.attention_full(t["q"], t["k"], t["v"], t["a"], n, cfg.n_head, cfg.head_dim, cfg.head_dim ** -0.5)
                self._linear(b + "attn_out", t["a"], t["h"], n)
                ops.add(t["x"], t["h"], t["x"], n * e)
                ops.layer_norm(t["x"], self._t(b + "ln2.weight"), self._t(b + "ln2.bias"), t["h"], cfg.eps, n, e)
                up, down = info.ffn_names[i]
                self._linear(up, t["h"], t["f"], n)
                ops.activation(t["f"], t["f"], n * cfg.n_ff, cfg.ffn_act)
                self._linear(down, t["f"], t["h"], n)
                ops.add(t["x"], t["h"], t["x"], n * e)
            if info.has_post_ln:
                ops.layer_norm(t["x"], self._t("v.post_ln.weight"), self._t("v.post_ln.bias"), t["x"], cfg.eps, n, e)
            if cfg.projector == "mlp":
                patches = view(t["x"], 4 * e * cls)  # the class position is dropped
                self._linear("mm.0", patches, t["m"], cfg.n_patches)
                ops.gelu(t["m"], t["m"], cfg.n_patches * text, "tanh")
                self._linear("mm.2", t["m"], t["y"], cfg.n_patches)
            else:
                ops.avg_pool_2d(t["x"], t["pooled"], side, cfg.n_merge, e)
                ops.rms_norm(t["pooled"], self._t("mm.soft_emb_norm.weight"), t["pooled"], cfg.eps, cfg.n_tokens, e)
                ops.matvec(self._w("mm.input_projection.weight"), t["pooled"], t["y"], cfg.n_tokens)

    def close(self) -> None:
        if getattr(self, "ops", None) is not None:
            self.ops.close()
            self.ops = None
        for region in (getattr(self, "act", None), getattr(self, "region", None)):
            if region is not None and region._r is not None:
                region.destroy()
