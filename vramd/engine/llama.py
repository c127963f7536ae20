"""The llama-family forward pass on the GPU (llama 2/3, Mistral, Qwen2), driven by GGUF metadata.

Owns: `LlamaConfig` (hyper-parameters read from the metadata, with the
checks that make an unsupported model a one-line ModelError at load),
`scratch_layout` (the activation buffers, sized for --ctx and a prefill
batch, placed in a residency `scratch` region) and `LlamaModel.forward`
(tokens at positions p0.. -> logits, writing their K/V into the KV cache, a
residency `state` region).

What it computes is tests/engine/reference.py's specification, op for op
(vramd/engine/ops.py's kernels); every op of a forward chunk is recorded
into one command buffer and submitted once.

Decode (one token, last logits) does not record at all: the one-token step
is recorded once into an `ops.graph()` and replayed for every token — no
Python work per layer per token.  The token id and position go in, and the
logits come out, through a small mapped host buffer (kernels.HostBuffer):
the step starts by copying id and position into their scratch buffers
(every kernel reads them from there) and ends by copying the logits out, so
a token costs one submit and one wait.  The recording binds device buffers as they are; a release
or restore of any region may move them, so the graph is re-recorded when
the residency core's `generation` has changed since (the scratch region is
re-created lazily on its next use after a release, by that recording).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vramd.engine.ops import Ops, Weight, view
from vramd.errors import ModelError
from vramd.engine.decode_step import DecodeStep

ARCHITECTURES = {"llama": False, "qwen2": True}   # architecture -> NeoX RoPE ordering
MAX_BATCH = 256                                   # tokens per prefill chunk


# Upper bound of every integer hyper-parameter read through metadata_getter: far above
# real models (the widest FFNs are ~10^5), and low enough that no buffer size
# computed from a few of them (KV cache, scratch) can overflow 64 bits.
MAX_HPARAM = 1 << 20
_MAX_HPARAM_BY_KEY = {"block_count": 1 << 12}   # as vramd.model.gguf_check bounds it


def shown(value) -> str:
    """repr(value), cut short: a metadata value in a one-line error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def metadata_getter(mf):
    """get(key, default=None, kind=int): `<architecture>.<key>` from the metadata, checked:
    missing (and no default), of the wrong kind, an integer outside 1..MAX_HPARAM or a
    number that is not finite is a ModelError naming the file and key."""
    arch, md = mf.architecture, mf.metadata

    def get(key, default=None, kind=int):
        v = md.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelError(f"{mf.path}: missing {arch}.{key}")
        if kind is int:
            limit = _MAX_HPARAM_BY_KEY.get(key, MAX_HPARAM)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= limit:
                raise ModelError(f"{mf.path}: {arch}.{key} = {shown(v)} is not a positive integer "
                                 f"(1..{limit})")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ModelError(f"{mf.path}: {arch}.{key} = {shown(v)} is not a finite number")
        return v
    return get


def vocab_size(mf) -> int:
    """n_vocab: the columns of token_embd.weight ([n_embd, n_vocab] in ggml order)."""
    if not any(t.name == "token_embd.weight" for t in mf.tensors):
        raise ModelError(f"{mf.path}: no token_embd.weight")
    shape = mf.tensor("token_embd.weight").shape
    if len(shape) != 2:
        raise ModelError(f"{mf.path}: token_embd.weight has shape {list(shape)}, expected [n_embd, n_vocab]")
    return shape[1]


def rope_scale_factor(mf, keys=("rope.scaling.factor", "rope.scale_linear")) -> float:
    """The first of `keys` present (`<architecture>.` prefixed): a linear RoPE
    scaling factor, checked to be a finite number >= 0; 0.0 when none is."""
    for key in keys:
        v = mf.metadata.get(f"{mf.architecture}.{key}")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ModelError(f"{mf.path}: {mf.architecture}.{key} = {shown(v)} is not a finite number >= 0")
        return float(v)
    return 0.0


@dataclass(frozen=True)
class LlamaConfig:
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
    rope_base: float
    rope_scale: float
    neox: bool
    tied_output: bool

    @classmethod
    def from_model(cls, mf) -> "LlamaConfig":
        arch = mf.architecture
        if arch not in ARCHITECTURES:
            raise ModelError(f"{mf.path}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        md = mf.metadata

        get = metadata_getter(mf)

        n_embd, n_head = get("embedding_length"), get("attention.head_count")
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
        names = {t.name for t in mf.tensors}
        n_vocab = vocab_size(mf)
        return cls(arch=arch, n_layer=get("block_count"), n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                   head_dim=head_k, n_ff=get("feed_forward_length"), n_vocab=n_vocab,
                   eps=float(get("attention.layer_norm_rms_epsilon", kind=float)),
                   n_rot=get("rope.dimension_count", head_k),
                   rope_base=float(get("rope.freq_base", 10000.0, kind=float)),
                   rope_scale=1.0 / factor if factor else 1.0, neox=ARCHITECTURES[arch],
                   tied_output="output.weight" not in names)

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim


def scratch_layout(cfg: LlamaConfig, batch: int = MAX_BATCH) -> list[tuple[str, int]]:
    """Activation buffers (f32 unless said) for a chunk of `batch` tokens."""
    b = batch
    return [("x", 4 * b * cfg.n_embd), ("h", 4 * b * cfg.n_embd), ("q", 4 * b * cfg.q_width),
            ("k", 4 * b * cfg.kv_width), ("v", 4 * b * cfg.kv_width), ("att", 4 * b * cfg.q_width),
            ("gate", 4 * b * cfg.n_ff), ("up", 4 * b * cfg.n_ff), ("logits", 4 * b * cfg.n_vocab),
            ("ids", 4 * b), ("pos", 4 * b)]


class LlamaModel:
    """Forward passes of one loaded model (weights region, KV `state` region, scratch region)."""

    def __init__(self, loaded, residency, ctx: int, scratch_region, batch: int = MAX_BATCH):
        self.file = mf = loaded.file
        self.cfg = LlamaConfig.from_model(mf)
        self.ctx, self.batch = ctx, batch
        self.ops = Ops(residency)
        self.residency = residency
        self.weights = loaded.weights.tensors
        self.kv = loaded.kv.tensors
        self.act = scratch_region.tensors
        self._types = {t.name: t for t in mf.tensors}
        self._check_shapes()
        self._decode_step = DecodeStep(self.ops, residency, self.act, self.cfg.n_vocab)  # replayed per token

    # -- weights -----------------------------------------------------------

    def _has(self, name: str) -> bool:
        return name in self._types

    def _weight(self, name: str) -> Weight:
        if not self._has(name):
            raise ModelError(f"{self.file.path}: missing tensor {name!r}")
        t = self._types[name]
        cols = t.shape[0]
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        return Weight(self.weights[name], t.type, rows, cols)

    def _vector(self, name: str, n: int):
        t = self._types.get(name)
        if t is None:
            return None
        if int(t.type) != 0 or t.n_elements != n:
            raise ModelError(f"{self.file.path}: {name} must be F32 of {n} elements")
        return self.weights[name]

    def _check_shapes(self) -> None:
        """Every tensor the forward pass reads exists with the shape the metadata implies."""
        cfg = self.cfg
        want = {"token_embd.weight": (cfg.n_embd, cfg.n_vocab), "output_norm.weight": (cfg.n_embd,)}
        if not cfg.tied_output:
            want["output.weight"] = (cfg.n_embd, cfg.n_vocab)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            want.update({p + "attn_norm.weight": (cfg.n_embd,), p + "ffn_norm.weight": (cfg.n_embd,),
                         p + "attn_q.weight": (cfg.n_embd, cfg.q_width), p + "attn_k.weight": (cfg.n_embd, cfg.kv_width),
                         p + "attn_v.weight": (cfg.n_embd, cfg.kv_width), p + "attn_output.weight": (cfg.q_width, cfg.n_embd),
                         p + "ffn_gate.weight": (cfg.n_embd, cfg.n_ff), p + "ffn_up.weight": (cfg.n_embd, cfg.n_ff),
                         p + "ffn_down.weight": (cfg.n_ff, cfg.n_embd)})
        for name, shape in want.items():
            t = self._types.get(name)
            if t is None:
                raise ModelError(f"{self.file.path}: missing tensor {name!r} for architecture {cfg.arch}")
            if tuple(t.shape) != shape:
                raise ModelError(f"{self.file.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        for name in want:
            if len(want[name]) == 2:
                self._weight(name)  # raises for a tensor type the kernels do not support

    # -- forward -------------------------------------------------------------

    def forward(self, tokens: list[int], pos0: int, all_logits: bool = False,
                embeds: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Run `tokens` at positions pos0.. through the model; their K/V enter the cache.

        Returns the logits of the last token ([n_vocab]), or of every token
        ([n_tokens, n_vocab]) with all_logits.  `embeds` maps indices into
        `tokens` to input embeddings ([n_embd] each, e.g. an image's from the
        vision encoder) used there instead of the token embedding table.
        """
        if not tokens:
            raise ValueError("no tokens")
        if pos0 < 0 or pos0 + len(tokens) > self.ctx:
            raise ModelError(f"positions {pos0}..{pos0 + len(tokens) - 1} outside the context of {self.ctx}")
        if len(tokens) == 1 and not all_logits and not embeds:
            return self._decode(int(tokens[0]), pos0)
        out = []
        for start in range(0, len(tokens), self.batch):
            chunk = tokens[start:start + self.batch]
            last = start + len(chunk) == len(tokens)
            want = all_logits or last
            rows = {i - start: v for i, v in (embeds or {}).items() if start <= i < start + len(chunk)}
            logits = self._chunk(chunk, pos0 + start, want_all=all_logits, want_last=last and not all_logits,
                                 embeds=rows)
            if want:
                out.append(logits)
        if all_logits:
            return np.concatenate(out, axis=0)
        return out[-1]

    def _decode(self, token: int, pos: int) -> np.ndarray:
        """One token at `pos` through the recorded step: the logits ([n_vocab])."""
        return self._decode_step.run(token, pos, lambda: self._record(1, want_all=False))

    @property
    def step_records(self) -> int:
        return self._decode_step.records

    def profile(self, timer) -> None:
        """Times every dispatch of the decode step with `timer` (a
        vramd.gpu.timing.Timestamps; None: stop); read `timer.read()` after
        a forward of one token.  Re-records the step."""
        self._decode_step.profile(timer)

    def _record(self, n: int, want_all: bool) -> None:
        """Records the forward pass of n tokens (ids and positions in the
        scratch buffers) into the current batch: the logits of every token,
        or of the last one at row 0."""
        cfg, ops, a = self.cfg, self.ops, self.act
        E = cfg.n_embd
        ops.get_rows(self._weight("token_embd.weight"), a["ids"], a["x"], n)
        ops.rms_norm(a["x"], self.weights["blk.0.attn_norm.weight"], a["h"], cfg.eps, n, E)
        for i in range(cfg.n_layer):
            # Each layer ends with its residual add fused with the next norm:
            # the next layer's attn_norm, after the last the output_norm.
            nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layer else "output_norm.weight"
            self._layer(i, n, self.weights[nxt])
        out_w = self._weight("token_embd.weight" if cfg.tied_output else "output.weight")
        if want_all:
            ops.matvec(out_w, a["h"], a["logits"], n)
        else:
            ops.matvec(out_w, view(a["h"], 4 * (n - 1) * E, 4 * E), a["logits"], 1)

    def _chunk(self, tokens: list[int], pos0: int, want_all: bool, want_last: bool,
               embeds: dict[int, np.ndarray] | None = None) -> np.ndarray | None:
        cfg, ops, a = self.cfg, self.ops, self.act
        n = len(tokens)
        ops.sync()  # the previous chunk is done with ids/pos
        ids = np.asarray(tokens, dtype=np.int64)
        for i, row in (embeds or {}).items():
            # get_rows leaves the row of an id outside the table alone: the
            # embedding written here stays where the token's would have gone.
            ids[i] = -1
            a["x"].write(np.ascontiguousarray(row, dtype=np.float32).reshape(cfg.n_embd), 4 * i * cfg.n_embd)
        a["ids"].write(ids.astype(np.int32))
        a["pos"].write(np.arange(pos0, pos0 + n, dtype=np.int32))
        with ops.batch():
            self._record(n, want_all)
        ops.sync()
        if want_all:
            return a["logits"].read(np.float32, 0, 4 * n * cfg.n_vocab).reshape(n, cfg.n_vocab).copy()
        if want_last:
            return a["logits"].read(np.float32, 0, 4 * cfg.n_vocab).copy()
        return None

    def _linear(self, name: str, x, y, n: int, width: int) -> None:
        self._linears([(name, x, y, width)], n)

    def _linears(self, items, n: int) -> None:
        """y = W x (+ bias) for independent (name, x, y, width) items: the
        matvecs run side by side (one barrier after them all), then the bias
        adds, likewise."""
        ops = self.ops
        with ops.parallel():
            for name, x, y, _width in items:
                ops.matvec(self._weight(name + ".weight"), x, y, n)
        biases = [(y, b, width) for name, _x, y, width in items
                  if (b := self._vector(name + ".bias", width)) is not None]
        if biases:
            with ops.parallel():
                for y, b, width in biases:
                    ops.add(y, b, y, n * width, width)

    def _layer(self, i: int, n: int, next_norm) -> None:
        """Layer i: from x (the residual) and h = attn_norm(x), made before;
        ends with x updated and h = next_norm(x)."""
        cfg, ops, a = self.cfg, self.ops, self.act
        p = f"blk.{i}."
        E, Q, KV, F, hd = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.n_ff, cfg.head_dim
        self._linears([(p + "attn_q", a["h"], a["q"], Q), (p + "attn_k", a["h"], a["k"], KV),
                       (p + "attn_v", a["h"], a["v"], KV)], n)
        rope = dict(n_rot=cfg.n_rot, neox=cfg.neox, freq_base=cfg.rope_base, freq_scale=cfg.rope_scale,
                    freq_factors=self.weights.get("rope_freqs.weight"))
        with ops.parallel():  # q rotates in place, k rotated into the cache, V to the cache as it is
            ops.rope(a["q"], a["pos"], n, cfg.n_head, hd, **rope)
            ops.rope_kv_write(a["k"], self.kv[f"cache_k_l{i}"], a["pos"], n, cfg.n_head_kv, hd, self.ctx, **rope)
            ops.kv_write(a["v"], self.kv[f"cache_v_l{i}"], a["pos"], n, KV, self.ctx)
        # tmp: "up" is free until the FFN; decode attention keeps its per-range partials there
        ops.attention(a["q"], self.kv[f"cache_k_l{i}"], self.kv[f"cache_v_l{i}"], a["pos"], a["att"], n,
                      cfg.n_head, cfg.n_head_kv, hd, self.ctx, 1.0 / math.sqrt(hd), tmp=a["up"])
        self._linear(p + "attn_output", a["att"], a["h"], n, E)
        ops.add_rms_norm(a["x"], a["h"], self.weights[p + "ffn_norm.weight"], a["h"], cfg.eps, n, E)
        self._linears([(p + "ffn_gate", a["h"], a["gate"], F), (p + "ffn_up", a["h"], a["up"], F)], n)
        ops.silu_mul(a["gate"], a["up"], a["gate"], n * F)
        self._linear(p + "ffn_down", a["gate"], a["h"], n, E)
        ops.add_rms_norm(a["x"], a["h"], next_norm, a["h"], cfg.eps, n, E)

    def close(self) -> None:
        self.ops.close()
        self._decode_step.close()
