"""The OpenRouter emulator: answer shape, determinism, routing, money, every fault kind, the request log, the CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import aiohttp
import pytest
from conftest import REPO

from aerie.emulator import (
    DEFAULT_PROVIDERS,
    FAULT_KINDS,
    LISTEN_LINE,
    EmulatorSettings,
    parse_faults,
    run_in_thread,
    serve_in_thread,
)

PRICES = {p.name: p for p in DEFAULT_PROVIDERS}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers please"}]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "moonshotai/kimi-k2.5", "messages": MESSAGES, "max_tokens": 4096, "seed": 7, **extra}


async def _call(url: str, method: str, payload: Any, headers: dict[str, str] | None, timeout: float):
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        async with session.request(method, url, json=payload, headers=headers) as resp:
            text = await resp.text()
            return resp.status, dict(resp.headers), (json.loads(text) if text else None)


def call(
    base: str, path: str, payload: Any = None, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of one request; POST when there is a payload."""
    return asyncio.run(_call(base + path, "POST" if payload is not None else "GET", payload, headers, timeout))


def chat(base: str, payload: dict[str, Any] | None = None, **kw: Any) -> tuple[int, dict[str, str], Any]:
    return call(base, "/chat/completions", payload or body(), **kw)


def test_normal_answer_shape_determinism_and_cost() -> None:
    with serve_in_thread(EmulatorSettings(credits=10.0)) as base:
        status, headers, out = chat(base)
        assert status == 200
        assert out["id"].startswith("gen-") and headers["X-Generation-Id"] == out["id"]
        assert out["object"] == "chat.completion" and out["model"] == "moonshotai/kimi-k2.5"
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["native_finish_reason"] == "stop"
        msg = choice["message"]
        assert msg["role"] == "assistant" and msg["content"] and msg["reasoning"]
        assert msg["reasoning_details"][0]["text"] == msg["reasoning"]
        usage = out["usage"]
        n_reason, n_content = len(msg["reasoning"].split()), len(msg["content"].split())
        assert usage["prompt_tokens"] == 7  # words in all message contents
        assert usage["completion_tokens_details"]["reasoning_tokens"] == n_reason
        assert usage["completion_tokens"] == n_reason + n_content
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        p = PRICES[out["provider"]]
        assert usage["cost"] == pytest.approx(7 * p.prompt_price + usage["completion_tokens"] * p.completion_price)

        # Same request, same answer (new id); another seed, another answer.
        _, headers2, again = chat(base)
        assert again["choices"] == out["choices"] and again["provider"] == out["provider"]
        assert again["id"] != out["id"] and headers2["X-Generation-Id"] == again["id"]
        _, _, other = chat(base, body(seed=8))
        assert other["choices"][0]["message"]["content"] != msg["content"]

        spent = out["usage"]["cost"] * 2 + other["usage"]["cost"]
        _, _, key = call(base, "/key")
        assert key["data"]["usage"] == pytest.approx(spent) and key["data"]["limit"] is None
        _, _, credits = call(base, "/credits")
        assert credits["data"] == {"total_credits": 10.0, "total_usage": pytest.approx(spent)}
        _, _, stats = call(base, "/emulator/stats")
        assert stats["outcomes"] == {"ok": 3} and stats["charged_usd"] == pytest.approx(spent)
        # The plain OpenAI-style prefix answers the same.
        status, _, plain = call(base.replace("/api/v1", "/v1"), "/chat/completions", body())
        assert status == 200 and plain["choices"] == out["choices"]


def test_provider_routing_and_no_endpoints() -> None:
    cases = [
        ({"only": ["Together"]}, "Together"),
        ({"ignore": ["chutes", "deepinfra", "together"]}, "Fireworks"),
        ({"quantizations": ["fp4"]}, "Fireworks"),
        ({"sort": "price"}, "Chutes"),
        ({"sort": "price", "ignore": ["chutes"]}, "DeepInfra"),
        ({"order": ["fireworks", "together"]}, "Fireworks"),
        ({"only": ["deepinfra/int4"]}, "DeepInfra"),
        ({"quantizations": ["int4", "fp8"], "max_price": {"completion": 2.0}}, "Chutes"),
    ]
    with serve_in_thread() as base:
        for prefs, want in cases:
            status, _, out = chat(base, body(provider=prefs))
            assert status == 200 and out["provider"] == want, prefs
            p = PRICES[want]
            u = out["usage"]
            assert u["cost"] == pytest.approx(
                u["prompt_tokens"] * p.prompt_price + u["completion_tokens"] * p.completion_price
            )
        for prefs in ({"only": ["baseten"]}, {"quantizations": ["bf16"]}, {"only": ["chutes"], "ignore": ["chutes"]}):
            status, _, out = chat(base, body(provider=prefs))
            assert status == 503 and "No endpoints found" in out["error"]["message"], prefs
        _, _, endpoints = call(base, "/models/moonshotai/kimi-k2.5/endpoints")
        eps = endpoints["data"]["endpoints"]
        assert [e["provider_name"] for e in eps] == [p.name for p in DEFAULT_PROVIDERS]
        assert eps[0]["pricing"] == {"prompt": "0.00000045", "completion": "0.0000019"}
        assert eps[0]["quantization"] == "int4" and eps[0]["status"] == 0 and eps[0]["context_length"] == 262144
        _, _, models = call(base, "/models")
        assert models["data"][0]["id"] == "moonshotai/kimi-k2.5"
        assert isinstance(models["data"][0]["pricing"]["prompt"], str)


def test_max_tokens_cap_and_reasoning_options() -> None:
    settings = EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", reasoning_fraction=0.5)
    with serve_in_thread(settings) as base:
        _, _, out = chat(base, body(max_tokens=70))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length" and choice["native_finish_reason"] == "max_tokens"
        assert out["usage"]["completion_tokens"] == 70
        assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 50
        assert len(choice["message"]["content"].split()) == 20

        _, _, off = chat(base, body(reasoning={"enabled": False}))
        assert off["choices"][0]["message"]["reasoning"] is None
        assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
        assert off["usage"]["completion_tokens"] == 100

        _, _, hidden = chat(base, body(reasoning={"exclude": True}))
        assert hidden["choices"][0]["message"]["reasoning"] is None
        assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] == 50  # billed all the same

        status, _, bad = chat(base, body(stream=True))
        assert status == 400 and "stream" in bad["error"]["message"]


def test_empty_rate_gives_empty_content() -> None:
    with serve_in_thread(EmulatorSettings(empty_rate=1.0)) as base:
        status, _, out = chat(base)
        assert status == 200 and out["choices"][0]["message"]["content"] == ""


@pytest.mark.parametrize("kind", ["429", "429-retry-after", "500", "502", "503", "402-in-flight"])
def test_error_status_faults(kind: str) -> None:
    with serve_in_thread(EmulatorSettings(faults={kind: 1.0}, retry_after=0.2)) as base:
        status, headers, out = chat(base)
        want = 402 if kind == "402-in-flight" else int(kind[:3])
        assert status == want and out["error"]["code"] == want and out["error"]["message"]
        if kind == "429":
            assert "Retry-After" not in headers
        if kind == "429-retry-after":
            assert headers["Retry-After"] == "0.2" and "0.2" in out["error"]["message"]
        if kind == "402-in-flight":
            assert out["error"]["metadata"]["limit_source"] == "openrouter_in_flight_budget"
            assert headers["Retry-After"] == "1"
        _, _, stats = call(base, "/emulator/stats")
        assert stats["outcomes"] == {kind: 1} and stats["charged_usd"] == 0.0


def test_200_error_alternates_error_body_and_finish_reason_error() -> None:
    with serve_in_thread(EmulatorSettings(faults={"200-error": 1.0})) as base:
        status1, _, first = chat(base)
        status2, _, second = chat(base)
        assert status1 == status2 == 200
        assert first["error"]["message"] and "choices" not in first
        assert second["choices"][0]["finish_reason"] == "error" and second["usage"]["cost"] == 0.0
        _, _, key = call(base, "/key")
        assert key["data"]["usage"] == 0.0


def test_torn_body_is_a_payload_error() -> None:
    with serve_in_thread(EmulatorSettings(faults={"torn": 1.0})) as base:
        with pytest.raises(aiohttp.ClientPayloadError):
            chat(base)


def test_reset_is_a_connection_error() -> None:
    with serve_in_thread(EmulatorSettings(faults={"reset": 1.0})) as base:
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            chat(base)
        _, _, stats = call(base, "/emulator/stats")
        assert stats["outcomes"] == {"reset": 1}


def test_slow_outlasts_a_client_timeout() -> None:
    with serve_in_thread(EmulatorSettings(faults={"slow": 1.0}, slow_seconds=0.6)) as base:
        with pytest.raises(asyncio.TimeoutError):
            chat(base, timeout=0.2)
        status, _, out = chat(base, timeout=5.0)  # a patient client gets a normal, billed answer
        assert status == 200 and out["usage"]["cost"] > 0


def test_fault_mix_is_seeded() -> None:
    faults = parse_faults(["429=0.3,500=0.3", "503=0.2"])
    assert faults == {"429": 0.3, "500": 0.3, "503": 0.2}
    seen = []
    for _ in range(2):
        with serve_in_thread(EmulatorSettings(faults=faults, fault_seed=3)) as base:
            seen.append([chat(base)[0] for _ in range(12)])
    assert seen[0] == seen[1] and len(set(seen[0])) > 1
    with pytest.raises(ValueError):
        run_in_thread(EmulatorSettings(faults={"teapot": 0.5}))
    assert "torn" in FAULT_KINDS and "reset" in FAULT_KINDS


def test_credits_key_limit_and_in_flight_budget() -> None:
    with serve_in_thread(EmulatorSettings(credits=1e-9)) as base:
        status, _, out = chat(base)
        assert status == 402 and out["error"]["metadata"]["limit_source"] == "openrouter_credits"
    with serve_in_thread(EmulatorSettings(key_limit=1e-9)) as base:
        status, _, out = chat(base)
        assert status == 402 and out["error"]["metadata"]["limit_source"] == "key_limit"
        _, _, key = call(base, "/key")
        assert key["data"]["limit"] == 1e-9 and key["data"]["usage"] == 0.0

    chutes = PRICES["Chutes"]
    reserve = 7 * chutes.prompt_price + 1000 * chutes.completion_price
    settings = EmulatorSettings(in_flight_budget=reserve * 1.5, latency_mean=0.4)
    payload = body(max_tokens=1000, provider={"only": ["chutes"]})

    async def two_at_once(url: str) -> list[tuple[int, str | None, Any]]:
        async with aiohttp.ClientSession() as session:

            async def one():
                async with session.post(url + "/chat/completions", json=payload) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            return await asyncio.gather(one(), one())

    with serve_in_thread(settings) as base:
        results = sorted(asyncio.run(two_at_once(base)), key=lambda r: r[0])
        assert [r[0] for r in results] == [200, 402]
        assert results[1][1] == "1"
        assert results[1][2]["error"]["metadata"]["limit_source"] == "openrouter_in_flight_budget"
        assert chat(base, payload)[0] == 200  # the reservation is released afterwards


def test_auth_and_request_log(tmp_path) -> None:
    secret = "sk-or-v1-emulator-test-secret"
    log = tmp_path / "requests.jsonl"
    url, stop = run_in_thread(EmulatorSettings(api_key=secret, request_log=log))
    try:
        status, _, out = chat(url)
        assert status == 401 and out["error"]["code"] == 401
        status, _, _ = chat(url, headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = chat(url, headers={"Authorization": f"Bearer {secret}"})
        assert status == 200
        assert call(url, "/key")[0] == 401
        assert call(url, "/key", headers={"Authorization": f"Bearer {secret}"})[0] == 200
    finally:
        stop()
    text = log.read_text()
    assert secret not in text and "Bearer" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(x["outcome"], x["status"]) for x in lines] == [("401", 401), ("401", 401), ("ok", 200)]
    canon = json.dumps(MESSAGES, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert all(x["messages_sha256"] == hashlib.sha256(canon.encode()).hexdigest() for x in lines)
    assert lines[2]["model"] == "moonshotai/kimi-k2.5" and lines[2]["max_tokens"] == 4096 and lines[2]["cost"] > 0
    assert lines[2]["completion_tokens"] > 0 and lines[0]["completion_tokens"] == 0  # output tokens charged


def test_strict_models() -> None:
    with serve_in_thread(EmulatorSettings(strict_models=True)) as base:
        assert chat(base, body(model="someone/else"))[0] == 400
        assert chat(base)[0] == 200
        assert call(base, "/models/someone/else/endpoints")[0] == 404


def test_cli_starts_answers_and_stops_on_sigterm(tmp_path) -> None:
    port_file, log = tmp_path / "port", tmp_path / "log.jsonl"
    env = {**os.environ, "AERIE_EMU_KEY": "k-123", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aerie.emulator",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--request-log",
            str(log),
            "--api-key-env",
            "AERIE_EMU_KEY",
            "--faults",
            "500=0.0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=15), "no listening line within 15 s"
        line = proc.stdout.readline().strip()
        prefix = LISTEN_LINE.format("")
        assert line.startswith(prefix) and line.endswith("/api/v1"), line
        url = line[len(prefix) :]
        assert url.startswith("http://127.0.0.1:")
        assert port_file.read_text().strip() == url.split(":")[2].split("/")[0]
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
        req = urllib.request.Request(
            url + "/chat/completions",
            data=json.dumps(body()).encode(),
            headers={"Authorization": "Bearer k-123", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.load(resp)["usage"]["cost"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert len(log.read_text().splitlines()) == 1  # flushed at shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_a_client_that_disconnects_is_billed_like_by_a_provider() -> None:
    """Work in flight when the client goes away is charged when the generation ends, and /key reports it."""
    import time

    with serve_in_thread(EmulatorSettings(latency_mean=0.6)) as base:
        with pytest.raises(asyncio.TimeoutError):
            chat(base, timeout=0.15)  # the client gives up (or is killed) while the model generates
        assert call(base, "/key")[2]["data"]["usage"] == 0.0  # not yet: the generation is still running
        deadline = time.monotonic() + 10
        while call(base, "/emulator/stats")[2]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        _, _, stats = call(base, "/emulator/stats")
        assert stats["outcomes"] == {"client-gone": 1} and stats["charged_usd"] > 0
        assert stats["charged_completion_tokens"] > 0 and stats["max_in_flight"] == 1 and stats["in_flight"] == 0
        _, _, key = call(base, "/key")
        assert key["data"]["usage"] == pytest.approx(stats["charged_usd"])
        _, _, credits = call(base, "/credits")
        assert credits["data"]["total_usage"] == pytest.approx(stats["charged_usd"])


# ---- the Batch API (aerie.emulator.batches) ------------------------------------------------------------------------


def batch_body(n: int, model: str = "moonshotai/kimi-k2.5", **extra: Any) -> dict[str, Any]:
    requests_ = [
        {"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 500}}
        for i in range(n)
    ]
    return {"endpoint": "/v1/chat/completions", "model": model, **extra, "requests": requests_}


def test_a_batch_is_validated_runs_on_one_provider_and_bills_each_answer_once_at_the_batch_price() -> None:
    import time

    settings = EmulatorSettings(
        output_tokens_mean=50, output_tokens_dist="fixed", batch_validate_s=0.2, batch_latency_mean=0.2
    )
    with serve_in_thread(settings) as base:
        status, _, batch = call(base, "/batches", batch_body(5))
        assert status == 202 and batch["status"] == "validating" and batch["results"] is None
        _, _, listed = call(base, "/batches")
        assert [b["id"] for b in listed["data"]] == [batch["id"]]
        time.sleep(0.9)
        _, _, done = call(base, f"/batches/{batch['id']}")
        _, _, partial = call(base, f"/batches/{batch['id']}/results")
        _, _, stats = call(base, "/emulator/stats")
    assert done["status"] == "completed" and done["provider"] == "Chutes"  # the cheapest eligible provider
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert (
        sorted(r["custom_id"] for r in done["results"])
        == [f"r{i}" for i in range(5)]
        == sorted(r["custom_id"] for r in partial["data"])
    )
    chutes = PRICES["Chutes"]
    per = 0.5 * (2 * chutes.prompt_price + 50 * chutes.completion_price)  # "q i": 2 prompt words, 50 out
    costs = [r["response"]["body"]["usage"]["cost"] for r in done["results"]]
    assert costs == pytest.approx([per] * 5) and stats["charged_usd"] == pytest.approx(5 * per)
    assert stats["outcomes"] == {"batch-ok": 5}


def test_batch_refusals_and_faults() -> None:
    """What a client must survive: a submission OpenRouter refuses (400), a model without a batch endpoint (failed at
    validation, nothing billed), entries that fail, a batch that expires halfway, polls and a submission whose answer
    is lost."""
    import time

    fast = dict(output_tokens_mean=10, output_tokens_dist="fixed", batch_validate_s=0.05, batch_latency_mean=0.2)
    with serve_in_thread(EmulatorSettings(**fast, batch_models=["other/model"])) as base:
        status, _, err = call(base, "/batches", batch_body(2, provider={"order": ["chutes"]}))
        assert status == 400 and "only provider.only" in err["error"]["message"]
        status, _, batch = call(base, "/batches", batch_body(2))
        time.sleep(0.2)
        _, _, failed = call(base, f"/batches/{batch['id']}")
        assert failed["status"] == "failed" and "no batch-eligible endpoint" in failed["error"]["message"]
        assert call(base, "/emulator/stats")[2]["charged_usd"] == 0
    faults = {"entry-error": 0.5, "expire": 1.0}
    with serve_in_thread(EmulatorSettings(**fast, batch_faults=faults, fault_seed=3)) as base:
        _, _, batch = call(base, "/batches", batch_body(20))
        time.sleep(0.6)
        _, _, expired = call(base, f"/batches/{batch['id']}")
    codes = [(r["error"] or {}).get("code") for r in expired["results"]]
    assert expired["status"] == "expired" and len(codes) == 20
    assert {"batch_expired", "provider_error", None} <= set(codes)  # answered, errored and expired entries
    with serve_in_thread(EmulatorSettings(**fast, batch_faults={"lost-poll": 1.0, "lost-submit": 1.0})) as base:
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            call(base, "/batches", batch_body(1))
        _, _, listed = call(base, "/batches")  # the batch whose answer was lost exists
        assert len(listed["data"]) == 1
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            call(base, f"/batches/{listed['data'][0]['id']}")
