"""The config files as the user wrote them: line numbers, duplicate keys, and schema errors named by file:line.

Snakemake reads ``--configfile`` itself (PyYAML, YAML 1.1) and hands the workflow a merged dict that has forgotten
where each value came from and silently kept the last of two equal keys. At parse time the workflow re-reads the
same files here with a line-tracking loader, so that

- a duplicate key fails, naming both lines;
- every JSON-schema error names the key path, the file and the line that set it (``--config`` values are named as
  such), all errors at once;
- a number that YAML 1.1 read as text (``1e-4``: no decimal point) is explained with how to write it;
- an integer setting refuses ``2.0`` (JSON Schema would accept it, and ``range(2.0)`` would fail hours later).

Torch-free and quick: it runs in every ``snakemake`` invocation and in every job's re-read of the workflow.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match

KeyPath = tuple[Any, ...]  # keys (str) and list indices (int) from the config root

# A schema annotation: the section's defaults come from this dataclass (its fields, in the job), so the schema's
# `default`s document them but are not filled in (tests/test_config.py keeps the two equal).
DEFAULTS_FROM = "x-defaults-from"

# Exponent notation. YAML 1.1 (PyYAML) reads it as a float only with a decimal point and a signed exponent (1.0e-4,
# 2.5e+3); 1e-4, 1E5 and 1.0e4 are text.
_EXPONENT = re.compile(r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$")


class ConfigError(ValueError):
    """A bad configuration value. With ``path`` (the key path it sits at) the message starts with the dotted path,
    and ConfigSources.describe adds the file:line that set it."""

    def __init__(self, message: str, path: KeyPath | None = None):
        super().__init__(f"{dotted(path)}: {message}" if path else message)
        self.detail = message
        self.path = path


def dotted(path: KeyPath) -> str:
    """``("datasets", "chat", "source", "path")`` -> ``datasets.chat.source.path``; list items as ``[i]``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


@dataclass
class ConfigFile:
    """One config file: the line of every key path it sets (1-based; list items by index)."""

    path: Path
    lines: dict[KeyPath, int] = field(default_factory=dict)
    readable: bool = True  # False: this loader could not parse what Snakemake did (no lines, no duplicate check)

    @classmethod
    def read(cls, path: str | Path) -> ConfigFile:
        """Parse ``path`` as Snakemake does (PyYAML's FullLoader, which JSON files also pass through), recording
        lines; a duplicate key raises ConfigError naming both lines."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # Snakemake read it (or failed already): only the lines are lost
            return cls(path, readable=False)
        loader = getattr(yaml, "CFullLoader", yaml.FullLoader)(text)  # libyaml: ~20x faster
        try:
            root = loader.get_single_node()
            out = cls(path)
            if root is not None:
                out._walk(loader, root, ())
            return out
        except yaml.YAMLError:
            return cls(path, readable=False)
        finally:
            loader.dispose()

    def _walk(self, loader: yaml.Loader, node: yaml.Node, path: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; its keys are not the user's
                    continue
                key = loader.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key (a list as a key): Snakemake failed on it already
                    continue
                if first is not None:
                    raise ConfigError(
                        f"{self.path}:{line}: {dotted(path + (key,))}: duplicate key (also set at line {first}); "
                        "YAML keeps only the last one, so the other would be ignored without a word: remove one"
                    )
                seen[key] = line
                self.lines[path + (key,)] = line
                self._walk(loader, value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[path + (i,)] = item.start_mark.line + 1
                self._walk(loader, item, path + (i,))


@dataclass
class ConfigSources:
    """Where the merged config's values came from: the config files in Snakemake's order (later ones override
    earlier ones key by key) and the top-level keys given with ``--config``."""

    files: list[ConfigFile]
    cli_keys: frozenset[str] = frozenset()

    @classmethod
    def read(cls, files: Iterable[str | Path], cli_config: dict[str, Any] | None = None) -> ConfigSources:
        return cls([ConfigFile.read(f) for f in files], frozenset(cli_config or ()))

    def where(self, path: KeyPath | None) -> str:
        """``file:line`` of the value at ``path`` (or of its closest enclosing key that a file sets); ``--config``
        when the command line set it; "" when unknown."""
        if not path:
            return ""
        if path[0] in self.cli_keys:
            return f"--config {path[0]}=..."
        best: tuple[int, ConfigFile, KeyPath] | None = None
        for f in reversed(self.files):  # the last file that sets a key is the one whose value counts
            for n in range(len(path), 0, -1):
                if path[:n] in f.lines:
                    if best is None or n > best[0]:
                        best = (n, f, path[:n])
                    break
        if best is None:
            return ""
        return f"{best[1].path}:{best[1].lines[best[2]]}"

    def describe(self, error: ConfigError) -> str:
        """The error's message with the file:line of the value it names (when it names one)."""
        return self.located(error.detail, error.path) if error.path else str(error)

    def located(self, message: str, path: KeyPath | None) -> str:
        """``file:line: key.path: message`` (compiler style, so editors jump to it); parts that are unknown left out."""
        where = self.where(path)
        if where.startswith("--config"):
            return f"{dotted(path)} (set with {where}): {message}"
        head = ": ".join(p for p in (where, dotted(path) if path else "") if p)
        return f"{head}: {message}" if head else message


@functools.cache
def _strict_validator_class():
    """Draft 2020-12, except that ``integer`` refuses floats such as 2.0 (a config integer feeds range(), a seed,
    a count: the float would fail, or worse be used, in a job hours later). Built once: every parse validates
    the config and each dataset's merged ``responses`` against it."""
    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool)
    )
    return validators.extend(Draft202012Validator, type_checker=checker)


def _strict_validator(schema: dict[str, Any]):
    return _strict_validator_class()(schema)


def _yaml11_number(text: str, integer: bool) -> str:
    """How to write the number ``text`` means so that YAML 1.1 reads it as one."""
    plain = format(Decimal(text), "f")
    if integer:
        return plain.split(".")[0] if Decimal(text) == Decimal(text).to_integral_value() else plain
    mantissa, exponent = re.split("[eE]", text)
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    return f"{mantissa}e{exponent} or {plain}"


def _type_message(instance: Any, expected: str | list[str]) -> str:
    want = [expected] if isinstance(expected, str) else list(expected)
    numeric = any(t in ("number", "integer") for t in want)
    if isinstance(instance, str) and numeric:
        text = instance.strip()
        if _EXPONENT.match(text) and not isinstance(yaml.safe_load(text), float):  # else it was quoted
            return (
                f"{instance!r} is text, not a number: YAML 1.1 (which Snakemake's config reader follows) reads "
                "exponent notation as a number only with a decimal point and a signed exponent. Write "
                + _yaml11_number(text, integer="number" not in want)
            )
        try:
            float(text)
            return f"{instance!r} is text, not a number: write it without quotes"
        except ValueError:
            pass
    names = {
        "integer": "an integer",
        "number": "a number",
        "string": "a string",
        "boolean": "true or false",
        "object": "a mapping of keys",
        "array": "a list",
        "null": "null",
    }
    if "integer" in want and isinstance(instance, float):
        return f"{instance!r} is not an integer (write it without a decimal point)"
    got = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "the text",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }.get(type(instance), type(instance).__name__)
    shown = "" if isinstance(instance, (dict, list)) else f" {instance!r}"
    return f"expected {' or '.join(names.get(t, t) for t in want)}, got {got}{shown}"


def _bound_message(error) -> str:
    v, bound, x = error.validator, error.validator_value, error.instance
    rule = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[v]
    return f"{x!r} is out of range: must be {rule} {bound}"


def _unknown_keys(error) -> Iterator[tuple[KeyPath, str]]:
    known = list(error.schema.get("properties", {}))
    patterns = [re.compile(p) for p in error.schema.get("patternProperties", {})]
    for key in error.instance:
        if key in known or any(p.search(str(key)) for p in patterns):
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        yield tuple(error.absolute_path) + (key,), f"unknown key{hint}; known keys: {', '.join(sorted(known))}"


def _describe(error) -> Iterator[tuple[KeyPath, str]]:
    """One or more (key path, message) for a jsonschema ValidationError, worded for a person editing YAML."""
    path = tuple(error.absolute_path)
    v = error.validator
    if v == "additionalProperties" and isinstance(error.instance, dict):
        yield from _unknown_keys(error)
    elif v == "type":
        yield path, _type_message(error.instance, error.validator_value)
    elif v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        yield path, _bound_message(error)
    elif v == "not" and isinstance(error.validator_value, dict) and "description" in error.validator_value:
        yield path, f"{error.instance!r} is not allowed ({error.validator_value['description']})"
    elif v == "pattern":
        yield path, f"{error.instance!r} does not match {error.validator_value!r}"
    elif v == "enum":
        yield path, f"{error.instance!r} is not one of {', '.join(map(repr, error.validator_value))}"
    elif v in ("oneOf", "anyOf") and error.context:
        # The alternative that got furthest says what is wrong (e.g. a list item out of range); a value of a type
        # that no alternative takes gets every alternative's expected type.
        types = [e.validator_value for e in error.context if e.validator == "type" and not e.relative_path]
        if len(types) == len(error.context):
            flat = [t for ts in types for t in ([ts] if isinstance(ts, str) else ts)]
            yield path, _type_message(error.instance, flat)
        else:
            yield from _describe(best_match(error.context))
    else:
        yield path, error.message


def schema_errors(config: dict[str, Any], schema: dict[str, Any]) -> list[tuple[KeyPath, str]]:
    """Every violation of ``schema`` in ``config`` as (key path, message), in file order of the key paths."""
    found: dict[tuple[KeyPath, str], None] = {}
    for error in _strict_validator(schema).iter_errors(config):
        for item in _describe(error):
            found[item] = None
    return sorted(found, key=lambda item: [str(p) for p in item[0]])


def fill_defaults(config: dict[str, Any], schema: dict[str, Any]) -> None:
    """Set every absent key that has a schema ``default`` (as Snakemake's ``validate`` does), except inside
    sections annotated ``x-defaults-from`` (a dataclass gives those defaults in the job; a filled-in default
    would override what the job computes, such as the threads Snakemake grants)."""
    base = type(_strict_validator(schema))
    properties = base.VALIDATORS["properties"]

    def set_defaults(validator, props, instance, subschema):
        if isinstance(instance, dict) and DEFAULTS_FROM not in subschema:
            for key, sub in props.items():
                if "default" in sub:
                    instance.setdefault(key, copy.deepcopy(sub["default"]))
        yield from properties(validator, props, instance, subschema)

    filler = validators.extend(base, {"properties": set_defaults})
    for _ in filler(schema).iter_errors(config):  # validation already passed; this walk only fills
        pass


def check_against_schema(config: dict[str, Any], schema: dict[str, Any], sources: ConfigSources) -> None:
    """Validate ``config`` (errors name key path, file and line; all of them at once), then fill defaults."""
    errors = schema_errors(config, schema)
    if errors:
        lines = [sources.located(message, path) for path, message in errors]
        head = "1 setting is wrong" if len(lines) == 1 else f"{len(lines)} settings are wrong"
        raise ConfigError(f"{head}:\n  " + "\n  ".join(lines))
    fill_defaults(config, schema)
