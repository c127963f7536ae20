"""The one place the conformance suite touches vramd's engine.

Owns `vramd_logits(device, path, tokens, ctx, decode_from=None, spec=None)`: load a GGUF
file with vramd's engine on `device` and return the logits of every token of
`tokens` at positions 0.. as float32 [len(tokens), n_vocab].  Everything the
suite knows of the engine's API is in this module (the API is being
reworked: when it changes, only this function changes).

decode_from=d: rows 0..d-1 come from one all-logits forward of tokens[:d] at
position 0 (the batched prefill), and each row i >= d from a one-token
forward of tokens[i] at position i on top of that cache (the recorded,
replayed decode step).  decode_from=None: every row from one all-logits
forward.  Either way row i is the distribution after tokens[0..i].

`EngineOn(device, path, pooling=None, ctx=64, batch=None)` is a whole
vramd Engine on a file (weights and cache resident; `.engine`, `.close()`):
the embedding and fill-in-the-middle tests' way in.
"""

from __future__ import annotations

import numpy as np


def vramd_logits(device, path, tokens: list[int], ctx: int, decode_from: int | None = None,
                 spec=None) -> np.ndarray:
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    tokens = [int(t) for t in tokens]
    d = len(tokens) if decode_from is None else decode_from
    if not 1 <= d <= len(tokens):
        raise ValueError(f"decode_from {decode_from} outside 1..{len(tokens)}")
    mf = validate_gguf(path)
    spec = spec or spec_for(mf)   # a test may run a variant of the file's spec
    res = Residency(device)
    model = None
    try:
        lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(spec), progress=False)
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, ctx, lm.scratch, spec=spec)
        rows = [np.asarray(model.forward(tokens[:d], 0, all_logits=True), np.float32)]
        for i in range(d, len(tokens)):
            rows.append(np.asarray(model.forward([tokens[i]], i), np.float32)[None, :])
        return np.concatenate(rows, axis=0)
    finally:
        if model is not None:
            model.close()
        res.close()


class EngineOn:
    """A vramd Engine on `path` (weights and cache resident); batch: the chunk size."""

    def __init__(self, device, path, pooling=None, ctx=64, batch=None):
        from vramd.engine.arch import spec_for
        from vramd.engine.runner import Engine
        from vramd.engine.scratch import scratch_layout
        from vramd.gpu.residency import Residency
        from vramd.model import loader
        from vramd.model.gguf_check import validate_gguf
        mf = validate_gguf(path)
        self.res = Residency(device)
        try:
            lm = loader.load(path, self.res, ctx, mf=mf, scratch=scratch_layout(spec_for(mf), batch), progress=False)
            self.res.restore(["weights", "state"])
            self.engine = Engine(lm, self.res, ctx, pooling=pooling)
        except BaseException:
            self.res.close()
            raise
        if batch:
            self.engine.model.batch = batch

    def close(self):
        self.engine.close()
        self.res.close()
