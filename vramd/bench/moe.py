"""The mixture-of-experts part of `vramd bench decode`: decode speed and VRAM for several --n-cpu-moe.

For each N: load the model with the experts of the first N layers on the
host, restore, prefill `prompt` tokens, decode `tokens` tokens greedily
(each timed), and report tokens/s next to the device and host bytes, so a
user can see what each layer moved off the GPU costs.  Each row also says
how many layers routed on the GPU (vramd/engine/moe.py: all of them with
--n-cpu-moe 0, and decode is then one replayed step).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def run(model: str | None, wtype: str, n_values: list[float], prompt: int, tokens: int, ctx: int,
        n_layer: int | None = None) -> dict:
    from vramd.bench.models import MoEShape, write_moe_model
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader, placement
    from vramd.model.gguf_check import validate_gguf

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="vramd-moe-", dir=base) as tmp:
        shape = MoEShape() if n_layer is None else MoEShape(n_layer=n_layer)
        path = model or str(write_moe_model(Path(tmp) / "moe.gguf", shape, wtype=wtype))
        mf = validate_gguf(path)
        cfg = spec_for(mf)
        with Device() as dev:
            for n in n_values:
                with Residency(dev) as res:
                    t0 = time.monotonic()
                    lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(cfg),
                                     host_tensors=placement.host_tensors(mf, n))
                    load_s = time.monotonic() - t0
                    res.restore(["weights", "state"])
                    m = TransformerModel(lm, res, ctx, lm.scratch, spec=cfg)
                    try:
                        ids = [int(x) for x in np.random.default_rng(0).integers(3, cfg.n_vocab, prompt)]
                        m.forward(ids[:16], 0)   # warm-up: pipelines, scratch, the chunk batch (the prefill path)
                        t0 = time.monotonic()
                        logits = m.forward(ids, 0)
                        prefill_s = time.monotonic() - t0
                        steps, pos = [], len(ids)
                        for _ in range(tokens):
                            tok = int(np.argmax(logits))
                            t0 = time.monotonic()
                            logits = m.forward([tok], pos)
                            steps.append(time.monotonic() - t0)
                            pos += 1
                        b = res.breakdown()
                        gpu_routed = sum(m.gpu_routed)
                    finally:
                        m.close()
                rows.append({"n_cpu_moe": n, "device_bytes": sum(v["device"] for v in b.values()),
                             "gpu_routed_layers": gpu_routed, "decode_replayed": gpu_routed == cfg.n_layer,
                             "host_expert_bytes": sum(v.nbytes for v in lm.host.values()), "load_s": load_s,
                             "prefill_tps": prompt / prefill_s, "decode_tps": 1.0 / statistics.median(steps),
                             "decode_ms_p50": statistics.median(steps) * 1000})
                del lm
            device = dev.name
    from vramd.engine import hostmv
    return {"device": device, "host_threads": hostmv.threads(),   # the pool host-placed experts run on
            "model": os.path.basename(path) if model else f"synthetic qwen3moe {wtype}",
            "n_layer": cfg.n_layer, "n_expert": cfg.moe.n_expert, "n_used": cfg.moe.n_used, "n_embd": cfg.n_embd,
            "weight_bytes": sum(t.nbytes for t in mf.tensors), "prompt_tokens": prompt, "decode_tokens": tokens,
            "placements": rows}
