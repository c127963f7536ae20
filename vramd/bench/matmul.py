"""`vramd bench matmul`: the prefill matmul kernels alone, by GPU timestamps, in TFLOP/s.

Times Ops.matvec over `--tokens` tokens on the 8B's matrix shapes (q/o
4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336) for each
`--types` weight type: the portable matmul_<type> and, where the device has
cooperative matrices (vramd/engine/linear.py coopmat_usable), the tensor-core
matmul_cm_<type>.  Each figure is the median GPU time of `--reps` dispatches
recorded into one command buffer with a timestamp after each
(vramd/gpu/timing.py), after one untimed dispatch; weights and activations
are random (valid scales), allocated once per shape.

Tile sweep (issue 15).  `--compile-sweep DIR` compiles every entry of VARIANTS
(native/shaders/matmul_cm.glsl's CM_* defines) for `--types` into DIR with
glslang (a dev dependency), a folder per variant and a manifest.json;
`--sweep DIR` (on the GPU machine, which has no compiler) times those instead
of the committed kernel, and first checks each against the portable kernel
on a ragged shape (a wrong variant is reported, not timed).  The committed
kernel is the best of the last sweep (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
from pathlib import Path

import click
import numpy as np

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]   # (rows, cols) of the 8B's matrices
TYPES = ("F16", "Q8_0", "Q4_K", "MXFP4")

# Tile configurations: name -> CM_* defines (BR x BT work group, SGR x SGT subgroup tile, BK,
# padding in f16vec4s, double-buffered shared memory).  NT follows: 32 x (BR/SGR) x (BT/SGT).
_BASE = dict(BR=128, BT=128, BK=64, SGR=32, SGT=64, PAD=2, DB=0, LATE=0, F16ACC=0)
# Shared memory is the bound: NVIDIA's Vulkan driver offers 48 KiB a work group (the H200
# too), so double buffers and 256-wide tiles only fit at BK 32 (config()["SHARED"]; run()
# leaves out what the device cannot hold).  LATE: the next step's weights kept as raw
# words and decoded after the multiplies (matmul_cm.glsl CM_LATE); F16ACC: f16 accumulators.
_TILES = {
    "base": {},
    "sg64x32": dict(SGR=64, SGT=32),
    "sg64x64": dict(SGR=64, SGT=64),                          # 4 subgroups, 128 threads
    "bk32": dict(BK=32),
    "pad0": dict(PAD=0),
    "pad4": dict(PAD=4),
    "db_bk32": dict(DB=1, BK=32),
    "db_bk32_pad0": dict(DB=1, BK=32, PAD=0),
    "db_bk32_sg64x32": dict(DB=1, BK=32, SGR=64, SGT=32),
    "db_bk32_sg64x64": dict(DB=1, BK=32, SGR=64, SGT=64),
    "wg256x128_bk32": dict(BR=256, SGR=64, SGT=64, BK=32),
    "wg128x256_bk32": dict(BT=256, SGR=64, SGT=64, BK=32),
    "wg256x128_bk32_pad0": dict(BR=256, SGR=64, SGT=64, BK=32, PAD=0),
    "wg64x128_sg32x32": dict(BR=64, SGR=32, SGT=32),          # small tiles: more groups at 256 tokens
    "wg128x64_sg32x32": dict(BT=64, SGR=32, SGT=32),
}
VARIANTS = {**_TILES, **{"late_" + k: {**v, "LATE": 1} for k, v in _TILES.items()},
            "late_f16acc": dict(LATE=1, F16ACC=1),
            "late_wg256x128_bk32_f16acc": dict(BR=256, SGR=64, SGT=64, BK=32, LATE=1, F16ACC=1)}
_DEFINES = ("BR", "BT", "BK", "SGR", "SGT", "NT", "PAD", "DB", "LATE", "F16ACC")


def config(name: str) -> dict:
    c = {**_BASE, **VARIANTS[name]}
    c["NT"] = 32 * (c["BR"] // c["SGR"]) * (c["BT"] // c["SGT"])
    cpr = c["BK"] // 16   # every thread loads whole 16-column chunks of both tiles (matmul_cm.glsl WCH, XCH)
    if c["NT"] % cpr or (c["BR"] * cpr) % c["NT"] or (c["BT"] * cpr) % c["NT"]:
        raise ValueError(f"tile variant {name}: {c['NT']} threads do not split its tiles in 16-column chunks")
    c["SHARED"] = 8 * (c["DB"] + 1) * (c["BR"] + c["BT"]) * (c["BK"] // 4 + c["PAD"]) + 4 * 256 * c["NT"] // 32
    return c


def compile_sweep(out: Path, types) -> None:
    """Every VARIANTS entry's matmul_cm_<type> for `types`, into out/<variant>/."""
    from vramd.gpu.kernels import SHADER_DIRS, glslc_command
    src = next(d for d in SHADER_DIRS if (d / "matmul_cm.glsl").is_file())
    manifest = {}
    for name in VARIANTS:
        c = config(name)
        (out / name).mkdir(parents=True, exist_ok=True)
        defs = [f"-DCM_{k}={c[k]}" for k in _DEFINES]
        for t in types:
            kname = "matmul_cm_" + t.lower()
            cmd = glslc_command(src / f"{kname}.comp", out / name / f"{kname}.spv")
            subprocess.run(cmd[:1] + defs + cmd[1:], check=True, capture_output=True)
        manifest[name] = c
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _random_weight(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Bytes of a rows x cols matrix of `qtype` with random values and small finite scales."""
    from gguf import GGMLQuantizationType as Q
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8).ravel()
    if qtype == Q.Q8_0:
        b = rng.integers(0, 256, (rows * cols // 32, 34), dtype=np.uint8)
        b[:, 0:2] = np.full((len(b), 1), np.float16(0.01)).view(np.uint8)
        return b.ravel()
    if qtype == Q.Q4_K:
        b = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
        b[:, 0:4] = np.full((len(b), 2), np.float16(0.002)).view(np.uint8)   # d, dmin
        return b.ravel()
    if qtype == Q.MXFP4:   # E8M0 scales 2^-8 .. 2^-5 (e 120 .. 123), any nibbles
        b = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
        b[:, 0] = rng.integers(120, 124, len(b), dtype=np.uint8)
        return b.ravel()
    raise click.UsageError(f"--types: {qtype.name} has no random generator here ({', '.join(TYPES)})")


@contextlib.contextmanager
def _variant(ops, c: dict | None, spv_dir: Path | None, kname: str):
    """Ops dispatching the variant's kernel and tile (the committed one with c None)."""
    from vramd.engine import linear
    from vramd.gpu.kernels import Kernel
    if c is None:
        yield
        return
    saved = linear.CM_ROWS, linear.CM_TOKENS
    old = ops._kernels.pop(kname, None)
    k = Kernel(ops.residency, kname, 3, 32, spv=spv_dir / f"{kname}.spv",
               subgroup_size=linear.cm_subgroup_size(ops.residency.device))
    ops._kernels[kname] = k
    linear.CM_ROWS, linear.CM_TOKENS = c["BR"], c["BT"]
    try:
        yield
    finally:
        linear.CM_ROWS, linear.CM_TOKENS = saved
        ops._kernels.pop(kname)
        k.close()
        if old is not None:
            ops._kernels[kname] = old


def _time(ops, timer, w, x, y, n: int, reps: int) -> float:
    """Median GPU seconds of one matvec of n tokens."""
    ops.timer = timer
    try:
        with ops.batch():
            for _ in range(reps + 1):
                ops.matvec(w, x, y, n)
        ops.sync()
        ns = [t for _l, _b, t in timer.read()][1:]
    finally:
        ops.timer = None
    return statistics.median(ns) / 1e9


def _check(ops, rng, qtype, c, spv_dir, kname) -> float:
    """max |variant - portable| / max |portable| on a ragged 333-row x 300-token product."""
    from vramd.engine.ops import Weight
    rows, cols, n = 333, 512, 300
    wb = _random_weight(rng, qtype, rows, cols)
    xv = rng.standard_normal((n, cols)).astype(np.float32)
    # an output each, NaN-filled: what a variant leaves unwritten shows
    r = ops.residency.region("weights", "mmcheck", {"w": wb.nbytes, "x": xv.nbytes, "y0": 4 * n * rows,
                                                    "y1": 4 * n * rows})
    r.restore()
    try:
        r.tensors["w"].write(wb)
        r.tensors["x"].write(xv)
        w = Weight(r.tensors["w"], qtype, rows, cols)
        out = []
        for cm in (False, True):
            y = r.tensors[f"y{int(cm)}"]
            y.write(np.full(n * rows, np.nan, np.float32))
            ops.coopmat = cm
            with _variant(ops, c if cm else None, spv_dir, kname):
                ops.matvec(w, r.tensors["x"], y, n)
                ops.sync()
            out.append(y.read(np.float32, 0, 4 * n * rows))
        if not np.isfinite(out[1]).all():
            return float("inf")
        return float(np.max(np.abs(out[1] - out[0])) / max(1e-30, float(np.max(np.abs(out[0])))))
    finally:
        r.destroy()


def run(types, tokens, reps: int, sweep: Path | None, variants=None, portable: bool = True, shapes=SHAPES) -> dict:
    from gguf import GGMLQuantizationType as Q
    from vramd.engine.ops import Ops, Weight, row_bytes
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.gpu.timing import Timestamps

    manifest = json.loads((sweep / "manifest.json").read_text()) if sweep else {"committed": None}
    names = [v for v in (variants or manifest) if v in manifest]
    unknown = sorted(set(variants or ()) - set(manifest))
    if unknown:
        raise click.UsageError(f"--variants: {', '.join(unknown)} not in {sweep}/manifest.json")
    rows_out, checks = [], {}
    rng = np.random.default_rng(0)
    with Device() as dev, Residency(dev) as res:
        ops = Ops(res)
        cm = ops.coopmat
        timer = Timestamps(dev)
        try:
            if sweep and not cm:
                raise click.UsageError(f"--sweep: {dev.name} cannot run the cooperative-matrix kernels")
            limit = dev.limits["maxComputeSharedMemorySize"]
            over = [v for v in names if manifest[v] and manifest[v]["SHARED"] > limit]
            for v in over:
                checks[f"{v} (shared memory {manifest[v]['SHARED']} > {limit})"] = float("inf")
            names = [v for v in names if v not in over]
            if sweep:
                for v in names:
                    for t in types:
                        kname = "matmul_cm_" + t.lower()
                        checks[f"{v} {t}"] = _check(ops, rng, getattr(Q, t), manifest[v], sweep / v, kname)
            n_max = max(tokens)
            runs = ([("portable", None, False)] if portable else []) + (
                [(v, manifest[v], True) for v in names] if cm else [])
            for t in types:
                qt = getattr(Q, t)
                kname = "matmul_cm_" + t.lower()
                mats = []   # every shape's matrix and activations, so each variant's pipeline is made once
                try:
                    for rows, cols in shapes:
                        r = res.region("weights", f"mm{t}{rows}x{cols}", {
                            "w": rows * row_bytes(qt, cols), "x": 4 * n_max * cols, "y": 4 * n_max * rows})
                        mats.append(r)
                        r.restore()
                        r.tensors["w"].write(_random_weight(rng, qt, rows, cols))
                        r.tensors["x"].write(rng.standard_normal(n_max * cols).astype(np.float32))
                    for v, c, on in runs:
                        if c is not None and checks.get(f"{v} {t}", 0.0) > 1e-2:
                            continue   # wrong: not timed
                        ops.coopmat = on
                        with _variant(ops, c, sweep / v if sweep and c else None, kname):
                            for (rows, cols), r in zip(shapes, mats):
                                w = Weight(r.tensors["w"], qt, rows, cols)
                                for n in tokens:
                                    s = _time(ops, timer, w, r.tensors["x"], r.tensors["y"], n, reps)
                                    rows_out.append({"type": t, "rows": rows, "cols": cols, "tokens": n,
                                                     "kernel": v, "ms": s * 1e3,
                                                     "tflops": 2 * rows * cols * n / s / 1e12})
                                    click.echo(f"{t:5} {rows:5}x{cols:<5} n={n:<5} {v:<20} {s * 1e3:8.3f} ms "
                                               f"{rows_out[-1]['tflops']:7.2f} TFLOP/s", err=True)
                finally:
                    for r in mats:
                        r.destroy()
            ops.coopmat = cm
        finally:
            timer.close()
            ops.close()
        device = dev.name
    summary = _summary(rows_out, shapes)
    return {"device": device, "coopmat": cm, "reps": reps, "checks": checks, "results": rows_out,
            "summary": summary, "best": _best(summary, types)}


def _best(summary: list[dict], types) -> dict:
    """Per token count: the kernel with the least summed one-layer time over every type
    (the choice to adopt: one tile for all types), with that sum; {} off the 8B's shapes."""
    out = {}
    for n in sorted({s["tokens"] for s in summary}):
        per: dict[str, list] = {}
        for s in summary:
            if s["tokens"] == n and s["layer_ms"] is not None:
                per.setdefault(s["kernel"], []).append(s["layer_ms"])
        full = {k: sum(v) for k, v in per.items() if len(v) == len(types)}
        if full:
            k = min(full, key=full.get)
            out[str(n)] = {"kernel": k, "layer_ms_all_types": full[k],
                           "ranking": sorted(full, key=full.get)}
    return out


def _summary(rows: list[dict], shapes) -> list[dict]:
    """Per kernel (variant), type and token count: the geometric mean TFLOP/s over the shapes
    and, on the 8B's shapes, the total time of one layer's matmuls (q, k, v, o, gate, up, down)."""
    per_layer = {(4096, 4096): 2, (1024, 4096): 2, (14336, 4096): 2, (4096, 14336): 1}
    per_layer = per_layer if set(map(tuple, shapes)) == set(per_layer) else {}
    keys = sorted({(r["kernel"], r["type"], r["tokens"]) for r in rows})
    out = []
    for k, t, n in keys:
        rs = [r for r in rows if (r["kernel"], r["type"], r["tokens"]) == (k, t, n)]
        layer = (sum(r["ms"] * per_layer[(r["rows"], r["cols"])] for r in rs)
                 if per_layer and len(rs) == len(per_layer) else None)
        out.append({"kernel": k, "type": t, "tokens": n, "shapes": len(rs),
                    "geomean_tflops": float(np.exp(np.mean([np.log(r["tflops"]) for r in rs]))),
                    "layer_ms": layer})
    return out


@click.command(name="matmul")
@click.option("--types", default=",".join(TYPES), show_default=True, help="Weight types, comma-separated.")
@click.option("--tokens", default="256,2000", show_default=True, help="Token counts, comma-separated.")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--shapes", default=None, help="Matrix shapes ROWSxCOLS, comma-separated [the 8B's four].")
@click.option("--compile-sweep", "compile_dir", type=click.Path(file_okay=False), default=None,
              help="Compile the tile VARIANTS into this folder (glslang) and stop.")
@click.option("--sweep", "sweep_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Time the variants compiled there (--compile-sweep) instead of the committed kernel.")
@click.option("--variants", default=None, help="With --sweep: only these variants, comma-separated.")
@click.option("--no-portable", is_flag=True, help="Leave the portable matmul_<type> out.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(types, tokens, reps, shapes, compile_dir, sweep_dir, variants, no_portable, as_json, json_out):
    """Prefill matmul kernels alone on the 8B's shapes: GPU ms and TFLOP/s."""
    tl = [t.strip().upper() for t in types.split(",") if t.strip()]
    bad = [t for t in tl if t not in TYPES]
    if bad:
        raise click.UsageError(f"--types: {', '.join(bad)} not among {', '.join(TYPES)}")
    if compile_dir:
        compile_sweep(Path(compile_dir), tl)
        click.echo(f"{len(VARIANTS)} variants x {len(tl)} types in {compile_dir}")
        return
    try:
        nl = [int(n) for n in tokens.split(",")]
    except ValueError:
        raise click.UsageError(f"--tokens: {tokens!r} is not a comma-separated list of numbers") from None
    if any(n < 4 for n in nl):
        raise click.UsageError("--tokens: matmuls start at 4 tokens (fewer go to matvec)")
    try:
        sl = [tuple(int(d) for d in x.lower().split("x")) for x in shapes.split(",")] if shapes else SHAPES
    except ValueError:
        raise click.UsageError(f"--shapes: {shapes!r} is not ROWSxCOLS[,ROWSxCOLS...]") from None
    if any(len(x) != 2 or min(x) < 1 or x[1] % 256 for x in sl):
        raise click.UsageError(f"--shapes: {shapes!r}: two positive sizes each, COLS a multiple of 256 (Q4_K blocks)")
    r = run(tl, nl, reps, Path(sweep_dir) if sweep_dir else None,
            variants.split(",") if variants else None, portable=not no_portable, shapes=sl)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=1) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=1))
        return
    click.echo(f"{r['device']} (cooperative matrices: {r['coopmat']}), median of {reps}")
    for name, err in r["checks"].items():
        if "shared memory" in name:
            click.echo(f"  left out: {name}")
        else:
            click.echo(f"  check {name:<28} max rel err {err:.2e}" + ("  WRONG: not timed" if err > 1e-2 else ""))
    for s in sorted(r["summary"], key=lambda s: (s["type"], s["tokens"], -s["geomean_tflops"])):
        layer = f"{s['layer_ms']:8.3f} ms/layer" if s["layer_ms"] else ""
        click.echo(f"  {s['type']:5} n={s['tokens']:<5} {s['kernel']:<20} {s['geomean_tflops']:7.2f} TFLOP/s "
                   f"(geomean of {s['shapes']}) {layer}")
    for n, b in r["best"].items():
        click.echo(f"  best at n={n}: {b['kernel']} ({b['layer_ms_all_types']:.3f} ms for a layer of each type); "
                   f"then {', '.join(b['ranking'][1:4])}")


if __name__ == "__main__":
    command()
