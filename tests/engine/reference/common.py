"""What the numpy references share: dequantization, the building blocks, the cache, the metadata.

Owns `dequantize_tensor` (a GGUF tensor -> float32 in numpy order), `rms_norm`,
`rope_angles` / `rope` (both orderings), `silu`, `top2_margin`, `ReferenceKV`
(the explicit K/V cache, in a chosen dtype), `metadata_key` (the `A.name`
reader with defaults and one-line errors), `read_attention` (the attention
and RoPE hyper-parameters the llama family and the MoEs read alike),
`start_forward` (every forward's cache and token-id rules) and `Tensors`
(taking weights by name with their shapes checked, and telling which tensors
were never taken).  Plain numpy; nothing of vramd's engine
(vramd.model.gguf_check reads the file).  llama.py's header is the
specification these pieces serve (layouts, RoPE, precision).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, quants

from vramd.model.gguf_check import ModelFile, TensorInfo


def dequantize_tensor(mf: ModelFile, info: TensorInfo) -> np.ndarray:
    """The tensor's values as float32 in numpy order (ggml shape reversed)."""
    block_size, block_bytes = GGML_QUANT_SIZES[info.type]
    row_len = info.shape[0]
    if row_len % block_size:
        raise ValueError(f"{info.name}: row length {row_len} is not a multiple of "
                         f"{info.type.name}'s block {block_size}")
    n_rows = info.n_elements // row_len
    with open(mf.path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:
        raise ValueError(f"{info.name}: file shorter than the tensor")
    data = np.frombuffer(raw, dtype=np.uint8).reshape(n_rows, row_len // block_size * block_bytes)
    values = quants.dequantize(data, info.type)
    return np.asarray(values, dtype=np.float32).reshape(info.numpy_shape)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_angles(positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float,
                freq_factors: np.ndarray | None = None, yarn: "Yarn | None" = None) -> np.ndarray:
    """theta[n, i] for each position n and pair i < n_rot/2, in float64.  With `yarn`
    (ggml's rope_yarn): pair i takes (1 - mix_i) of the interpolated angle (times
    freq_scale) and mix_i of the extrapolated one (without), mix_i = ext_factor *
    (1 - clip((i - lo) / max(0.001, hi - lo), 0, 1)), [lo, hi] = yarn.corr_dims(...)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = freq_base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    extrap = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    if yarn is None:
        return freq_scale * extrap
    lo, hi = yarn.corr_dims(n_rot, freq_base)
    mix = yarn.ext_factor * (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0))
    return freq_scale * extrap * (1.0 - mix) + extrap * mix


class Yarn:
    """YaRN as llama.cpp runs it: ext_factor 1, the correction range from the original
    context and beta_fast / beta_slow (ggml_rope_yarn_corr_dims: the pairs that turn
    fewer than beta_fast and more than beta_slow times over n_ctx_orig)."""

    def __init__(self, n_ctx_orig: int, beta_fast: float = 32.0, beta_slow: float = 1.0, ext_factor: float = 1.0):
        self.n_ctx_orig, self.beta_fast, self.beta_slow, self.ext_factor = n_ctx_orig, beta_fast, beta_slow, ext_factor

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        def pair(turns: float) -> float:   # the pair index whose wavelength is n_ctx_orig / turns
            return n_rot * math.log(self.n_ctx_orig / (turns * 2.0 * math.pi)) / (2.0 * math.log(base))
        return max(0.0, math.floor(pair(self.beta_fast))), min(n_rot - 1.0, math.ceil(pair(self.beta_slow)))


def rope(x: np.ndarray, theta: np.ndarray, ordering: str, magnitude: float = 1.0) -> np.ndarray:
    """Rotate x [n_tokens, n_heads, head_dim] by theta [n_tokens, n_rot/2] in `ordering`,
    the rotated pairs multiplied by `magnitude` (YaRN's / LongRoPE's mscale; a scalar or
    one per token)."""
    n_rot = 2 * theta.shape[1]
    out = x.copy()
    mag = np.broadcast_to(np.asarray(magnitude, dtype=np.float64), (theta.shape[0],))[:, None, None]
    cos = (np.cos(theta)[:, None, :] * mag).astype(x.dtype)
    sin = (np.sin(theta)[:, None, :] * mag).astype(x.dtype)
    if ordering == "normal":
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    elif ordering == "neox":
        half = n_rot // 2
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        raise ValueError(f"unknown RoPE ordering {ordering!r}")
    return out


class ReferenceKV:
    """The K/V cache of one sequence: for every layer, K (after RoPE) and V of
    positions 0 .. n-1, each [n, n_head_kv, head_dim], stored in `dtype`."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 dtype: type = np.float32):
        self.dtype = np.dtype(dtype)
        self.k = [np.zeros((0, n_head_kv, head_dim_k), self.dtype) for _ in range(n_layer)]
        self.v = [np.zeros((0, n_head_kv, head_dim_v), self.dtype) for _ in range(n_layer)]

    def __len__(self) -> int:
        return self.k[0].shape[0]

    def truncate(self, n: int) -> None:
        """Forget positions n and later (a prefix reuse keeps the first n)."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot truncate a cache of {len(self)} positions to {n}")
        self.k = [k[:n] for k in self.k]
        self.v = [v[:n] for v in self.v]

    def copy(self) -> "ReferenceKV":
        other = ReferenceKV.__new__(ReferenceKV)
        other.dtype = self.dtype
        other.k = [k.copy() for k in self.k]
        other.v = [v.copy() for v in self.v]
        return other


def silu(z: np.ndarray) -> np.ndarray:
    """z * sigmoid(z) = z / (1 + exp(-z)), written with tanh so that it never overflows."""
    return z * 0.5 * (1.0 + np.tanh(0.5 * z))


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """For each row, the highest logit minus the runner-up: how far a greedy
    choice is from flipping."""
    part = np.partition(logits, -2, axis=-1)
    return part[..., -1] - part[..., -2]


def metadata_key(md: dict, arch: str, path) -> Callable[..., Any]:
    """key(name, default=None, required=False) -> md[f"{arch}.{name}"]; a missing
    required key is a ValueError naming the file and the key."""

    def key(name: str, default=None, required: bool = False):
        full = f"{arch}.{name}"
        if full in md:
            return md[full]
        if required:
            raise ValueError(f"{path}: missing {full}")
        return default

    return key


def read_attention(m, key: Callable[..., Any], md: dict, path) -> None:
    """Set on `m` what llama.py's header lists: n_layer, n_embd, n_head, n_head_kv,
    head_dim_k, head_dim_v, eps, n_rot, freq_base, freq_scale (none/linear
    scaling only), n_ctx_train, bos, eos."""
    m.n_layer = int(key("block_count", required=True))
    m.n_embd = int(key("embedding_length", required=True))
    m.n_head = int(key("attention.head_count", required=True))
    m.n_head_kv = int(key("attention.head_count_kv", m.n_head))
    if m.n_head % m.n_head_kv:
        raise ValueError(f"{path}: head_count {m.n_head} is not a multiple of "
                         f"head_count_kv {m.n_head_kv}")
    m.head_dim_k = int(key("attention.key_length", m.n_embd // m.n_head))
    m.head_dim_v = int(key("attention.value_length", m.n_embd // m.n_head))
    m.eps = float(key("attention.layer_norm_rms_epsilon", required=True))
    m.n_rot = int(key("rope.dimension_count", m.head_dim_k))
    if m.n_rot % 2 or not 0 < m.n_rot <= m.head_dim_k:
        raise ValueError(f"{path}: rope.dimension_count {m.n_rot} does not fit "
                         f"head_dim {m.head_dim_k}")
    m.freq_base = float(key("rope.freq_base", 10000.0))
    read_rope_scaling(m, key, path)
    m.n_ctx_train = key("context_length", None)
    m.bos = md.get("tokenizer.ggml.bos_token_id")
    m.eos = md.get("tokenizer.ggml.eos_token_id")


def read_rope_scaling(m, key: Callable[..., Any], path, yarn_keys: bool = False) -> None:
    """Set m.freq_scale, m.yarn (a Yarn or None), m.n_ctx_orig and m.rope_magnitude(freq_scale)
    from A.rope.scaling.* as llama.cpp's context reads them: "none" never scales; "linear",
    "yarn" and "longrope" take freq_scale = 1/factor (absent or 0: 1); "yarn" adds the mix
    (beta_fast 32, beta_slow 1 unless the architecture reads A.rope.scaling.yarn_beta_*:
    yarn_keys) and cos/sin are multiplied by A.rope.scaling.attn_factor (default 1) times,
    for YaRN, 1 + 0.1 ln(1 / freq_scale) of the layer -- with A.rope.scaling.yarn_log_multiplier
    L (yarn_keys only) the factor-level part becomes mscale(f, 1) / mscale(f, L),
    mscale(f, m) = 1 + 0.1 m ln f (1 for f <= 1)."""
    scaling = key("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not implemented by the reference")
    factor = key("rope.scaling.factor", None)
    if factor is None:
        factor = key("rope.scale_linear", 0.0)
    factor = float(factor)
    m.freq_scale = 1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor
    m.n_ctx_orig = int(key("rope.scaling.original_context_length", key("context_length", 0)))
    attn = float(key("rope.scaling.attn_factor", 1.0))
    m.yarn = None
    if scaling == "yarn":
        fast = float(key("rope.scaling.yarn_beta_fast", 32.0)) if yarn_keys else 32.0
        slow = float(key("rope.scaling.yarn_beta_slow", 1.0)) if yarn_keys else 1.0
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0)) if yarn_keys else 0.0
        m.yarn = Yarn(m.n_ctx_orig, fast, slow)
        f = 1.0 / m.freq_scale

        def mscale(mul: float) -> float:
            return 1.0 if f <= 1.0 else 1.0 + 0.1 * mul * math.log(f)
        if log_mul:   # the kernel's own (1 + 0.1 ln f) is cancelled, this ratio stands instead
            attn = attn * mscale(1.0) / mscale(log_mul) / (1.0 + 0.1 * math.log(f))
        else:
            attn = attn * mscale(1.0) / (1.0 + 0.1 * math.log(f))

    def magnitude(freq_scale: float) -> float:
        return attn * (1.0 + 0.1 * math.log(1.0 / freq_scale)) if m.yarn is not None else attn

    m.rope_magnitude = magnitude


class Greedy:
    """Greedy decoding for a reference model: what it needs of the model is `new_kv(dtype)`,
    `forward(tokens, kv)` (logits of each token, the cache advanced) and `n_vocab`."""

    def greedy(self, prompt, n: int, *, kv_dtype: type = np.float32, stop=()) -> list[int]:
        """The n tokens greedy decoding appends to `prompt` (prefill, then one token at a
        time), ending early after a token in `stop` (which is included).  EOS does not stop
        it unless it is in `stop`."""
        return self.greedy_logits(prompt, n, kv_dtype=kv_dtype, stop=stop)[0]

    def greedy_logits(self, prompt, n: int, *, kv_dtype: type = np.float32, stop=()) -> tuple[list[int], np.ndarray]:
        """Like greedy(), also returning the logits [len(out), n_vocab] each token was chosen
        from (so a test can see how close the runner-up was)."""
        kv = self.new_kv(kv_dtype)
        logits = self.forward(prompt, kv)[-1]
        out, rows = [], []
        for _ in range(n):
            token = int(np.argmax(logits))
            out.append(token)
            rows.append(logits)
            if token in stop or len(out) == n:
                break
            logits = self.forward([token], kv)[-1]
        return out, np.array(rows).reshape(len(rows), self.n_vocab)


class Tensors:
    """`take(name, shape, optional)`: the dequantized tensor in `dtype`, its numpy
    shape checked (None: any); a missing one is a ValueError unless optional.
    `unknown()`: the names never taken, for a reference to refuse."""

    def __init__(self, tensors: dict[str, np.ndarray], path: str, dtype):
        self.tensors, self.path, self.dtype = dict(tensors), path, dtype
        self.known: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...] | None, optional: bool = False):
        if name not in self.tensors:
            if optional:
                return None
            raise ValueError(f"{self.path}: missing tensor {name}")
        self.known.add(name)
        value = self.tensors[name]
        if shape is not None and value.shape != shape:
            raise ValueError(f"{self.path}: {name} has shape {value.shape} (numpy order), "
                             f"expected {shape}")
        return value.astype(self.dtype)

    def unknown(self) -> list[str]:
        return sorted(set(self.tensors) - self.known)


def start_forward(model, tokens, kv: ReferenceKV | None, pos0: int | None):
    """What every reference's forward begins with: (kv, ids, positions).  kv None:
    a fresh model.new_kv(); pos0 None: len(kv); pos0 < len(kv) drops positions
    >= pos0 (prefix reuse); pos0 > len(kv), an empty list or an id outside the
    vocabulary is a ValueError."""
    if kv is None:
        kv = model.new_kv()
    if pos0 is None:
        pos0 = len(kv)
    if pos0 > len(kv):
        raise ValueError(f"pos0 {pos0} beyond the {len(kv)} cached positions")
    kv.truncate(pos0)
    ids = np.asarray(list(tokens), dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError("forward needs a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= model.n_vocab:
        raise ValueError(f"token id outside 0..{model.n_vocab - 1}")
    return kv, ids, np.arange(pos0, pos0 + len(ids))
