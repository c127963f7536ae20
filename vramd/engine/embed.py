"""Embeddings: a prompt's final hidden states, pooled into one L2-normalised vector.

Owns the pooling types (`POOLING`, llama.cpp's `llama_pooling_type` enum as
the GGUF key `<arch>.pooling_type` stores it), `pooling_of` (what a file says,
or what `--pooling` overrides it with) and `embedding` (rows -> one vector),
the host half of `Engine.embed` (vramd/engine/runner.py); the device half is
`TransformerModel.hidden` (vramd/engine/model.py): the rows of
h = output_norm(x), the hidden state after the final norm and before the
output head, which is what llama.cpp pools (`t_embd`, "result_norm").

What llama.cpp's server does, and so vramd:
  * a file without `<arch>.pooling_type` (every generative model's
    conversion) pools "none": llama.cpp then answers the OpenAI
    /v1/embeddings with a 400 ("Pooling type 'none' is not OAI compatible");
    so does vramd, naming `--pooling mean|cls|last` (llama.cpp's flag of the
    same name) as the way to choose one;
  * mean: the average of every row of the sequence (its BOS included),
    cls: the first row, last: the last row; "rank" (a reranker's
    classification head) is not served;
  * the pooled vector is divided by its Euclidean norm (embd_normalize 2, the
    server's default); a zero vector stays zero.
Pooling runs on the host in float64 (a few rows x n_embd: nothing to gain on
the device), the vector is returned as float32.
"""

from __future__ import annotations

import numpy as np

from vramd.errors import ModelError, UsageError

POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
CHOICES = ("none", "mean", "cls", "last")   # what --pooling takes


def pooling_of(mf, override: str | None = None) -> str:
    """The pooling `mf` (a validated GGUF) asks for, or `override` (--pooling)."""
    if override is not None:
        if override not in CHOICES:
            raise UsageError(f"pooling {override!r}: one of {', '.join(CHOICES)}")
        return override
    key = f"{mf.architecture}.pooling_type"
    v = mf.metadata.get(key)
    if v is None:
        return "none"
    if isinstance(v, bool) or not isinstance(v, int) or v not in POOLING:
        raise ModelError(f"{mf.path}: {key} is {v!r}: expected one of "
                         + ", ".join(f"{k} ({n})" for k, n in POOLING.items()))
    return POOLING[v]


def check_servable(pooling: str) -> None:
    """A 400 for a pooling no OpenAI embeddings request can be answered with."""
    if pooling == "none":
        raise UsageError("this model's pooling type is none (its file has no <arch>.pooling_type, as every "
                         "generative model's): one vector per input needs one; start the daemon with "
                         "--pooling mean, cls or last (llama.cpp's --pooling)")
    if pooling == "rank":
        raise UsageError("this model's pooling type is rank (a reranker): vramd serves no reranking, and its "
                         "scores are no embeddings")


def embedding(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One L2-normalised float32 vector from the final-normed rows [n, n_embd] of a sequence."""
    check_servable(pooling)
    rows = np.asarray(rows, dtype=np.float64)
    if pooling == "mean":
        v = rows.mean(axis=0)
    elif pooling == "cls":
        v = rows[0]
    else:
        v = rows[-1]
    norm = float(np.sqrt(np.dot(v, v)))
    return (v / norm if norm > 0 else v).astype(np.float32)


def rows_needed(pooling: str, n: int) -> tuple[int, ...]:
    """Which of a sequence's n rows the pooling reads (the rest need not come back from the device)."""
    if pooling == "cls":
        return (0,)
    if pooling == "last":
        return (n - 1,)
    return tuple(range(n))
