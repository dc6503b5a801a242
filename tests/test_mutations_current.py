"""tests/mutations.py stays applicable: every mutation's original text occurs exactly once in its file (a refactor
that moves or rewrites the code it breaks must update the harness, or this fails), the broken text differs from
it, and every test it names exists. Reads files only; runs no mutation."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO
from mutations import GROUPS, MUTATIONS


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_mutation_applies_to_todays_code(name: str) -> None:
    rel, old, new, tests = MUTATIONS[name]
    text = (REPO / rel).read_text()
    assert text.count(old) == 1, f"{name}: the original text occurs {text.count(old)} times in {rel}"
    assert new and new != old, name
    # the harness puts the code back by replacing the first occurrence of the broken text: it must be its own
    assert text.replace(old, new).find(new) == text.find(old), f"{name}: the broken text occurs earlier in {rel}"
    assert tests, name
    if rel.endswith(".py"):
        ast.parse(text.replace(old, new), rel)  # the mutant still parses: a test fails on behaviour, not syntax
    for node in tests:
        path, _, func = node.partition("::")
        source = (REPO / path).read_text()
        assert f"def {func}(" in source, f"{name}: {node} does not exist"


def test_every_mutation_is_in_a_group() -> None:
    assert sorted(n for g in GROUPS.values() for n in g) == sorted(MUTATIONS)
