"""Synthetic gemma4 GGUF models with experts (Gemma 4 26B-A4B's layout, as llama.cpp's converter writes it).

Owns `write_gemma4_moe` (and `Gemma4MoESpec`, `make_gemma4_moe_weights`,
`write_gemma4_moe_weights`): tests/ggufgen/gemma4.py's dense file (its
attention, norms, sliding pattern, proportional RoPE, layer_output_scale,
softcap and vocabulary) plus, in each layer of `moe_layers`, what the
26B-A4B carries beside its dense FFN:

  * expert_count / expert_used_count (16 / 4 here; the 26B-A4B: 128 / 8) and
    expert_feed_forward_length (256 here, against the dense FFN's 512; the 26B-A4B:
    704 against 2112);
  * ffn_gate_inp.weight [n_embd, n_expert] (F32, as llama-quantize leaves routers) and
    ffn_gate_inp.scale [n_embd] (the checkpoint's router.scale);
  * the experts as ffn_gate_up_exps [n_embd, 2 n_ff_exp, n_expert] (each expert's gate
    rows, then its up rows: the checkpoint's experts.gate_up_proj) or, fused=False,
    ffn_gate_exps and ffn_up_exps; ffn_down_exps [n_ff_exp, n_embd, n_expert];
  * ffn_down_exps.scale [n_expert] (per_expert_scale), uniform in 0.5 .. 1.5 so that it
    matters; expert_scale=False leaves it out (llama.cpp reads it where present);
  * pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2 [n_embd].

Scales: the router reads rms_norm(x) / sqrt(n_embd) * scale, a vector of norm ~1, so a
router of N(0, ROUTER_STD^2) gives logits of std ~ROUTER_STD (4, tests/ggufgen/moe.py's
choice and reasoning); experts N(0, 1/n_embd) (gate, up), N(0, 1/n_ff_exp) (down).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import gain, normal, rng
from tests.ggufgen.gemma4 import Gemma4Spec, make_gemma4_weights, write_gemma4_weights

ROUTER_STD = 10.0


@dataclass(frozen=True)
class Gemma4MoESpec(Gemma4Spec):
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 256
    moe_layers: tuple | None = None   # which layers route (None: every layer, as the 26B-A4B)
    fused: bool = True                # ffn_gate_up_exps, else ffn_gate_exps + ffn_up_exps
    expert_scale: bool = True         # ffn_down_exps.scale

    def routed(self, i: int) -> bool:
        return self.moe_layers is None or i in self.moe_layers


def make_gemma4_moe_weights(spec: Gemma4MoESpec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order ([rows, row length], stacks [n_expert, rows, length])."""
    w = make_gemma4_weights(spec)
    e, f, ne = spec.n_embd, spec.n_ff_exp, spec.n_expert
    normal_, gain_ = functools.partial(normal, spec), functools.partial(gain, spec)
    for i in range(spec.n_layer):
        if not spec.routed(i):
            continue
        p = f"blk.{i}."
        w[p + "ffn_gate_inp.weight"] = normal_(p + "ffn_gate_inp.weight", (ne, e), ROUTER_STD)
        w[p + "ffn_gate_inp.scale"] = gain_(p + "ffn_gate_inp.scale", e)
        gate = normal_(p + "ffn_gate_exps.weight", (ne, f, e), 1 / np.sqrt(e))
        up = normal_(p + "ffn_up_exps.weight", (ne, f, e), 1 / np.sqrt(e))
        if spec.fused:
            w[p + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
        else:
            w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"] = gate, up
        w[p + "ffn_down_exps.weight"] = normal_(p + "ffn_down_exps.weight", (ne, e, f), 1 / np.sqrt(f))
        if spec.expert_scale:
            w[p + "ffn_down_exps.scale"] = (0.5 + rng(spec.seed, p + "ffn_down_exps.scale").random(ne)).astype(
                np.float32)
        for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
            w[p + norm + ".weight"] = gain_(p + norm + ".weight", e)
    return w


def write_gemma4_moe(path: str | Path, **options) -> Path:
    """Write a synthetic gemma4 model with experts (Gemma4MoESpec's fields as keywords) to `path`."""
    spec = Gemma4MoESpec(**options).check()
    return write_gemma4_moe_weights(path, spec, make_gemma4_moe_weights(spec))


def write_gemma4_moe_weights(path: str | Path, spec: Gemma4MoESpec, weights: dict[str, np.ndarray]) -> Path:
    def keys(writer) -> None:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
        writer.add_expert_feed_forward_length(spec.n_ff_exp)

    def type_of(name: str, value, qtype):
        return Q.F32 if np.ndim(value) == 1 or name.endswith("ffn_gate_inp.weight") else qtype

    return write_gemma4_weights(path, spec, weights, more_keys=keys, type_of=type_of)
