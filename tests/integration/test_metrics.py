"""/metrics answers the usual questions (issue 21, item 2), read by prometheus_client's own parser.

Real daemons: token counters, request latency and time-to-first-token
histograms, queue depth and in-flight gauges, errors by status, requests
counted when they start (API and control apart), the device-memory series
always present, and /metrics open to scrapers with --metrics-public.
"""

import json
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .test_logs import wait_for
from .test_shutdown import held_elsewhere, in_thread, post, wait_queued


def scrape(url: str, key: str | None = None) -> dict:
    """{(sample name, frozenset of labels but name): value} of one scrape; HELP and TYPE for every family."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name   # every family has its HELP
        assert family.type != "unknown", family.name   # ...and its TYPE
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "name"))] = s.value
    return out


def one(m: dict, name: str, **labels) -> float:
    want = frozenset(labels.items())
    got = [v for (n, ls), v in m.items() if n == name and want <= ls]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def test_new_series_move_when_requests_run(arena, models, daemons):
    d = daemons(arena, models[0], "alpha")
    url = d.member().endpoint
    before = scrape(url)
    for key in ("prompt", "generated", "reused"):
        assert one(before, f"vramd_{key}_tokens_total") == 0
    assert one(before, "vramd_request_seconds_count") == 0
    # Present before anything is known about them (0), not absent.
    one(before, "vramd_device_outside_arena_bytes")
    one(before, "vramd_device_foreign_bytes")
    assert one(before, "vramd_queued_requests") == 0 and one(before, "vramd_inflight_requests") == 0

    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0}
    status, first = post(url + "/v1/completions", body)
    assert status == 200
    assert post(url + "/v1/completions", body)[0] == 200      # the same prompt: 4 of its 5 tokens reused
    assert post(url + "/v1/completions", {"prompt": [1], "max_tokens": 0})[0] == 400
    assert post(url + "/v1/completions", {"prompt": [1], "model": "nope"})[0] == 404
    assert d.ask("wake")["ok"]
    after = scrape(url)

    assert one(after, "vramd_prompt_tokens_total") == 10
    assert one(after, "vramd_reused_tokens_total") == 4
    assert one(after, "vramd_generated_tokens_total") == 2 * first["usage"]["completion_tokens"]
    # Matches what /vramd/status says (the engine's counters).
    with urllib.request.urlopen(url + "/vramd/status") as r:
        engine = json.loads(r.read())["engine"]
    assert engine["prompt_tokens"] == 10 and engine["reused_tokens"] == 4
    # Four generation requests, timed (the refused ones too); two first tokens.
    assert one(after, "vramd_request_seconds_count") == 4
    assert one(after, "vramd_request_seconds_bucket", le="+Inf") == 4
    assert one(after, "vramd_request_seconds_sum") > 0
    assert one(after, "vramd_time_to_first_token_seconds_count") == 2
    assert one(after, "vramd_time_to_first_token_seconds_sum") <= one(after, "vramd_request_seconds_sum")
    # Errors by status.
    assert one(after, "vramd_request_errors_total", plane="api", status="400") == 1
    assert one(after, "vramd_request_errors_total", plane="api", status="404") == 1
    # API and control apart; a scrape counts itself (it started before it rendered).
    api = one(after, "vramd_requests_total", plane="api")
    assert api == one(before, "vramd_requests_total", plane="api") + 4 + 1   # 4 posts, this scrape
    assert one(after, "vramd_requests_total", plane="control") >= 1 + one(before, "vramd_requests_total",
                                                                           plane="control")
    try:
        d.ask("bogus")
    except Exception:
        pass
    assert one(scrape(url), "vramd_request_errors_total", plane="control", status="2") == 1


def test_requests_are_counted_when_they_start(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--wake-timeout", "30")
    url = d.member().endpoint
    base = one(scrape(url), "vramd_requests_total", plane="api")
    with held_elsewhere(d, arena):
        waits = [in_thread(post, url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}) for _ in range(2)]
        wait_queued(d, 2)
        during = scrape(url)
        # Neither has an answer yet: both counted, both in flight; the second waits behind the first.
        assert one(during, "vramd_requests_total", plane="api") == base + 2 + 1   # 2 posts, this scrape
        assert one(during, "vramd_inflight_requests") == 2
        assert one(during, "vramd_queued_requests") == 1
        assert one(during, "vramd_request_seconds_count") == 0
    for w in waits:
        w["thread"].join(60)
        assert w["result"][0] == 200
    done = scrape(url)
    assert one(done, "vramd_inflight_requests") == 0 and one(done, "vramd_queued_requests") == 0
    assert one(done, "vramd_request_seconds_count") == 2
    assert one(done, "vramd_time_to_first_token_seconds_bucket", le="+Inf") == 2


def test_metrics_public_opens_only_metrics(arena, models, daemons, tmp_path):
    key = "s3cret-key"
    closed = daemons(arena, models[0], "alpha", env=_env(VRAMD_API_KEY=key))
    opened = daemons(arena, models[1], "beta", "--metrics-public", env=_env(VRAMD_API_KEY=key))
    for d, public in ((closed, False), (opened, True)):
        url = d.member().endpoint
        try:
            urllib.request.urlopen(url + "/metrics").read()
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        assert status == (200 if public else 401), d.name
        assert one(scrape(url, key), "vramd_token_held") in (0, 1)   # with the key: always
        try:
            urllib.request.urlopen(url + "/vramd/status").read()
            raise AssertionError("/vramd/status answered without the key")
        except urllib.error.HTTPError as e:
            assert e.code == 401
    wait_for(lambda: one(scrape(opened.member().endpoint), "vramd_request_errors_total", plane="api",
                         status="401") == 1, "beta's 401 counted", opened)


def _env(**extra):
    from .conftest import daemon_env
    return daemon_env(**extra)
