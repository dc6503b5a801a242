"""The synthetic task language (``source.kind: synthetic``), deterministic from a seed: the demo target is
pre-trained on it (aerie.targets.demo) and the demo's prompts come from it.

A tiny model cannot learn natural text in a few CPU minutes (see the demo-target note), but it can learn a
structured language whose outputs depend on the prompt: worked arithmetic, step-by-step list transforms,
and descriptions of Python functions that look like HumanEval prompts. Every example is a user message,
a reasoning (the "thinking", sampled after the prompt's `<think>`) and a one-line answer.

Public API (the prompt sources, the demo and rehearsal builders): FAMILIES, TaskExample, make_example,
generate_prompts, describe_code_instruction.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

FAMILIES: tuple[str, ...] = ("arith", "lists", "code")


@dataclass(frozen=True)
class TaskExample:
    family: str
    user: str  # the user message
    reasoning: str  # text between <think> and </think>
    answer: str  # text after </think>, before <|im_end|>


def make_example(family: str, rng: random.Random) -> TaskExample:
    """One example of ``family``, drawn with ``rng`` (same rng state -> same example)."""
    makers = {"arith": _arith, "lists": _lists, "code": _code}
    if family not in makers:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    user, reasoning, answer = makers[family](rng)
    return TaskExample(family, user, reasoning, answer)


def generate_prompts(families: Sequence[str], n: int, seed: int) -> list[dict]:
    """``n`` prompts, round-robin over ``families``; prompt ``i`` depends only on (family, seed, i)."""
    families = list(families)
    if not families:
        raise ValueError("generate_prompts needs at least one family")
    prompts = []
    for i in range(n):
        family = families[i % len(families)]
        ex = make_example(family, example_rng(family, seed, i))
        prompts.append({"id": f"{family}-{seed}-{i}", "family": family, "user": ex.user})
    return prompts


def example_rng(family: str, seed: int, index: int) -> random.Random:
    # String seeds hash with sha512, so this is stable across processes and Python versions.
    return random.Random(f"aerie-task/{family}/{seed}/{index}")


def describe_code_instruction(code: str) -> str:
    """The user message of the `code` family; HumanEval prompts are wrapped with it too."""
    return (
        "Describe the last function in this code: its name, parameters and return type.\n\n"
        f"```python\n{code.strip(chr(10))}\n```"
    )


# ---------------------------------------------------------------------------------------------------
# arith: "Compute 37 + 48 * 2." -> "48 * 2 = 96. 37 + 96 = 133." -> "The answer is 133."

_ARITH_ASK = ("Compute {}.", "What is {}?", "Evaluate {}.", "Calculate {}.", "Work out {}.")


def _arith(rng: random.Random) -> tuple[str, str, str]:
    n_ops = rng.choice((1, 2, 2, 3, 3))
    nums = [rng.randint(1, 99)]
    ops = []
    for _ in range(n_ops):
        op = rng.choice("++-*")
        ops.append(op)
        # Small right factors keep products readable (two digits times a single digit or so).
        nums.append(rng.randint(2, 12) if op == "*" else rng.randint(1, 99))
    # Sometimes bracket one adjacent pair: it is evaluated first, which changes the order of steps.
    paren = rng.randrange(n_ops) if n_ops > 1 and rng.random() < 0.3 else None

    text = ""
    for i, x in enumerate(nums):
        if i:
            text += f" {ops[i - 1]} "
        text += ("(" if paren == i else "") + str(x) + (")" if paren is not None and paren + 1 == i else "")

    steps = []

    def apply(i: int) -> None:
        a, op, b = nums[i], ops[i], nums[i + 1]
        c = a + b if op == "+" else a - b if op == "-" else a * b
        steps.append(f"{a} {op} {b} = {c}.")
        nums[i : i + 2] = [c]
        del ops[i]

    if paren is not None:
        apply(paren)
    while "*" in ops:  # multiplication before addition, left to right
        apply(ops.index("*"))
    while ops:
        apply(0)
    return rng.choice(_ARITH_ASK).format(text), " ".join(steps), f"The answer is {nums[0]}."


# ---------------------------------------------------------------------------------------------------
# lists: sort, reverse, max/min, sum, dedupe - each with a step per element.


def _fmt(xs: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, xs)) + "]"


def _lists(rng: random.Random) -> tuple[str, str, str]:
    op = rng.choice(("sort", "sort_desc", "reverse", "max", "min", "sum", "dedupe"))
    k = rng.randint(3, 7)
    if op == "sum":
        xs = [rng.randint(1, 20) for _ in range(k)]
    elif op == "dedupe":
        pool = [rng.randint(0, 30) for _ in range(rng.randint(2, k - 1))]
        xs = pool + [rng.choice(pool) for _ in range(k - len(pool))]  # at least one repeat
        rng.shuffle(xs)
    else:
        xs = [rng.randint(0, 60) for _ in range(k)]
    L = _fmt(xs)

    if op in ("sort", "sort_desc"):
        desc = op == "sort_desc"
        out = sorted(xs, reverse=desc)
        user = rng.choice(
            (
                f"Sort {L} in {'descending' if desc else 'ascending'} order.",
                f"Sort the list {L} from {'largest to smallest' if desc else 'smallest to largest'}.",
            )
        )
        first = "The largest is" if desc else "The smallest is"
        reasoning = " ".join([f"{first} {out[0]}."] + [f"Next is {x}." for x in out[1:]])
        return user, reasoning, f"The sorted list is {_fmt(out)}."
    if op == "reverse":
        out = xs[::-1]
        user = rng.choice((f"Reverse the list {L}.", f"Write {L} backwards."))
        reasoning = " ".join([f"The last item is {out[0]}."] + [f"Then {x}." for x in out[1:]])
        return user, reasoning, f"The reversed list is {_fmt(out)}."
    if op in ("max", "min"):
        big = op == "max"
        word = "largest" if big else "smallest"
        user = rng.choice((f"Find the {word} number in {L}.", f"What is the {word} value in {L}?"))
        best, steps = xs[0], [f"Start with {xs[0]}."]
        for x in xs[1:]:
            if (x > best) if big else (x < best):
                best = x
                steps.append(f"{x} is {'larger' if big else 'smaller'}, keep {x}.")
            else:
                steps.append(f"{x} is not {'larger' if big else 'smaller'}.")
        return user, " ".join(steps), f"The {word} number is {best}."
    if op == "sum":
        user = rng.choice((f"Add up the numbers in {L}.", f"What is the sum of {L}?"))
        total, steps = xs[0], []
        for x in xs[1:]:
            steps.append(f"{total} + {x} = {total + x}.")
            total += x
        return user, " ".join(steps), f"The sum is {total}."
    # dedupe: keep first occurrences in order
    user = rng.choice((f"Remove duplicates from {L}.", f"Keep only the first copy of each number in {L}."))
    seen: list[int] = []
    steps = []
    for x in xs:
        if x in seen:
            steps.append(f"{x} is a repeat, skip it.")
        else:
            seen.append(x)
            steps.append(f"Keep {x}.")
    return user, " ".join(steps), f"The result is {_fmt(seen)}."


# ---------------------------------------------------------------------------------------------------
# code: describe the last function of a HumanEval-like snippet (imports, typed or untyped signature,
# docstring with a sentence and examples). Word lists written for this project.

_VERBS = (
    "count",
    "find",
    "sum",
    "filter",
    "sort",
    "check",
    "get",
    "make",
    "remove",
    "split",
    "merge",
    "parse",
    "encode",
    "decode",
    "compute",
    "select",
    "rotate",
    "flip",
    "reverse",
    "collect",
    "order",
    "match",
    "shift",
    "group",
    "join",
    "strip",
    "scale",
    "round",
    "pick",
    "rank",
    "search",
    "validate",
    "convert",
)
_ADJS = (
    "max",
    "min",
    "longest",
    "shortest",
    "even",
    "odd",
    "prime",
    "unique",
    "common",
    "sorted",
    "nested",
    "positive",
    "negative",
    "closest",
    "first",
    "last",
    "total",
    "special",
    "balanced",
    "digit",
    "upper",
)
_NOUNS = (
    "numbers",
    "words",
    "vowels",
    "digits",
    "elements",
    "pairs",
    "string",
    "list",
    "values",
    "sum",
    "product",
    "average",
    "palindrome",
    "prefix",
    "suffix",
    "index",
    "count",
    "groups",
    "letters",
    "parens",
    "intervals",
    "primes",
    "divisors",
    "squares",
    "chars",
    "tokens",
    "keys",
    "items",
    "score",
)
_PARAMS = (
    "numbers",
    "values",
    "text",
    "string",
    "words",
    "n",
    "k",
    "m",
    "x",
    "y",
    "threshold",
    "items",
    "lst",
    "arr",
    "s",
    "delimiter",
    "grid",
    "key",
    "prefix",
    "substring",
    "limit",
    "base",
    "a",
    "b",
    "nums",
    "strings",
    "factor",
    "start",
    "end",
    "capacity",
    "word",
    "interval",
)
_TYPES = (
    "int",
    "int",
    "float",
    "str",
    "str",
    "bool",
    "List[int]",
    "List[int]",
    "List[str]",
    "List[float]",
    "Tuple[int, int]",
    "Dict[str, int]",
    "Optional[int]",
    "list",
)
_RETURNS = _TYPES + ("Tuple[int, int]", "Optional[str]", "List[Tuple[int, int]]")
_DOC_GIVEN = ("Given", "For", "You are given", "Input to this function is", "Take")
_DOC_WHAT = (
    "return the number of {adj} {noun}",
    "return True if the {noun} is {adj}, and False otherwise",
    "return the {adj} {noun} found in it",
    "return a list of all {adj} {noun}",
    "find the {adj} {noun} and return it",
    "compute the {noun} of the {adj} elements",
    "return the {noun} sorted by {adj} value",
    "check whether every element is {adj}",
)
_DOC_EXTRA = (
    "If the input is empty, return None.",
    "The order of the elements must be kept.",
    "Ignore any spaces in the input string.",
    "Note: the input is always valid.",
    "You may assume that {p} is not negative.",
    "",
    "",
)


def _sample_value(type_: str, rng: random.Random) -> str:
    """A plausible Python literal for a type (examples only have to look right)."""
    word = lambda: rng.choice(("apple", "hello", "abc", "xyz", "world", "moon", "cat", "dog"))  # noqa: E731
    if type_ in ("int", "Optional[int]"):
        return str(rng.randint(-5, 40))
    if type_ == "float":
        return f"{rng.randint(0, 9)}.{rng.randint(0, 9)}"
    if type_ in ("str", "Optional[str]"):
        return repr(word())
    if type_ == "bool":
        return rng.choice(("True", "False"))
    if type_ == "List[float]":
        return "[" + ", ".join(f"{rng.randint(0, 9)}.{rng.randint(0, 9)}" for _ in range(rng.randint(0, 4))) + "]"
    if type_ == "List[str]":
        return "[" + ", ".join(repr(word()) for _ in range(rng.randint(0, 3))) + "]"
    if type_ == "Tuple[int, int]":
        return f"({rng.randint(0, 9)}, {rng.randint(0, 9)})"
    if type_ == "List[Tuple[int, int]]":
        return "[" + ", ".join(f"({rng.randint(0, 9)}, {rng.randint(0, 9)})" for _ in range(rng.randint(0, 3))) + "]"
    if type_ == "Dict[str, int]":
        return "{" + ", ".join(f"{word()!r}: {rng.randint(0, 9)}" for _ in range(rng.randint(0, 2))) + "}"
    return "[" + ", ".join(str(rng.randint(0, 20)) for _ in range(rng.randint(0, 5))) + "]"  # List[int], list


def _func_name(rng: random.Random) -> str:
    parts = [rng.choice(_VERBS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_ADJS))
    parts.append(rng.choice(_NOUNS))
    if rng.random() < 0.15:
        parts.insert(0, rng.choice(("is", "has", "can", "all", "any")))
    return "_".join(parts)


def _code(rng: random.Random) -> tuple[str, str, str]:
    typed = rng.random() < 0.6  # HumanEval mixes annotated and bare signatures
    name = _func_name(rng)
    params = rng.sample(_PARAMS, rng.randint(1, 4))
    types = [rng.choice(_TYPES) for _ in params]
    ret = rng.choice(_RETURNS) if typed else None

    lines: list[str] = []
    if rng.random() < 0.15:  # a helper defined first, as in some HumanEval prompts: describe the LAST one
        helper, hp = _func_name(rng), rng.choice(_PARAMS)
        lines += [
            f"def {helper}({hp}{': ' + rng.choice(_TYPES) if typed else ''}):",
            f'    """ {rng.choice(_DOC_GIVEN)} {hp}, {rng.choice(_DOC_WHAT).format(adj=rng.choice(_ADJS), noun=rng.choice(_NOUNS))}. """',  # noqa: E501 - one f-string keeps the RNG draw order
            f"    return {rng.choice(('len', 'sorted', 'sum', 'set', 'list'))}({hp})",
            "",
            "",
        ]

    sig = ", ".join(f"{p}: {t}" if typed else p for p, t in zip(params, types))
    lines.append(f"def {name}({sig})" + (f" -> {ret}:" if typed else ":"))
    sentence = (
        f"{rng.choice(_DOC_GIVEN)} {', '.join(params[:2])}, "
        + rng.choice(_DOC_WHAT).format(adj=rng.choice(_ADJS), noun=rng.choice(_NOUNS))
        + "."
    )
    extra = rng.choice(_DOC_EXTRA).format(p=params[0])
    ret_type = ret or rng.choice(_RETURNS)
    example_args = lambda: ", ".join(_sample_value(t, rng) for t in types)  # noqa: E731
    n_ex = rng.randint(1, 3)
    if typed or rng.random() < 0.5:
        lines.append(f'    """ {sentence}')
        if extra:
            lines.append(f"    {extra}")
        for _ in range(n_ex):
            lines += [f"    >>> {name}({example_args()})", f"    {_sample_value(ret_type, rng)}"]
    else:
        lines += [
            '    """',
            f"    {sentence}",
            f"    {extra}" if extra else "    ",
            "",
            f"    {rng.choice(('Examples:', 'For example:', 'Example:'))}",
        ]
        for _ in range(n_ex):
            lines.append(f"    {name}({example_args()}) == {_sample_value(ret_type, rng)}")
    lines.append('    """')

    body = "\n".join(lines)
    header = []
    typing_names = [t for t in ("List", "Tuple", "Dict", "Optional") if t + "[" in body]
    if typing_names:
        header.append(f"from typing import {', '.join(typing_names)}")
    if rng.random() < 0.15:
        header.append(rng.choice(("import math", "import re", "import string")))
    code = "\n".join(header + ["", ""] if header else [""]) + "\n" + body + "\n"

    # The reasoning repeats the signature verbatim (copying is what a small model learns fastest, and it
    # works the same on real HumanEval prompts), then restates name, parameter count and return type.
    signature = f"{name}({sig})" + (f" -> {ret}" if typed else "")
    plural = "parameter" if len(params) == 1 else "parameters"
    reasoning = f"The signature is {signature}. The name is {name}. It takes {len(params)} {plural}. " + (
        f"It returns {ret}." if typed else "The return type is not annotated."
    )
    answer = f"In short: {name}({', '.join(params)}) returns {ret if typed else 'an unannotated value'}."
    return describe_code_instruction(code), reasoning, answer
