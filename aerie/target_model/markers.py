"""The special markers a target's chat template writes, and the check that the tokenizer as loaded keeps each one id.

One job: ``check_template_markers``. A marker is a token the tokenizer's own files declare as an added token
(``tokenizer_config.json`` ``added_tokens_decoder``, else ``tokenizer.json`` ``added_tokens``; the bos/eos/...
names of ``special_tokens_map.json``) or the loaded tokenizer holds as one, and whose text the chat template
writes: in its source, or in its renders of probe conversations (bos/eos come in through variables); and the
reasoning markers ``<think>`` / ``</think>`` wherever the template writes them, declared or not (the tokens
stage frames reasoning with them). Each must encode, with the tokenizer as loaded, to exactly one id - the
id the files declare where they give one - both the way a server encodes text (``tokenizer.encode``) and the
way the tokens stage does (``aerie.target_model.text_encoder.TextEncoder``). Otherwise every training sequence
would hold several ids where the server's model reads and writes one: some transformers 5.x releases are
publicly reported to load Kimi K2.5's tiktoken tokenizer through an automatic conversion that splits
``<think>``. Rule ``tokenizer_check`` runs it once per run before any responses or tokens job (no API job
starts on such a target) and the tokens stage again on the tokenizer it encodes with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from aerie.target_model.template import render_text
from aerie.target_model.text_encoder import TextEncoder
from aerie.tools.artifacts import FormatError, atomic_write_json

CHECK_FORMAT = "aerie.tokenizer-check/1"
REASONING_MARKERS = ("<think>", "</think>")
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "aerie_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_CALL = {"id": "call_aerie_probe_0", "type": "function", "function": {"name": "aerie_probe", "arguments": {}}}


class TokenizerMarkerError(FormatError):
    """The tokenizer as loaded splits (or renumbers) a special marker its chat template writes."""


def package_version(name: str) -> str:
    """The installed version of a package, without importing it ("not installed" when absent)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_tokens_of(path: Path) -> list[Any]:
    """``added_tokens`` of a tokenizer.json without parsing its vocabulary (megabytes): the array is decoded
    where the key stands; the whole file only when that fails."""
    text = path.read_text(encoding="utf-8")
    at = text.find('"added_tokens"')
    if at >= 0:
        start = text.find("[", at)
        try:
            value, _ = json.JSONDecoder().raw_decode(text, start)
            if isinstance(value, list):
                return value
        except ValueError:
            pass
    return json.loads(text).get("added_tokens") or []


SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


def declared_tokens(target_path: str | Path | None) -> dict[str, int | None]:
    """Added tokens the tokenizer's files declare (text -> id, None where a file names no id)."""
    folder = Path(target_path) if target_path else None
    if folder is None or not folder.is_dir():
        return {}

    def read(name: str) -> dict[str, Any]:
        path = folder / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as err:
            raise FormatError(f"{path}: not readable JSON ({err})") from None
        return data if isinstance(data, dict) else {}

    config = read("tokenizer_config.json")
    declared: dict[str, int | None] = {}
    for i, v in (config.get("added_tokens_decoder") or {}).items():
        if c := _content(v):
            declared[c] = int(i)
    if (folder / "tokenizer.json").is_file():
        try:
            added = _added_tokens_of(folder / "tokenizer.json")
        except (OSError, ValueError) as err:
            raise FormatError(f"{folder / 'tokenizer.json'}: not readable JSON ({err})") from None
        for t in added:
            if isinstance(t, dict) and (c := _content(t)) and c not in declared:
                declared[c] = int(t["id"])
    for source in (config, read("special_tokens_map.json")):
        for key, value in source.items():
            if not key.endswith("_token") and key not in SPECIAL_TOKEN_LISTS:
                continue
            for v in value if isinstance(value, list) else [value]:
                if (c := _content(v)) and c not in declared:
                    declared[c] = None
    return declared


# A block drafter's MASK slot (DFlash) needs an id of the vocabulary that no text encodes to: SGLang's own name
# for it, the tokenizer's unknown token (never produced by a byte-level BPE: Kimi K2.5's [UNK] 163838 is what
# z-lab's drafter uses), or one of the reserved ids some vocabularies keep.
MASK_TOKEN = "<|MASK|>"


def _unk_token(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            value = (json.loads(path.read_text(encoding="utf-8")) or {}).get("unk_token")
            if content := _content(value):
                return content
    return None


def never_in_text_ids(target_path: str | Path) -> dict[int, str]:
    """The declared tokens of a target's tokenizer that text never encodes to (id -> text): its unknown token,
    SGLang's ``<|MASK|>``, and reserved tokens (``<|reserved_...|>``, ``[unused...]``)."""
    folder = Path(target_path)
    unk = _unk_token(folder)
    out = {}
    for text, i in declared_tokens(folder).items():
        lowered = text.lower()
        if i is not None and (text in (unk, MASK_TOKEN) or "reserved" in lowered or lowered.startswith("[unused")):
            out[i] = text
    return out


def mask_token_id(target_path: str | Path) -> int:
    """The id a block drafter's MASK slots take on this target when drafter.mask_token_id is unset: the tokenizer's
    ``<|MASK|>``, else its unknown token; ValueError naming the setting when it declares neither."""
    folder = Path(target_path)
    declared = declared_tokens(folder)
    unk = _unk_token(folder)
    for text in (MASK_TOKEN, unk):
        if text is not None and declared.get(text) is not None:
            return int(declared[text])
    raise ValueError(
        f"{folder}: its tokenizer declares neither {MASK_TOKEN} nor an unknown token: set drafter.mask_token_id to an "
        "id of the target's vocabulary that no text encodes to (a reserved special token)"
    )


def _template_source(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    if isinstance(t, list):
        return "\n".join(str(v.get("template", "")) for v in t if isinstance(v, dict))
    return t or ""


def _renders(tokenizer) -> list[str]:
    """The template's text for a few probe conversations (each one the template refuses is left out)."""
    user = [{"role": "system", "content": "aerie probe"}, {"role": "user", "content": "aerie probe question"}]
    answered = {"role": "assistant", "content": "aerie probe answer", "reasoning_content": "aerie probe reasoning"}
    called = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [_PROBE_CALL]}
    result = {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "name": "aerie_probe", "content": "ok"}
    probes = [
        (user, True, None),
        (user + [answered], False, None),
        (user + [called, result], True, [_PROBE_TOOL]),
        (user + [called, result, answered], False, [_PROBE_TOOL]),
    ]
    out = []
    for messages, agp, tools in probes:
        try:
            out.append(render_text(tokenizer, messages, add_generation_prompt=agp, tools=tools))
        except Exception:  # noqa: BLE001 - a template may refuse a probe shape; the others still show its markers
            continue
    return out


def template_markers(tokenizer, target_path: str | Path | None = None) -> dict[str, int | None]:
    """The special markers the chat template writes: text -> the id the tokenizer's files declare (None when
    they declare none, e.g. ``<think>`` of a tokenizer that lost it)."""
    loaded = {
        str(getattr(t, "content", t)): int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
    }
    declared = {**loaded, **declared_tokens(target_path)}  # the files win: they say what the model was trained on
    text = "\n".join([_template_source(tokenizer), *_renders(tokenizer)])
    markers = {t: i for t, i in declared.items() if t in text}
    markers.update({m: declared.get(m) for m in REASONING_MARKERS if m in text})
    return dict(sorted(markers.items()))


def check_template_markers(
    tokenizer, target_path: str | Path | None = None, *, as_server: bool = True
) -> dict[str, int]:
    """Each marker of ``template_markers`` -> its one id; TokenizerMarkerError naming every marker the tokenizer
    as loaded splits or renumbers, and the transformers version that loaded it. ``as_server``: check
    ``tokenizer.encode`` too (a freshly loaded tokenizer, as a server encodes; the tokens stage checks only its
    own encoder, which no state left on the tokenizer by earlier calls changes)."""
    enc = TextEncoder(tokenizer)
    found: dict[str, int] = {}
    wrong = []
    for marker, want in template_markers(tokenizer, target_path).items():
        ours = [int(i) for i in enc.encode(marker)]
        server = [int(i) for i in tokenizer.encode(marker, add_special_tokens=False)] if as_server else ours
        if len(ours) == 1 and server == ours and want in (None, ours[0]):
            found[marker] = ours[0]
            continue
        if server != ours:
            how = f"{server} by tokenizer.encode and {ours} by the tokens stage's encoder"
        else:
            how = f"{len(ours)} ids {ours}" if len(ours) != 1 else f"id {ours[0]}"
        declared = f"declared as id {want}" if want is not None else "declared by no tokenizer file"
        wrong.append(f"{marker!r} as {how} ({declared})")
    if wrong:
        where = f"{target_path}: " if target_path else ""
        raise TokenizerMarkerError(
            f"{where}the tokenizer as loaded ({type(tokenizer).__name__}, transformers "
            f"{package_version('transformers')}, tokenizers {package_version('tokenizers')}) does not encode the "
            f"chat template's special markers as one token each, at the id its files declare: {'; '.join(wrong)}. "
            f"Every training sequence would hold other ids than the server's model reads and writes there (some "
            f"transformers 5.x releases are reported to split Kimi K2.5's <think> when they convert its tiktoken "
            f"tokenizer): install a transformers release that loads this tokenizer whole, or fix the tokenizer "
            f"files, then rerun"
        )
    return found


# The target folder's files that make its tokenizer (the check runs again when one changes).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
)


def tokenizer_files(target_path: str | Path) -> list[str]:
    """The files of ``TOKENIZER_FILES`` (and remote tokenizer code, ``tokenization_*.py``) a target folder holds."""
    folder = Path(target_path)
    if not folder.is_dir():
        return []
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    return [str(folder / n) for n in names] + sorted(str(p) for p in folder.glob("tokenization_*.py"))


def write_tokenizer_check(
    target_path: str | Path, out: str | Path, trust_remote_code: bool = False, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Rule ``tokenizer_check``: load the target's tokenizer once, check its markers, write the check file
    (``aerie.tokenizer-check/1``, docs/formats.md); nothing is written when a marker splits."""
    from aerie.target_model.model import load_tokenizer

    tokenizer = load_tokenizer(target_path, trust_remote_code)
    try:
        markers = check_template_markers(tokenizer, target_path)
    except TokenizerMarkerError as err:
        log(f"REFUSED: {err}")
        raise
    record = {
        "format": CHECK_FORMAT,
        "target": str(target_path),
        "tokenizer_class": type(tokenizer).__name__,
        "transformers": package_version("transformers"),
        "tokenizers": package_version("tokenizers"),
        "markers": markers,
    }
    atomic_write_json(Path(out), record)
    log(
        f"{target_path}: the tokenizer as loaded ({record['tokenizer_class']}, transformers {record['transformers']}) "
        f"encodes each of the chat template's {len(markers)} special markers as one id: "
        + ", ".join(f"{m} {i}" for m, i in markers.items())
    )
    return record
