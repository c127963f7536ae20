"""`vramd bench pause`: how long a streaming generation waits while a peer takes the GPU (issue 16).

Two `vramd serve` daemons A and B (switch.Served) on synthetic llama files of `--gib` GiB of
F16 weights each (switch.write_sparse_model: zeros in a sparse file, or `--fill random` for a
small pair whose text means something) share one arena with `--residency exclusive`: only the
token holder is on the device, so every switch moves a whole model.  Before the daemons start,
the raw host->device link rate is measured (switch.link_rate, the residency core's probe).

B serves the request once first (its pipelines are created on first use).  Then A streams its
generation alone (`--tokens` tokens, ignore_eos, greedy): the reference
text and A's ordinary step.  Then each of `--reps` rounds: A streams the same generation; after
`--before` of its tokens B gets a short request (`--b-tokens` tokens), which rings A; A pauses
between two steps, goes cold (its K/V kept), B uploads its weights and serves, and A, ringing
back, uploads its own and resumes.  Measured per round:

  pause_ms      A's longest gap between two streamed tokens (the wait across the switch);
  b_request_ms  B's request, sent to answered (its switch included);
  moved_bytes   host->device bytes of both daemons in the round (B's and A's bytes_h2d in their status);
  ideal_ms      one upload of each (its bytes per switch in the round) / the raw link rate: the two
                DMAs the pause holds; goal: pause <= ideal + 20 ms;
  switches_ms   B's and A's own measure of their switches (status last_switch_ms), and the
                link rate those give (bytes_h2d / last_switch_ms);
  text_same     A's text equals its reference (a pause must not change what it generates);
  a_log, b_log  the daemons' log lines of the round (their cold, switch and resume events).

The report: the medians over the rounds and the goal's verdict; `--json` prints every round.
docs/benchmarks.md records results and commands.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import click

from vramd.bench.parallel import stream_completion
from vramd.errors import VramdError

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]


def _bytes_h2d(d) -> tuple[int, float | None, int]:
    s = d.ask("status")
    return s["bytes_h2d"], s["last_switch_ms"], s["switches"]


def one_round(a, b, a_url: str, b_url: str, tokens: int, before: int, b_tokens: int) -> dict:
    """A streams; after `before` of its tokens B is asked; the round's figures."""
    a.ask("wake")   # A warm and holding the GPU, as a generation that was running before B came
    logs = len(a.log), len(b.log)
    a0, _, a_n0 = _bytes_h2d(a)
    b0, _, b_n0 = _bytes_h2d(b)
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    out: dict = {}
    count = [0]

    def gen() -> None:
        try:
            out["a"] = stream_completion(a_url, body, timeout=3600, count=count)
        except BaseException as e:
            out["a"] = e

    t = threading.Thread(target=gen, daemon=True)
    t.start()
    while count[0] < before and t.is_alive():
        time.sleep(0.001)
    if not t.is_alive():
        raise VramdError(f"pause benchmark: A ended before its {before}th token: {out.get('a')}")
    b_start = time.monotonic()
    b_reply = stream_completion(b_url, {"prompt": PROMPT, "max_tokens": b_tokens, "temperature": 0,
                                        "ignore_eos": True}, timeout=3600)
    b_end = time.monotonic()
    t.join()
    if isinstance(out["a"], BaseException):
        raise out["a"]
    times = out["a"]["times"]
    gaps = [(y - x) * 1000 for x, y in zip(times, times[1:])]
    at = max(range(len(gaps)), key=gaps.__getitem__)
    a1, a_switch, a_n1 = _bytes_h2d(a)
    b1, b_switch, b_n1 = _bytes_h2d(b)
    return {"a": out["a"], "tokens": len(times), "pause_ms": gaps[at], "pause_after_token": at + 1,
            "paused_after_b": times[at + 1] > b_start,   # the longest gap is the one B's request falls in
            "step_p50_ms": statistics.median(gaps), "b_request_ms": (b_end - b_start) * 1000,
            "b_tokens": len(b_reply["times"]), "a_moved_bytes": a1 - a0, "b_moved_bytes": b1 - b0,
            "a_switches": a_n1 - a_n0, "b_switches": b_n1 - b_n0, "a_switch_ms": a_switch, "b_switch_ms": b_switch,
            # the daemons' log lines of the round (cold, switch, resumed: where the pause went)
            "a_log": [x.rstrip() for x in a.log[logs[0]:]], "b_log": [x.rstrip() for x in b.log[logs[1]:]]}


def run(gib: float, reps: int, tokens: int, before: int, b_tokens: int, fill: str, probe_gib: float) -> dict:
    from vramd.bench.switch import Served, link_rate, write_sparse_model
    nbytes = int(gib * 2**30)
    ctx = len(PROMPT) + tokens + 16
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    rounds = []
    with tempfile.TemporaryDirectory(prefix="vramd-pause-", dir=base) as tmp:
        tmp = Path(tmp)
        a_path = write_sparse_model(tmp / "a.gguf", nbytes, 1, fill=fill)
        b_path = write_sparse_model(tmp / "b.gguf", nbytes, 2, fill=fill)
        link = link_rate(int(min(probe_gib, max(gib, 0.0625)) * 2**30))
        arena = tmp / "arena"
        a = Served(arena, a_path, "A", ctx, "exclusive")
        try:
            a.wait_ready()
            b = Served(arena, b_path, "B", len(PROMPT) + b_tokens + 16, "exclusive")
            try:
                b.wait_ready()
                a_url = a.ask("status")["endpoint"] + "/v1/completions"
                b_url = b.ask("status")["endpoint"] + "/v1/completions"
                # B serves once before the rounds: its first request creates its pipelines (0.6 s
                # on the H200), which is start-up, not the switch a round measures
                stream_completion(b_url, {"prompt": PROMPT, "max_tokens": b_tokens, "temperature": 0,
                                          "ignore_eos": True}, timeout=3600)
                a.ask("wake")
                alone = stream_completion(a_url, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                                                  "ignore_eos": True}, timeout=3600)
                gaps = [(y - x) * 1000 for x, y in zip(alone["times"], alone["times"][1:])]
                for _ in range(reps):
                    r = one_round(a, b, a_url, b_url, tokens, before, b_tokens)
                    r["text_same"] = r.pop("a")["text"] == alone["text"]
                    rounds.append(r)
                device = a.ask("status")["device"]["name"]
            finally:
                b.stop()
        finally:
            a.stop()
    h2d = link["h2d_gbps"] * 1e9
    for r in rounds:
        moved = r["a_moved_bytes"] + r["b_moved_bytes"]
        r["moved_bytes"] = moved
        # The pause holds one upload of each (B's in, A's back): bytes per switch, not the round's
        # sum (a daemon may switch more than once in a round: seen twice each on the H200)
        one = sum(r[f"{x}_moved_bytes"] / max(r[f"{x}_switches"], 1) for x in "ab")
        r["ideal_ms"] = one / h2d * 1000
        r["over_ideal_ms"] = r["pause_ms"] - r["ideal_ms"]
        sw = (r["a_switch_ms"] or 0) + (r["b_switch_ms"] or 0)
        r["switches_gbps"] = moved / (sw / 1000) / 1e9 if sw and moved else None

    def med(key):
        vals = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(vals) if vals else None

    pause, ideal = med("pause_ms"), med("ideal_ms")
    return {"device": device, "gib": gib, "fill": fill, "reps": reps, "tokens": tokens, "before": before,
            "b_tokens": b_tokens, "link_h2d_gbps": link["h2d_gbps"], "alone_step_p50_ms": statistics.median(gaps),
            "alone_tokens": len(alone["times"]), "pause_ms": pause, "ideal_ms": ideal, "goal_ms": ideal + 20.0,
            "over_ideal_ms": med("over_ideal_ms"), "met": pause <= ideal + 20.0,
            "b_request_ms": med("b_request_ms"), "moved_bytes": med("moved_bytes"),
            "switches_gbps": med("switches_gbps"), "text_same": all(r["text_same"] for r in rounds),
            "rounds": rounds}


@click.command(name="pause")
@click.option("--gib", type=click.FloatRange(min=0.01), default=16.0, show_default=True,
              help="Size of each of the two synthetic models (F16 weights).")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True, help="Paused generations.")
@click.option("--tokens", type=click.IntRange(min=4), default=512, show_default=True,
              help="A's generation (ignore_eos): long enough to outlast B's request.")
@click.option("--before", type=click.IntRange(min=1), default=64, show_default=True,
              help="A's tokens streamed before B is asked.")
@click.option("--b-tokens", type=click.IntRange(min=1), default=1, show_default=True, help="B's request's tokens.")
@click.option("--fill", type=click.Choice(["zeros", "random"]), default="zeros", show_default=True,
              help="zeros: a sparse file (any size, instant); random: seeded weights, for a text that means "
                   "something (small sizes: it is written).")
@click.option("--probe-gib", type=click.FloatRange(min=0.01), default=4.0, show_default=True,
              help="Size of the raw link-rate probe (at most --gib).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(gib, reps, tokens, before, b_tokens, fill, probe_gib, as_json, json_out):
    """How long a streaming generation on A waits while B takes the GPU, against the two DMAs."""
    if before >= tokens - 1:
        raise click.UsageError("--before must be less than --tokens - 1 (A must still stream after B's request)")
    r = run(gib, reps, tokens, before, b_tokens, fill, probe_gib)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"pause of A's stream while B serves, on {r['device']}: 2 x {gib:g} GiB models (exclusive), "
               f"median of {reps}; raw link {r['link_h2d_gbps']:.1f} GB/s host->device")
    click.echo(f"  A's step alone {r['alone_step_p50_ms']:.2f} ms; pause {r['pause_ms']:.1f} ms; two DMAs "
               f"(one upload of each) {r['ideal_ms']:.1f} ms ideal ({r['moved_bytes'] / 2**30:.2f} GiB moved in "
               f"the round); over it "
               f"{r['over_ideal_ms']:.1f} ms "
               f"(goal <= 20: {'met' if r['met'] else 'not met'}); B's request {r['b_request_ms']:.1f} ms; "
               f"text {'unchanged' if r['text_same'] else 'CHANGED'}")


if __name__ == "__main__":
    command()
