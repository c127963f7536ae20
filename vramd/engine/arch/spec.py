"""What an architecture is, as data: `ArchSpec` (the model) and `LayerSpec` (one layer).

An architecture module (vramd/engine/arch/<family>.py) turns a file's
metadata into an ArchSpec; everything after that — the tensor table
(vramd/engine/tensors.py), the scratch layout, the layer math
(vramd/engine/blocks.py, moe.py) and the forward pass
(vramd/engine/model.py) — reads only the spec, so two architectures that
differ in a convention differ in one field here, not in a copied forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    rope_base: float
    rope_scale: float          # freq_scale (1 / linear factor)
    window: int = 0            # sliding-window size; 0: the layer attends to every key
    moe: bool = False          # the FFN is routed experts (else dense)


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0        # qwen2moe's shared expert (0: none)
    renormalize: bool = True   # the chosen experts' weights are scaled to sum 1


@dataclass(frozen=True)
class ArchSpec:
    arch: str                  # general.architecture
    family: str                # what the registry calls it (mixtral is "llama" with experts)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    n_rot: int
    tied_output: bool
    layers: tuple              # LayerSpec per layer
    n_ff: int = 0              # dense FFN width (0: every FFN is MoE)
    neox: bool = False         # RoPE pairs (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1])
    rope_factors: bool = False  # rope_freqs.weight, where the file has it, divides the frequencies (llama 3)
    qk_norm: bool = False      # RMSNorm over each head of q and k (attn_q_norm, attn_k_norm)
    post_norms: bool = False   # gemma: RMSNorm of the attention and FFN outputs before the residual add
    embed_scale: float = 1.0   # token embeddings are multiplied by this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0    # softmax scale; 0: 1/sqrt(head_dim)
    activation: str = "silu"   # the gated FFN's: "silu" or "gelu" (tanh approximation)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0
    moe: MoESpec | None = None
    batch: int = 256           # tokens per prefill chunk
    # Capabilities the daemon asks about instead of sniffing the code:
    takes_embeds: bool = True  # input embeddings (an image's) can stand in for tokens

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)
