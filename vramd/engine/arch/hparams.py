"""The one reader of a model's hyper-parameters from its GGUF metadata, with its bounds.

Owns: `Hparams` (`<architecture>.<key>` read and checked: missing, of the
wrong kind, an integer outside 1..MAX_HPARAM or a number that is not finite
is a ModelError naming the file and the key), the checks every architecture
shares (heads a multiple of KV heads, key length = value length, RoPE
scaling: none, linear, YaRN, LongRoPE's magnitude), and `common()`, the
geometry every transformer spec starts from (rope_scaling included).

Every architecture reads its metadata through here, so an unsupported
setting is refused the same way everywhere: the MoE forward pass used to
accept `rope.scaling.type = "yarn"` and apply it as linear, and 4 heads over
3 KV heads, where the llama one refused both.  `vramd.model.gguf_check`
bounds the same keys (REQUIRED_KEYS, MAX_BY_KEY) before a file is trusted.
"""

from __future__ import annotations

import math

from vramd.engine.arch.spec import RopeScaling
from vramd.errors import ModelError

# Upper bound of every integer hyper-parameter: far above real models (the
# widest FFNs are ~10^5), and low enough that no buffer size computed from a
# few of them (KV cache, scratch) can overflow 64 bits.
MAX_HPARAM = 1 << 20
MAX_BY_KEY = {"block_count": 1 << 12, "attention.head_count": 1 << 12}
# Keys no architecture runs without (beyond general.architecture): gguf_check
# refuses a file that lacks them before anything else reads it.
REQUIRED_KEYS = ("block_count", "embedding_length", "attention.head_count")
# RoPE scalings the kernels compute (llama.cpp's rope.scaling.type names).  "longrope" is
# frequency factors (phi3's rope_factors_long/short) and a magnitude, no YaRN mix.
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")


def shown(value) -> str:
    """repr(value), cut short: a metadata value in a one-line error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Hparams:
    """The checked metadata of one model file (`mf`, a gguf_check.ModelFile)."""

    def __init__(self, mf):
        self.mf, self.arch, self.md = mf, mf.architecture, mf.metadata
        self.tensor_names = {t.name for t in mf.tensors}

    def fail(self, problem: str) -> ModelError:
        return ModelError(f"{self.mf.path}: {problem}")

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.md

    def get(self, key: str, default=None, kind=int):
        """`<arch>.<key>`, or `default` when absent (None: the key is required)."""
        v = self.md.get(f"{self.arch}.{key}", default)
        if v is None:
            raise self.fail(f"missing {self.arch}.{key}")
        if kind is int:
            limit = MAX_BY_KEY.get(key, MAX_HPARAM)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= limit:
                raise self.fail(f"{self.arch}.{key} = {shown(v)} is not a positive integer (1..{limit})")
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise self.fail(f"{self.arch}.{key} = {shown(v)} is not a finite number")
            v = float(v)
        return v

    def size(self, key: str) -> int:
        """A non-negative integer key that may be 0 or absent (0), e.g. a sliding window."""
        v = self.md.get(f"{self.arch}.{key}", 0) or 0
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_HPARAM:
            raise self.fail(f"{self.arch}.{key} = {shown(v)} is not a size (0..{MAX_HPARAM})")
        return v

    def per_layer(self, key: str, n_layer: int, default=None) -> tuple:
        """An integer key that may be one number or an array of one per layer (llama.cpp's
        get_key_or_arr: gemma4's head_count_kv), as a tuple of n_layer positive integers."""
        v = self.md.get(f"{self.arch}.{key}", default)
        if not isinstance(v, list):
            return (self.get(key, default),) * n_layer
        limit = MAX_BY_KEY.get(key, MAX_HPARAM)
        if len(v) != n_layer or any(isinstance(x, bool) or not isinstance(x, int) or not 0 < x <= limit for x in v):
            raise self.fail(f"{self.arch}.{key} = {shown(v)} is not {n_layer} positive integers (1..{limit})")
        return tuple(v)

    def flags(self, key: str, n_layer: int) -> tuple:
        """A required array of one bool per layer (gemma4's attention.sliding_window_pattern)."""
        v = self.md.get(f"{self.arch}.{key}")
        if v is None:
            raise self.fail(f"missing {self.arch}.{key}")
        if not isinstance(v, list) or len(v) != n_layer or any(not isinstance(x, bool) for x in v):
            raise self.fail(f"{self.arch}.{key} = {shown(v)} is not an array of {n_layer} bools")
        return tuple(v)

    def n_vocab(self) -> int:
        """The columns of token_embd.weight ([n_embd, n_vocab] in ggml order)."""
        if "token_embd.weight" not in self.tensor_names:
            raise self.fail("no token_embd.weight")
        shape = self.mf.tensor("token_embd.weight").shape
        if len(shape) != 2:
            raise self.fail(f"token_embd.weight has shape {list(shape)}, expected [n_embd, n_vocab]")
        return shape[1]

    def rope_scaling_type(self) -> str:
        scaling = self.md.get(f"{self.arch}.rope.scaling.type", "linear")
        if scaling not in ROPE_SCALINGS:
            raise self.fail(f"{self.arch}.rope.scaling.type = {shown(scaling)} is not supported "
                            f"({', '.join(ROPE_SCALINGS)})")
        return scaling

    def positive(self, key: str, default: float) -> float:
        """A finite number > 0, `default` when absent."""
        v = self.get(key, default, kind=float)
        if not v > 0:
            raise self.fail(f"{self.arch}.{key} = {shown(v)} is not a number > 0")
        return v

    def rope_freq_scale(self) -> float:
        """freq_scale for the RoPE scaling the file declares, as llama.cpp: 1/factor
        (rope.scaling.factor, or the older rope.scale_linear; absent or 0: 1) for
        every type but "none", which never scales; an unknown type is refused."""
        scaling = self.rope_scaling_type()
        for key in ("rope.scaling.factor", "rope.scale_linear"):
            v = self.md.get(f"{self.arch}.{key}")
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise self.fail(f"{self.arch}.{key} = {shown(v)} is not a finite number >= 0")
            return 1.0 / float(v) if v and scaling != "none" else 1.0
        return 1.0

    def n_ctx_orig(self) -> int:
        """rope.scaling.original_context_length, else context_length (llama.cpp's n_ctx_orig_yarn)."""
        for key in ("rope.scaling.original_context_length", "context_length"):
            if self.has(key):
                return self.get(key)
        raise self.fail(f"missing {self.arch}.rope.scaling.original_context_length (and context_length)")

    def rope_scaling(self, *, yarn_keys: bool = False) -> RopeScaling:
        """The YaRN / magnitude part of the file's RoPE (arch/spec.py RopeScaling), as
        llama.cpp's context derives it: ext_factor 1 for "yarn", else 0; the magnitude
        from rope.scaling.attn_factor (default 1) and, for YaRN, the factor f = 1 /
        freq_scale: the kernel's (1 + 0.1 ln f) stays unless yarn_log_mul is set, which
        turns it into mscale(f, 1) / mscale(f, log_mul).  yarn_keys: the architecture's
        llama.cpp loader also reads rope.scaling.yarn_beta_fast / _slow / _log_mul (mistral3)."""
        scaling, attn = self.rope_scaling_type(), self.positive("rope.scaling.attn_factor", 1.0)
        if scaling != "yarn":
            return RopeScaling(attn_factor=attn)
        f = 1.0 / self.rope_freq_scale()
        fast, slow, log_mul = 32.0, 1.0, 0.0
        if yarn_keys:
            fast = self.positive("rope.scaling.yarn_beta_fast", fast)
            slow = self.positive("rope.scaling.yarn_beta_slow", slow)
            log_mul = self.get("rope.scaling.yarn_log_multiplier", 0.0, kind=float)

        def mscale(m: float) -> float:
            return 1.0 if f <= 1.0 else 0.1 * m * math.log(f) + 1.0
        derived = mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)
        return RopeScaling(ext_factor=1.0, attn_factor=attn * derived / (1.0 + 0.1 * math.log(f)),
                           beta_fast=fast, beta_slow=slow, n_ctx_orig=self.n_ctx_orig())

    def common(self) -> dict:
        """The geometry every transformer spec has, checked the same way for all."""
        n_embd, n_head = self.get("embedding_length"), self.get("attention.head_count")
        n_head_kv = self.get("attention.head_count_kv", n_head)
        head_k = self.get("attention.key_length", max(n_embd // n_head, 1))
        head_v = self.get("attention.value_length", max(n_embd // n_head, 1))
        if head_k != head_v:
            raise self.fail(f"{self.arch}.attention.key_length {head_k} != value_length {head_v} "
                            f"is not supported")
        if n_head % n_head_kv:
            raise self.fail(f"{self.arch}.attention.head_count {n_head} is not a multiple of "
                            f"{self.arch}.attention.head_count_kv {n_head_kv}")
        n_rot = self.get("rope.dimension_count", head_k)
        if n_rot % 2 or n_rot > head_k:
            raise self.fail(f"{self.arch}.rope.dimension_count {n_rot} does not fit head_dim {head_k}")
        return dict(arch=self.arch, n_layer=self.get("block_count"), n_embd=n_embd, n_head=n_head,
                    rope_scaling=self.rope_scaling(),
                    n_head_kv=n_head_kv, head_dim=head_k, n_vocab=self.n_vocab(),
                    eps=self.get("attention.layer_norm_rms_epsilon", kind=float), n_rot=n_rot,
                    tied_output="output.weight" not in self.tensor_names)
