"""Configuration and dry runs: bad input fails before any work, naming the setting or file:line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conda_stand_in import CONDA_DEPLOYMENT, conda_on_path
from conftest import REPO, shared_path, snakemake


def write_config(workdir: Path, config: dict) -> Path:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def demo_config() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def jsonl_config(path: str) -> dict:
    config = demo_config()
    config["datasets"] = {"mine": {"source": {"kind": "jsonl", "path": path}, "shard_size": 2, "bench_prompts": 1}}
    return config


def dry_run(workdir: Path, config: dict) -> tuple[int, str]:
    proc = snakemake(workdir, "-n", "--configfile", str(write_config(workdir, config)))
    return proc.returncode, proc.stdout + proc.stderr


def test_demo_dry_run_sees_every_job(workdir: Path) -> None:
    proc = snakemake(workdir, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    config = demo_config()
    # Shard counts come from the config and the prompt sources, before anything runs.
    tasks = config["datasets"]["tasks"]
    tasks_shards = -(-(tasks["source"]["count"] - tasks["bench_prompts"]) // tasks["shard_size"])
    he = config["datasets"]["humaneval"]
    he_shards = -(-(164 - he["bench_prompts"]) // he["shard_size"])
    shards = tasks_shards + he_shards
    assert tasks_shards >= 2 and he_shards >= 2
    assert int(counts["prompts"]) == shards
    assert int(counts["responses"]) == 1  # every API-backed shard (the demo's humaneval) in one job: one set of limits
    assert int(counts["responses_hf"]) == 1  # every in-process shard in one job: the target loads once
    assert int(counts["tokens"]) == shards
    assert int(counts["hidden"]) == 1  # one capture job for every shard: the target loads once (rules/hidden.smk)
    assert int(counts["bench_prompts"]) == 2
    for rule in ("demo_target", "tokenizer_check", "draft_vocab", "drafter", "bench", "all"):
        assert int(counts[rule]) == 1


def test_unknown_key_is_named(workdir: Path) -> None:
    config = demo_config()
    config["responses"]["temprature"] = 0.5
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "temprature" in out


def test_wrong_type_is_named(workdir: Path) -> None:
    config = demo_config()
    config["responses"]["max_new_tokens"] = "many"
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "max_new_tokens" in out and "many" in out


def test_unknown_drafter_key_is_named(workdir: Path) -> None:
    config = demo_config()
    config["drafter"] = {"learnig_rate": 1e-3}
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "learnig_rate" in out


def test_missing_prompt_file_is_named(workdir: Path) -> None:
    rc, out = dry_run(workdir, jsonl_config("prompts/nowhere.jsonl"))
    assert rc != 0
    assert "prompts/nowhere.jsonl" in out and "not found" in out


def test_malformed_jsonl_line_is_named(workdir: Path) -> None:
    prompts = workdir / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"\n{"prompt": "four"}\n')
    rc, out = dry_run(workdir, jsonl_config("prompts.jsonl"))
    assert rc != 0
    assert "prompts.jsonl:3" in out and "malformed JSON" in out


def test_missing_field_is_named(workdir: Path) -> None:
    prompts = workdir / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"question": "two"}\n{"prompt": "three"}\n')
    rc, out = dry_run(workdir, jsonl_config("prompts.jsonl"))
    assert rc != 0
    assert "prompts.jsonl:2" in out and "'prompt'" in out


def test_aux_layer_out_of_range_is_named(workdir: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    config["hidden"]["aux_layer_ids"] = [1, 29, 61]
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "hidden.aux_layer_ids" in out and "61" in out


def test_kimi_example_config_dry_run(workdir: Path) -> None:
    """The Kimi K2.5 example validates and plans every shard, with its Hub sources replaced by small stand-in prompt
    files (a test cannot fill the datasets cache offline; tests/test_kimi_preview.py checks the money)."""
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    # five prompt datasets, and the two optional recorded ones (absent here: they plan no shard)
    assert [n for n, d in config["datasets"].items() if d["source"]["kind"] == "recorded"] == [
        "kimi_mtp",
        "own_traffic",
    ]
    assert len(config["datasets"]) == 7 and list(config["bench"]["sets"]) == ["mtbench", "gsm8k", "humaneval"]
    assert config["hidden"]["aux_layer_ids"] == [1, 29, 57]
    assert config["vocab"]["draft_vocab_size"] == 32000
    gsm8k = shared_path("datasets", "gsm8k_test.jsonl")
    for name, ds in config["datasets"].items():
        path = workdir / "prompts" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if ds["source"]["kind"] == "recorded":
            continue
        if name == "math":
            path.write_text("".join(gsm8k.read_text().splitlines(keepends=True)[:50]))
            ds["source"] = {"kind": "jsonl", "path": str(path), "text_field": "question"}
        else:
            path.write_text(
                "".join(
                    json.dumps({"messages": [{"role": "user", "content": f"{name} question {i}"}], "id": f"{name}-{i}"})
                    + "\n"
                    for i in range(5)
                )
            )
            ds["source"] = {"kind": "jsonl", "path": str(path), "messages_field": "messages", "id_field": "id"}
    # Stand-in files are tiny: shrink shards so every dataset still has several.
    for ds in config["datasets"].values():
        ds["shard_size"] = 2
    # Its SGLang rules run in SGLang's env: conda deployment, as in profiles/gpu-host (tests/conda_stand_in.py).
    proc = snakemake(
        workdir, "-n", *CONDA_DEPLOYMENT, "--configfile", str(write_config(workdir, config)), env=conda_on_path(workdir)
    )
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    # 4 datasets x 3 shards (5 prompts) + math 25 shards (50 prompts: its quota can use them all); MT-Bench, GSM8K
    # test and HumanEval are benchmark sets. (The API responses are one job: count the prompt shards.)
    assert int(counts["prompts"]) == 4 * 3 + 25
    assert "bench_prompts" not in counts and int(counts["bench_set"]) == 3
    # The dry run names every set, the gate and every reference; the published drafters are not in this cache.
    line = next(x for x in out.splitlines() if x.startswith("aerie benchmark: backend sglang, one table per set: "))
    for named in (
        "mtbench (HuggingFaceH4/mt_bench_prompts, else prompts/mt_bench_questions.jsonl)",
        "gsm8k (openai/gsm8k, else prompts/gsm8k_test.jsonl)",
        "humaneval (humaneval)",
    ):
        assert named in line, line
    gate = next(x for x in out.splitlines() if x.startswith("  the gate, for each trained drafter on its own"))
    assert all(f"{s} {w:.2f}" in gate for s, w in (("humaneval", 0.5), ("mtbench", 0.3), ("gsm8k", 0.2))), gate
    assert "no loss to a reference on any set beyond its spread, above the best reference on the weighted mix" in gate
    assert "reference ngram_default: built in (SGLang's own" in out
    assert "reference lightseekorg/kimi-k2.5-eagle3: NOT HERE YET" in out
    assert "reference z-lab/Kimi-K2.5-DFlash: NOT HERE YET" in out
    assert "demo_target" not in counts


# --- every setting typed at parse time (issue 12 item 3) ------------------------------------------------------------


def demo_text_with(edits: dict[str, str]) -> str:
    """config/config.yaml's text with whole lines replaced (written by hand, so YAML reads what a user wrote)."""
    text = (REPO / "config" / "config.yaml").read_text()
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def line_of(path: Path, needle: str) -> int:
    (n,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    return n


def dry_run_text(workdir: Path, *texts: str, extra: tuple[str, ...] = ()) -> tuple[int, str, list[Path]]:
    paths = []
    for i, text in enumerate(texts):
        paths.append(workdir / f"config{i or ''}.yaml")
        paths[-1].write_text(text)
    proc = snakemake(workdir, "-n", "--configfile", *map(str, paths), *extra)
    return proc.returncode, proc.stdout + proc.stderr, paths


def test_every_kind_of_bad_setting_names_key_path_file_and_line(workdir: Path) -> None:
    """A number YAML 1.1 reads as text, a word for a number, an unknown key, a value out of range, a float for an
    integer, a bad demo-target setting: all reported in one dry run, each with its key path and file:line."""
    text = demo_text_with(
        {
            "  learning_rate: 0.001 ": "  learning_rate: 1e-4 ",
            "  ttt_steps: 3 ": "  ttt_steps: three ",
            "  batch_size: 24\n": "  batch_size: 24\n  temprature: 0.3\n",
            "  demo: {}": "  demo: {hidden_size: 0, vocab_sise: 512}",
            "  batch_tokens: 8192\n": "  batch_tokens: 8192.0\n",
            "    min_speedup: 1.0 ": "    min_speedup: -1 ",
        }
    )
    rc, out, (cfg,) = dry_run_text(workdir, text)
    assert rc != 0
    expected = [
        ("drafter.learning_rate", "learning_rate: 1e-4", "'1e-4' is text, not a number: YAML 1.1"),
        ("drafter.ttt_steps", "ttt_steps: three", "expected an integer, got the text 'three'"),
        ("responses.temprature", "temprature", "unknown key (did you mean 'temperature'?)"),
        ("target.demo.hidden_size", "demo: {", "0 is out of range: must be >= 1"),
        ("target.demo.vocab_sise", "demo: {", "unknown key (did you mean 'vocab_size'?)"),
        ("hidden.batch_tokens", "batch_tokens:", "8192.0 is not an integer"),
        ("bench.gate.min_speedup", "min_speedup:", "-1 is out of range: must be >= 0"),
    ]
    for key, needle, message in expected:
        assert f"{cfg}:{line_of(cfg, needle)}: {key}: {message}" in out, (key, out)
    assert "Write 1.0e-4 or 0.0001" in out  # how to write it so YAML reads a number
    assert "7 settings are wrong" in out


def test_duplicate_yaml_key_names_both_lines(workdir: Path) -> None:
    text = demo_text_with({"  ttt_steps: 3 ": "  ttt_steps: 3\n  epochs: 1\n  ttt_steps: 5 "})
    rc, out, (cfg,) = dry_run_text(workdir, text)
    assert rc != 0
    lines = [i for i, line in enumerate(cfg.read_text().splitlines(), 1) if line.startswith("  ttt_steps:")]
    assert f"{cfg}:{lines[1]}: drafter.ttt_steps: duplicate key (also set at line {lines[0]})" in out, out


def test_duplicate_section_is_refused_too(workdir: Path) -> None:
    text = demo_text_with({}) + "\ndrafter:\n  epochs: 3\n"
    rc, out, (cfg,) = dry_run_text(workdir, text)
    assert rc != 0
    first, second = [i for i, line in enumerate(cfg.read_text().splitlines(), 1) if line.startswith("drafter:")]
    assert f"{cfg}:{second}: drafter: duplicate key (also set at line {first})" in out, out


def test_the_file_that_set_the_value_is_named_and_command_line_values_too(workdir: Path) -> None:
    """With two config files the later one's value counts, so its line is named; a --config value is named as such."""
    override = "drafter:\n  learning_rate: 0.001\n  epochs: 2\n  eval_fraction: 1.5\n"
    rc, out, (base, second) = dry_run_text(workdir, demo_text_with({}), override, extra=("--config", "run=bad/name"))
    assert rc != 0
    assert f"{second}:4: drafter.eval_fraction: 1.5 is out of range: must be < 1" in out, out
    assert "run (set with --config run=...): 'bad/name' does not match" in out, out


def test_dataset_responses_override_is_named_where_the_dataset_sets_it(workdir: Path) -> None:
    text = demo_text_with({"      concurrency: 8\n": "      concurrency: 0\n"})
    rc, out, (cfg,) = dry_run_text(workdir, text)
    assert rc != 0
    line = line_of(cfg, "concurrency: 0")
    assert f"{cfg}:{line}: datasets.humaneval.responses.concurrency: 0 is out of range: must be >= 1" in out, out


def dataclass_sections(schema: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    found = [(path, schema)] if "x-defaults-from" in schema else []
    for key, sub in schema.get("properties", {}).items():
        found += dataclass_sections(sub, path + (key,))
    return found


def json_type(annotation) -> dict:
    import typing

    if annotation is bool:
        return {"type": "boolean"}
    if annotation is int:
        return {"type": "integer"}
    if annotation is float:
        return {"type": "number"}
    if annotation is str:
        return {"type": "string"}
    if typing.get_origin(annotation) is tuple:
        (item, _dots) = typing.get_args(annotation)
        if typing.get_args(item) == (str, float):  # (key, weight) pairs: a mapping in the YAML (heldout_weights)
            return {"type": "object"}
        return {"type": "array", "items": json_type(item)["type"]}
    raise AssertionError(f"no JSON type for {annotation}")


def test_built_targets_declare_their_shared_pretraining_settings_once() -> None:
    """target.demo and target.rehearsal pre-train with one loop: its data, optimisation and evaluation settings are
    declared once (PretrainingConfig); a builder restates a shared field only to change its default."""
    import dataclasses

    from aerie.targets.demo.config import DemoTargetConfig
    from aerie.targets.pretraining import PretrainingConfig
    from aerie.targets.rehearsal.config import RehearsalTargetConfig

    shared = {f.name: f.default for f in dataclasses.fields(PretrainingConfig)}
    for cls in (DemoTargetConfig, RehearsalTargetConfig):
        assert issubclass(cls, PretrainingConfig), cls.__name__
        restated = set(vars(cls).get("__annotations__", {})) & set(shared)
        same = sorted(name for name in restated if getattr(cls(), name) == shared[name])
        assert not same, f"{cls.__name__} restates {same} with PretrainingConfig's own default"
    assert RehearsalTargetConfig().train_steps < DemoTargetConfig().train_steps  # the rehearsal builds faster


def test_schema_of_dataclass_sections_matches_the_dataclass_fields() -> None:
    """drafter, target.demo and target.rehearsal: the same keys, types and defaults as TrainConfig /
    DemoTargetConfig / RehearsalTargetConfig, so neither can change without the other."""
    import dataclasses
    import importlib
    import typing

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    sections = dict(dataclass_sections(schema))
    assert {("drafter",), ("target", "demo"), ("target", "rehearsal")} <= set(sections)
    for path, section in sections.items():
        module, _, name = section["x-defaults-from"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "kind_settings"}
        props = section["properties"]
        assert section.get("additionalProperties") is False, path
        if "x-kind-settings-from" in section:  # the drafter section: TrainConfig's keys and every kind's own
            for kind in importlib.import_module(section["x-kind-settings-from"]).kinds().values():
                own = typing.get_type_hints(kind.settings_class)
                for f in dataclasses.fields(kind.settings_class):
                    if f.name in fields:  # a key two kinds share: the same type and default
                        assert own[f.name] == hints[f.name] and f.default == fields[f.name].default, (kind.name, f.name)
                    fields[f.name], hints[f.name] = f, own[f.name]
            assert set(props) == set(fields), f"{'.'.join(path)}: schema keys differ: {set(props) ^ set(fields)}"
        else:
            assert list(props) == list(fields), f"{'.'.join(path)}: schema keys differ from {name}'s fields"
        for key, f in fields.items():
            want = json_type(hints[key])
            got = {"type": props[key]["type"]}
            if want["type"] == "array":
                got["items"] = props[key]["items"]["type"]
            assert got == want, f"{'.'.join(path)}.{key}: schema type {got} but {name} says {want}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            schema_default = props[key]["default"]
            if want["type"] == "object":  # pairs kept sorted, written as a mapping
                default = dict(default)
            assert type(schema_default) is type(default) or isinstance(default, tuple), (path, key)
            assert (list(default) if isinstance(default, tuple) else default) == schema_default, (path, key)
            # The default lies inside the schema's own range and enum (it passes the schema).
            from aerie.plan.config_file import schema_errors

            assert schema_errors({key: schema_default}, {"properties": {key: props[key]}}) == [], (path, key)


# Objects a user writes whose keys stay open, each for a reason; every other object refuses unknown keys.
OPEN_OBJECTS = {
    "hidden.sglang": "keyword arguments of SGLang's engine, whose set depends on the installed SGLang",
    "datasets.*.responses": "overrides of the responses section, checked by aerie.plan.resolve.responses_config",
    "datasets.*.source": "closed per source kind by its allOf/then branches",
    "bench.chat_template_kwargs": "the target's chat template's own keyword arguments (thinking, enable_thinking ...)",
    "datasets.*.source#then.chat_template_kwargs": "recorded answers' template keyword arguments, the template's own",
    "responses.provider.sort": "OpenRouter's sort object (or a string)",
    "responses.provider.max_price": "OpenRouter's price caps, passed as is",
    "responses.provider.preferred_min_throughput": "OpenRouter's percentile object (or a number)",
    "responses.provider.preferred_max_latency": "OpenRouter's percentile object (or a number)",
}


def open_objects(schema: dict, path: str = "") -> list[str]:
    found = []
    subs = [schema, *schema.get("oneOf", []), *schema.get("anyOf", [])]
    for sub in subs:
        is_object = sub.get("type") == "object" or "properties" in sub
        if is_object and "additionalProperties" not in sub and path:
            found.append(path)
        for key, prop in sub.get("properties", {}).items():
            found += open_objects(prop, f"{path}.{key}" if path else key)
        if isinstance(sub.get("additionalProperties"), dict):
            found += open_objects(sub["additionalProperties"], f"{path}.*")
        for branch in sub.get("allOf", []):
            found += open_objects(branch.get("then", {}), path + "#then")
    return sorted(set(p for p in found if not p.endswith("#then")))


def test_every_object_a_user_writes_refuses_unknown_keys() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(open_objects(schema)) <= set(OPEN_OBJECTS), sorted(set(open_objects(schema)) - set(OPEN_OBJECTS))


def test_every_leaf_setting_has_a_type() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())

    def untyped(s: dict, path: str) -> list[str]:
        out = []
        if not any(k in s for k in ("type", "oneOf", "anyOf", "const", "enum", "$ref")) and path and "#" not in path:
            out.append(path)
        for key, prop in s.get("properties", {}).items():
            out += untyped(prop, f"{path}.{key}" if path else key)
        if isinstance(s.get("additionalProperties"), dict):
            out += untyped(s["additionalProperties"], f"{path}.*")
        for branch in s.get("allOf", []):
            out += [p.replace("#then", "") for p in untyped(branch.get("then", {}), path + "#then")]
        return out

    assert untyped(schema, "") == []


def test_config_sources_name_the_line_of_the_value_that_counts(tmp_path: Path) -> None:
    from aerie.plan.config_file import ConfigError, ConfigSources

    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("bench:\n  references: [untrained,\n    ngram]\n  gate:\n    min_speedup: 1.0\n")
    second.write_text("# override\nbench:\n  gate: {min_speedup: 2.0}\n")
    sources = ConfigSources.read([first, second], {"run": "x"})
    assert sources.where(("bench", "gate", "min_speedup")) == f"{second}:3"  # the later file's value counts
    assert sources.where(("bench", "references", 1)) == f"{first}:3"  # a list item on its own line
    assert sources.where(("bench", "gate", "max_simulated_gap")) == f"{second}:3"  # unset: its enclosing key
    assert sources.where(("run",)) == "--config run=..."
    assert sources.where(("vocab", "draft_vocab_size")) == ""  # set nowhere (a default)
    err = ConfigError("2 is too much", ("bench", "gate", "min_speedup"))
    assert str(err) == "bench.gate.min_speedup: 2 is too much"
    assert sources.describe(err) == f"{second}:3: bench.gate.min_speedup: 2 is too much"

    nested = tmp_path / "c.yaml"
    nested.write_text("datasets:\n  - {a: 1}\n  - a: 1\n    b: 2\n    a: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:5: datasets\[1\]\.a: duplicate key \(also set at line 3\)"):
        ConfigSources.read([nested])


@pytest.mark.parametrize(
    ("value", "types", "needle"),
    [
        ("1e-4", "number", "Write 1.0e-4 or 0.0001"),
        ("5e3", "number", "Write 5.0e+3 or 5000"),  # YAML 1.1 also wants the exponent's sign
        ("1e4", "integer", "Write 10000"),  # an integer setting gets the integer
        ("0.5", "number", "write it without quotes"),  # quoted in the file
        ("many", "integer", "expected an integer, got the text 'many'"),
        (2.0, "integer", "2.0 is not an integer"),
        (True, "number", "expected a number, got true/false"),
    ],
)
def test_type_errors_say_what_to_write(value, types, needle) -> None:
    from aerie.plan.config_file import schema_errors

    ((path, message),) = schema_errors({"x": value}, {"properties": {"x": {"type": types}}})
    assert path == ("x",) and needle in message, message
