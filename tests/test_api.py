"""API regeneration: journal, error handling, money guard - against the OpenRouter emulator on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from api_world import CHUTES, MODEL, REPO, exact_cost, job_config, make_prompts, shard_of, start_job, write_prompt_file

from aerie.emulator import EmulatorSettings, serve_in_thread
from aerie.formats.responses import read_completion
from aerie.plan.resolve import api_run
from aerie.responses.api.backends import BackendSettings, request_body
from aerie.responses.api.client import ClientLimits, MoneyGuard, RegenerationStopped, regenerate_shard
from aerie.responses.api.journal import (
    Journal,
    dataset_journal_totals,
    intents_path,
    journal_path,
    messages_key,
    read_journal,
    request_tally,
    unseen_intents,
)
from aerie.responses.api.wire import (
    FatalError,
    RetryableError,
    classify_http_error,
    parse_chat_completion,
    parse_sglang_generate,
)
from aerie.tools.artifacts import FormatError, read_jsonl


def settings(base: str, **kw) -> BackendSettings:
    args = dict(
        backend="openrouter",
        model=MODEL,
        base_url=base,
        temperature=1.0,
        top_p=0.95,
        max_new_tokens=512,
        provider={"sort": "price"},
        reasoning={"enabled": True},
    )
    args.update(kw)
    return BackendSettings(**args)


FAST = ClientLimits(concurrency=200, backoff_base=0.02, backoff_max=0.2, progress_interval=5, read_timeout=10)


def run(prompts, out, s, guard=None, limits=FAST, key="sk-test", **kw):
    return asyncio.run(
        regenerate_shard(
            prompts, out, s, api_key=key, limits=limits, guard=guard or MoneyGuard(), log=lambda m: None, **kw
        )
    )


def request_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- journal -------------------------------------------------------------------------------------


def test_journal_cuts_torn_tail_and_ignores_other_parameters(tmp_path: Path) -> None:
    path = tmp_path / "shard-00000.journal.jsonl"
    j = Journal(path)
    msgs = [{"role": "user", "content": "x"}]
    j.append({"id": "a", "params_hash": "p1", "messages": msgs, "cost": 0.5})
    j.append({"id": "b", "params_hash": "p2", "messages": msgs, "cost": 0.25})
    j.close()
    with open(path, "ab") as fh:
        fh.write(b'{"id": "c", "params_hash": "p1", "mess')  # killed inside write
    prompts = {"a": messages_key(msgs), "b": messages_key(msgs), "c": messages_key(msgs)}
    state = read_journal(path, "p1", prompts, repair=True)
    assert set(state.finished) == {"a"}
    assert state.stale == 1 and state.torn_bytes > 0
    assert state.cost == pytest.approx(0.75)  # money spent under other parameters still counts
    assert path.read_bytes().endswith(b"\n")  # repaired: the next append starts on a clean line
    # The same id with edited prompt text is new work.
    edited = read_journal(path, "p1", {"a": messages_key([{"role": "user", "content": "y"}])})
    assert not edited.finished
    # The dataset's totals (the preview's and the books' spend) read the same whole lines, stale ones included.
    with open(path, "ab") as fh:
        fh.write(b'\n{"id": "d", "params_hash": "p1", "cost": 0.125, "usage": {"completion_tokens": 7}}\n')
        fh.write(b'{"id": "e", "co')  # torn again
    totals = dataset_journal_totals(tmp_path)
    assert totals == {"cost": pytest.approx(0.875), "completion_tokens": 7, "samples": 3}


def test_journal_corruption_before_the_last_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(FormatError, match=r"j.jsonl:2: corrupt journal line"):
        read_journal(path)


# ---- backends: recorded shapes -------------------------------------------------------------------

OPENROUTER_RESPONSE = {
    "id": "gen-1733-abc",
    "provider": "Chutes",
    "model": MODEL,
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "native_finish_reason": "stop",
            "logprobs": None,
            "message": {
                "role": "assistant",
                "content": "The answer is 4.",
                "refusal": None,
                "reasoning": "2 plus 2 is 4.",
                "reasoning_details": [
                    {"type": "reasoning.text", "text": "2 plus 2 is 4.", "format": "unknown", "index": 0}
                ],
            },
        }
    ],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 9,
        "total_tokens": 21,
        "cost": 2.7e-05,
        "is_byok": False,
        "completion_tokens_details": {"reasoning_tokens": 6},
    },
}

SGLANG_CHAT_RESPONSE = {  # OpenAI-compatible server with a reasoning parser (SGLang / vLLM style)
    "id": "c1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "matched_stop": None,
            "message": {"role": "assistant", "content": "", "reasoning_content": "long thought", "tool_calls": None},
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
}

SGLANG_GENERATE_RESPONSE = {  # native /generate, ids given: input_ids in, output_ids out
    "text": "r</think>c",
    "output_ids": [11, 12, 7, 13],
    "meta_info": {
        "id": "req-1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 6,
        "completion_tokens": 5,
        "cached_tokens": 0,
        "e2e_latency": 0.1,
    },
}


def test_parse_openrouter_response_keeps_reasoning_usage_cost_provider() -> None:
    rec = parse_chat_completion(OPENROUTER_RESPONSE, want_reasoning=True)
    assert rec["reasoning"] == "2 plus 2 is 4." and rec["content"] == "The answer is 4."
    assert rec["cost"] == pytest.approx(2.7e-05) and rec["provider"] == "Chutes"
    assert rec["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    assert rec["generation_id"] == "gen-1733-abc" and rec["flags"] == []


def test_parse_openai_compatible_reasoning_content_and_flags() -> None:
    rec = parse_chat_completion(SGLANG_CHAT_RESPONSE, want_reasoning=True)
    assert rec["reasoning"] == "long thought"
    assert rec["flags"] == ["truncated"]  # cut off inside the reasoning: no content yet, not "empty"
    finished_empty = json.loads(json.dumps(SGLANG_CHAT_RESPONSE))
    finished_empty["choices"][0]["finish_reason"] = "stop"
    assert parse_chat_completion(finished_empty, want_reasoning=True)["flags"] == ["empty"]
    no_reasoning = json.loads(json.dumps(OPENROUTER_RESPONSE))
    no_reasoning["choices"][0]["message"]["reasoning"] = None
    assert parse_chat_completion(no_reasoning, want_reasoning=True)["flags"] == ["no_reasoning"]


def test_parse_sglang_generate_keeps_exact_ids_and_appends_matched_stop() -> None:
    def split(ids):
        cut = ids.index(7)
        return {
            "reasoning": str(ids[:cut]),
            "content": str(ids[cut + 1 : -1]),
            "finish_reason": "stop" if ids[-1] == 2 else "length",
        }

    rec = parse_sglang_generate(SGLANG_GENERATE_RESPONSE, split, [2], want_reasoning=True)
    assert rec["output_token_ids"] == [11, 12, 7, 13, 2]  # the matched end-of-turn id is trained on
    assert rec["finish_reason"] == "stop" and rec["reasoning"] == "[11, 12]"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = request_body(settings("http://x"), [{"role": "user", "content": "q"}], tools=tools)
    assert chat["tools"] == tools  # the server renders the declarations and parses the calls
    assert "tools" not in request_body(settings("http://x"), [{"role": "user", "content": "q"}])
    # A prompt whose tools changed is new work on resume.
    assert messages_key([{"role": "user", "content": "q"}], tools) != messages_key([{"role": "user", "content": "q"}])
    body = request_body(settings("http://x", backend="sglang"), [], prompt_ids=[1, 2, 3])
    assert body["input_ids"] == [1, 2, 3] and body["sampling_params"]["skip_special_tokens"] is False


@pytest.mark.parametrize(
    ("status", "body", "retry_after", "expect", "kind"),
    [
        (429, {"error": {"code": 429, "message": "slow down"}}, "3", RetryableError, "429"),
        (502, {"error": {"code": 502, "message": "provider down"}}, None, RetryableError, "5xx"),
        (408, {"error": {"code": 408, "message": "timeout"}}, None, RetryableError, "408"),
        (
            402,
            {"error": {"code": 402, "message": "reserve", "metadata": {"limit_source": "openrouter_in_flight_budget"}}},
            "1",
            RetryableError,
            "402_in_flight",
        ),
        (
            402,
            {"error": {"code": 402, "message": "no credits", "metadata": {"limit_source": "openrouter_credits"}}},
            None,
            FatalError,
            "402_credits",
        ),
        (
            503,
            {"error": {"code": 503, "message": "No endpoints found matching your data policy"}},
            None,
            FatalError,
            "no_endpoints",
        ),
        (401, {"error": {"code": 401, "message": "User not found."}}, None, FatalError, "401"),
        (400, {"error": {"code": 400, "message": "max_tokens too large"}}, None, FatalError, "400"),
    ],
)
def test_http_errors_are_classified_with_the_server_message(status, body, retry_after, expect, kind) -> None:
    err = classify_http_error(status, body, json.dumps(body), retry_after)
    assert isinstance(err, expect) and err.kind == kind
    assert body["error"]["message"] in str(err)
    if retry_after:
        assert err.retry_after == float(retry_after)


def test_errors_inside_http_200_are_retried() -> None:
    with pytest.raises(RetryableError, match="error in a 200"):
        parse_chat_completion({"error": {"code": 502, "message": "upstream died"}}, True)
    failed = json.loads(json.dumps(OPENROUTER_RESPONSE))
    failed["choices"][0]["finish_reason"] = "error"
    with pytest.raises(RetryableError, match="finish_reason 'error'"):
        parse_chat_completion(failed, True)


# ---- the client against the emulator -------------------------------------------------------------

FAULTS = {
    "429": 0.05,
    "429-retry-after": 0.05,
    "500": 0.025,
    "503": 0.025,
    "200-error": 0.02,
    "torn": 0.01,
    "reset": 0.01,
}


def test_fault_run_5000_samples_complete_without_duplicates_or_losses(tmp_path: Path) -> None:
    prompts = make_prompts(5000)
    out = tmp_path / "shard-00000.jsonl"
    log = tmp_path / "requests.jsonl"
    emu = EmulatorSettings(faults=FAULTS, retry_after=0.05, request_log=str(log), output_tokens_mean=40)
    with serve_in_thread(emu) as base:
        summary = run(
            prompts,
            out,
            settings(base),
            limits=ClientLimits(concurrency=500, backoff_base=0.02, backoff_max=0.2, progress_interval=5),
        )
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [p["id"] for p in prompts]  # 0 lost, in prompt order
    assert len(read_jsonl(journal_path(out))) == 5000  # 0 duplicates journaled
    # Paid exactly once per sample: the emulator answered "ok" once per distinct prompt.
    ok = Counter(line["messages_sha256"] for line in request_log(log) if line["outcome"] == "ok")
    assert len(ok) == 5000 and max(ok.values()) == 1
    assert stats["outcomes"]["ok"] == 5000
    # Every injected fault kind was met and retried; the records count their attempts.
    for kind in ("429", "5xx", "200_error", "torn", "connection"):
        assert summary["retries"].get(kind, 0) > 0, summary["retries"]
    assert sum(r["attempts"] - 1 for r in records) == sum(summary["retries"].values())
    assert sum(r["cost"] for r in records) == pytest.approx(stats["charged_usd"])
    assert all(r["provider"] == "Chutes" for r in records)  # sort: price -> the cheapest provider


def test_budget_counts_in_flight_requests_and_never_overshoots(tmp_path: Path) -> None:
    """50 in flight at a time: a guard that forgot them would admit up to 49 samples past the budget."""
    prompts = make_prompts(600)
    out = tmp_path / "shard-00000.jsonl"
    log = tmp_path / "requests.jsonl"
    emu = EmulatorSettings(output_tokens_mean=200, output_tokens_dist="fixed", latency_mean=0.05, request_log=str(log))
    limits = ClientLimits(concurrency=50, backoff_base=0.02, progress_interval=5)
    per_sample = exact_cost(200)
    budget = 0.05
    with serve_in_thread(emu) as base:
        s = settings(base)
        guard = MoneyGuard(budget_usd=budget, expected_cost=per_sample)
        with pytest.raises(
            RegenerationStopped, match=r"budget: \$0\.0\d spent \(\$0\.0\d journaled\) of responses.budget_usd \$0\.05"
        ):
            run(prompts, out, s, guard=guard, limits=limits)
        assert not out.exists()  # the budget is a stop: an incomplete shard is never published
        first = read_journal(journal_path(out), s.params_hash())
        spent = first.cost
        fit = int(budget / per_sample)  # 131
        assert spent <= budget + 1e-9, f"${spent:.6f} spent: {len(first.finished) - fit} samples over the budget"
        assert len(first.finished) >= fit - 1  # and it did not stop early either
        # More budget: only the rest is requested.
        run(prompts, out, s, guard=MoneyGuard(budget_usd=10.0, spent_before=spent), limits=limits)
    assert [r["id"] for r in read_jsonl(out)] == [p["id"] for p in prompts]
    ok = Counter(line["messages_sha256"] for line in request_log(log) if line["outcome"] == "ok")
    assert len(ok) == 600 and max(ok.values()) == 1


def test_a_budget_waits_for_requests_in_flight_when_answers_cost_less_than_expected(tmp_path: Path) -> None:
    """Answers half as long as expected: a request that fits only once those in flight come back waits for them
    instead of ending the run at the first refusal, so the budget is used (and never passed)."""
    out = tmp_path / "shard-00000.jsonl"
    per = exact_cost(50)
    with serve_in_thread(
        EmulatorSettings(output_tokens_mean=50, output_tokens_dist="fixed", latency_mean=0.05)
    ) as base:
        guard = MoneyGuard(budget_usd=16 * per, expected_cost=exact_cost(100))
        with pytest.raises(RegenerationStopped, match="budget: "):
            run(make_prompts(40), out, settings(base), guard=guard, limits=ClientLimits(concurrency=8))
    spent = read_journal(journal_path(out)).cost
    assert spent <= 16 * per + 1e-12
    assert spent >= 15 * per, f"{spent / per:.1f} of 16 requests: admission stopped at the first wave"


def test_budget_counts_spend_lost_to_interrupted_requests(tmp_path: Path) -> None:
    """Money the account was billed for answers no journal holds is spent too: the guard stops earlier."""
    out = tmp_path / "shard-00000.jsonl"
    per_sample = exact_cost(100)
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        guard = MoneyGuard(budget_usd=40 * per_sample, expected_cost=per_sample, lost_usd=25 * per_sample)
        with pytest.raises(RegenerationStopped, match=r"lost to interrupted requests"):
            run(make_prompts(100), out, settings(base), guard=guard, limits=ClientLimits(concurrency=8))
    assert len(read_journal(journal_path(out)).finished) == 15


def test_account_polled_while_running_stops_the_budget_on_spend_no_journal_holds(tmp_path: Path, monkeypatch) -> None:
    """While this run goes, 40 answers are billed on its key that no request of any run explains (another use of the
    key): the poll of GET /key finds them through the key's books and the budget stops on them, naming them. They are
    not this folder's books: its report is its journals, with the 40 shown beside them."""
    from aerie.responses.api.books import spend_story
    from aerie.responses.api.job import regenerate_api_shard

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    per = exact_cost(100)
    out = tmp_path / "results" / "chat" / "responses" / "shard-00000.jsonl"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(200)]
    emu = EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", latency_mean=0.05)
    with serve_in_thread(emu) as base:
        config = job_config(base, {"chat": {}}, budget_usd=100 * per, concurrency=4, progress_interval_s=0.1)

        def another_use_of_the_key() -> None:  # once this run has answers: 40 billed, never journaled anywhere
            while not journal_path(out).exists() or len(journal_path(out).read_bytes().splitlines()) < 5:
                time.sleep(0.01)
            bodies = [request_body(settings(base), p["messages"]) for p in make_prompts(40, tag="z")]
            with ThreadPoolExecutor(40) as pool:  # at once, well before this run's budget is reached
                list(pool.map(lambda b: requests.post(f"{base}/chat/completions", json=b, timeout=10), bodies))

        other = threading.Thread(target=another_use_of_the_key)
        other.start()
        with pytest.raises(RegenerationStopped, match=r"billed on the key, no request of any run explains it"):
            regenerate_api_shard(
                write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat", log=lambda m: None
            )
        other.join()
        billed = requests.get(f"{base}/key", timeout=5).json()["data"]["usage"]
        story = spend_story([out])
    # The account, not just the journals, stayed within budget: another use of the key is seen at the next reading
    # (0.1 s), so at most the requests admitted before it (4 in flight) pass it.
    assert billed <= 104 * per + 1e-9, billed / per
    assert len(read_journal(journal_path(out)).finished) >= 60 - 4 - 1  # what the budget left, minus a window
    assert story.unattributed == pytest.approx(40 * per) and story.total == pytest.approx(story.journaled_usd)


def test_a_final_budget_stop_is_decided_on_a_reading_without_requests_in_flight(tmp_path: Path) -> None:
    """A reading taken while requests are in flight can count some answers twice (billed, not journaled yet). At
    2,000 in flight that stopped a run 3.5% short of its budget: the stop is final only once the account was read
    with nothing of the job in flight."""
    from aerie.responses.api.client import Lane, ShardWork, regenerate
    from aerie.responses.api.key_books import Attribution, FolderShare, Weights
    from aerie.responses.api.key_ledger import KeyLedger
    from aerie.responses.api.spend import KeyAccount, RunSpend

    per = exact_cost(100)
    out = tmp_path / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        ledger = KeyLedger(tmp_path / "key.json", label="here", settle_s=60)
        ledger.open()
        # As read with 10 answers billed and still on their way: counted as this folder's lost requests.
        first = Attribution(10 * per, 10 * per, {"here": FolderShare(lost=10 * per)}, 0.0)
        account = KeyAccount(ledger, f"{base}/key", lambda b: b["data"]["usage"], Weights(), None)
        account.take(first, 0.0)
        account.exact = False
        lane = Lane(
            "d",
            settings(base),
            [ShardWork(make_prompts(100), out)],
            limits=ClientLimits(concurrency=8),
            guard=MoneyGuard(budget_usd=40 * per, expected_cost=per),
            account="acct",
        )
        spend = RunSpend({"acct": 0.0}, {"acct": account})
        result = asyncio.run(regenerate([lane], concurrency=8, spend=spend, log=lambda m: None))[out]
    assert isinstance(result, str) and result.startswith("budget: ")
    assert len(read_journal(journal_path(out)).finished) == 40


def test_a_quota_of_one_wave_keeps_admitting_as_short_answers_come_back(tmp_path: Path) -> None:
    """Quota = concurrency x expected length (the Kimi config's 7M = 2,000 x 3,500): answers half as long as
    expected leave room, so admission waits for requests in flight instead of ending the dataset after its
    first wave; the quota still holds to the token."""
    out = tmp_path / "shard-00000.jsonl"
    with serve_in_thread(
        EmulatorSettings(output_tokens_mean=50, output_tokens_dist="fixed", latency_mean=0.05)
    ) as base:
        guard = MoneyGuard(token_cap=800, expected_tokens=100)
        run(make_prompts(40), out, settings(base), guard=guard, limits=ClientLimits(concurrency=8))
    records = read_jsonl(out)
    tokens = sum(r["usage"]["completion_tokens"] for r in records)
    assert tokens <= 800, f"{tokens} output tokens for a quota of 800"
    assert len(records) >= 14, f"{len(records)} samples: admission stopped at the first wave (8 x 100 expected)"
    completion = read_completion(out)
    assert completion["reason"] == "max_output_tokens" and completion["samples"] == len(records)


def test_output_token_quota_completes_the_dataset_with_the_samples_that_fit(tmp_path: Path) -> None:
    """A quota is not a stop: the shard is published with what fits (never a token over the quota, even
    with 8 requests in flight), the rest recorded as not requested; a later shard of the dataset is empty."""
    out = tmp_path / "shard-00000.jsonl"
    with serve_in_thread(
        EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", latency_mean=0.05)
    ) as base:
        guard = MoneyGuard(token_cap=3000, expected_tokens=100)
        summary = run(make_prompts(100), out, settings(base), guard=guard, limits=ClientLimits(concurrency=8))
        records = read_jsonl(out)
        tokens = sum(r["usage"]["completion_tokens"] for r in records)
        assert tokens <= 3000, f"{tokens} output tokens for a quota of 3,000"
        assert len(records) == 30
        assert [r["id"] for r in records] == sorted((r["id"] for r in records), key=lambda x: int(x.split("/")[1]))
        completion = read_completion(out)
        assert completion == summary["completion"]
        assert completion["format"] == "aerie.responses-completion/1" and completion["reason"] == "max_output_tokens"
        assert (completion["prompts"], completion["samples"], completion["not_requested"]) == (100, 30, 70)
        assert completion["max_output_tokens"] == 3000 and completion["dataset_output_tokens"] == 3000
        assert completion["shard_output_tokens"] == 3000
        # The next shard of the same dataset starts with the quota used up: published empty, nothing requested.
        second = tmp_path / "shard-00001.jsonl"
        before = requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"]
        run(
            make_prompts(50, tag="r"),
            second,
            settings(base),
            guard=MoneyGuard(token_cap=3000, tokens_before=3000, expected_tokens=100),
        )
        assert requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"] == before
    assert second.exists() and second.read_bytes() == b""
    assert read_completion(second)["samples"] == 0 and read_completion(second)["not_requested"] == 50
    # A shard that finished every prompt says so too.
    full = tmp_path / "full" / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(output_tokens_mean=10)) as base:
        run(make_prompts(5), full, settings(base))
    assert read_completion(full)["reason"] is None and read_completion(full)["not_requested"] == 0
    # The report shows the quota: 30 of the first shard's 100 prompts, none of the second's 50.
    from aerie.publish.report import figure_spend, load_quotas, load_responses

    shards = [out, second]
    quotas = load_quotas(shards)
    assert quotas == {
        tmp_path.parent.name: {
            "prompts": 150,
            "samples": 30,
            "not_requested": 120,
            "max_output_tokens": 3000,
            "quota_reached": True,
        }
    }
    summary = figure_spend(load_responses(shards), tmp_path / "spend.png", quotas)
    assert summary["quotas"] == quotas and (tmp_path / "spend.png").stat().st_size > 0


def test_402_in_flight_is_retried_within_max_attempts_then_reported(tmp_path: Path) -> None:
    """A transient in-flight-budget 402 that never clears must end the job, not hang it."""
    out = tmp_path / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(faults={"402-in-flight": 1.0})) as base:
        coro = regenerate_shard(
            make_prompts(3),
            out,
            settings(base),
            api_key="k",
            guard=MoneyGuard(),
            limits=ClientLimits(concurrency=3, max_attempts=2, backoff_base=0.01),
            log=lambda m: None,
        )
        with pytest.raises(RegenerationStopped, match=r"402_in_flight: 3"):
            asyncio.run(asyncio.wait_for(coro, timeout=30))
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    assert stats["outcomes"] == {"402-in-flight": 6}  # Retry-After honoured once per sample, then given up


def test_intents_are_journaled_before_each_request_and_every_request_is_accounted_for(tmp_path: Path) -> None:
    """A line before each request, a line after each failure: every request is journaled, failed (by kind) or
    unanswered, and only requests in flight when a process died are unanswered."""
    out = tmp_path / "shard-00000.jsonl"
    log = tmp_path / "requests.jsonl"
    faults = {"500": 0.2, "slow": 0.1}  # slow answers outlast the read timeout: billed, never read
    with serve_in_thread(EmulatorSettings(request_log=str(log), faults=faults, fault_seed=5, slow_seconds=1.0)) as base:
        run(
            make_prompts(40),
            out,
            settings(base),
            limits=ClientLimits(concurrency=8, backoff_base=0.01, read_timeout=0.4),
        )
    lines = read_jsonl(intents_path(out))
    sent = [i for i in lines if i["event"] == "sent"]
    records = read_jsonl(out)
    assert len(sent) == sum(r["attempts"] for r in records) == len(request_log(log))
    assert {i["format"] for i in lines} == {"aerie.request-intent/2"}
    assert len({i["session"] for i in lines} | {r["session"] for r in records}) == 1
    by_id = Counter(i["id"] for i in sent)
    assert all(by_id[r["id"]] == r["attempts"] for r in records)
    tally = request_tally(out)
    outcomes = Counter(x["outcome"] for x in request_log(log))
    assert tally.sent == len(sent) and tally.journaled == 40 and not tally.unanswered
    # A slow answer the client gave up on is billed all the same (the emulator logs it "client-gone").
    assert tally.failed == Counter({"5xx": outcomes["500"], "timeout": outcomes["client-gone"]}), (tally, outcomes)
    assert tally.billable_failures == outcomes["client-gone"] > 0  # a 500 refuses before any model works: not billed
    assert not unseen_intents(intents_path(out), read_journal(journal_path(out)))
    # A request sent with no answer and no failure line: in flight when its process died, maybe billed unseen.
    with open(intents_path(out), "a") as fh:
        fh.write(
            json.dumps({"format": "aerie.request-intent/1", "id": "d/999", "t": 5.0, "params_hash": "x", "attempt": 1})
            + "\n"
        )
    assert unseen_intents(intents_path(out), read_journal(journal_path(out))) == {"d/999"}
    assert request_tally(out).unanswered == [5.0]


def test_changed_sampling_parameters_never_reuse_old_responses(tmp_path: Path) -> None:
    prompts = make_prompts(30)
    out = tmp_path / "shard-00000.jsonl"
    log = tmp_path / "requests.jsonl"
    with serve_in_thread(EmulatorSettings(request_log=str(log))) as base:
        run(prompts, out, settings(base))
        run(prompts, out, settings(base))  # unchanged: nothing requested
        assert requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"] == 30
        run(prompts, out, settings(base, temperature=0.6))
    assert len(request_log(log)) == 60
    assert {r["params"]["temperature"] for r in read_jsonl(out)} == {0.6}
    assert len(read_jsonl(journal_path(out))) == 60  # the old responses stay on disk (they were paid for)


@pytest.mark.parametrize(
    ("emu_kw", "client_kw", "message"),
    [
        ({"api_key": "sk-right"}, {"key": "sk-wrong"}, "HTTP 401"),
        ({}, {"provider": {"only": ["nobody"]}}, "No endpoints found"),
        ({"credits": 0.01}, {}, "openrouter_credits"),
    ],
)
def test_fatal_errors_stop_with_the_server_message_and_keep_finished_work(tmp_path, emu_kw, client_kw, message) -> None:
    out = tmp_path / "shard-00000.jsonl"
    key = client_kw.pop("key", "sk-right")
    with serve_in_thread(EmulatorSettings(output_tokens_mean=300, **emu_kw)) as base:
        with pytest.raises(RegenerationStopped, match=message):
            run(
                make_prompts(200),
                out,
                settings(base, **client_kw),
                key=key,
                limits=ClientLimits(concurrency=8, backoff_base=0.01),
            )
    assert not out.exists()
    finished = read_journal(journal_path(out)).finished
    if "credits" in emu_kw:
        assert finished  # what was paid before the credits ran out is kept
        assert sum(r["cost"] for r in finished.values()) <= 0.01


def test_retry_after_is_honoured(tmp_path: Path) -> None:
    out = tmp_path / "shard-00000.jsonl"

    with serve_in_thread(EmulatorSettings(faults={"429-retry-after": 1.0}, retry_after=0.4)) as base:
        t0 = time.monotonic()
        with pytest.raises(RegenerationStopped):
            run(
                make_prompts(1),
                out,
                settings(base),
                limits=ClientLimits(concurrency=1, max_attempts=3, backoff_base=0.0),
            )
        elapsed = time.monotonic() - t0
    assert elapsed >= 0.8  # two waits of Retry-After 0.4 s, although the backoff base is 0


def test_sglang_native_backend_sends_ids_and_keeps_exact_output_ids(tmp_path: Path) -> None:
    """Through the client, against a loopback server answering in /generate's recorded shape."""
    import threading

    from aiohttp import web

    seen: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        ids = body["input_ids"]
        # The "model" echoes the prompt's last id as reasoning, then </think> (7), content, and stops on 2.
        return web.json_response(
            {
                "text": "...",
                "output_ids": [ids[-1], 7, 40, 41],
                "meta_info": {
                    "id": "r",
                    "finish_reason": {"type": "stop", "matched": 2},
                    "prompt_tokens": len(ids),
                    "completion_tokens": 5,
                },
            }
        )

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:

        def render(messages, tools=None):
            return [1, 100 + len(messages[0]["content"])]

        def split(ids):
            cut = ids.index(7)
            return {"reasoning": f"r{ids[:cut]}", "content": f"c{ids[cut + 1 : -1]}", "finish_reason": "stop"}

        out = tmp_path / "shard-00000.jsonl"
        s = BackendSettings("sglang", "kimi", f"http://127.0.0.1:{port}", 0.0, 1.0, 64)
        run(make_prompts(3), out, s, render_ids=render, split_ids=split, eos_ids=[2])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    recs = read_jsonl(out)
    assert [b["input_ids"] for b in seen] == [[1, 100 + len(p["messages"][0]["content"])] for p in make_prompts(3)]
    assert all(b["sampling_params"]["max_new_tokens"] == 64 for b in seen)
    for r in recs:
        assert r["prompt_token_ids"] == [1, r["output_token_ids"][0]]
        assert r["output_token_ids"][1:] == [7, 40, 41, 2]
        assert r["content"] == "c[40, 41]" and r["provider"] == "sglang"


def test_samples_failing_every_attempt_leave_the_shard_unpublished_with_a_clear_message(tmp_path: Path) -> None:
    out = tmp_path / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(faults={"500": 1.0})) as base:
        with pytest.raises(
            RegenerationStopped,
            match=r"5 samples have no response after responses.max_attempts "
            r"attempts \(5xx: 5\); rerun to retry only them",
        ):
            run(
                make_prompts(5),
                out,
                settings(base),
                limits=ClientLimits(concurrency=5, max_attempts=2, backoff_base=0.01),
            )
    assert not out.exists() and not read_journal(journal_path(out)).finished


def test_a_request_that_fails_for_good_gives_its_place_and_budget_room_back(tmp_path: Path) -> None:
    """Every request fails for good (one attempt each); the budget has room for one request in flight at a time.
    Each failure hands its reservation back - its place among those in flight and its expected cost - so every
    sample is tried and the run ends naming them all. A failure that kept its reservation would leave the next
    request waiting forever for room (issue 30 item 7: that change passed every test): here, a timeout."""
    out = tmp_path / "shard-00000.jsonl"
    per = exact_cost(100)
    guard = MoneyGuard(budget_usd=1.5 * per, expected_cost=per)
    limits = ClientLimits(concurrency=2, max_attempts=1, backoff_base=0.0)
    with serve_in_thread(EmulatorSettings(faults={"500": 1.0})) as base:
        job = regenerate_shard(
            make_prompts(4), out, settings(base), api_key="sk-test", limits=limits, guard=guard, log=lambda m: None
        )
        with pytest.raises(RegenerationStopped, match=r"4 samples have no response after responses.max_attempts"):
            asyncio.run(asyncio.wait_for(job, timeout=10))
    assert not out.exists()


# ---- TLS -------------------------------------------------------------------------------------------


def test_tls_server_is_trusted_only_through_ca_bundle(tmp_path: Path) -> None:
    """HTTPS with a self-signed certificate: trusted when named in ca_bundle; otherwise the job stops at once
    (no retries of a certificate error) with a message naming the setting - verification is never off."""
    import shutil
    import time

    from aerie.emulator.tls import server_tls_context, write_self_signed_certificate

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (makes the test certificate)")
    cert, key = write_self_signed_certificate(tmp_path)
    with serve_in_thread(EmulatorSettings(), ssl_context=server_tls_context(str(cert), str(key))) as base:
        assert base.startswith("https://")
        trusted = tmp_path / "ok" / "shard-00000.jsonl"
        run(make_prompts(5), trusted, settings(base), limits=ClientLimits(concurrency=2, ca_bundle=str(cert)))
        assert len(trusted.read_text().splitlines()) == 5
        untrusted = tmp_path / "no" / "shard-00000.jsonl"
        t0 = time.monotonic()
        with pytest.raises(RegenerationStopped, match="responses.ca_bundle"):
            run(
                make_prompts(5),
                untrusted,
                settings(base),
                limits=ClientLimits(concurrency=2, max_attempts=8, backoff_base=2.0, backoff_max=30.0),
            )
        assert time.monotonic() - t0 < 10  # retried, it would back off 2 + 4 + 8 + ... seconds first
        assert not untrusted.exists()


# ---- one run, one account: several datasets and shards in one process (aerie.responses.api.job) -----------------


def expected_request_cost(prompts: list[dict]) -> float:
    """What the job expects a request to cost before it has measured 20 (money.expected_sample_cost)."""
    from aerie.formats.prompts import estimate_prompt_tokens

    prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in prompts) / len(prompts)
    return 100 * CHUTES.completion_price + prompt_tokens * CHUTES.prompt_price


def test_datasets_and_shards_of_one_run_share_one_concurrency_budget_and_quota(tmp_path: Path, monkeypatch) -> None:
    """Three datasets of two shards each, in one job: at most `concurrency` requests in flight in all (the
    emulator's own count), the budget held to the request, the quota'd dataset held to the token over both of
    its shards, and the datasets taking turns until the budget stops them."""
    from aerie.responses.api.job import ApiShardTask, regenerate_api_shards

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    per = exact_cost(100)
    tasks = []
    for name in ("a", "b", "q"):
        for shard in range(2):
            prompts = [
                {**p, "id": f"{name}/{shard}/{i}", "dataset": name}
                for i, p in enumerate(make_prompts(60, tag=f"{name}{shard}"))
            ]
            path = write_prompt_file(tmp_path / "prompts" / name / f"shard-{shard:05d}.jsonl", prompts)
            tasks.append(ApiShardTask(name, path, results / name / "responses" / f"shard-{shard:05d}.jsonl"))
    emu = EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", latency_mean=0.1)
    with serve_in_thread(emu) as base:
        config = job_config(base, {"a": {}, "b": {}, "q": {"max_output_tokens": 4000}}, budget_usd=200 * per)
        results_by_shard = regenerate_api_shards(tasks, api_run(config), log=lambda m: None)
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    assert 15 <= stats["max_in_flight"] <= 30, stats  # 30 in all, not 30 per dataset or per shard
    assert 200 * per - 2 * per <= stats["charged_usd"] <= 200 * per + 1e-9, stats["charged_usd"] / per
    done = {
        name: sum(len(read_journal(journal_path(t.out)).finished) for t in tasks if t.dataset == name) for name in "abq"
    }
    assert done["q"] == 40  # 4,000 tokens of quota at 100 a request, over its two shards
    assert abs(done["a"] - done["b"]) <= 30 and min(done["a"], done["b"]) >= 60, done  # turns, until the budget
    why = {t.out: results_by_shard[t.out] for t in tasks}
    assert all(isinstance(why[t.out], dict) for t in tasks if t.dataset == "q")  # complete at its quota
    assert any(isinstance(v, str) and v.startswith("budget: ") for v in why.values())


def test_a_job_start_counts_what_the_account_billed_beyond_the_journals(tmp_path: Path, monkeypatch) -> None:
    """The start-of-run reconcile: an earlier job of this run answered 10 requests and was killed with 40 more in
    flight, which the provider billed (no journal holds them). The job's start reads the account: the key's books
    attribute the 40 to this folder's lost requests and the budget counts them; with no poll while it runs (progress
    every 60 s), nothing else could: without the reconcile it spends 40 requests too many."""
    from aerie.responses.api.job import regenerate_api_shard
    from aerie.responses.api.journal import INTENT_FORMAT

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    per = exact_cost(100)
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(200)]
    earlier = [{**p, "id": f"e/{i}", "dataset": "chat"} for i, p in enumerate(make_prompts(10, tag="earlier"))]
    out = results / "chat" / "responses" / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        config = job_config(base, {"chat": {}}, budget_usd=70 * per)
        regenerate_api_shard(
            write_prompt_file(tmp_path / "e.jsonl", earlier),
            out.with_name("shard-00001.jsonl"),
            api_run(config),
            "chat",
        )
        sent = {"format": INTENT_FORMAT, "event": "sent", "session": "killed", "attempt": 1, "t": time.time()}
        intents_path(out).write_text("".join(json.dumps({**sent, "id": p["id"]}) + "\n" for p in prompts[:40]))
        for p in prompts[:40]:  # the killed job's requests: billed by the provider, never answered
            requests.post(f"{base}/chat/completions", json=request_body(settings(base), p["messages"]), timeout=10)
        logged: list[str] = []
        with pytest.raises(RegenerationStopped, match=r"budget: .* lost to interrupted requests"):
            regenerate_api_shard(
                write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat", log=logged.append
            )
        billed = requests.get(f"{base}/key", timeout=5).json()["data"]["usage"]
    assert billed <= 70 * per + 1e-9, f"{billed / per:.1f} requests billed for a budget of 70"
    assert 18 <= len(read_journal(journal_path(out)).finished) <= 20
    assert any("$0.0077 lost to interrupted requests" in line for line in logged), logged[:3]


def test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them(
    tmp_path: Path, monkeypatch
) -> None:
    """Restart pricing: the intents log holds 40 requests sent and never answered (their job was killed while the
    provider generated them); the account shows none yet. The restart prices each at the expected cost, so the
    budget keeps room for them: without it, the run spends the whole budget and the 40 land on top (+40%)."""
    from aerie.responses.api.job import regenerate_api_shard
    from aerie.responses.api.journal import INTENT_FORMAT

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(200)]
    expected = expected_request_cost(prompts)
    out = results / "chat" / "responses" / "shard-00000.jsonl"
    intents = intents_path(out)
    intents.parent.mkdir(parents=True)
    intents.write_text(
        "".join(
            json.dumps({"format": INTENT_FORMAT, "event": "sent", "session": "killed", "id": p["id"], "t": time.time()})
            + "\n"
            for p in prompts[:40]
        )
    )
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        config = job_config(base, {"chat": {}}, budget_usd=100 * expected)
        logged: list[str] = []
        with pytest.raises(RegenerationStopped, match=r"sent before an interruption, not yet billed"):
            regenerate_api_shard(
                write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat", log=logged.append
            )
    spent = read_journal(journal_path(out)).cost
    # 40 priced requests + what was spent fit the budget; the journals' measured mean replaces the estimate.
    assert spent + 40 * expected <= 100 * expected + 1e-9, (spent / expected, 40)
    assert spent + 40 * expected >= 100 * expected - 2 * expected
    assert any("40 samples were sent before an interruption" in line for line in logged), logged


def test_a_finished_datasets_journals_and_unanswered_requests_count_against_the_shared_budget(
    tmp_path: Path, monkeypatch
) -> None:
    """Two datasets share one budget; this job has work for `chat` only. `done` holds 30 journaled answers, and a
    killed job left 20 of its requests sent and never answered (the account shows none of them yet). Both count:
    its journals in the run's spend, its unanswered requests at its journals' mean cost - so `chat` gets what is
    left, 50 requests. (Issue 30 item 7: leaving `done`'s journals out, or pricing its requests at $0 because it
    has no work in the job, each passed every test: `chat` would spend 30 or 20 requests too many.)"""
    from aerie.responses.api.job import regenerate_api_shard
    from aerie.responses.api.journal import INTENT_FORMAT

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    per = exact_cost(100)
    done_out = results / "done" / "responses" / "shard-00000.jsonl"
    chat_out = results / "chat" / "responses" / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        config = job_config(base, {"done": {}, "chat": {}}, budget_usd=100 * per)
        done = [{**p, "id": f"done/{i}", "dataset": "done"} for i, p in enumerate(make_prompts(50, tag="done"))]
        regenerate_api_shard(write_prompt_file(tmp_path / "done.jsonl", done[:30]), done_out, api_run(config), "done")
        killed = intents_path(done_out.with_name("shard-00001.jsonl"))
        sent = {"format": INTENT_FORMAT, "event": "sent", "session": "killed", "attempt": 1, "t": time.time()}
        killed.write_text("".join(json.dumps({**sent, "id": p["id"]}) + "\n" for p in done[30:]))
        chat = [{**p, "id": f"chat/{i}", "dataset": "chat"} for i, p in enumerate(make_prompts(200, tag="chat"))]
        with pytest.raises(RegenerationStopped, match=r"budget: "):
            regenerate_api_shard(
                write_prompt_file(tmp_path / "chat.jsonl", chat), chat_out, api_run(config), "chat", log=lambda m: None
            )
    journaled = read_journal(journal_path(done_out)).cost
    mean = journaled / 30
    spent = read_journal(journal_path(chat_out)).cost
    assert journaled + 20 * mean + spent <= 100 * per + 1e-9, (journaled / per, spent / per)
    assert journaled + 20 * mean + spent >= 98 * per, (journaled / per, spent / per)


def test_the_job_logs_its_progress_with_rate_eta_and_dollars(tmp_path: Path, monkeypatch) -> None:
    """aerie.tools.progress in the responses job: samples done of all, samples/s, ETA and the run's dollars, throttled
    (the last line always), counting what a journal already holds as done."""
    import re

    from aerie.responses.api.job import ApiShardTask, regenerate_api_shards

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(30)]
    out = results / "chat" / "responses" / "shard-00000.jsonl"
    with serve_in_thread(EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        task = ApiShardTask("chat", write_prompt_file(tmp_path / "p.jsonl", prompts), out)
        lines: list[str] = []
        assert isinstance(
            regenerate_api_shards([task], api_run(job_config(base, {"chat": {}})), log=lines.append)[out], dict
        )
        out.unlink()  # a rerun publishes the shard again from its journal: every sample is already done
        rerun: list[str] = []
        regenerate_api_shards([task], api_run(job_config(base, {"chat": {}})), log=rerun.append)
    bars = [x for x in lines if x.startswith("responses: ")]
    assert 1 <= len(bars) <= 3, bars  # the first, maybe one more, the last: not one per sample
    assert re.fullmatch(
        r"responses: 100% 30/30 \[[\d:]+<00:00, [\d.]+ ?(sample/s|s/sample), spent=\$[\d.]+, in_flight=0, "
        r"retries=0, failed=0\]",
        bars[-1],
    )
    assert [x for x in rerun if x.startswith("responses: ")][-1].startswith("responses: 100% 30/30")


def test_the_preview_counts_spend_beyond_the_journals_against_the_budget() -> None:
    """The preview's remaining budget and its OVER BUDGET verdict count what this folder's books hold beyond the
    journals (billed, and priced as pending), named as the logs and the report name them."""
    from aerie.responses.api.money import DatasetEstimate, Prices, Unjournaled, format_preview

    prices = Prices(0.5e-6, 2e-6, "config")
    pending_work = [DatasetEstimate("chat", 1, 100, 100, 1000, 20_000, 0.05, "expected", 200.0)]
    beyond = Unjournaled(retries=0.01, lost=0.02, pending=0.004)
    text = format_preview(pending_work, 0.05, 0.12, [prices], beyond)
    assert "spent: $0.05 journaled + $0.01 billed retries + $0.02 lost to interrupted requests + $0.0040 sent " in text
    assert "= $0.08; budget $0.12, remaining $0.04" in text
    assert "OVER BUDGET by $0.01" in text  # $0.05 of work, $0.036 left: the journals alone would leave $0.07
    assert "OVER BUDGET" not in format_preview(pending_work, 0.05, 0.12, [prices], None)


def test_the_money_story_adds_up_to_the_account(tmp_path: Path, monkeypatch) -> None:
    """A run never killed whose slow answers outlast the read timeout (billed, retried): the report's story is the
    journals plus billed retries - named so, not "lost to interrupted requests" - and equals the account."""
    from aerie.responses.api.books import spend_story
    from aerie.responses.api.job import ApiShardTask, regenerate_api_shards

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    results = tmp_path / "results"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(60)]
    out = results / "chat" / "responses" / "shard-00000.jsonl"
    emu = EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", faults={"slow": 0.1}, slow_seconds=0.6)
    with serve_in_thread(emu) as base:
        config = job_config(base, {"chat": {}}, read_timeout_s=0.3, budget_usd=1.0)
        task = ApiShardTask("chat", write_prompt_file(tmp_path / "p.jsonl", prompts), out)
        assert isinstance(regenerate_api_shards([task], api_run(config), log=lambda m: None)[out], dict)
        deadline = time.monotonic() + 10
        while requests.get(f"{base}/emulator/stats", timeout=5).json()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
        story = spend_story([out])
    timeouts = stats["outcomes"]["client-gone"]
    assert timeouts > 0
    assert story.account == pytest.approx(stats["charged_usd"], abs=1e-12)
    assert story.total == pytest.approx(stats["charged_usd"], abs=1e-12)
    assert story.journaled_usd == pytest.approx(60 * exact_cost(100))
    assert story.billed["chat"].retries == pytest.approx(timeouts * exact_cost(100))
    assert story.billed["chat"].lost == 0 and story.unattributed == 0
    assert "billed retries" in story.words() and "lost to interrupted" not in story.words()


# ---- responses.mode: batch (aerie.responses.api.batches) -----------------------------------------------------------


def batch_settled(base: str, timeout: float = 60.0) -> dict:
    """The emulator's figures once no batch is validating or in progress (every entry finished and billed)."""
    deadline = time.monotonic() + timeout
    while set((stats := requests.get(f"{base}/emulator/stats", timeout=5).json())["batches"]) & {
        "validating",
        "in_progress",
    }:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    return stats


BATCH_RUN = dict(
    mode="batch", max_new_tokens=128, batch={"size": 40, "poll_interval_s": 0.1, "max_batches_in_flight": 3}
)


def test_batches_killed_with_failures_expiry_and_lost_answers_pay_each_answer_once(tmp_path: Path, monkeypatch) -> None:
    """A batch run through an emulator whose batches lose entries (errors), expire halfway, and lose the answers of
    polls and of submissions, SIGKILLed once its batches are in flight and started again: the restart resumes polling
    what was submitted (never submits a request twice), every answer is journaled once and billed once, failed and
    expired entries go in later batches, and the run stays within its budget."""
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    emu = EmulatorSettings(
        output_tokens_mean=100,
        output_tokens_dist="fixed",
        batch_validate_s=0.2,
        batch_latency_mean=1.0,
        batch_faults={"entry-error": 0.1, "expire": 0.3, "lost-poll": 0.2, "lost-submit": 0.2},
        request_log=str(tmp_path / "requests.jsonl"),
    )
    folder, go = tmp_path / "run", tmp_path / "go"
    folder.mkdir()
    go.touch()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    budget = 200 * exact_cost(100)  # the whole shard at the batch price, and room for its batches' most cost
    out = shard_of(folder)
    with serve_in_thread(emu) as base:
        first = start_job(folder, base, budget, go, 200, env, **BATCH_RUN)
        batches = out.with_name("shard-00000.batches.jsonl")
        deadline = time.monotonic() + 60
        while not (batches.exists() and b'"submitted"' in batches.read_bytes()):
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.02)
        first.kill()  # batches submitted and running: they finish, and bill, while no one polls
        first.communicate(timeout=30)
        second = start_job(folder, base, budget, go, 200, env, **BATCH_RUN)
        log = second.communicate(timeout=240)[0]
        stats = batch_settled(base)
    assert second.returncode == 0 and '"unfinished": 0' in log, log[-3000:]
    assert "batches submitted before" in log, log[-3000:]  # resumed, not submitted again
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(f"run/{i}" for i in range(200))
    assert all(r.get("batch") for r in records)
    billed = Counter(line["messages_sha256"] for line in request_log(tmp_path / "requests.jsonl") if line["cost"])
    assert len(billed) == 200 and max(billed.values()) == 1, billed.most_common(3)  # each answer paid once
    outcomes = stats["outcomes"]
    assert outcomes.get("batch-provider_error", 0) > 0 and stats["batches"].get("expired", 0) > 0, stats
    journaled = read_journal(journal_path(out)).cost
    assert journaled == pytest.approx(stats["charged_usd"]) and stats["charged_usd"] <= budget


def test_a_model_that_takes_no_batches_is_refused_at_its_first_batch_and_nothing_is_billed(
    tmp_path: Path, monkeypatch
) -> None:
    """Whether a model takes batches is not published: the first batch of a dataset finds out. Until it has left
    validating no other batch is submitted; failed at validation, it stops the dataset naming OpenRouter's answer,
    and nothing was billed."""
    from aerie.responses.api.job import regenerate_api_shard

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    out = tmp_path / "results" / "chat" / "responses" / "shard-00000.jsonl"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(300)]
    emu = EmulatorSettings(batch_models=["another/model"], batch_validate_s=0.3)
    with serve_in_thread(emu) as base:
        config = job_config(base, {"chat": {}}, budget_usd=1.0, **BATCH_RUN)
        with pytest.raises(RegenerationStopped, match=r"failed the first batch of moonshotai/kimi-k2.5 at validation"):
            regenerate_api_shard(write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat")
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    assert stats["batches"] == {"failed": 1} and stats["charged_usd"] == 0


def test_failed_batch_entries_go_through_the_streaming_path_when_asked(tmp_path: Path, monkeypatch) -> None:
    """``batch.failed: stream``: entries a batch failed are requested one by one instead of in a later batch."""
    from aerie.responses.api.job import regenerate_api_shard

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    out = tmp_path / "results" / "chat" / "responses" / "shard-00000.jsonl"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(60)]
    emu = EmulatorSettings(
        output_tokens_mean=50,
        output_tokens_dist="fixed",
        batch_validate_s=0.05,
        batch_latency_mean=0.2,
        batch_faults={"entry-error": 0.3},
        request_log=str(tmp_path / "requests.jsonl"),
    )
    with serve_in_thread(emu) as base:
        run = {**BATCH_RUN, "batch": {**BATCH_RUN["batch"], "failed": "stream"}}
        config = job_config(base, {"chat": {}}, budget_usd=1.0, **run)
        regenerate_api_shard(write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat")
        stats = batch_settled(base)
    streamed = [r for r in read_jsonl(out) if not r.get("batch")]
    assert len(read_jsonl(out)) == 60 and len(streamed) == stats["outcomes"]["batch-provider_error"] > 0
    assert stats["outcomes"]["ok"] == len(streamed) and stats["batches"] == {"completed": stats["batches"]["completed"]}


def test_a_batch_reserves_its_most_cost_before_it_is_submitted(tmp_path: Path, monkeypatch) -> None:
    """Answers five times longer than expected: a batch cannot be stopped once submitted, so the budget admits it at
    its requests' most cost (prompt + max_new_tokens at the per-token price), never at their expected cost, and the
    run stays within its budget (a batch admitted at the expected cost would overshoot fivefold)."""
    from aerie.responses.api.job import regenerate_api_shard

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    out = tmp_path / "results" / "chat" / "responses" / "shard-00000.jsonl"
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(300)]
    per = 0.5 * exact_cost(100)  # the batch price of an answer
    emu = EmulatorSettings(output_tokens_mean=100, output_tokens_dist="fixed", batch_validate_s=0.05,
                           batch_latency_mean=0.1)  # fmt: skip
    with serve_in_thread(emu) as base:
        config = job_config(base, {"chat": {}}, budget_usd=50 * per, expected_output_tokens=20, **BATCH_RUN)
        with pytest.raises(RegenerationStopped, match="budget: "):
            regenerate_api_shard(write_prompt_file(tmp_path / "p.jsonl", prompts), out, api_run(config), "chat")
        billed = batch_settled(base)["charged_usd"]
    assert billed <= 50 * per + 1e-9, billed / per
    assert len(read_journal(journal_path(out)).finished) >= 5  # it did spend, in batches that fit


def test_the_preview_prices_batch_mode_at_both_prices_with_the_wait(tmp_path: Path, monkeypatch) -> None:
    """``snakemake -n`` for a batch-mode dataset: the pending work at the batch price (assumed until measured, and
    said so), the streaming price beside it, and the wait to expect."""
    import dataclasses

    from aerie.preview.money import cost_preview
    from aerie.responses.api.settings import PlannedShard

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test")
    prompts = [{**p, "dataset": "chat"} for p in make_prompts(100)]
    with serve_in_thread(EmulatorSettings()) as base:
        config = job_config(base, {"chat": {}}, budget_usd=1.0, live_prices=True, **BATCH_RUN)
        run = api_run(config)
        chat = dataclasses.replace(
            run.datasets["chat"], shards=(PlannedShard("00000", 0, 100),), planned_prompts=lambda: iter(prompts)
        )
        preview = cost_preview(dataclasses.replace(run, datasets={"chat": chat}), tmp_path / "results")
    estimate = preview.datasets["chat"]
    assert estimate.streaming_dollars == pytest.approx(2 * estimate.dollars) and estimate.dollars > 0
    assert "batch: 50% of live: Chutes, assumed (responses.batch.price_factor)" in preview.text, preview.text
    assert f"batch (streaming: ${estimate.streaming_dollars:.2f}; wait: OpenRouter: median 7 min" in preview.text


def test_the_budget_has_one_home_and_a_batch_is_checked_before_any_spend(tmp_path: Path) -> None:
    """A dataset cannot have a budget of its own (the run's responses.budget_usd is the one the job and the preview
    read); mode batch is refused at parse time for a backend without batches and for routing a batch cannot take,
    each naming the setting."""
    import copy

    import yaml
    from api_world import api_pipeline_config

    from aerie.plan.config_file import ConfigError, ConfigSources
    from aerie.plan.resolve import check_config, validate_config

    path = api_pipeline_config(tmp_path, "http://127.0.0.1:9/api/v1", tmp_path / "target", {"chat": {"n": 4}})
    base = yaml.safe_load(path.read_text())

    def check(change) -> None:
        config = copy.deepcopy(base)
        change(config)
        validate_config(config, ConfigSources([]))
        check_config(config)

    check(lambda c: c["responses"].update(budget_usd=5.0, mode="batch"))  # fine: the run's budget, batches
    cases = [
        (lambda c: c["datasets"]["chat"].update(responses={"budget_usd": 1.0}), "datasets.chat.responses.budget_usd"),
        (lambda c: c["responses"].update(mode="batch", provider={"order": ["chutes"]}), "responses.provider"),
        (lambda c: c["responses"].update(mode="batch", backend="openai"), "responses.mode"),
    ]
    for change, where in cases:
        with pytest.raises(ConfigError) as e:
            check(change)
        assert where in str(e.value), (where, str(e.value))
