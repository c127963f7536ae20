"""The numpy reference of embeddings: a prompt's final-normed hidden states, pooled, L2-normalised.

Owns `reference_embedding(path, ids, pooling)`.  The specification (as
llama.cpp's server computes /v1/embeddings, src/llama-graph.cpp's pooling of
"result_norm" and common_embd_normalize with norm 2):
  H = the rows h_i = rms_norm(x_i) * output_norm after the last layer, for the
      tokens at positions 0..n-1 (a fresh cache: nothing before them), i.e.
      the input of the output head, before it (ReferenceModel.last_hidden);
  mean: (1/n) sum_i h_i over every row (a BOS included);  cls: h_0;  last: h_{n-1};
  the vector divided by its Euclidean norm (a zero vector stays zero).
The K/V cache is f16 by default, as the engine's and llama.cpp's (llama.py's
Precision says what that rounding costs).  Nothing here imports vramd.engine.
"""

from __future__ import annotations

import numpy as np


def reference_model(path):
    """The reference of `path`'s architecture (llama family, gemma3, the MoEs)."""
    import gguf
    from tests.engine.reference.gemma3 import Gemma3Reference
    from tests.engine.reference.llama import ReferenceModel
    from tests.engine.reference.moe import ReferenceMoE
    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch in ("qwen3moe", "qwen2moe", "mixtral") or (arch == "llama" and "blk.0.ffn_gate_inp.weight" in
                                                       {t.name for t in gguf.GGUFReader(str(path)).tensors}):
        return ReferenceMoE(path)
    return Gemma3Reference(path) if arch == "gemma3" else ReferenceModel(path)


def reference_embedding(path, ids, pooling: str, kv_dtype=np.float16, model=None) -> np.ndarray:
    """The embedding of `ids` (float64 [n_embd], unit length) under `pooling` (mean, cls, last)."""
    ref = model or reference_model(path)
    ref.forward(list(ids), ref.new_kv(kv_dtype), 0)
    rows = np.asarray(ref.last_hidden, dtype=np.float64)
    if pooling == "mean":
        v = rows.sum(axis=0) / len(rows)
    elif pooling == "cls":
        v = rows[0]
    elif pooling == "last":
        v = rows[len(rows) - 1]
    else:
        raise ValueError(f"pooling {pooling!r}: the reference pools mean, cls or last")
    norm = np.sqrt(np.sum(v * v))
    return v / norm if norm > 0 else v
