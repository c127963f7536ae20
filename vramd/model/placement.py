"""Where each tensor of a mixture-of-experts model lives: device or host (`--n-cpu-moe N`).

The rule (brief §4): the expert tensors (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) of the first ⌊N⌋ layers stay in host memory and are
computed on the CPU; in the boundary layer ⌊N⌋, k = ⌊frac × 3 + 0.5⌋ of its
three expert tensors stay on the host (frac = N − ⌊N⌋), dropped in the
order gate, then up — down stays on the device longest (a fused
`ffn_gate_up_exps`, gemma4's, leaves with the gate).  Everything else
goes to the device.  `plan()` adds the KV cache and compute scratch and
totals it all; `smallest_fit()` finds the smallest N (in steps of 1/3) whose
device footprint fits a budget, which is what `--n-cpu-moe auto` uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from vramd.errors import UsageError

EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")   # the order they leave the device
# In the boundary layer a kind leaves the device when k reaches its rank (gate and up fused: the gate's).
_RANK = {"ffn_gate_exps": 1, "ffn_gate_up_exps": 1, "ffn_up_exps": 2, "ffn_down_exps": 3}
_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_gate_up_exps|ffn_down_exps)\.weight$")


def parse_n_cpu_moe(value) -> float | str:
    """`--n-cpu-moe`: a number >= 0 (fractions allowed, e.g. 1.5 or 4/3), or "auto"."""
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        try:
            if "/" in text:
                num, den = text.split("/", 1)
                n = float(num) / float(den)
            else:
                n = float(text)
        except (ValueError, ZeroDivisionError):
            raise UsageError(f"--n-cpu-moe {value!r}: give a number of layers >= 0 (e.g. 2, 1.5, 4/3) or auto") \
                from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        raise UsageError(f"--n-cpu-moe {value!r}: give a number of layers >= 0 or auto")
    if not math.isfinite(n) or n < 0:
        raise UsageError(f"--n-cpu-moe {value!r}: must be a finite number >= 0")
    return n


def expert_tensors(mf) -> dict[int, dict[str, str]]:
    """{layer: {kind: tensor name}} of every stacked expert tensor in the model."""
    out: dict[int, dict[str, str]] = {}
    for t in mf.tensors:
        m = _EXPERT.match(t.name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = t.name
    return out


def host_tensors(mf, n: float) -> list[str]:
    """Names of the expert tensors that stay on the host for --n-cpu-moe n."""
    experts = expert_tensors(mf)
    whole = math.floor(n)
    # k = floor(frac * 3 + 0.5); the epsilon absorbs float noise (4/3 - 1 is
    # 0.33333333333333326, so frac * 3 + 0.5 lands just under 1.5, as it should).
    k = math.floor((n - whole) * 3 + 0.5 + 1e-9)
    out = []
    for layer in sorted(experts):
        kinds = experts[layer]
        if layer < whole:
            out += [kinds[kind] for kind in _RANK if kind in kinds]
        elif layer == whole and k:
            out += [kinds[kind] for kind, rank in _RANK.items() if rank <= k and kind in kinds]
    return out


@dataclass
class Plan:
    n_cpu_moe: float
    tensors: list[dict] = field(default_factory=list)   # {"name", "placement", "bytes"}
    kv_bytes: int = 0
    scratch_bytes: int = 0
    has_experts: bool = False

    @property
    def device_weight_bytes(self) -> int:
        return sum(t["bytes"] for t in self.tensors if t["placement"] == "device")

    @property
    def host_bytes(self) -> int:
        return sum(t["bytes"] for t in self.tensors if t["placement"] == "host")

    @property
    def device_bytes(self) -> int:
        return self.device_weight_bytes + self.kv_bytes + self.scratch_bytes

    def to_json(self) -> dict:
        return {"n_cpu_moe": self.n_cpu_moe, "has_experts": self.has_experts, "tensors": self.tensors,
                "device_weight_bytes": self.device_weight_bytes, "kv_bytes": self.kv_bytes,
                "scratch_bytes": self.scratch_bytes, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes}


def plan(mf, n: float, kv_bytes: int = 0, scratch_bytes: int = 0) -> Plan:
    host = set(host_tensors(mf, n))
    p = Plan(n_cpu_moe=n, kv_bytes=kv_bytes, scratch_bytes=scratch_bytes, has_experts=bool(expert_tensors(mf)))
    for t in mf.tensors:
        p.tensors.append({"name": t.name, "placement": "host" if t.name in host else "device", "bytes": t.nbytes})
    return p


def smallest_fit(mf, budget: int, kv_bytes: int = 0, scratch_bytes: int = 0,
                 measure: Callable[[Plan], int] | None = None) -> Plan:
    """The plan with the smallest N (steps of 1/3) whose device bytes fit `budget`.

    `measure(plan)`: the device bytes of a plan (default `Plan.device_bytes`, the tensors'
    own sizes; vramd/model/footprint.py measures them as the residency core packs them).
    A larger N never brings a tensor back to the device, so the device bytes
    never grow with N, and the step is found by bisection: log2(3 L) plans
    rather than 3 L (each plan walks every tensor; a crafted file of 65,536
    expert tensors kept the linear search busy for hours)."""
    measure = measure or (lambda p: p.device_bytes)
    layers = len(expert_tensors(mf))
    lo, hi = 0, 3 * layers
    p = plan(mf, hi / 3, kv_bytes, scratch_bytes)
    if (least := measure(p)) <= budget:
        while lo < hi:
            mid = (lo + hi) // 2
            if measure(plan(mf, mid / 3, kv_bytes, scratch_bytes)) <= budget:
                hi = mid
            else:
                lo = mid + 1
        return plan(mf, lo / 3, kv_bytes, scratch_bytes)
    raise UsageError(f"{mf.path}: even with every expert on the host the model needs {least} device "
                     f"bytes (weights {least - kv_bytes - scratch_bytes}, KV {kv_bytes}, scratch {scratch_bytes}); "
                     f"the budget is {budget}")
