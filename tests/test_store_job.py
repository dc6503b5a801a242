"""The store job (aerie.target_model.store.run_store_job), the one loop of rules ``hidden`` and ``responses_hf``.

Run here with real store entries of both kinds - JSONL shards bound to their key by a generation record (the
generation store), safetensors shards carrying their key in their header (the capture store) - and each
stage's own lines (aerie.hidden.run.CAPTURE_STAGE, aerie.responses.in_process.GENERATION_STAGE), with a producer that
writes the entry from its input's bytes instead of running a target: what is checked is the loop, not the
target. A finished entry for the task's key is reused without producing; an entry whose bytes changed, one
cut short, one without its record (a job killed between the two) or one made for another key is produced
again, alone; the first failing shard stops the job and keeps the entries finished before it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from aerie.hidden.run import CAPTURE_STAGE, ShardTask
from aerie.responses.in_process import GENERATION_STAGE
from aerie.target_model.store import (
    KEY_FIELD,
    file_sha256,
    generation_record_path,
    run_store_job,
    store_path,
    stored_facts,
    stored_generation,
    write_generation_record,
)
from aerie.tools.artifacts import save_packed, write_jsonl

SHARDS = 4


@dataclass(frozen=True)
class SaltedTask:
    """A store task (aerie.target_model.store.StoreTask) whose settings are a salt: another salt is another key."""

    prompts: Path
    out: Path
    salt: str
    log: Path | None = None


class LazyTarget:
    """The job's target session as the store job sees it: loaded on the first shard produced, loads counted."""

    def __init__(self) -> None:
        self.loads = 0
        self.load_seconds = 0.0

    def open(self) -> None:
        if not self.loads:
            self.loads, self.load_seconds = 1, 0.25


@dataclass
class Generation:
    """The generation store's flavour of the job: JSONL entries bound to their key by a record."""

    root: Path
    salt: str = "v1"  # stands for the settings: another salt is another key
    fail_at: int | None = None  # the 0-based task whose producer raises

    def tasks(self) -> list[SaltedTask]:
        tasks = []
        for s in range(SHARDS):
            prompts = self.root / "prompts" / f"shard-{s:05d}.jsonl"
            if not prompts.exists():
                write_jsonl(prompts, [{"id": f"p{s}-{i}", "text": f"question {s}.{i}"} for i in range(3)])
            out = self.root / "responses" / prompts.name
            tasks.append(SaltedTask(prompts, out, self.salt, self.root / "logs" / f"{prompts.stem}.log"))
        return tasks

    def run(self, log: Callable[[str], None]) -> tuple[dict, list[int], LazyTarget]:
        session, produced = LazyTarget(), []
        tasks = self.tasks()

        def key_of(task: SaltedTask) -> str:
            return f"{file_sha256(task.prompts)}-{task.salt}"

        def reuse(task: SaltedTask, store: Path, key: str) -> bool:
            return stored_generation(store, key) is not None

        def produce(task: SaltedTask, store: Path, key: str, shard_log: Callable[[str], None]) -> float:
            n = tasks.index(task)
            if n == self.fail_at:
                raise RuntimeError("the target ran out of memory")
            session.open()
            records = [
                {"id": r["id"], "answer": r["text"].upper(), "key": key} for r in map(json.loads, task.prompts.open())
            ]
            write_jsonl(store, records)
            write_generation_record(store, key, {"samples": len(records), "seconds": 0.5})
            produced.append(n)
            return 0.5

        result = run_store_job(
            tasks, GENERATION_STAGE, key=key_of, reuse=reuse, produce=produce, session=session, log=log
        )
        return result, produced, session


@dataclass
class Capture:
    """The capture store's flavour of the job: safetensors entries carrying their key in their header."""

    root: Path
    salt: str = "v1"

    def tasks(self) -> list[ShardTask]:
        tasks = []
        for s in range(SHARDS):
            tokens = self.root / "tokens" / f"shard-{s:05d}.safetensors"
            if not tokens.exists():
                save_packed(tokens, {"input_ids": torch.arange(64, dtype=torch.int32) * (s + 1)}, {"format": "t"})
            tasks.append(ShardTask(tokens, self.root / "hidden" / tokens.name))
        return tasks

    def run(self, log: Callable[[str], None]) -> tuple[dict, list[int], LazyTarget]:
        session, produced = LazyTarget(), []
        tasks = self.tasks()

        def key_of(task: ShardTask) -> str:
            return f"{file_sha256(task.tokens)}-{self.salt}"

        def reuse(task: ShardTask, store: Path, key: str) -> bool:
            return stored_facts(store, key) is not None

        def produce(task: ShardTask, store: Path, key: str, shard_log: Callable[[str], None]) -> float:
            session.open()
            ids = torch.arange(64, dtype=torch.int32) * (tasks.index(task) + 1)
            save_packed(store, {"aux": ids.float().repeat(8)}, {"format": "h", KEY_FIELD: key})
            produced.append(tasks.index(task))
            return 1.5

        result = run_store_job(tasks, CAPTURE_STAGE, key=key_of, reuse=reuse, produce=produce, session=session, log=log)
        return result, produced, session


def outputs(job: Generation | Capture) -> list[Path]:
    return [t.out for t in job.tasks()]


def test_a_first_attempt_produces_every_entry_and_publishes_it_under_its_name(tmp_path: Path) -> None:
    lines: list[str] = []
    job = Generation(tmp_path)
    result, produced, _ = job.run(lines.append)
    assert produced == list(range(SHARDS))
    assert result == {
        "shards": SHARDS,
        "generated": SHARDS,
        "reused": 0,
        "target_loads": 1,
        "load_seconds": 0.25,
        "generate_seconds": SHARDS * 0.5,
        "seconds": result["seconds"],
    }
    assert lines[-1] == (
        f"aerie responses: {SHARDS} in-process shards, {SHARDS} generated, 0 reused from the generation store; "
        f"target loads in this job: 1 (0.25s loading, {SHARDS * 0.5}s generating)"
    )
    for n, (task, out) in enumerate(zip(job.tasks(), outputs(job)), 1):
        store = store_path(out, "generated")
        assert os.stat(out).st_ino == os.stat(store).st_ino  # a hard link: one file under two names
        assert f"{out} [{n}/{SHARDS}]: generating from {task.prompts}" in lines
        assert f"generating from {task.prompts}" in task.log.read_text()  # the shard's own log, kept across attempts


def test_a_later_attempt_reuses_every_finished_entry_and_loads_nothing(tmp_path: Path) -> None:
    job = Generation(tmp_path)
    job.run(lambda _: None)
    for out in outputs(job):
        out.unlink()  # Snakemake deletes a failed job's declared outputs; the store keeps the entries
    lines: list[str] = []
    result, produced, session = job.run(lines.append)
    assert produced == [] and session.loads == 0
    assert (result["generated"], result["reused"], result["target_loads"]) == (0, SHARDS, 0)
    for n, out in enumerate(outputs(job), 1):
        store = store_path(out, "generated")
        reused = f"{out} [{n}/{SHARDS}]: reused from the generation store ({store}: same prompts, target and settings)"
        assert any(line.startswith(reused) for line in lines), lines
        assert out.exists()


def _corrupt(store: Path) -> None:
    with open(store, "r+b") as f:
        f.seek(10)
        f.write(b"#")


def _drop_record(store: Path) -> None:
    generation_record_path(store).unlink()  # a job killed between the entry and its record


def _cut_short(store: Path) -> None:
    os.truncate(store, store.stat().st_size - 16)


@pytest.mark.parametrize(
    ("flavour", "damage"),
    [
        (Generation, _corrupt),
        (Generation, _cut_short),
        (Generation, _drop_record),
        (Capture, _cut_short),  # a copy cut short: its header promises bytes it does not hold
    ],
    ids=["changed-bytes", "cut-short", "no-record", "safetensors-cut-short"],
)
def test_an_entry_that_is_not_a_finished_shard_is_produced_again_alone(tmp_path: Path, flavour, damage) -> None:
    job = flavour(tmp_path)
    job.run(lambda _: None)
    damaged = store_path(outputs(job)[2], "generated" if flavour is Generation else "captured")
    before = damaged.read_bytes()
    damage(damaged)
    result, produced, session = job.run(lambda _: None)
    assert produced == [2] and session.loads == 1
    assert result["reused"] == SHARDS - 1
    assert damaged.read_bytes() == before  # the producer is deterministic: the entry is whole again
    assert os.stat(outputs(job)[2]).st_ino == os.stat(damaged).st_ino


@pytest.mark.parametrize("flavour", [Generation, Capture])
def test_an_entry_made_for_another_key_is_produced_again(tmp_path: Path, flavour) -> None:
    flavour(tmp_path).run(lambda _: None)
    lines: list[str] = []
    result, produced, _ = flavour(tmp_path, salt="v2").run(lines.append)
    assert produced == list(range(SHARDS)) and result["reused"] == 0
    if flavour is Capture:
        assert lines[-1] == (
            f"aerie capture: {SHARDS} shards, {SHARDS} captured, 0 reused from the capture store; target loads in "
            f"this job: 1 (0.25s loading, {SHARDS * 1.5}s capturing)"
        )


def test_the_first_failing_shard_stops_the_job_and_keeps_the_entries_before_it(tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="out of memory"):
        Generation(tmp_path, fail_at=2).run(lines.append)
    job = Generation(tmp_path)
    outs, tasks = outputs(job), job.tasks()
    assert lines[-1] == (
        f"generation stopped at {outs[2]} (3 of {SHARDS}): 2 generated and 0 reused before it stay in the "
        "generation store for the next attempt"
    )
    assert "FAILED: RuntimeError: the target ran out of memory" in tasks[2].log.read_text()
    assert [o.exists() for o in outs] == [True, True, False, False]
    result, produced, _ = job.run(lambda _: None)
    assert produced == [2, 3] and (result["generated"], result["reused"]) == (2, 2)


def test_a_reused_entry_that_fails_its_check_stops_the_job(tmp_path: Path) -> None:
    """``reuse`` may raise (rule hidden checks a stored shard against this run's thresholds): the job stops."""
    job = Generation(tmp_path)
    job.run(lambda _: None)
    lines: list[str] = []

    def refuse(task, store: Path, key: str) -> bool:
        raise ValueError(f"{store}: next-token agreement 0.10 is below the minimum 0.50")

    with pytest.raises(ValueError, match="below the minimum"):
        run_store_job(
            job.tasks(),
            GENERATION_STAGE,
            key=lambda t: "k",
            reuse=refuse,
            produce=lambda *a: pytest.fail("nothing is produced after a failed check"),
            session=LazyTarget(),
            log=lines.append,
        )
    assert lines[-1].startswith(f"generation stopped at {outputs(job)[0]} (1 of {SHARDS}): 0 generated and 0 reused")
