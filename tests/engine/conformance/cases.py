"""The conformance suite's models: one small synthetic GGUF per (architecture, weight type).

Owns `ARCHS`, `TYPES`, `cases()` (every pair a writer can make) and
`write_case(arch, weight_type, path)`.  Every architecture uses rows of 256
(n_embd, n_ff, the experts' n_ff, n_head * head_dim), so that every type,
the 256-value K-quant blocks included, is written from the same float values:
files of one architecture differ only by their weight type.

Shapes, chosen to be fast on llama.cpp's CPU backend and lavapipe (well under
a second per file either way) and still exercise what the engines must get
right: GQA everywhere (qwen3 and the MoEs 4 query heads on 2 KV heads,
gemma3 4 on 1), head_dim != n_embd / n_head for qwen3 (128 x 4 heads on an
n_embd of 256, as Qwen3-0.6B's 16 x 128 on 1024) and gemma3, tied output for
qwen3 and gemma3, q/k/v biases for qwen2 and qwen2moe, a shared expert for
qwen2moe, 8 experts of which 2 are used, and for gemma3 a sliding window of 8
positions over 7 layers (layer 5 global), which the suite's prompts cross.
"""

from __future__ import annotations

from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "mixtral")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_DENSE = dict(n_embd=256, n_ff=512, n_head=4, n_layer=2, n_vocab=512, seed=7)
_MOE = dict(n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
            n_expert_used=2, seed=3)


def cases() -> list[tuple[str, str]]:
    return [(a, t) for a in ARCHS for t in TYPES]


def write_case(arch: str, weight_type: str, path: str | Path) -> Path:
    from tests.engine.models import write_llama
    from tests.engine.models_gemma3 import write_gemma3
    from tests.engine.models_moe import write_moe

    if arch in ("llama", "qwen2"):
        return write_llama(path, arch=arch, weight_type=weight_type, **_DENSE)
    if arch == "qwen3":
        return write_llama(path, arch=arch, weight_type=weight_type, key_length=128, tied_output=True,
                           n_head_kv=2, **_DENSE)
    if arch == "gemma3":
        return write_gemma3(path, weight_type=weight_type, n_embd=256, n_ff=512, n_head=4, n_head_kv=1,
                            head_dim=64, n_layer=7, window=8, seed=5)
    return write_moe(path, arch=arch, weight_type=weight_type, **_MOE)
