"""Shard stores: finished shards of a one-load job (capture, in-process responses) kept across its attempts.

The capture store holds finished hidden shards across attempts of the one capture job of a run.

Loading a 1T-parameter target costs more than capturing with it (bench/RESULTS.md), so rule ``hidden`` is one
job that loads the target once and captures every shard of the run (aerie.hidden.capture_shards). Snakemake
deletes every declared output of a job before it starts and after it fails, so a job with many outputs would
lose finished shards to a crash and redo them all. Each shard is therefore written first to the store,
``results/<dataset>/hidden/captured/shard-NNNNN.safetensors`` (not a declared output: Snakemake never deletes
it), and then hard-linked to its declared path (one file under two names: no extra disk). A later attempt of
the job - after a crash, a failed shard, or a newer tokens shard - reuses every store entry whose capture key
still matches and captures only the rest, with one target load (none when nothing is left to capture).

The capture key (metadata ``capture_key`` of the shard, docs/formats.md) is a sha256 over the tokens shard's
bytes, the target's identity (config.json and custom code by content, weight files by name, size and mtime)
and every setting that decides the shard's bytes. Deleting a published shard is not enough to recapture it
while its store entry matches: delete the store entry too.

The same mechanism serves the other stage that loads the target: in-process responses (``responses.backend:
hf``, rule ``responses_hf``, aerie.responses.in_process.generate_hf_shards) keep each finished shard in the generation
store, ``results/<dataset>/responses/generated/shard-NNNNN.jsonl``, beside a small record binding it to its
generation key (a JSONL shard has no header to carry one; the shard's bytes stay those of a shard generated
alone). Both stages run the one store job, ``run_store_job`` (key, reuse or produce, publish, the shard's
log, the job's summary), handing it their own key, reuse check and producer; the keys, records and
``snakemake -n`` lines are per stage, the rest (``store_path``, ``publish``, ``target_identity``,
``pending_plan``) is shared.

Torch-free: ``snakemake -n`` uses it to say how many target loads the plan contains.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aerie.formats.backends import backend_named
from aerie.formats.responses import is_in_process
from aerie.target_model.config import read_text_config, resolve_aux_layer_ids, target_architectures
from aerie.tools.artifacts import atomic_write_json

STORE_DIR = "captured"
KEY_FIELD = "capture_key"
HASH_CHUNK = 1 << 22


def store_path(out_path: str | Path, store_dir: str = STORE_DIR) -> Path:
    """Where the store keeps the shard published at ``out_path``: ``<its folder>/<store_dir>/<its name>``
    (``.../hidden/captured/<name>``; ``.../responses/generated/<name>`` with GENERATION_STORE_DIR)."""
    path = Path(out_path)
    return path.parent / store_dir / path.name


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def target_identity(target_path: str | Path) -> dict[str, Any]:
    """What identifies the target's weights without reading them: small files (config, custom code, weight
    index) by content, weight files by name, size and mtime (a re-downloaded target is recaptured)."""
    root = Path(target_path)
    small, weights = {}, {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_file():
            continue
        if p.suffix in (".json", ".py") and p.stat().st_size < (1 << 24):
            small[p.name] = file_sha256(p)
        elif p.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            st = p.stat()
            weights[p.name] = [st.st_size, st.st_mtime_ns]
    return {"files": small, "weights": weights}


def capture_key(tokens_sha256: str, target: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """The key a store entry must carry to be reused for these tokens, this target and these settings."""
    blob = json.dumps(
        {"tokens": tokens_sha256, "target": target, "settings": settings}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def read_metadata(path: str | Path) -> dict[str, str] | None:
    """A safetensors file's ``__metadata__`` from its header alone (no tensor is read); None when the file
    is missing or not a complete safetensors header."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > (1 << 27):
                return None
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, struct.error, ValueError):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:  # truncated (a copy cut short): not a finished shard
        return None
    return header.get("__metadata__") or {}


def stored_facts(store: str | Path, key: str) -> dict[str, Any] | None:
    """The facts of the store entry at ``store`` when it exists and carries ``key``; else None."""
    meta = read_metadata(store)
    if meta is None or meta.get(KEY_FIELD) != key:
        return None
    return {k: _decode(v) for k, v in meta.items()}


def _decode(value: str) -> Any:
    """Metadata values are JSON unless they were plain strings (aerie.tools.artifacts.save_packed)."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def publish(store: str | Path, out: str | Path) -> None:
    """Give the store entry its declared name: a hard link (a copy where the file system has none), swapped
    in atomically, with a fresh mtime so Snakemake sees the output newer than its inputs."""
    store, out = Path(store), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.publish-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(store, tmp)
    except OSError:
        shutil.copyfile(store, tmp)
    os.replace(tmp, out)
    os.utime(out)


def capture_settings(
    *,
    aux_layer_ids: Sequence[int],
    layout: str,
    backend: str,
    backend_options: Mapping | None,
    batch_tokens: int,
    device: str,
    dtype: str,
    target_topk: int,
    storage_dtype: str,
) -> dict[str, Any]:
    """Every setting that decides a captured shard's bytes (the thresholds only accept or refuse a shard:
    a reused entry is checked against them again instead)."""
    return {
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "layout": layout,
        "backend": backend,
        "backend_options": dict(backend_options or {}),
        "batch_tokens": int(batch_tokens),
        "device": device,
        "dtype": dtype,
        **({"target_topk": int(target_topk)} if layout == "compact" else {"storage_dtype": storage_dtype}),
    }


def config_key_function(
    config: Mapping[str, Any], layer_ids: Sequence[int] | None = None
) -> Callable[[Path], str] | None:
    """tokens path -> capture key, from the pipeline config as rule ``hidden`` would compute it; None when the
    target is not there yet (its layer count and identity are unknown). ``layer_ids``: the layers the rule captures
    (every drafter's: aerie.plan.resolve.hidden_layer_ids), else hidden.aux_layer_ids."""
    hidden, target = config["hidden"], config["target"]
    configured = list(layer_ids) if layer_ids is not None else hidden.get("aux_layer_ids")
    try:
        layers = int(read_text_config(target["path"])["num_hidden_layers"])
        ids = resolve_aux_layer_ids(configured, layers, target_architectures(target["path"]))
        identity = target_identity(target["path"])
    except (OSError, KeyError, ValueError):
        return None
    settings = capture_settings(
        aux_layer_ids=ids,
        layout=hidden["layout"],
        backend=hidden["backend"],
        backend_options=backend_named("hidden", hidden["backend"]).options(config),
        batch_tokens=hidden["batch_tokens"],
        device=target["device"],
        dtype=target["dtype"],
        target_topk=hidden["target_topk"],
        storage_dtype=hidden["storage_dtype"],
    )
    return lambda tokens: capture_key(cached_sha256(tokens), identity, settings)


@functools.lru_cache(maxsize=4096)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def cached_sha256(path: str | Path) -> str:
    """``file_sha256``, computed once per file version in this process: ``snakemake -n`` asks for a pending
    shard's key in the plan line and again in the disk preview."""
    st = os.stat(path)
    return _sha256_of(str(path), st.st_size, st.st_mtime_ns)


def pending_plan(
    outputs: Sequence[str | Path], inputs: Sequence[str | Path], reusable: Callable[[Path, Path], bool]
) -> dict[str, int]:
    """What a once-per-run job has left to do, judged from the files (as Snakemake judges, by mtime):
    ``pending`` outputs (missing, or older than their input), of which ``stored`` have a store entry the job
    will reuse (``reusable(output, input)``, asked only when the input exists) and ``to_generate`` do not;
    ``loads``: target loads of the job (1 when something is left to compute, else 0)."""
    pending = stored = 0
    for out, inp in zip(outputs, inputs):
        out, inp = Path(out), Path(inp)
        if out.exists() and inp.exists() and out.stat().st_mtime >= inp.stat().st_mtime:
            continue
        pending += 1
        stored += inp.exists() and reusable(out, inp)
    return {
        "shards": len(outputs),
        "pending": pending,
        "stored": stored,
        "to_generate": pending - stored,
        "loads": int(pending > stored),
    }


def capture_reusable(key_of: Callable[[Path], str] | None) -> Callable[[Path, Path], bool]:
    """(hidden path, tokens path) -> whether the capture job will reuse the shard's store entry: its capture
    key equals ``key_of(tokens)``; without ``key_of`` (the target is not there yet), any complete entry newer
    than its tokens shard."""

    def reusable(hidden: Path, tokens: Path) -> bool:
        store = store_path(hidden)
        if not store.exists():
            return False
        if key_of is not None:
            return stored_facts(store, key_of(tokens)) is not None
        return store.stat().st_mtime >= tokens.stat().st_mtime and read_metadata(store) is not None

    return reusable


def capture_plan(
    hidden_paths: Sequence[str | Path], tokens_paths: Sequence[str | Path], key_of: Callable[[Path], str] | None = None
) -> dict[str, int]:
    """``pending_plan`` of the capture job (``to_capture``: the pending shards no store entry serves)."""
    plan = pending_plan(hidden_paths, tokens_paths, capture_reusable(key_of))
    plan["to_capture"] = plan.pop("to_generate")
    return plan


def capture_plan_text(plan: Mapping[str, int]) -> str:
    """The ``snakemake -n`` line: target loads of the capture job, against one load per pending shard. Judged
    from the files, like ``capture_plan``: Snakemake may still leave the job out (a shard missing while
    everything downstream is complete is not redone unless asked for)."""
    if not plan["pending"]:
        return f"aerie capture plan: all {plan['shards']} hidden shards are published: 0 target loads"
    stored = f", {plan['stored']} of them from the capture store" if plan["stored"] else ""
    return (
        f"aerie capture plan: rule hidden (one job for all {plan['shards']} shards) publishes "
        f"{plan['pending']} pending{stored}: {plan['loads']} target load{'' if plan['loads'] == 1 else 's'} "
        f"when it runs (one job per shard: {plan['to_capture']})"
    )


def shard_logger(path: Path | None, job_log: Callable[[str], None]) -> Callable[[str], None]:
    """A shard's logger in a job of many shards: lines go to the job's log and, appended with a timestamp, to
    the shard's own log (not a declared output: Snakemake never deletes it, so every attempt's story of the
    shard stays readable)."""
    if path is None:
        return job_log
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        job_log(msg)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")

    return log


# ----------------------------------------------------------------------------------------------------------
# the store job: one loop for every stage that keeps finished shards in a store (rules hidden, responses_hf)


class StoreTask(Protocol):
    """What the store job reads of a stage's shard task
    (aerie.hidden.ShardTask, aerie.responses.in_process.ResponsesTask)."""

    @property
    def out(self) -> Path: ...

    @property
    def log(self) -> Path | None: ...


class CountsLoads(Protocol):
    """The stage's target session: loaded lazily on the first shard produced, its loads counted."""

    loads: int
    load_seconds: float


Task = TypeVar("Task", bound=StoreTask)


@dataclass(frozen=True)
class StoreStage:
    """What differs between the stages that share the store job: their store's folder, the names of their
    counts in the job's result, and the lines they log (``str.format`` templates; users and tests read them).

    ``reused`` is formatted with ``store`` (the entry's path), ``producing`` with ``task``; ``stopped`` and
    ``summary`` with the job's result so far (``shards``, ``reused``, ``<produced>``, ``<seconds>``, and for
    ``stopped`` ``out`` and ``n``, the failing shard and its 1-based position; for ``summary`` the loads)."""

    store_dir: str
    produced: str  # the result's count of shards produced, e.g. "captured"
    seconds: str  # the result's seconds spent producing them, e.g. "capture_seconds"
    reused: str
    producing: str
    stopped: str
    summary: str


def run_store_job(
    tasks: Sequence[Task],
    stage: StoreStage,
    *,
    key: Callable[[Task], str],
    reuse: Callable[[Task, Path, str], bool],
    produce: Callable[[Task, Path, str, Callable[[str], None]], float],
    session: CountsLoads,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Publish every task's shard, each from its store entry, producing only the entries no attempt finished.

    Per task, in order: its store key ``key(task)``; ``reuse(task, entry, key)`` says whether the entry at
    ``store_path(task.out, stage.store_dir)`` is a finished shard for this key (it may raise: a reused shard
    is checked like a produced one); if not, ``produce(task, entry, key, shard_log)`` writes the entry (and
    whatever binds it to the key) and returns its seconds of work; then the entry is published under the
    task's declared name (``publish``). The entry is complete before it is published, so a job killed at any
    point leaves finished entries only, and the next attempt reuses them. The first task that fails stops
    the job (a problem is rarely confined to one shard, and GPU hours are not free): the error is logged to
    the shard's log, the entries finished before it stay in the store, and the error is raised again.

    Returns the counts (``shards``, ``stage.produced``, ``reused``), the session's ``target_loads`` and
    ``load_seconds``, ``stage.seconds`` and the job's ``seconds``; logs ``stage.summary`` of them."""
    started = time.perf_counter()
    produced: list[str] = []
    reused: list[str] = []
    produce_seconds = 0.0
    for n, task in enumerate(tasks, 1):
        shard_log = shard_logger(task.log, log)
        store = store_path(task.out, stage.store_dir)
        try:
            entry_key = key(task)
            if reuse(task, store, entry_key):
                shard_log(f"{task.out} [{n}/{len(tasks)}]: " + stage.reused.format(store=store))
                reused.append(str(task.out))
            else:
                shard_log(f"{task.out} [{n}/{len(tasks)}]: " + stage.producing.format(task=task))
                store.parent.mkdir(parents=True, exist_ok=True)
                produce_seconds += produce(task, store, entry_key, shard_log)
                produced.append(str(task.out))
            publish(store, task.out)
        except Exception as e:
            shard_log(f"{task.out}: FAILED: {type(e).__name__}: {e}")
            counts = {"shards": len(tasks), stage.produced: len(produced), "reused": len(reused)}
            log(stage.stopped.format(out=task.out, n=n, **counts))
            raise
    result = {
        "shards": len(tasks),
        stage.produced: len(produced),
        "reused": len(reused),
        "target_loads": session.loads,
        "load_seconds": round(session.load_seconds, 2),
        stage.seconds: round(produce_seconds, 2),
        "seconds": round(time.perf_counter() - started, 2),
    }
    log(stage.summary.format(**result))
    return result


# ----------------------------------------------------------------------------------------------------------
# the generation store: in-process responses shards (responses.backend: hf), one target load per run

GENERATION_STORE_DIR = "generated"
GENERATION_RECORD_FORMAT = "aerie.generation-record/1"


def generation_record_path(store: str | Path) -> Path:
    """The record beside a generation store entry: ``shard-NNNNN.jsonl`` -> ``shard-NNNNN.record.json``."""
    store = Path(store)
    return store.with_name(store.name.removesuffix(".jsonl") + ".record.json")


def generation_settings(
    *,
    model: str,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    device: str,
    dtype: str,
) -> dict[str, Any]:
    """Every setting that decides an in-process responses shard's bytes: the sampling parameters, the batch
    size (rows are padded and seeded per batch), the device and dtype, and the target path the records name."""
    return {
        "model": str(model),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "max_new_tokens": int(max_new_tokens),
        "batch_size": int(batch_size),
        "seed": int(seed),
        "device": device,
        "dtype": dtype,
    }


def generation_key(prompts_sha256: str, target: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """The key a generation store entry must carry to be reused for these prompts, target and settings."""
    blob = json.dumps(
        {"prompts": prompts_sha256, "target": target, "settings": settings}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def write_generation_record(store: str | Path, key: str, summary: Mapping[str, Any]) -> None:
    """After the entry ``store`` is published: its record (format, key, the entry's sha256 and the job's summary
    of the shard), written atomically. A crash between the two leaves an entry without a record: regenerated."""
    atomic_write_json(
        generation_record_path(store),
        {"format": GENERATION_RECORD_FORMAT, "key": key, "sha256": file_sha256(store), "summary": dict(summary)},
    )


def stored_generation(store: str | Path, key: str) -> dict[str, Any] | None:
    """The record of the generation store entry at ``store`` when the entry exists, its record carries ``key``
    and the entry's bytes are the ones recorded (not cut short, not rewritten); else None."""
    try:
        record = json.loads(generation_record_path(store).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != GENERATION_RECORD_FORMAT or record.get("key") != key:
        return None
    try:
        same = file_sha256(store) == record.get("sha256")
    except OSError:
        return None
    return record if same else None


def responses_key_function(
    target: Mapping[str, Any], responses: Mapping[str, Mapping[str, Any]]
) -> Callable[[str, Path], str] | None:
    """(dataset, prompts path) -> generation key, as rule ``responses_hf`` computes it from the config's
    ``target`` section and each dataset's ``responses`` settings; None when the target is not there yet (its
    identity is unknown)."""
    if not Path(target["path"], "config.json").exists():
        return None
    try:
        identity = target_identity(target["path"])
    except OSError:
        return None

    def key_of(dataset: str, prompts: Path) -> str:
        r = responses[dataset]
        settings = generation_settings(
            model=target["path"],
            temperature=r["temperature"],
            top_p=r["top_p"],
            max_new_tokens=r["max_new_tokens"],
            batch_size=r["batch_size"],
            seed=r["seed"],
            device=target["device"],
            dtype=target["dtype"],
        )
        return generation_key(cached_sha256(prompts), identity, settings)

    return key_of


def generation_reusable(
    dataset_of: Mapping[Path, str], key_of: Callable[[str, Path], str] | None
) -> Callable[[Path, Path], bool]:
    """(responses path, prompts path) -> whether rule ``responses_hf`` will reuse the shard's store entry: its
    record carries ``key_of(dataset, prompts)``; without ``key_of`` (no target yet), any recorded entry newer
    than its prompts shard."""

    def reusable(out: Path, prompts: Path) -> bool:
        store = store_path(out, GENERATION_STORE_DIR)
        if not store.exists():
            return False
        if key_of is not None:
            return stored_generation(store, key_of(dataset_of[out], prompts)) is not None
        return generation_record_path(store).exists() and store.stat().st_mtime >= prompts.stat().st_mtime

    return reusable


def responses_plan_text(plan: Mapping[str, int] | None, served_pending: int = 0) -> str | None:
    """The ``snakemake -n`` line of the responses stage's target loads: rule ``responses_hf`` (one job for every
    in-process shard, ``pending_plan``), and the API shards served by the server rule ``responses`` starts
    (``responses.serve``: one load for the job of every API shard). None when no dataset generates with the
    target."""
    parts = []
    if plan is not None:
        if not plan["pending"]:
            parts.append(f"all {plan['shards']} in-process responses shards are published: 0 target loads")
        else:
            stored = f", {plan['stored']} of them from the generation store" if plan["stored"] else ""
            loads = plan["loads"]
            parts.append(
                f"rule responses_hf (one job for all {plan['shards']} in-process shards) publishes "
                f"{plan['pending']} pending{stored}: {loads} target load{'' if loads == 1 else 's'} when it runs "
                f"(one job per shard: {plan['to_generate']})"
            )
    if served_pending:
        parts.append(
            f"{served_pending} pending shards through the server rule responses starts (responses.serve): "
            "1 target load (one job for every API shard)"
        )
    return "aerie responses plan: " + "; ".join(parts) if parts else None


def responses_loads_text(
    target: Mapping[str, Any],
    responses: Mapping[str, Mapping[str, Any]],
    shard_names: Mapping[str, Sequence[str]],
    results_dir: Path = Path("results"),
) -> str | None:
    """``responses_plan_text`` of a run: per dataset its responses settings and shard names; shards under
    ``results_dir/<dataset>/{prompts,responses}/shard-NNNNN.jsonl``."""

    def shards(want: Callable[[Mapping[str, Any]], bool]) -> list[tuple[str, Path, Path]]:
        return [
            (d, results_dir / d / "responses" / f"shard-{s}.jsonl", results_dir / d / "prompts" / f"shard-{s}.jsonl")
            for d, names in shard_names.items()
            if want(responses[d])
            for s in names
        ]

    in_process = shards(lambda r: is_in_process(r["backend"]))
    served = shards(lambda r: not is_in_process(r["backend"]) and bool(r.get("serve")))
    plan = None
    if in_process:
        reusable = generation_reusable({o: d for d, o, _ in in_process}, responses_key_function(target, responses))
        plan = pending_plan([o for _, o, _ in in_process], [p for _, _, p in in_process], reusable)
    served_pending = pending_plan([o for _, o, _ in served], [p for _, _, p in served], lambda o, p: False)["pending"]
    return responses_plan_text(plan, served_pending)
