"""What Gemma 4 E2B / E4B add to gemma4's dense graph (arch/gemma4.py): shared KV, per-layer embeddings.

As llama.cpp 0c1e570 defines them (src/models/gemma4.cpp; llama-model.cpp's
layer_reuse_cb for LLM_ARCH_GEMMA4; llama-hparams.cpp's has_kv):

  * attention.shared_kv_layers = N > 0: the last N layers compute only their
    queries and attend over the K/V of an earlier layer, which llama.cpp fixes
    as n_kv - 2 for a sliding layer and n_kv - 1 for a global one (n_kv =
    block_count - N: the last two layers that have a cache, sliding then
    global, as in every Gemma 4 file).  They write and keep no K/V (their
    attn_k / attn_v / attn_k_norm are not read).  A file whose source layer is
    of the other kind, or of another KV width, is refused.
  * embedding_length_per_layer_input = P > 0: per-layer embeddings (PLE; the
    computation is vramd/engine/ple.py's header).
  * feed_forward_length as one width per layer (the converter's
    use_double_wide_mlp: the KV-sharing layers' FFN twice as wide).
No AltUp or Laurel (gemma3n's): gemma4's graph has neither.
"""

from __future__ import annotations

from dataclasses import replace

from vramd.engine.arch.hparams import Hparams


def kv_sources(hp: Hparams, swa: tuple, n_kv: tuple, hd: dict) -> list[int]:
    """Per layer, the layer whose K/V it reads (-1: its own)."""
    n_layer, shared = len(swa), hp.size("attention.shared_kv_layers")
    if not shared:
        return [-1] * n_layer
    a, first = hp.arch, n_layer - shared
    if first < 2:
        raise hp.fail(f"{a}.attention.shared_kv_layers = {shared} of {n_layer} layers: "
                      "at least two layers must keep their K/V")
    out = [-1] * first
    for i in range(first, n_layer):
        src = first - (2 if swa[i] else 1)
        if swa[src] != swa[i] or n_kv[src] * hd[swa[src]] != n_kv[i] * hd[swa[i]]:
            raise hp.fail(f"{a}: layer {i} would share layer {src}'s K/V (llama.cpp's rule), "
                          "which is of another kind or width")
        out.append(src)
    return out


def e_layers(hp: Hparams, layers: tuple, n_ff: tuple, sources: list[int]) -> tuple:
    """The LayerSpecs with their KV source and, where widths differ, their FFN width."""
    wide = len(set(n_ff)) > 1
    return tuple(replace(layer, kv_source=src, n_ff=n_ff[i] if wide else 0)
                 for i, (layer, src) in enumerate(zip(layers, sources)))


def ple_width(hp: Hparams) -> int:
    """embedding_length_per_layer_input (0: no per-layer embeddings)."""
    return hp.size("embedding_length_per_layer_input")
