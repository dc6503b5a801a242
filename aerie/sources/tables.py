"""Prompt datasets by name or by local file (``source.kind: hf``), read with Hugging Face ``datasets``.

One home for turning the conversation shapes that public prompt datasets use into aerie prompts:

- ``sharegpt``: a list of ``{from, value}`` turns (ShareGPT, Vicuna, Hermes): ``human``/``gpt``/``system``/...
- ``messages``: an OpenAI chat list of ``{role, content}`` (UltraChat, OpenHermes-2.5 converted, tool sets)
- ``instruction``: an instruction column (+ an optional ``input`` column, Alpaca style); the response
  column, if any, is what the target regenerates, so it is never read
- ``question``: one text column (GSM8K ``question``); a list (MT-bench ``prompt``/``turns``) gives its first turn

``auto`` picks the shape from the columns present. Rows are visited in source order, or in a seeded
random order (``seed``) so that ``max_prompts`` takes a deterministic uniform sample. Prompts are filtered
(language, estimated or counted prompt tokens), and deduplicated by normalised text: within the
dataset, and against the datasets listed before it when the caller passes them (``exclude``).

A dry run never downloads. Datasets named on the Hub are read from the local ``datasets`` cache with
the Hub switched off; ``python -m aerie.sources fetch --configfile CONFIG`` fills that cache
(the one step that touches the network, like SpecForge's ``prepare_data``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from aerie.formats.prompts import estimate_prompt_tokens


class PromptSourceError(ValueError):
    """Bad prompt input, with the file and line (or the config setting) that caused it."""


SHAPES = ("auto", "sharegpt", "messages", "instruction", "question")
TURNS = ("last_user", "every_assistant")
# The column each shape reads unless ``field`` says otherwise.
DEFAULT_FIELD = {
    "sharegpt": "conversations",
    "messages": "messages",
    "instruction": "instruction",
    "question": "question",
}
# ``auto``: the first of these columns present decides the shape (and is the field read).
AUTO_COLUMNS = (
    ("conversations", "sharegpt"),
    ("messages", "messages"),
    ("instruction", "instruction"),
    ("problem", "instruction"),
    ("question", "question"),
    ("prompt", "question"),
)
# File name endings -> the datasets builder that reads them.
FILE_FORMATS = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".arrow": "arrow",
}
# ShareGPT speaker names seen in the public dumps -> chat roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
FETCH_COMMAND = "python -m aerie.sources fetch --configfile CONFIG"


def source_label(source: dict[str, Any]) -> str:
    """How error messages and prompt records name an hf source: the Hub name, else its data files."""
    if source.get("name"):
        return source["name"] + (f" ({source['config']})" if source.get("config") else "")
    files = source.get("data_files")
    return ", ".join(files) if isinstance(files, list) else str(files)


def local_data_files(source: dict[str, Any]) -> list[Path]:
    """The local files of a source without a Hub name (globs expanded, sorted); [] for Hub datasets."""
    if source.get("name"):
        return []
    patterns = source["data_files"]
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matched or not all(Path(m).is_file() for m in matched):
            raise PromptSourceError(f"source.data_files: no file matches '{pattern}'")
        files.extend(Path(m) for m in matched)
    return files


def _file_format(source: dict[str, Any], files: list[Path]) -> str:
    if source.get("format"):
        return source["format"]
    for ending, builder in sorted(FILE_FORMATS.items(), key=lambda kv: -len(kv[0])):
        if all(f.name.endswith(ending) for f in files):
            return builder
    raise PromptSourceError(
        f"source.data_files {[str(f) for f in files]}: cannot tell the format from the file "
        f"names; set source.format to one of {sorted(set(FILE_FORMATS.values()))}"
    )


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Switch the Hub off for this process while loading: reads come from the local cache or fail."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def load_table(source: dict[str, Any], where: str, download: bool = False) -> Any:
    """The source's split as a ``datasets.Dataset``; never touches the network unless ``download``."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise PromptSourceError(
            f"{where}: source.kind hf needs the `datasets` package (pip install datasets)"
        ) from None

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    split = source.get("split", "train")
    if source.get("name"):
        args: dict[str, Any] = {
            "path": source["name"],
            "name": source.get("config"),
            "revision": source.get("revision"),
            "data_files": source.get("data_files"),
        }
    else:
        files = local_data_files(source)
        args = {"path": _file_format(source, files), "data_files": {split: [str(f) for f in files]}}
    guard = contextlib.nullcontext() if download else _hub_offline()
    try:
        with guard:
            return datasets.load_dataset(**args, split=split)
    except PromptSourceError:
        raise
    except (ConnectionError, FileNotFoundError) as e:
        if source.get("name") and not download:
            raise PromptSourceError(
                f"{where}: dataset '{source_label(source)}' is not in the local Hugging Face datasets cache and "
                f"the dry run never downloads; fetch it first: {FETCH_COMMAND} ({type(e).__name__}: {e})"
            ) from None
        raise PromptSourceError(f"{where}: cannot load dataset '{source_label(source)}': {e}") from None
    except ValueError as e:  # unknown split or config, unreadable file
        raise PromptSourceError(f"{where}: cannot load split '{split}' of '{source_label(source)}': {e}") from None


def _text(content: Any) -> str | None:
    """Message content as text: a string, or an OpenAI list of parts that are all text; else None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def _sharegpt(turns: Any, field: str) -> list[dict[str, Any]] | None:
    if not isinstance(turns, list):
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
        text = _text(t.get("value"))
        if role is None or text is None:
            return None
        messages.append({"role": role, "content": text})
    return messages


def _openai_messages(items: Any, field: str) -> list[dict[str, Any]] | None:
    if not isinstance(items, list):
        return None
    messages = []
    for m in items:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        text = _text(m.get("content"))
        if text is None and not (m.get("content") is None and m.get("tool_calls")):
            return None
        # Tool-call conversations keep what the chat template renders (calls, results, names, reasoning).
        messages.append({k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None} | {"content": text})
    return messages


def _question(value: Any) -> str | None:
    if isinstance(value, list):  # MT-bench style: the first turn is the one that can be asked alone
        value = value[0] if value else None
    return value if isinstance(value, str) else None


def resolve_shape(source: dict[str, Any], columns: list[str], where: str) -> tuple[str, str]:
    """(shape, field) of a source, checking that the field is a column of the dataset."""
    shape, field = source.get("shape", "auto"), source.get("field")
    if shape == "auto":
        if field is not None:
            raise PromptSourceError(f"{where}: source.field needs an explicit source.shape")
        for column, candidate in AUTO_COLUMNS:
            if column in columns:
                return candidate, column
        raise PromptSourceError(
            f"{where}: cannot tell the prompt shape from the columns {columns}; set source.shape "
            f"(one of {list(SHAPES[1:])}) and source.field"
        )
    field = field or DEFAULT_FIELD[shape]
    if field not in columns:
        raise PromptSourceError(
            f"{where}: column '{field}' (source.field of shape '{shape}') is not in the dataset; columns: {columns}"
        )
    return shape, field


def conversation(row: dict[str, Any], shape: str, field: str, input_field: str | None) -> list[dict[str, Any]] | None:
    """The row's conversation as chat messages, or None when the row is not of the shape (it is skipped)."""
    if shape == "sharegpt":
        return _sharegpt(row.get(field), field)
    if shape == "messages":
        return _openai_messages(row.get(field), field)
    text = _question(row.get(field))
    if text is None:
        return None
    if shape == "instruction" and input_field and isinstance(row.get(input_field), str) and row[input_field].strip():
        text = f"{text}\n\n{row[input_field]}"
    return [{"role": "user", "content": text}]


def prompt_turns(messages: list[dict[str, Any]], turns: str) -> list[tuple[int, list[dict[str, Any]]]]:
    """The prompts a conversation gives: (assistant turn number, messages the target answers).

    ``last_user``: everything up to the last user turn (one prompt). ``every_assistant``: the context before
    each assistant turn, plus the whole conversation when it ends on a user or tool turn. The earlier
    assistant turns inside a context are the dataset's, not regenerated ones; only the turn after the
    prompt is regenerated and trained on.
    """
    has_user = [any(m["role"] == "user" for m in messages[:i]) for i in range(len(messages) + 1)]
    if turns == "last_user":
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        return [] if last is None else [(0, messages[: last + 1])]
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and has_user[i] and messages[i - 1]["role"] in ("user", "tool"):
            out.append((len(out), messages[:i]))
    if messages and messages[-1]["role"] in ("user", "tool") and has_user[len(messages)]:
        out.append((len(out), messages))
    return out


def normalised_text(messages: list[dict[str, Any]]) -> str:
    """What two prompts must share to count as duplicates: NFKC, case-folded, whitespace-collapsed text of
    every non-system turn with its role (an earlier turn makes a different prompt; a dataset's own
    ``system_prompt`` does not, so datasets with different system prompts still dedup)."""
    text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages if m["role"] != "system")
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


DEDUP_KEY_BYTES = 16


def dedup_key(messages: list[dict[str, Any]]) -> bytes:
    """A 16-byte digest of :func:`normalised_text`: what dedup compares (a set of 300k digests is 20 MB where the
    texts themselves of a chat set are gigabytes; a collision among 10^6 prompts has odds ~10^-26)."""
    return hashlib.blake2b(normalised_text(messages).encode(), digest_size=DEDUP_KEY_BYTES).digest()


class _TokenCounter:
    """Prompt tokens for ``max_prompt_tokens``: the given tokenizer's chat template, else ~4 characters a token."""

    def __init__(self, tokenizer: str | None, where: str) -> None:
        self.tokenizer = None
        if tokenizer:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            except (OSError, ValueError) as e:
                raise PromptSourceError(f"{where}: source.tokenizer '{tokenizer}' cannot be loaded: {e}") from None

    def __call__(self, messages: list[dict[str, Any]]) -> int:
        if self.tokenizer is None:
            return estimate_prompt_tokens(messages)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if isinstance(ids, dict) else ids)


def _tools(row: dict[str, Any], source: dict[str, Any], columns: list[str], where: str) -> list[dict[str, Any]] | None:
    field = source.get("tools_field", "tools")
    if field not in columns or row.get(field) in (None, "", []):
        if field != "tools":  # the default column is optional; a named one must exist
            raise PromptSourceError(f"{where}: column '{field}' (source.tools_field) is not in the dataset")
        return None
    tools = row[field]
    if isinstance(tools, str):  # many sets store the declarations as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return None
    return tools if isinstance(tools, list) and all(isinstance(t, dict) for t in tools) and tools else None


def iter_hf_prompts(
    name: str,
    source: dict[str, Any],
    exclude: set[bytes] | frozenset[bytes] = frozenset(),
) -> Iterator[dict[str, Any]]:
    """Prompts of an ``hf`` source in sampling order, filtered and deduplicated (lazy: stops when dropped).

    ``exclude``: :func:`dedup_key` digests of prompts to drop (those of the datasets listed before this one)."""
    for record, _ in iter_hf_prompts_keyed(name, source, exclude):
        yield record


def iter_hf_prompts_keyed(
    name: str,
    source: dict[str, Any],
    exclude: set[bytes] | frozenset[bytes] = frozenset(),
) -> Iterator[tuple[dict[str, Any], bytes]]:
    """:func:`iter_hf_prompts` with each prompt's :func:`dedup_key` (the prompt cache keeps them for the datasets
    listed after this one)."""
    where = f"datasets.{name}"
    table = load_table(source, where)
    columns = list(table.column_names)
    shape, field = resolve_shape(source, columns, where)
    input_field = source.get("input_field", "input" if shape == "instruction" else None)
    if "input_field" in source and input_field not in columns:
        raise PromptSourceError(f"{where}: column '{input_field}' (source.input_field) is not in the dataset")
    id_field = source.get("id_field")
    if id_field and id_field not in columns:
        raise PromptSourceError(
            f"{where}: column '{id_field}' (source.id_field) is not in the dataset; columns: {columns}"
        )
    languages = source.get("language")
    language_field = source.get("language_field", "language")
    if languages and language_field not in columns:
        raise PromptSourceError(
            f"{where}: source.language needs a language column; '{language_field}' "
            f"(source.language_field) is not in the dataset; columns: {columns}"
        )
    wanted_languages = {str(lang).casefold() for lang in languages or ()}
    max_tokens = source.get("max_prompt_tokens")
    count_tokens = _TokenCounter(source.get("tokenizer"), where) if max_tokens else None
    turns = source.get("turns", "last_user")
    dedup = source.get("dedup", True)
    seen: set[bytes] = set()
    order: Any = range(len(table))
    if source.get("seed") is not None:
        import numpy as np

        order = np.random.default_rng(source["seed"]).permutation(len(table)).tolist()
    label = source_label(source)
    for index in order:
        row = table[index]
        if wanted_languages and str(row.get(language_field, "")).casefold() not in wanted_languages:
            continue
        messages = conversation(row, shape, field, input_field)
        if not messages or any(m["role"] not in ("system", "user", "assistant", "tool") for m in messages):
            continue  # not a conversation of this shape (public dumps hold empty and broken rows)
        tools = _tools(row, source, columns, where)
        for turn, prompt in prompt_turns(messages, turns):
            if not any((m.get("content") or "").strip() for m in prompt if m["role"] == "user"):
                continue
            if count_tokens is not None and count_tokens(prompt) > max_tokens:
                continue
            key = dedup_key(prompt)
            if dedup:
                if key in seen or key in exclude:
                    continue
                seen.add(key)
            sid = str(row[id_field]) if id_field else f"row{index}"
            if turns == "every_assistant":
                sid = f"{sid}/turn{turn}"
            record = {
                "id": sid,
                "messages": prompt,
                **({"tools": tools} if tools else {}),
                "source": {
                    "kind": "hf",
                    "dataset": label,
                    "split": source.get("split", "train"),
                    "row": index,
                    **({"turn": turn} if turns == "every_assistant" else {}),
                },
            }
            yield record, key


def _file_identity(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def hub_cache_dir(name: str) -> Path:
    """Where ``datasets`` keeps a Hub dataset it has loaded once (what an offline load reads): HF_DATASETS_CACHE
    (default HF_HOME/datasets) / ``{namespace}___{snake_case name}``, as datasets' cached-module factory looks."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    root = Path(os.environ.get("HF_DATASETS_CACHE") or os.path.join(os.path.expanduser(home), "datasets"))
    parts = name.split("/")
    snake = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", parts[-1])
    parts[-1] = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", snake).lower()
    return root.expanduser() / "___".join(parts)


def source_identity(source: dict[str, Any]) -> dict[str, Any] | None:
    """What the prompts of a ``jsonl`` or ``hf`` source are read from, cheaply: each local file's (path, size,
    mtime_ns);
    for a Hub dataset, the same of every ``.arrow``/``.json`` file of its copy in the datasets cache (lock files
    left out: a load touches them). None when the Hub dataset is not cached (the load then fails, naming fetch).
    A ``source.tokenizer`` (counting max_prompt_tokens) is part of it too."""
    identity: dict[str, Any] = {}
    if source["kind"] == "jsonl":
        path = Path(source["path"])
        return {"files": [_file_identity(path)]} if path.is_file() else None
    if source.get("name"):
        folder = hub_cache_dir(source["name"])
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".arrow", ".json"))
        if not files:
            return None
        identity["hub_cache"] = [_file_identity(p) for p in files]
    else:
        identity["files"] = [_file_identity(p) for p in local_data_files(source)]
    if source.get("tokenizer") and source.get("max_prompt_tokens"):
        folder = Path(source["tokenizer"])
        identity["tokenizer"] = [_file_identity(p) for p in sorted(folder.glob("*")) if p.is_file()]
    return identity


def fetch(config: dict[str, Any], out: Any = sys.stdout) -> int:
    """Download every Hub dataset a config names into the local cache; returns how many were fetched."""
    fetched = 0
    for name, ds in config["datasets"].items():
        source = ds["source"]
        if source.get("kind") not in ("hf", "recorded") or not source.get("name"):
            continue
        table = load_table(source, f"datasets.{name}", download=True)
        print(
            f"datasets.{name}: {source_label(source)} split {source.get('split', 'train')}: {len(table)} rows, "
            f"columns {list(table.column_names)}",
            file=out,
        )
        fetched += 1
    return fetched


def main(argv: list[str] | None = None) -> int:
    """``fetch --configfile CONFIG``: fill the datasets cache so dry runs and jobs read offline."""
    parser = argparse.ArgumentParser(prog="python -m aerie.sources.tables", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch_parser = sub.add_parser("fetch", help="download the Hub datasets the config names")
    fetch_parser.add_argument("--configfile", required=True, type=Path)
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.configfile.read_text())
    try:
        n = fetch(config)
    except PromptSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{n} dataset(s) in the local cache; `snakemake -n` now plans them offline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
