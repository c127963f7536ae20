"""A qwen35 daemon and a gpt-oss daemon time-share one GPU (issue 17's done-when), real processes.

Both `--residency exclusive --evict-state always` in one arena, so every request to the
one that is cold moves the other's weights and state (gpt-oss: K/V; qwen35: K/V of its
attention layers and the DeltaNet layers' recurrent state and checkpoint) to the host and
its own back.  Alternating requests through the `openai` client give each one's solo output
(the numpy reference's greedy continuation, as in test_qwen35_serve.py / test_gptoss_serve.py);
`vramd status --json` counts each one's weights and state as `vramd plan --json` computes for
its file, and the state's recurrent part (qwen35) as such; the plan's state region is what
llama.cpp's sizes say (its n_embd_r / n_embd_s per recurrent layer, f32; f16 K/V per
attention layer), written here from the file's metadata.
"""

import json
import subprocess
import sys

import openai

from tests.engine.conformance.cases import write_case
from vramd.model.gguf_check import validate_gguf

from .conftest import ROOT, daemon_env
from .test_gptoss_serve import PROMPT as GPTOSS_PROMPT, reference_text as gptoss_text
from .test_qwen35_serve import PROMPT as QWEN_PROMPT, reference_text as qwen_text

CTX = 256
FLAGS = ("--residency", "exclusive", "--evict-state", "always")
N = 6


def vramd(*args: str, as_json: bool = True):
    out = subprocess.run([sys.executable, "-m", "vramd.cli", *args, *(("--json",) if as_json else ())],
                         capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout) if as_json else out.stdout


def state_tensor_bytes(path) -> tuple[int, int]:
    """(K/V bytes, recurrent bytes) of a daemon at CTX, from the file's metadata with
    llama.cpp's sizes: f16 K and V per attention layer; per recurrent layer the conv state
    (d_conv - 1) * (d_inner + 2 * n_group * d_state) and the delta-rule state d_state * d_inner,
    f32, twice (the state and its checkpoint)."""
    md = validate_gguf(path).metadata
    a = md["general.architecture"]
    n_layer, n_kv = md[f"{a}.block_count"], md[f"{a}.attention.head_count_kv"]
    head = md.get(f"{a}.attention.key_length") or md[f"{a}.embedding_length"] // md[f"{a}.attention.head_count"]
    interval = md.get(f"{a}.full_attention_interval", 4) if f"{a}.ssm.state_size" in md else None
    recurrent = [i for i in range(n_layer) if interval and (i + 1) % interval != 0]   # llama.cpp's default 4
    kv = (n_layer - len(recurrent)) * 2 * CTX * n_kv * head * 2
    if not recurrent:
        return kv, 0
    d_conv, d_inner = md[f"{a}.ssm.conv_kernel"], md[f"{a}.ssm.inner_size"]
    d_state, n_group = md[f"{a}.ssm.state_size"], md[f"{a}.ssm.group_count"]
    per_layer = 4 * ((d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
    return kv, 2 * len(recurrent) * per_layer


def test_qwen35_and_gpt_oss_time_share_one_gpu(arena, tmp_path, daemons):
    qpath = write_case("qwen35", "Q4_K", tmp_path / "qwen35.gguf")
    gpath = write_case("gpt-oss", "Q8_0", tmp_path / "gpt-oss.gguf")
    qwen = daemons(arena, qpath, "qwen", *FLAGS, ctx=CTX, wait_ready=False)
    oss = daemons(arena, gpath, "oss", *FLAGS, ctx=CTX, wait_ready=False)
    want = {"qwen": qwen_text(qpath), "oss": gptoss_text(gpath)}
    qwen.wait_ready(120)
    oss.wait_ready(120)
    clients = {d.name: openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0,
                                     timeout=120) for d in (qwen, oss)}
    prompts = {"qwen": QWEN_PROMPT, "oss": GPTOSS_PROMPT}
    plans = {d.name: vramd("plan", str(p), "--ctx", str(CTX)) for d, p in ((qwen, qpath), (oss, gpath))}
    switches = {d.name: d.member().switches for d in (qwen, oss)}
    for _ in range(4):
        for d in (qwen, oss):
            r = clients[d.name].completions.create(model=d.name, prompt=prompts[d.name], max_tokens=N, temperature=0)
            assert r.choices[0].text == want[d.name], d.name
            # Warm after its request, the other cold: `vramd status` counts what each holds where.
            rows = {m["name"]: m for m in vramd("status", "--arena", str(arena))["members"]}
            plan = plans[d.name]
            warm, cold = rows[d.name], rows["oss" if d is qwen else "qwen"]
            assert warm["state"] == "warm" and cold["state"] == "cold"
            assert warm["device_bytes"]["weights"] == plan["device"]["weights"]
            assert warm["device_bytes"]["state"] == plan["device"]["state"]
            assert cold["device_bytes"]["weights"] == cold["device_bytes"]["state"] == 0
            for row, name in ((warm, d.name), (cold, cold["name"])):
                assert row["host_bytes"]["weights"] == plans[name]["host"]["weights"]
                assert row["host_bytes"]["state"] == plans[name]["host"]["state"]
                assert row["daemon"]["recurrent_state_bytes"] == plans[name]["recurrent_state_bytes"]
    # For people: the qwen35 row's KV/STATE split into its recurrent state and K/V; gpt-oss has none.
    from vramd.cli import human_bytes
    text = vramd("status", "--arena", str(arena), as_json=False)
    assert f"state   qwen: KV/STATE {human_bytes(plans['qwen']['host']['state'])} = recurrent state and its " \
           f"checkpoint {human_bytes(plans['qwen']['recurrent_state_bytes'])}" in text, text
    assert "state   oss" not in text
    for d in (qwen, oss):
        assert d.member().switches >= switches[d.name] + 3
        assert d.ask("verify")["weights_ok"]
    # What plan counts is what llama.cpp's sizes say: K/V for both, the recurrent state for qwen35,
    # per sequence (one slot: llama.cpp's one sequence); the daemons' default 4 slots hold 4 of them.
    for name, path in (("qwen", qpath), ("oss", gpath)):
        kv, rec = state_tensor_bytes(path)
        one = vramd("plan", str(path), "--ctx", str(CTX), "--parallel", "1")
        assert one["regions"]["kv"]["tensor_bytes"] == kv + rec, name
        assert one["recurrent_state_bytes"] == rec, name
        assert plans[name]["regions"]["kv"]["tensor_bytes"] == 4 * (kv + rec), name
        assert plans[name]["recurrent_state_bytes"] == 4 * rec, name
    assert plans["qwen"]["recurrent_state_bytes"] > 0 and plans["oss"]["recurrent_state_bytes"] == 0
