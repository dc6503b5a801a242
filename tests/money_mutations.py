"""Mutation checks of the money mechanisms (issue 23 item 5): break one at a time in the working tree, run the
tests that must notice, put it back (by replacing the broken text back, so other edits to the file survive).

    python tests/money_mutations.py                 # every mechanism (about 10 minutes: three need Snakemake)
    python tests/money_mutations.py "quota admit off"

Prints a table: the mechanism, the file, whether a test failed. Not collected by pytest (it edits the code).
"""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = "tests/test_api.py"
MUTATIONS = {
    "budget: in-flight not reserved": (
        "aerie/api/client.py",
        "            reserved = sum(r.in_flight * r.per_cost() for r in runs)",
        "            reserved = 0.0",
        [f"{FAST}::test_budget_counts_in_flight_requests_and_never_overshoots"],
    ),
    "quota admit off": (
        "aerie/api/client.py",
        "        if guard.token_cap is not None:\n            used = guard.tokens_before + run.tokens",
        "        if False:\n            used = guard.tokens_before + run.tokens",
        [
            f"{FAST}::test_output_token_quota_completes_the_dataset_with_the_samples_that_fit",
            f"{FAST}::test_a_quota_of_one_wave_keeps_admitting_as_short_answers_come_back",
        ],
    ),
    "budget: stop at the first refusal (no in-flight wait)": (
        "aerie/api/client.py",
        '                if in_flight[0] > 0:\n                    return "wait"',
        '                if False:\n                    return "wait"',
        [f"{FAST}::test_a_budget_waits_for_requests_in_flight_when_answers_cost_less_than_expected"],
    ),
    "quota: stop at the first refusal (no in-flight wait)": (
        "aerie/api/client.py",
        '                if run.in_flight > 0:\n                    return "wait"',
        '                if False:\n                    return "wait"',
        [f"{FAST}::test_a_quota_of_one_wave_keeps_admitting_as_short_answers_come_back"],
    ),
    "a final budget stop decided on a reading taken with requests in flight": (
        "aerie/api/client.py",
        "                if any(not w.exact for w in spend.watchers.values()):",
        "                if False:",
        [f"{FAST}::test_a_final_budget_stop_is_decided_on_a_reading_without_requests_in_flight"],
    ),
    "start-of-run reconciliation off": (
        "aerie/api/job.py",
        "        floor=money.billed_unjournaled,",
        "        floor=0.0,",
        [f"{FAST}::test_a_job_start_counts_what_the_account_billed_beyond_the_journals"],
    ),
    "account not polled while running": (
        "aerie/api/client.py",
        "        self.polls += 1\n        self.billed = max(self.floor, self.unexplained(float(usage), journal_spend))",
        "        self.polls += 1\n        self.billed = self.floor",
        [f"{FAST}::test_account_polled_while_running_stops_the_budget_on_spend_no_journal_holds"],
    ),
    "preview ignores spend beyond the journals": (
        "aerie/api/money.py",
        "    used = spent_total + unjournaled.total",
        "    used = spent_total",
        [
            f"{FAST}::test_the_preview_counts_spend_beyond_the_journals_against_the_budget",
            "tests/test_api_pipeline.py::test_kill_9_at_peak_in_flight_then_the_lost_spend_counts_against_the_budget",
        ],
    ),
    "cost preview hands 0 lost to the onstart refusal": (
        "aerie/api/preview.py",
        "        account.lost if account else 0.0,",
        "        0.0,",
        ["tests/test_api_pipeline.py::test_kill_9_at_peak_in_flight_then_the_lost_spend_counts_against_the_budget"],
    ),
    "refuse_over_budget off (rules/common.smk)": (
        "rules/common.smk",
        '        and not config["allow_over_budget"]',
        "        and False",
        ["tests/test_api_pipeline.py::test_dry_run_previews_cost_and_a_real_run_refuses_over_budget"],
    ),
    "402 in-flight budget treated as final": (
        "aerie/api/backends.py",
        '            return RetryableError("402_in_flight", f"HTTP 402 ({source}): {message}", wait or 1.0)',
        '            return FatalError("402_in_flight", f"HTTP 402 ({source}): {message}")',
        [f"{FAST}::test_402_in_flight_is_retried_within_max_attempts_then_reported"],
    ),
    "402 credits retried": (
        "aerie/api/backends.py",
        '        return FatalError("402_credits", f"HTTP 402 ({source or \'credits\'}): {message}")',
        '        return RetryableError("402_credits", f"HTTP 402 ({source or \'credits\'}): {message}")',
        [f"{FAST}::test_fatal_errors_stop_with_the_server_message_and_keep_finished_work"],
    ),
    "account ledger never written": (
        "aerie/api/money.py",
        '(whose journals it counts)."""\n    import time',
        '(whose journals it counts)."""\n    return\n    import time',
        [
            f"{FAST}::test_a_job_start_counts_what_the_account_billed_beyond_the_journals",
            f"{FAST}::test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them",
        ],
    ),
    "restart pricing off (unanswered intents not priced)": (
        "aerie/api/money.py",
        "    if items:\n        sent_first",
        "    if False:\n        sent_first",
        [f"{FAST}::test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them"],
    ),
    "restart pricing dropped by the watcher": (
        "aerie/api/client.py",
        "        if self.pending is None:\n            return billed",
        "        if True:\n            return billed",
        [f"{FAST}::test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them"],
    ),
    "cross-dataset sharing: concurrency per dataset, not per run": (
        "aerie/api/client.py",
        "        workers = min(concurrency, sum(min(len(r.queue), r.lane.limits.concurrency) for r in runs))",
        "        workers = sum(min(len(r.queue), r.lane.limits.concurrency) for r in runs)",
        [f"{FAST}::test_datasets_and_shards_of_one_run_share_one_concurrency_budget_and_quota"],
    ),
    "cross-dataset sharing: budget reserves only its own dataset's requests in flight": (
        "aerie/api/client.py",
        "            if spent + reserved + per_cost > guard.budget_usd:",
        "            if spent + run.in_flight * per_cost + per_cost > guard.budget_usd:",
        [f"{FAST}::test_datasets_and_shards_of_one_run_share_one_concurrency_budget_and_quota"],
    ),
    "report: spend beyond the journals left out": (
        "aerie/api/money.py",
        "        return self.journaled_usd + sum(u.retries + u.lost for u in self.billed.values()) + self.unattributed",
        "        return self.journaled_usd",
        [f"{FAST}::test_the_money_story_adds_up_to_the_account"],
    ),
    "report: billed retries named lost": (
        "aerie/api/money.py",
        "d: (r.billable_failures * r.expected_cost, len(r.unanswered) * r.expected_cost) for d, r in requests.items()",
        "d: (0.0, (r.billable_failures + len(r.unanswered)) * r.expected_cost) for d, r in requests.items()",
        [f"{FAST}::test_the_money_story_adds_up_to_the_account"],
    ),
    "slow: restart pricing off, under Snakemake (kill -9, rerun at once)": (
        "aerie/api/money.py",
        "    if items:\n        sent_first",
        "    if False:\n        sent_first",
        [
            "tests/test_api_pipeline.py::"
            "test_a_rerun_at_once_after_kill_9_prices_answers_still_in_flight_and_the_report_adds_up_to_the_account"
        ],
    ),
    "slow: budget reserves only its own dataset's requests in flight, under Snakemake": (
        "aerie/api/client.py",
        "            if spent + reserved + per_cost > guard.budget_usd:",
        "            if spent + run.in_flight * per_cost + per_cost > guard.budget_usd:",
        [
            "tests/test_api_pipeline.py::test_shards_and_datasets_scheduled_at_once_share_one_concurrency_budget_and_quota"
        ],
    ),
    "intents: failures not logged (every retry counted as interrupted)": (
        "aerie/api/client.py",
        "                failed(shard, sid, attempt, kind)\n                if kind in BILLABLE_FAILURES:",
        "                if kind in BILLABLE_FAILURES:",
        [
            f"{FAST}::test_intents_are_journaled_before_each_request_and_every_request_is_accounted_for",
            f"{FAST}::test_the_money_story_adds_up_to_the_account",
        ],
    ),
}


def run(names):
    rows = []
    for name in names:
        rel, old, new, tests = MUTATIONS[name]
        path = REPO / rel
        text = path.read_text()
        assert text.count(old) == 1, (name, text.count(old))
        path.write_text(text.replace(old, new))
        try:
            t0 = time.time()
            proc = subprocess.run(
                ["nice", "-n", "10", ".venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=1500,
            )
            tail = [
                line
                for line in proc.stdout.splitlines()
                if line.startswith(("FAILED", "ERROR")) or " passed" in line or " failed" in line
            ]
            rows.append((name, rel, proc.returncode != 0, round(time.time() - t0), tail[-3:]))
        finally:
            cur = path.read_text()
            assert cur.count(new) >= 1
            path.write_text(cur.replace(new, old, 1))
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n in MUTATIONS if not n.startswith("slow:")]
    rows = run(names)
    print("\n| mechanism broken | file | a test failed | s |\n|---|---|---|---|")
    for name, rel, caught, secs, _ in rows:
        print(f"| {name} | {rel} | {'yes' if caught else '**NO**'} | {secs} |")
