"""The package's shape: imports run one way, and parse-time code never pays for torch.

Layers (a module may import from its own layer or a lower one, never a higher one):
  0  aerie.artifacts                      atomic publishing, packed safetensors, JSONL
  1  aerie.formats.*, aerie.target_model.*      one module per on-disk format; everything about the target model
  2  everything else (the stages, the drafter, the API client, benchmarks, prompt sources)
  3  the planning layer: aerie.plan, aerie.config_file, aerie.disk, aerie.fit, aerie.time_preview (the config,
     the shard plan, the previews); it resolves a run's settings and hands them down (aerie.api.settings.ApiRun
     for the API job)
and no import cycle anywhere, counting imports inside functions too. Within layer 2 the API package never reads
prompt sources (aerie.prompts & co. price prompts with aerie.api.money, so they sit above it): its jobs get their
prompts from the prompt shards (aerie.formats.prompts) and the plan's resolved settings.
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


PLANNING = ("aerie.plan", "aerie.config_file", "aerie.disk", "aerie.fit", "aerie.time_preview")
PROMPT_SOURCES = ("aerie.prompts", "aerie.prompt_sources", "aerie.prompt_cache")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def layer(module: str) -> int:
    if module == "aerie.artifacts":
        return 0
    if _in(module, ("aerie.formats", "aerie.target_model")):
        return 1
    if _in(module, PLANNING):
        return 3
    return 2


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer into a higher one, and from the API package into the prompt sources."""
    wrong = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in graph.items()
        for d in deps
        if layer(d) > layer(m)
    ]
    wrong += [
        f"{m} imports {d}: the API package gets its settings and prompts from the plan (aerie.api.settings)"
        for m, deps in graph.items()
        if _in(m, ("aerie.api",))
        for d in deps
        if _in(d, PROMPT_SOURCES)
    ]
    return wrong


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = upward_imports(import_graph())
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_refuses_the_api_climbing_to_the_plan() -> None:
    """The direction issue 31 fixed: the API job reading the plan or the prompt sources is an upward import."""
    graph = import_graph()
    assert "aerie.api.job" in graph and not (graph["aerie.api.job"] & {"aerie.plan", "aerie.prompts"})
    assert upward_imports({"aerie.api.job": {"aerie.plan"}}) == ["aerie.api.job (layer 2) imports aerie.plan (layer 3)"]
    assert len(upward_imports({"aerie.api.preview": {"aerie.prompts"}})) == 1
    assert len(upward_imports({"aerie.drafter.loop": {"aerie.fit"}, "aerie.formats.hidden": {"aerie.hidden"}})) == 2
    assert upward_imports({"aerie.plan": {"aerie.api.settings"}, "aerie.api.job": {"aerie.formats.prompts"}}) == []


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
    assert {"aerie.plan", "aerie.config_file", "aerie.api.preview", "aerie.disk"} <= set(modules), modules
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
