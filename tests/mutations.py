"""Mutation checks: break one mechanism at a time in the working tree, run the tests that must notice, put it back
(by replacing the broken text back, so other edits to the file survive). Groups:

- ``money``: the money mechanisms of the API client (issue 23 item 5);
- ``issue30``: the ten changes issue 30 item 7 found the whole non-slow suite green on (softmax without the row
  max, a memory estimate without the batch size, a prompt cache key without max_prompts, marker checks, reference
  divergences, a gate without a speedup, an open reasoning block, a reservation kept after a failure, a finished
  dataset's journals and requests in flight left out of the shared budget);
- ``key_ledger``: one budget per key across runs (issue 30 item 5);
- ``issue39``: the gaps issue 39 listed in the API, host check, recorded answers and time preview, and its mechanisms
  (books per folder on a shared key, the batch path, the budget's one home);
- ``issue36_37``: DFlash's block mask (no block sees another, nor its own anchor's target feature) and the gate on
  the traffic mix (a set's spread, the weighted mix, the drafter served for the mix);
- ``slow``: money mechanisms that only the Snakemake tests reach.

    python tests/mutations.py                      # every mutation but the slow ones (minutes: some need Snakemake)
    python tests/mutations.py issue30              # one group (money, issue30, key_ledger, issue39, issue36_37, slow)
    python tests/mutations.py "quota admit off"    # by name

Prints a table: the mechanism, the file, whether a test failed (pytest's exit status 1; any other status is an
error of the harness, shown as such). Not collected by pytest (it edits the code); tests/test_mutations_current.py
checks that every original text still occurs exactly once in its file, so a refactor cannot leave a mutation that
no longer applies.
"""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = "tests/test_api.py"

MONEY = {
    "budget: in-flight not reserved": (
        "aerie/responses/api/client.py",
        "        reserved = sum(r.reserved() for r in runs)",
        "        reserved = 0.0",
        [f"{FAST}::test_budget_counts_in_flight_requests_and_never_overshoots"],
    ),
    "quota admit off": (
        "aerie/responses/api/client.py",
        "        if guard.token_cap is not None:\n            used = guard.tokens_before + run.tokens",
        "        if False:\n            used = guard.tokens_before + run.tokens",
        [
            f"{FAST}::test_output_token_quota_completes_the_dataset_with_the_samples_that_fit",
            f"{FAST}::test_a_quota_of_one_wave_keeps_admitting_as_short_answers_come_back",
        ],
    ),
    "budget: stop at the first refusal (no in-flight wait)": (
        "aerie/responses/api/client.py",
        '            if self.busy() or self.spend.others_in_flight():\n                return "wait"',
        '            if False:\n                return "wait"',
        [f"{FAST}::test_a_budget_waits_for_requests_in_flight_when_answers_cost_less_than_expected"],
    ),
    "quota: stop at the first refusal (no in-flight wait)": (
        "aerie/responses/api/client.py",
        '                if run.entries_in_flight() > 0:\n                    return "wait"',
        '                if False:\n                    return "wait"',
        [f"{FAST}::test_a_quota_of_one_wave_keeps_admitting_as_short_answers_come_back"],
    ),
    "a final budget stop decided on a reading taken with requests in flight": (
        "aerie/responses/api/client.py",
        "            if any(not a.exact for a in self.spend.accounts.values()):",
        "            if False:",
        [f"{FAST}::test_a_final_budget_stop_is_decided_on_a_reading_without_requests_in_flight"],
    ),
    "start-of-run reconciliation off": (
        "aerie/responses/api/job.py",
        "    attribution = ledger.reconcile(reading.usage, journal, weights)",
        "    attribution = ledger.reconcile(None, journal, weights)",
        [f"{FAST}::test_a_job_start_counts_what_the_account_billed_beyond_the_journals"],
    ),
    "account not polled while running": (
        "aerie/responses/api/spend.py",
        "        self.take(self.ledger.reconcile(float(usage), journal, self.weights), journal)",
        "        self.take(None, journal)",
        [f"{FAST}::test_account_polled_while_running_stops_the_budget_on_spend_no_journal_holds"],
    ),
    "preview ignores spend beyond the journals": (
        "aerie/responses/api/money.py",
        "    used = spent_total + unjournaled.total",
        "    used = spent_total",
        [
            f"{FAST}::test_the_preview_counts_spend_beyond_the_journals_against_the_budget",
            "tests/test_api_pipeline.py::test_kill_9_at_peak_in_flight_then_the_lost_spend_counts_against_the_budget",
        ],
    ),
    "cost preview hands 0 lost to the onstart refusal": (
        "aerie/preview/money.py",
        "        unjournaled.total,\n        estimates,",
        "        0.0,\n        estimates,",
        ["tests/test_api_pipeline.py::test_kill_9_at_peak_in_flight_then_the_lost_spend_counts_against_the_budget"],
    ),
    "refuse_over_budget off (rules/common.smk)": (
        "rules/common.smk",
        '        and not config["allow_over_budget"]',
        "        and False",
        ["tests/test_api_pipeline.py::test_dry_run_previews_cost_and_a_real_run_refuses_over_budget"],
    ),
    "402 in-flight budget treated as final": (
        "aerie/responses/api/wire.py",
        '            return RetryableError("402_in_flight", f"HTTP 402 ({source}): {message}", wait or 1.0)',
        '            return FatalError("402_in_flight", f"HTTP 402 ({source}): {message}")',
        [f"{FAST}::test_402_in_flight_is_retried_within_max_attempts_then_reported"],
    ),
    "402 credits retried": (
        "aerie/responses/api/wire.py",
        '        return FatalError("402_credits", f"HTTP 402 ({source or \'credits\'}): {message}")',
        '        return RetryableError("402_credits", f"HTTP 402 ({source or \'credits\'}): {message}")',
        [f"{FAST}::test_fatal_errors_stop_with_the_server_message_and_keep_finished_work"],
    ),
    "account ledger never written": (
        "aerie/responses/api/books.py",
        "    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n    try:\n        os.write(fd, (json",
        "    return\n    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
        "    try:\n        os.write(fd, (json",
        [f"{FAST}::test_the_money_story_adds_up_to_the_account"],
    ),
    "restart pricing off (unanswered intents not priced)": (
        "aerie/responses/api/key_books.py",
        "        s.pending = min(f.weights.unsettled_at(now),",
        "        s.pending = 0.0 * min(f.weights.unsettled_at(now),",
        [f"{FAST}::test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them"],
    ),
    "restart pricing dropped by the watcher": (
        "aerie/responses/api/spend.py",
        "        return self.share.billed + self.share.pending + self.others_growth",
        "        return self.share.billed + self.others_growth",
        [f"{FAST}::test_requests_sent_before_an_interruption_are_priced_until_the_account_shows_them"],
    ),
    "cross-dataset sharing: concurrency per dataset, not per run": (
        "aerie/responses/api/client.py",
        "        workers = min(concurrency, streamable)",
        "        workers = streamable",
        [f"{FAST}::test_datasets_and_shards_of_one_run_share_one_concurrency_budget_and_quota"],
    ),
    "cross-dataset sharing: budget reserves only its own dataset's requests in flight": (
        "aerie/responses/api/client.py",
        "        reserved = sum(r.reserved() for r in runs)",
        "        reserved = sum(r.reserved() for r in runs[:1])  # the first dataset's only",
        [f"{FAST}::test_datasets_and_shards_of_one_run_share_one_concurrency_budget_and_quota"],
    ),
    "report: spend beyond the journals left out": (
        "aerie/responses/api/books.py",
        "        return self.journaled_usd + sum(u.retries + u.lost for u in self.billed.values())",
        "        return self.journaled_usd",
        [f"{FAST}::test_the_money_story_adds_up_to_the_account"],
    ),
    "report: billed retries named lost": (
        "aerie/responses/api/key_books.py",
        '    ("retries", "retries", "retries_max"),\n    ("lost", "lost", "lost_max"),',
        '    ("lost", "retries", "retries_max"),\n    ("lost", "lost", "lost_max"),',
        [f"{FAST}::test_the_money_story_adds_up_to_the_account"],
    ),
    "slow: restart pricing off, under Snakemake (kill -9, rerun at once)": (
        "aerie/responses/api/key_books.py",
        "        s.pending = min(f.weights.unsettled_at(now),",
        "        s.pending = 0.0 * min(f.weights.unsettled_at(now),",
        [
            "tests/test_api_pipeline.py::"
            "test_a_rerun_at_once_after_kill_9_prices_answers_still_in_flight_and_the_report_adds_up_to_the_account"
        ],
    ),
    "slow: budget reserves only its own dataset's requests in flight, under Snakemake": (
        "aerie/responses/api/client.py",
        "        reserved = sum(r.reserved() for r in runs)",
        "        reserved = sum(r.reserved() for r in runs[:1])  # the first dataset's only",
        [
            "tests/test_api_pipeline.py::test_shards_and_datasets_scheduled_at_once_share_one_concurrency_budget_and_quota"
        ],
    ),
    "intents: failures not logged (every retry counted as interrupted)": (
        "aerie/responses/api/client.py",
        '        self.intent(shard, "failed", sid, attempt, kind=kind)\n        if kind in BILLABLE_FAILURES:',
        "        if kind in BILLABLE_FAILURES:",
        [
            f"{FAST}::test_intents_are_journaled_before_each_request_and_every_request_is_accounted_for",
            f"{FAST}::test_the_money_story_adds_up_to_the_account",
        ],
    ),
}


ISSUE_30 = {
    "softmax without the row max: chunked TTT attention": (
        "aerie/drafter_kinds/eagle3/layers.py",
        "torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1)",
        "(lambda x: x.exp() / x.exp().sum(-1, keepdim=True))(torch.cat([scores, *diag], dim=-1).float())",
        [
            "tests/test_ttt_flex.py::test_large_scores_in_fp32_stay_finite_and_exact",
            "tests/test_ttt_flex.py::test_flex_forward_equals_chunked_and_exact",
        ],
    ),
    "softmax without the row max: flex path's log-sum-exp merge": (
        "aerie/drafter_kinds/eagle3/ttt_flex.py",
        "w = torch.softmax(torch.stack([lse0.view(B, kvh, g, T).float(), *diag], dim=-1), dim=-1)",
        "w = (lambda x: x.exp() / x.exp().sum(-1, keepdim=True))"
        "(torch.stack([lse0.view(B, kvh, g, T).float(), *diag], dim=-1))",
        ["tests/test_ttt_flex.py::test_lse_merge_and_chunked_gradients_equal_exact"],
    ),
    "drafter memory estimate ignores the batch size": (
        "aerie/drafter_kinds/eagle3/memory.py",
        "activation_bytes(d, K, a, B, T)",
        "activation_bytes(d, K, a, 1, T)",
        ["tests/test_drafter_memory.py::test_estimate_follows_the_batch_size"],
    ),
    "responses fit ignores the batch size": (
        "aerie/preview/fit.py",
        '    batch = max(r["batch_size"] if is_in_process(r["backend"]) else r.get("concurrency", 1) for r in local)',
        "    batch = 1",
        ["tests/test_fit_plan.py::test_the_in_process_responses_fit_holds_a_batch_of_sequences"],
    ),
    "prompt cache key ignores max_prompts": (
        "aerie/sources/datasets.py",
        '"max_prompts": dataset.get("max_prompts"),',
        '"max_prompts": None,',
        ["tests/test_prompt_sources.py::test_a_changed_max_prompts_is_a_new_cache_entry"],
    ),
    "tokenizer check: a marker numbered otherwise than its files passes": (
        "aerie/target_model/markers.py",
        "server == ours and want in (None, ours[0]):",
        "server == ours:",
        ["tests/test_tokenizer_check.py::test_a_marker_the_loader_numbers_otherwise_than_its_files_is_refused"],
    ),
    "tokenizer check: a marker split only by tokenizer.encode passes": (
        "aerie/target_model/markers.py",
        "server == ours and want in (None, ours[0]):",
        "want in (None, ours[0]):",
        ["tests/test_tokenizer_check.py::test_a_marker_split_only_by_tokenizer_encode_is_refused"],
    ),
    "SGLang bench report drops the references' divergences": (
        "aerie/benchmark/serving.py",
        "        for m in methods\n        for d in (_lossless_check(r, m)",
        "        for m in methods[:1]\n        for d in (_lossless_check(r, m)",
        ["tests/test_bench_serving.py::test_a_reference_servers_divergences_are_kept_and_fail_the_gate"],
    ),
    "gate passes a report with no speedup figure": (
        "aerie/benchmark/gate.py",
        '    if s["speedup"] is not None and s["speedup"] >= gate.min_speedup:',
        '    if s["speedup"] is None or s["speedup"] >= gate.min_speedup:',
        ["tests/test_bench_gate.py::test_a_drafter_without_a_speedup_figure_does_not_pass"],
    ),
    "a reasoning block left open at the end of the turn passes": (
        "aerie/target_model/turns.py",
        '    return "at the end of the turn" if after(text[pos:], is_open) else ""',
        '    return "" if after(text[pos:], is_open) else ""',
        ["tests/test_templates.py::test_a_turn_that_ends_inside_the_open_reasoning_block_is_refused"],
    ),
    "a request that fails for good keeps its reservation (in flight)": (
        "aerie/responses/api/client.py",
        "            finally:\n                self.count_in_flight(run, shard, -1)",
        "            finally:\n                if record is not None:\n"
        "                    self.count_in_flight(run, shard, -1)",
        [f"{FAST}::test_a_request_that_fails_for_good_gives_its_place_and_budget_room_back"],
    ),
    "the shared budget leaves out a finished dataset's journals": (
        "aerie/responses/api/job.py",
        'sum(spend[d]["cost"] for d in run.account_datasets(a))',
        'sum(spend[d]["cost"] for d in run.account_datasets(a) if d in by_dataset)',
        [f"{FAST}::test_a_finished_datasets_journals_and_unanswered_requests_count_against_the_shared_budget"],
    ),
    "a finished dataset's requests in flight priced at $0 on restart": (
        "aerie/responses/api/job.py",
        'mean = done["cost"] / done["samples"] if done["samples"] else',
        "mean = 0.0 if done else",
        [f"{FAST}::test_a_finished_datasets_journals_and_unanswered_requests_count_against_the_shared_budget"],
    ),
}

# One budget per key across runs (issue 30 item 5, aerie/responses/api/key_ledger.py): each breaks what two runs on
# one key need to stay within one budget.
KEY = "tests/test_key_ledger.py"
KEY_LEDGER = {
    "key ledger: the other runs' spend and leases not counted": (
        "aerie/responses/api/key_ledger.py",
        "        others.spent = sum(self._seen.values())\n",
        "        others = OtherRuns()  # nothing counted\n",
        [f"{KEY}::test_two_runs_at_once_on_one_key_stay_within_one_budget_and_each_folder_books_its_own"],
    ),
    "key ledger: a lease granted whatever the budget leaves": (
        "aerie/responses/api/key_ledger.py",
        "            fits = need <= left + _EPS\n",
        "            fits = True\n",
        [f"{KEY}::test_leases_of_two_runs_never_add_up_past_the_budget"],
    ),
    "key ledger: a clean end drops the entry (its last answers counted by nobody)": (
        "aerie/responses/api/key_ledger.py",
        '                self._doc["runs"][self.run_id]["ended"] = True',
        '                del self._doc["runs"][self.run_id]',
        [f"{KEY}::test_leases_of_two_runs_never_add_up_past_the_budget"],
    ),
}

# Issue 39: the gaps it listed in this area (each a plausible bug no non-slow test caught), and the mechanisms it
# built: books per folder on a shared key (aerie/responses/api/key_books.py), the batch path, the budget's one home.
HOST = "tests/test_host_check.py"
SCHEDULES = "tests/test_key_ledger.py"
BATCH_KILL = f"{FAST}::test_batches_killed_with_failures_expiry_and_lost_answers_pay_each_answer_once"
ISSUE_39 = {
    "key ledger: a lease the budget refuses keeps its headroom": (
        "aerie/responses/api/key_ledger.py",
        "            self.lease = committed + (min(left, max(need, headroom)) if fits else 0.0)",
        "            self.lease = committed + (min(left, max(need, headroom)) if fits else self.lease - committed)",
        [f"{KEY}::test_a_lease_the_budget_refuses_keeps_no_headroom"],
    ),
    "host check: GPU memory judged by the largest GPU, not each": (
        "aerie/preview/host.py",
        "    ok = min(memory) >= (needs.gpu_memory_bytes or 0)",
        "    ok = max(memory) >= (needs.gpu_memory_bytes or 0)",
        [f"{HOST}::test_each_bad_host_condition_is_refused_naming_its_fix"],
    ),
    "host check: /dev/shm judged on its total, not what is free": (
        "aerie/preview/host.py",
        'free of {_gib(facts.shm[0])}", facts.shm[1] >= needs.shm_bytes',
        'free of {_gib(facts.shm[0])}", facts.shm[0] >= needs.shm_bytes',
        [f"{HOST}::test_each_bad_host_condition_is_refused_naming_its_fix"],
    ),
    "host check: SGLang's GPU checks skipped when no GPU is seen": (
        "aerie/preview/host.py",
        '    if needs.sglang_rules:\n        return ""  # SGLang runs on GPUs only',
        '    if False:\n        return ""  # SGLang runs on GPUs only',
        [f"{HOST}::test_sglang_rules_need_the_gpus_even_when_target_device_is_auto_and_none_is_seen"],
    ),
    "recorded answers: the log's usage cost taken as paid": (
        "aerie/responses/recorded.py",
        '        "cost": 0.0,\n',
        '        "cost": float((r.get("usage") or {}).get("cost") or 0.0),\n',
        ["tests/test_recorded.py::test_recorded_answers_become_responses_and_rebuild_exactly"],
    ),
    "time preview: a toy-scale measurement taken for a real GPU": (
        "aerie/preview/timing.py",
        '        if data.get("toy"):\n            continue',
        "        if False:\n            continue",
        ["tests/test_time_preview.py::test_no_measurement_of_this_gpu_estimates_nothing"],
    ),
    "key books: the journals left out of the key's unexplained money": (
        "aerie/responses/api/key_books.py",
        "    growth = sum(f.journal - f.journal_at_join for f in folders.values())",
        "    growth = 0.0",
        [f"{SCHEDULES}::test_two_runs_at_once_on_one_key_stay_within_one_budget_and_each_folder_books_its_own"],
    ),
    "key books: every folder takes the whole unexplained money": (
        "aerie/responses/api/key_books.py",
        "getattr(shares[label], share_field) + give * r / total)",
        "getattr(shares[label], share_field) + give)",
        [f"{SCHEDULES}::test_two_runs_at_once_on_one_key_stay_within_one_budget_and_each_folder_books_its_own"],
    ),
    "key books: a dead run's requests in flight never become its folder's lost requests": (
        "aerie/responses/api/key_ledger.py",
        "    if expected > 0:\n        weights.lost += expected\n",
        "    if False:\n        weights.lost += expected\n",
        [f"{SCHEDULES}::test_a_dead_runs_requests_in_flight_become_its_folders_lost_requests_in_the_keys_books"],
    ),
    "batch: a submission whose answer was lost is sent again": (
        "aerie/responses/api/batches.py",
        '        tries = 1 if method == "POST" else limits.max_attempts',
        "        tries = limits.max_attempts",
        [BATCH_KILL],
    ),
    "batch: a killed run's batches are not resumed (submitted again)": (
        "aerie/responses/api/client.py",
        "open_batches(out_path) if lane.batch is not None else []",
        "[] if lane.batch is not None else []",
        [BATCH_KILL],
    ),
    "batch: failed and expired entries are not retried": (
        "aerie/responses/api/batches.py",
        "        again.append((shard, shard.prompt(sid)))",
        "        pass",
        [BATCH_KILL],
    ),
    "batch: a batch reserved at its expected cost, not its most": (
        "aerie/responses/api/client.py",
        "        return n * self.per_most()",
        "        return n * self.per_cost()",
        [f"{FAST}::test_a_batch_reserves_its_most_cost_before_it_is_submitted"],
    ),
    "batch: more batches submitted before the first has left validating": (
        "aerie/responses/api/batches.py",
        "    if not state.validated and state.open:\n        return 0",
        "    if False:\n        return 0",
        [f"{FAST}::test_a_model_that_takes_no_batches_is_refused_at_its_first_batch_and_nothing_is_billed"],
    ),
    "tokens: a stop token in the template's framing trained before the turn's end": (
        "aerie/tokens/rebuild.py",
        "        return Rebuilt(_no_stop_before_end(ids[:end], stops) + [ids[end]], special_text, True)",
        "        return Rebuilt(ids[: end + 1], special_text, True)",
        ["tests/test_templates.py::test_no_kept_record_trains_a_stop_token_before_its_end"],
    ),
    "budget: a dataset's own budget_usd accepted (two homes)": (
        "aerie/plan/resolve.py",
        '    if "budget_usd" in own:',
        "    if False:",
        [f"{FAST}::test_the_budget_has_one_home_and_a_batch_is_checked_before_any_spend"],
    ),
}

# DFlash (issue 36) and the traffic gate (issue 37): each breaks what the issue's tests must notice.
ISSUE_36_37 = {
    "DFlash block sees every other block": (
        "aerie/drafter_kinds/dflash/objective.py",
        "    same_block = torch.eye(N, dtype=torch.bool, device=device)[None, :, None, :, None]  # [1, N, 1, N, 1]",
        "    same_block = torch.ones(N, N, dtype=torch.bool, device=device)[None, :, None, :, None]",
        ["tests/test_dflash_objective.py::test_the_reference_path_equals_each_block_alone"],
    ),
    "DFlash block reads its own anchor's target feature": (
        "aerie/drafter_kinds/dflash/objective.py",
        "    context = ((kv_row >= start) & (kv_row < anchor)).expand(B, N, Bk, T)",
        "    context = ((kv_row >= start) & (kv_row <= anchor)).expand(B, N, Bk, T)",
        ["tests/test_dflash_objective.py::test_the_reference_path_equals_each_block_alone"],
    ),
    "traffic gate ignores each set's spread": (
        "aerie/benchmark/traffic.py",
        "            if gap < -max(mine.spread, figures[r].spread):",
        "            if gap < 0:",
        [
            "tests/test_bench_gate.py::test_on_the_traffic_mix_a_loss_within_the_spread_passes_and_one_beyond_it_fails",
            "tests/test_traffic.py::test_the_gate_fails_a_drafter_that_loses_any_set_or_the_mix_naming_the_figures",
        ],
    ),
    "traffic gate never asks for a win on the weighted mix": (
        "aerie/benchmark/traffic.py",
        "        if weighted[drafter] - weighted[best] <= mix_spread:",
        "        if False:",
        [
            "tests/test_bench_gate.py::test_on_the_traffic_mix_a_loss_within_the_spread_passes_and_one_beyond_it_fails",
            "tests/test_traffic.py::test_the_gate_fails_a_drafter_that_loses_any_set_or_the_mix_naming_the_figures",
        ],
    ),
    "the drafter served for a mix is the fastest overall": (
        "aerie/benchmark/gate.py",
        "    if passed and gate.traffic:",
        "    if passed and not gate:",
        ["tests/test_bench_gate.py::test_the_drafter_served_for_a_traffic_mix_is_the_best_on_that_mix"],
    ),
}

MUTATIONS = {**MONEY, **ISSUE_30, **KEY_LEDGER, **ISSUE_39, **ISSUE_36_37}
GROUPS = {
    "money": [n for n in MONEY if not n.startswith("slow:")],
    "slow": [n for n in MONEY if n.startswith("slow:")],
    "issue30": list(ISSUE_30),
    "key_ledger": list(KEY_LEDGER),
    "issue39": list(ISSUE_39),
    "issue36_37": list(ISSUE_36_37),
}


def run(names):
    rows = []
    for name in names:
        rel, old, new, tests = MUTATIONS[name]
        path = REPO / rel
        text = path.read_text()
        assert text.count(old) == 1, (name, text.count(old))
        # put back by replacing the first occurrence of the broken text: it must be the one written here
        assert text.replace(old, new).find(new) == text.find(old), name
        path.write_text(text.replace(old, new))
        try:
            t0 = time.time()
            proc = subprocess.run(
                ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
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
            rows.append((name, rel, proc.returncode, round(time.time() - t0), tail[-3:]))
        finally:
            cur = path.read_text()
            assert cur.count(new) >= 1
            path.write_text(cur.replace(new, old, 1))
        print(rows[-1], flush=True)
    return rows


def verdict(returncode: int) -> str:
    """pytest's exit status 1: a test failed (the mutation was caught); 0: none did; else the run itself failed."""
    return {1: "yes", 0: "**NO**"}.get(returncode, f"error (pytest exit {returncode})")


if __name__ == "__main__":
    args = sys.argv[1:] or ["money", "issue30"]
    names = [n for a in args for n in GROUPS.get(a, [a])]
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        sys.exit(f"unknown mutations {unknown}; groups: {', '.join(GROUPS)}")
    rows = run(names)
    print("\n| mechanism broken | file | a test failed | s |\n|---|---|---|---|")
    for name, rel, rc, secs, _ in rows:
        print(f"| {name} | {rel} | {verdict(rc)} | {secs} |")
