"""The numpy reference of gemma4 with experts (Gemma 4 26B-A4B): the specification
vramd/engine/arch/gemma4_moe.py and vramd/engine/moe_beside.py are checked against.

Owns `Gemma4MoEReference`: tests/engine/reference/gemma4.py's model (attention,
norms, logits: that module's header) with the FFN of a routed layer (one with
blk.l.ffn_gate_inp.weight; llama.cpp decides per layer) as llama.cpp
(0c1e570, src/models/gemma4.cpp's graph and llama-graph.cpp's build_moe_ffn
with LLM_FFN_GELU, norm_w = true, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)
describes it, written from that description and not from the engine.

Metadata keys read beyond gemma4.py's (`A` = "gemma4")
  A.expert_count, A.expert_used_count (required)
  (A.expert_feed_forward_length: the stacks' shapes say the width)

A routed layer's FFN, from x = the residual stream after the attention
  dense   = rms_norm(Wdown (gelu(Wgate h1) * Wup h1)) * post_ffw_norm_1,  h1 = rms_norm(x) * ffn_norm
  logits  = Wr (rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale)
  p = softmax(logits); ids = the k most probable (ties: lower id first);
  w = p[ids] / max(sum p[ids], 2^-14)
  experts = rms_norm(sum_j w_j s[ids_j] down_j(gelu(gate_j h2) * up_j h2)) * post_ffw_norm_2,
            h2 = rms_norm(x) * pre_ffw_norm_2; s = ffn_down_exps.scale (1 where absent);
            gate_j / up_j: the first / last n_ff_exp rows of expert j's ffn_gate_up_exps,
            or its ffn_gate_exps / ffn_up_exps
  the FFN = dense + experts (gemma4.py then adds rms_norm(FFN) * post_ffw_norm to x)

After each forward, `.last_routes[j]` is the Route (tests/engine/reference/moe.py's:
ids, weights, margin, logits) of the j-th routed layer for every token of the call.
"""

from __future__ import annotations

import math

import numpy as np

from tests.engine.reference.common import metadata_key, rms_norm
from tests.engine.reference.gemma3 import gelu
from tests.engine.reference.gemma4 import Gemma4Reference
from tests.engine.reference.moe import Route, softmax_top_k

__all__ = ["Gemma4MoEReference"]

_ROUTED = ("ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_down_exps.weight", "pre_ffw_norm_2.weight",
           "post_ffw_norm_1.weight", "post_ffw_norm_2.weight")
_ROUTED_OPTIONAL = ("ffn_down_exps.scale", "ffn_gate_up_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")


class Gemma4MoEReference(Gemma4Reference):
    OPTIONAL = Gemma4Reference.OPTIONAL + _ROUTED_OPTIONAL

    def __init__(self, path, dtype: type = np.float64):
        super().__init__(path, dtype)
        key = metadata_key(self.file.metadata, "gemma4", path)
        self.n_expert = int(key("expert_count", required=True))
        self.n_expert_used = int(key("expert_used_count", required=True))
        self.last_routes: list[Route] = []
        for il, L in enumerate(self.layers):
            if "ffn_gate_inp" in L and "ffn_gate_up_exps" not in L and not {"ffn_gate_exps", "ffn_up_exps"} <= set(L):
                raise ValueError(f"{path}: layer {il} has neither ffn_gate_up_exps nor ffn_gate_exps + ffn_up_exps")

    def _layer_tensors(self, il: int) -> tuple:
        routed = f"blk.{il}.ffn_gate_inp.weight" in {t.name for t in self.file.tensors}
        return self.TENSORS + (_ROUTED + _ROUTED_OPTIONAL if routed else ())

    def forward(self, tokens, kv=None, pos0=None) -> np.ndarray:
        self.last_routes = []
        return super().forward(tokens, kv, pos0)

    def route(self, L: dict, x: np.ndarray) -> Route:
        """The experts a routed layer (its tensors L) sends each row of x, the residual stream, to."""
        r = rms_norm(x, np.ones(x.shape[1], self.dtype), self.eps) / math.sqrt(self.n_embd) * L["ffn_gate_inp.scale"]
        return softmax_top_k(r @ L["ffn_gate_inp"].T, self.n_expert_used, True)

    def _ffn(self, il: int, L: dict, x: np.ndarray) -> np.ndarray:
        if "ffn_gate_inp" not in L:
            return super()._ffn(il, L, x)
        dense = rms_norm(super()._ffn(il, L, x), L["post_ffw_norm_1"], self.eps)
        route = self.route(L, x)
        self.last_routes.append(route)
        h = rms_norm(x, L["pre_ffw_norm_2"], self.eps)
        if "ffn_gate_up_exps" in L:
            f = L["ffn_gate_up_exps"].shape[1] // 2
            gate, up = L["ffn_gate_up_exps"][:, :f], L["ffn_gate_up_exps"][:, f:]
        else:
            gate, up = L["ffn_gate_exps"], L["ffn_up_exps"]
        scale = L.get("ffn_down_exps.scale", np.ones(self.n_expert, self.dtype))
        out = np.zeros_like(x)
        for e in np.unique(route.ids):
            rows, slot = np.nonzero(route.ids == e)
            y = (gelu(h[rows] @ gate[e].T) * (h[rows] @ up[e].T)) @ L["ffn_down_exps"][e].T
            out[rows] += (route.weights[rows, slot] * scale[e])[:, None] * y
        return dense + rms_norm(out, L["post_ffw_norm_2"], self.eps)
