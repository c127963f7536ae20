"""The gemma3 forward pass on the GPU (Gemma 3 270M / 1B / 4B / 12B / 27B text), driven by GGUF metadata.

Owns: `Gemma3Config` (hyper-parameters read from the metadata, plus the
values llama.cpp assumes for gemma3 that no key carries), `scratch_layout`
(the activation buffers) and `Gemma3Model.forward` (tokens at positions
p0.. -> logits, their K/V written into the KV cache).  Same interface as
vramd/engine/llama.py's LlamaModel and the same recording: one command
buffer per prefill chunk, and a one-token decode step recorded once and
replayed per token (token, position and logits through a mapped host
buffer; re-recorded after a release/restore).  What it computes is
tests/engine/reference_gemma3.py's specification, op for op.

What llama.cpp computes for general.architecture "gemma3" (its
src/models/gemma3.cpp graph and llama-model.cpp hparams), and so this module:

  x = token_embd[t] * sqrt(n_embd)                 (sqrtf, f32)
  per layer l:
    h = rms_norm(x) * attn_norm
    q, k, v = Wq h, Wk h, Wv h                      (no biases)
    q = rms_norm_per_head(q) * attn_q_norm          (over head_dim, one weight for every head)
    k = rms_norm_per_head(k) * attn_k_norm
    q, k = rope_neox(q, k; base_l, scale_l)
    o = attention(q, K, V; scale = f_attention_scale, window_l)
    x = x + rms_norm(Wo o) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    x = x + rms_norm(Wdown (gelu(Wgate h) * Wup h)) * post_ffw_norm
  logits = Woutput (rms_norm(x) * output_norm)       (Woutput = token_embd when output.weight is absent)
  logits = cap * tanh(logits / cap)                   when A.final_logit_softcapping > 0

Conventions, as found:
  * Norm weights: Gemma's RMSNorm computes x_hat * (1 + w) in HF; llama.cpp's
    convert_hf_to_gguf.py (Gemma3Model.modify_tensors, "ref code in
    Gemma3RMSNorm") adds 1 to every `*norm.weight` at conversion, and the
    graph multiplies by the stored weight (build_norm, LLM_NORM_RMS, no +1).
    So the kernel multiplies by the weight as stored.  The real Gemma 3 270M
    file agrees: its norm weights are stored "shifted" (attn_norm mean ~13,
    ffn_norm with exact 0.0 entries = HF w of -1.0, output_norm up to 301).
    With them as stored, the numpy reference continues "Q: What is the
    capital of France?\nA:" with " The capital of France is Paris." (the
    real-model test checks the GPU's continuation); with 1 + stored it
    produces "là........" and stray unicode.
  * Sliding window: A.attention.sliding_window (512 in the 270M) is read;
    when it is present and > 0, llama.cpp's set_swa_pattern(6) makes layer l
    sliding iff l % 6 < 5, i.e. every 6th layer (5, 11, 17, ...) is global.
    No key carries the pattern for gemma3 (llama.cpp reads none; no
    A.attention.sliding_window_pattern is written), so 6 is assumed here too.
    A sliding layer's query at position p sees cache rows p - window < j <= p
    (LLAMA_SWA_TYPE_STANDARD).  Without the key (or 0) every layer is global.
  * RoPE: NeoX ordering (llama.cpp's rope type for gemma3).  Global layers:
    base A.rope.freq_base (1e6 in the 270M), freq_scale 1/A.rope.scaling.factor
    for A.rope.scaling.type "linear" (the 4B-27B files carry factor 8; absent:
    1).  Sliding layers: base 10000 and scale 1, hard-coded by llama.cpp
    (rope_freq_base_train_swa / _scale_train_swa); no key.  n_rot =
    A.rope.dimension_count, default key_length.
  * Attention scale (query_pre_attn_scalar): llama.cpp uses 1/sqrt(key_length),
    except for the 27B (62 layers), where it is 1/sqrt(n_embd / n_head)
    (integer division); no key carries it.  Applied as the attention's scale.
  * GELU: ggml_gelu, the tanh approximation (native/shaders/gelu_mul.comp).
  * Final logit soft-capping: A.final_logit_softcapping, applied when present
    and > 0 (native/shaders/softcap.comp).  Gemma 3 checkpoints do not set it
    (the 270M file has no such key).  Note: llama.cpp's current gemma3 graph
    applies it only in its no-sliding-window variant; a file with both a
    window and a cap is capped here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vramd.engine.llama import MAX_BATCH, metadata_getter, rope_scale_factor, shown, vocab_size
from vramd.engine.ops import Ops, Weight, view
from vramd.errors import ModelError
from vramd.engine.decode_step import DecodeStep

ARCH = "gemma3"
SWA_PATTERN = 6            # llama.cpp: hparams.set_swa_pattern(6) for gemma3
SWA_FREQ_BASE = 10000.0    # llama.cpp: rope_freq_base_train_swa for gemma3
SWA_FREQ_SCALE = 1.0
LOGITS_BYTES = 64 << 20    # the logits buffer (all_logits chunks are cut to fit it; half lavapipe's range)


@dataclass(frozen=True)
class Gemma3Config:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    eps: float
    n_rot: int
    rope_base: float          # global layers
    rope_scale: float
    rope_base_swa: float      # sliding layers
    rope_scale_swa: float
    window: int               # 0: no sliding window
    swa_layers: tuple         # bool per layer
    attn_scale: float
    softcap: float            # 0: none
    tied_output: bool
    neox: bool = True

    @classmethod
    def from_model(cls, mf) -> "Gemma3Config":
        arch = mf.architecture
        if arch != ARCH:
            raise ModelError(f"{mf.path}: architecture {arch!r} is not {ARCH!r}")
        md = mf.metadata

        get = metadata_getter(mf)

        n_layer, n_embd, n_head = get("block_count"), get("embedding_length"), get("attention.head_count")
        n_head_kv = get("attention.head_count_kv", n_head)
        head_k = get("attention.key_length", n_embd // n_head)
        head_v = get("attention.value_length", n_embd // n_head)
        if head_k != head_v:
            raise ModelError(f"{mf.path}: key length {head_k} != value length {head_v} is not supported")
        if n_head % n_head_kv:
            raise ModelError(f"{mf.path}: {n_head} heads are not a multiple of {n_head_kv} KV heads")
        scaling = md.get(f"{arch}.rope.scaling.type", "linear")
        if scaling not in ("none", "linear"):
            raise ModelError(f"{mf.path}: RoPE scaling {shown(scaling)} is not supported (none, linear)")
        factor = rope_scale_factor(mf)
        window = md.get(f"{arch}.attention.sliding_window", 0) or 0
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ModelError(f"{mf.path}: {arch}.attention.sliding_window = {shown(window)} is not a size")
        swa = tuple(window > 0 and i % SWA_PATTERN < SWA_PATTERN - 1 for i in range(n_layer))
        softcap = float(get("final_logit_softcapping", 0.0, kind=float))
        if softcap < 0:
            raise ModelError(f"{mf.path}: {arch}.final_logit_softcapping = {softcap} is negative")
        # llama.cpp: 1/sqrt(n_embd / n_head) for the 27B (62 layers), else 1/sqrt(head_dim_k).
        attn_scale = 1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_k)
        names = {t.name for t in mf.tensors}
        n_vocab = vocab_size(mf)
        n_rot = get("rope.dimension_count", head_k)
        if n_rot % 2 or n_rot > head_k:
            raise ModelError(f"{mf.path}: rope.dimension_count {n_rot} does not fit head_dim {head_k}")
        return cls(arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                   head_dim=head_k, n_ff=get("feed_forward_length"), n_vocab=n_vocab,
                   eps=float(get("attention.layer_norm_rms_epsilon", kind=float)), n_rot=n_rot,
                   rope_base=float(get("rope.freq_base", 10000.0, kind=float)),
                   rope_scale=1.0 / factor if factor and scaling == "linear" else 1.0,
                   rope_base_swa=SWA_FREQ_BASE, rope_scale_swa=SWA_FREQ_SCALE, window=int(window),
                   swa_layers=swa, attn_scale=attn_scale, softcap=softcap,
                   tied_output="output.weight" not in names)

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    def logit_rows(self, batch: int) -> int:
        """Token rows of logits the scratch holds (a 262144-token vocabulary
        makes 1 MiB per row: a full 256-token chunk's logits would not fit
        one storage binding on lavapipe)."""
        return max(1, min(batch, LOGITS_BYTES // (4 * self.n_vocab)))


def scratch_layout(cfg: Gemma3Config, batch: int = MAX_BATCH) -> list[tuple[str, int]]:
    """Activation buffers (f32 unless said) for a chunk of `batch` tokens."""
    b = batch
    return [("x", 4 * b * cfg.n_embd), ("h", 4 * b * cfg.n_embd), ("q", 4 * b * cfg.q_width),
            ("k", 4 * b * cfg.kv_width), ("v", 4 * b * cfg.kv_width), ("att", 4 * b * cfg.q_width),
            ("gate", 4 * b * cfg.n_ff), ("up", 4 * b * cfg.n_ff),
            ("logits", 4 * cfg.logit_rows(b) * cfg.n_vocab), ("ids", 4 * b), ("pos", 4 * b)]


class Gemma3Model:
    """Forward passes of one loaded gemma3 model (weights region, KV `state` region, scratch region)."""

    def __init__(self, loaded, residency, ctx: int, scratch_region, batch: int = MAX_BATCH):
        self.file = mf = loaded.file
        self.cfg = Gemma3Config.from_model(mf)
        self.ctx, self.batch = ctx, batch
        self.ops = Ops(residency)
        self.residency = residency
        self.weights = loaded.weights.tensors
        self.kv = loaded.kv.tensors
        self.act = scratch_region.tensors
        self._types = {t.name: t for t in mf.tensors}
        self._check_tensors()
        # The one-token decode step, recorded once and replayed (as LlamaModel's):
        self._decode_step = DecodeStep(self.ops, residency, self.act, self.cfg.n_vocab)  # replayed per token

    # -- weights -----------------------------------------------------------

    def _weight(self, name: str) -> Weight:
        t = self._types[name]
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        return Weight(self.weights[name], t.type, rows, t.shape[0])

    def _check_tensors(self) -> None:
        """Every tensor the forward pass reads exists with the shape the
        metadata implies, matrices in a type the kernels run, norms in F32."""
        cfg = self.cfg
        E, Q, KV, F, hd = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.n_ff, cfg.head_dim
        want = {"token_embd.weight": (E, cfg.n_vocab), "output_norm.weight": (E,)}
        if not cfg.tied_output:
            want["output.weight"] = (E, cfg.n_vocab)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            want.update({p + "attn_norm.weight": (E,), p + "attn_q_norm.weight": (hd,),
                         p + "attn_k_norm.weight": (hd,), p + "post_attention_norm.weight": (E,),
                         p + "ffn_norm.weight": (E,), p + "post_ffw_norm.weight": (E,),
                         p + "attn_q.weight": (E, Q), p + "attn_k.weight": (E, KV), p + "attn_v.weight": (E, KV),
                         p + "attn_output.weight": (Q, E), p + "ffn_gate.weight": (E, F),
                         p + "ffn_up.weight": (E, F), p + "ffn_down.weight": (F, E)})
        for name, shape in want.items():
            t = self._types.get(name)
            if t is None:
                raise ModelError(f"{self.file.path}: missing tensor {name!r} for architecture {cfg.arch}")
            if tuple(t.shape) != shape:
                raise ModelError(f"{self.file.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            if len(shape) == 1 and int(t.type) != 0:
                raise ModelError(f"{self.file.path}: {name} must be F32")
            if len(shape) == 2:
                self._weight(name)  # raises for a tensor type the kernels do not support

    # -- forward -------------------------------------------------------------

    def forward(self, tokens: list[int], pos0: int, all_logits: bool = False,
                embeds: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Run `tokens` at positions pos0.. through the model; their K/V enter the cache.

        Returns the logits of the last token ([n_vocab]), or of every token
        ([n_tokens, n_vocab]) with all_logits (then chunks are at most
        cfg.logit_rows(batch) tokens long).  `embeds` maps indices into
        `tokens` to input embeddings used there instead of the token table
        (an image's, from the vision encoder); like llama.cpp, they are not
        scaled by sqrt(n_embd) as token embeddings are.
        """
        if not tokens:
            raise ValueError("no tokens")
        if pos0 < 0 or pos0 + len(tokens) > self.ctx:
            raise ModelError(f"positions {pos0}..{pos0 + len(tokens) - 1} outside the context of {self.ctx}")
        if len(tokens) == 1 and not all_logits and not embeds:
            return self._decode(int(tokens[0]), pos0)
        step = self.cfg.logit_rows(self.batch) if all_logits else self.batch
        out = []
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            last = start + len(chunk) == len(tokens)
            rows = {i - start: v for i, v in (embeds or {}).items() if start <= i < start + len(chunk)}
            logits = self._chunk(chunk, pos0 + start, want_all=all_logits, want_last=last and not all_logits,
                                 embeds=rows)
            if logits is not None:
                out.append(logits)
        return np.concatenate(out, axis=0) if all_logits else out[-1]

    def _decode(self, token: int, pos: int) -> np.ndarray:
        """One token at `pos` through the recorded step: the logits ([n_vocab])."""
        return self._decode_step.run(token, pos, lambda: self._record(1, want_all=False, want_logits=True))

    @property
    def step_records(self) -> int:
        return self._decode_step.records

    def profile(self, timer) -> None:
        """Times every dispatch of the decode step with `timer` (a
        vramd.gpu.timing.Timestamps; None: stop); read `timer.read()` after
        a forward of one token.  Re-records the step."""
        self._decode_step.profile(timer)

    def _record(self, n: int, want_all: bool, want_logits: bool) -> None:
        """Records the forward pass of n tokens (ids and positions in the
        scratch buffers) into the current batch: the logits of every token
        (want_all), or of the last one at row 0, or none."""
        cfg, ops, a = self.cfg, self.ops, self.act
        E, V = cfg.n_embd, cfg.n_vocab
        ops.get_rows(self._weight("token_embd.weight"), a["ids"], a["x"], n)
        ops.scale(a["x"], a["x"], n * E, math.sqrt(E))
        ops.rms_norm(a["x"], self.weights["blk.0.attn_norm.weight"], a["h"], cfg.eps, n, E)
        for i in range(cfg.n_layer):
            # each layer's last residual add is fused with the next norm
            # (the next layer's attn_norm; after the last, output_norm)
            nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layer else "output_norm.weight"
            self._layer(i, n, self.weights[nxt])
        if want_logits:
            out_w = self._weight("token_embd.weight" if cfg.tied_output else "output.weight")
            rows = n if want_all else 1
            ops.matvec(out_w, view(a["h"], 4 * (n - rows) * E, 4 * rows * E), a["logits"], rows)
            if cfg.softcap > 0:
                ops.softcap(a["logits"], a["logits"], rows * V, cfg.softcap)

    def _chunk(self, tokens: list[int], pos0: int, want_all: bool, want_last: bool,
               embeds: dict[int, np.ndarray] | None = None) -> np.ndarray | None:
        cfg, ops, a = self.cfg, self.ops, self.act
        n, V = len(tokens), cfg.n_vocab
        ops.sync()  # the previous chunk is done with ids/pos
        ids = np.asarray(tokens, dtype=np.int64)
        for i, row in (embeds or {}).items():
            # get_rows leaves the row of an id outside the table alone; the row
            # goes in divided by sqrt(n_embd) so that the scale every row then
            # gets leaves it as given (images are not scaled, as in llama.cpp).
            ids[i] = -1
            row = np.asarray(row, dtype=np.float32).reshape(cfg.n_embd) / np.float32(math.sqrt(cfg.n_embd))
            a["x"].write(np.ascontiguousarray(row), 4 * i * cfg.n_embd)
        a["ids"].write(ids.astype(np.int32))
        a["pos"].write(np.arange(pos0, pos0 + n, dtype=np.int32))
        with ops.batch():
            self._record(n, want_all, want_logits=want_all or want_last)
        ops.sync()
        if want_all:
            return a["logits"].read(np.float32, 0, 4 * n * V).reshape(n, V).copy()
        if want_last:
            return a["logits"].read(np.float32, 0, 4 * V).copy()
        return None

    def _layer(self, i: int, n: int, next_norm) -> None:
        """Layer i, from x (the residual stream) and h = attn_norm(x), made
        before; ends with x updated and h = next_norm(x)."""
        cfg, ops, a, w = self.cfg, self.ops, self.act, self.weights
        p = f"blk.{i}."
        E, KV, F, hd = cfg.n_embd, cfg.kv_width, cfg.n_ff, cfg.head_dim
        swa = cfg.swa_layers[i]
        with ops.parallel():   # independent ops: one barrier after each group
            ops.matvec(self._weight(p + "attn_q.weight"), a["h"], a["q"], n)
            ops.matvec(self._weight(p + "attn_k.weight"), a["h"], a["k"], n)
            ops.matvec(self._weight(p + "attn_v.weight"), a["h"], a["v"], n)
        with ops.parallel():   # QK-norm: every head's row of head_dim floats is a row of its own
            ops.rms_norm(a["q"], w[p + "attn_q_norm.weight"], a["q"], cfg.eps, n * cfg.n_head, hd)
            ops.rms_norm(a["k"], w[p + "attn_k_norm.weight"], a["k"], cfg.eps, n * cfg.n_head_kv, hd)
        rope = dict(n_rot=cfg.n_rot, neox=cfg.neox,
                    freq_base=cfg.rope_base_swa if swa else cfg.rope_base,
                    freq_scale=cfg.rope_scale_swa if swa else cfg.rope_scale)
        with ops.parallel():
            ops.rope(a["q"], a["pos"], n, cfg.n_head, hd, **rope)
            ops.rope(a["k"], a["pos"], n, cfg.n_head_kv, hd, **rope)
            ops.kv_write(a["v"], self.kv[f"cache_v_l{i}"], a["pos"], n, KV, self.ctx)
        ops.kv_write(a["k"], self.kv[f"cache_k_l{i}"], a["pos"], n, KV, self.ctx)
        ops.attention(a["q"], self.kv[f"cache_k_l{i}"], self.kv[f"cache_v_l{i}"], a["pos"], a["att"], n,
                      cfg.n_head, cfg.n_head_kv, hd, self.ctx, cfg.attn_scale, window=cfg.window if swa else 0,
                      tmp=a["up"])  # free until the FFN: decode attention's per-range partials
        ops.matvec(self._weight(p + "attn_output.weight"), a["att"], a["h"], n)
        ops.rms_norm(a["h"], w[p + "post_attention_norm.weight"], a["h"], cfg.eps, n, E)
        ops.add_rms_norm(a["x"], a["h"], w[p + "ffn_norm.weight"], a["h"], cfg.eps, n, E)   # x += h; h = ffn_norm(x)
        with ops.parallel():
            ops.matvec(self._weight(p + "ffn_gate.weight"), a["h"], a["gate"], n)
            ops.matvec(self._weight(p + "ffn_up.weight"), a["h"], a["up"], n)
        ops.gelu_mul(a["gate"], a["up"], a["gate"], n * F)
        ops.matvec(self._weight(p + "ffn_down.weight"), a["gate"], a["h"], n)
        ops.rms_norm(a["h"], w[p + "post_ffw_norm.weight"], a["h"], cfg.eps, n, E)
        ops.add_rms_norm(a["x"], a["h"], next_norm, a["h"], cfg.eps, n, E)

    def close(self) -> None:
        self.ops.close()
        self._decode_step.close()
