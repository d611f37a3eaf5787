"""The packages' import graph: no cycle between modules, and dependencies pointing one way.

Every import is counted, at module level, inside functions (lazy) and under ``TYPE_CHECKING``:
each is a dependency a reader has to follow. ``from pkg import name`` is an import of the module
``pkg.name`` when that is a module, else of ``pkg`` itself; the parent packages Python imports on
the way are not counted (``pkg/__init__.py`` re-exporting its modules would be a cycle with each).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trajectory", "sandbox", "harnesses", "ares_gateway")

# What each package (or part of one) may import of ours, besides itself. A prefix matches a module
# and everything under it; the first matching rule of a module applies.
ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("trajectory", ()),
    ("sandbox", ()),
    ("harnesses", ("sandbox",)),
    # The core knows no wire protocol (the adapters are handed to it: core.wire), no harness and no policy.
    ("ares_gateway.core", ("trajectory",)),
    ("ares_gateway.protocols", ("ares_gateway.core",)),
    ("ares_gateway.tokens", ("trajectory", "ares_gateway.core")),
    ("ares_gateway.engines", ("trajectory", "ares_gateway.core", "ares_gateway.tokens")),
    # Policies know no task format: the oracle asks the task for its command (episodes computes it).
    ("ares_gateway.policies", ("trajectory", "harnesses", "ares_gateway.core", "ares_gateway.protocols",
                               "ares_gateway.tokens", "ares_gateway.engines")),
    ("ares_gateway.http", ("trajectory", "ares_gateway.core", "ares_gateway.protocols")),
    # The viewer reads what the core records and a run writes; it knows a live gateway only by duck type.
    ("ares_gateway.viewer", ("trajectory", "ares_gateway.core", "ares_gateway.protocols",
                             "ares_gateway.episodes.output", "ares_gateway.tokens")),
    ("ares_gateway", PACKAGES),
]


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # The longest known module the dotted name starts with (``import a.b.c`` of a function ``c``).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source)
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for each import the :data:`ALLOWED` rules forbid."""
    out = []
    for module, targets in sorted(graph.items()):
        own, allowed = next((p, a) for p, a in ALLOWED if _within(module, p))
        for target in sorted(targets):
            if not (_within(target, own) or any(_within(target, a) for a in allowed)):
                out.append(f"{module} -> {target}")
    return out


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and graph["ares_gateway.gateway"], "the walk found too few modules or imports"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_dependencies_point_one_way() -> None:
    assert direction_violations(import_graph()) == []


def test_http_and_policies_do_not_import_the_gateway_module() -> None:
    """http/ and policies/ see the gateway through the small protocols they declare."""
    graph = import_graph()
    users = sorted(m for m,
                   t in graph.items() if "ares_gateway.gateway" in t and not _within(m, "ares_gateway.cli"))
    assert [m for m in users if _within(m, "ares_gateway.http") or _within(m, "ares_gateway.policies")] == []


# ---------------------------------------------------------------------- the checks can fail


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        # a lazy import closing the circle
        ({"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import x\n",
          "pkg/b.py": "def f():\n    from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        # a TYPE_CHECKING import, relative
        ({"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
          "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"},
         ["pkg.a", "pkg.b", "pkg.a"]),
        # through a package's re-exports
        ({"pkg/__init__.py": "from pkg.a import A\n", "pkg/a.py": "from pkg.sub import f\n",
          "pkg/sub/__init__.py": "from pkg import A\n"}, ["pkg", "pkg.a", "pkg.sub", "pkg"]),
        ({"pkg/__init__.py": "", "pkg/a.py": "import json\nfrom pkg import b\n", "pkg/b.py": ""}, None),
    ],
)
def test_cycle_finder_on_deliberate_cycles(tmp_path: Path, files: dict[str, str],
                                           cycle: list[str] | None) -> None:
    _write(tmp_path, files)
    assert find_cycle(import_graph(tmp_path, ["pkg"])) == cycle


def test_direction_rules_catch_a_core_module_importing_http() -> None:
    graph = {"ares_gateway.core.broker": {"ares_gateway.http.render", "ares_gateway.core.canonical"},
             "sandbox.local": {"harnesses.base"}, "harnesses.base": {"sandbox"}}
    assert direction_violations(graph) == ["ares_gateway.core.broker -> ares_gateway.http.render",
                                           "sandbox.local -> harnesses.base"]


@pytest.mark.parametrize(("importer", "imported"), [
    # Arrows that must not come back: the core fetching adapters from protocols/, importing every
    # harness for side calls, and the oracle policy importing the task format.
    ("ares_gateway.core.answers", "ares_gateway.protocols"),
    ("ares_gateway.core.recorder", "ares_gateway.protocols"),
    ("ares_gateway.core.side_calls", "harnesses"),
    ("ares_gateway.policies.scripted", "ares_gateway.episodes.tasks"),
    ("ares_gateway.tokens.tokenizer", "ares_gateway.engines"),
])
def test_direction_rules_catch_each_removed_arrow_coming_back(importer: str, imported: str) -> None:
    graph = import_graph()
    graph[importer] = {*graph.get(importer, set()), imported}
    assert f"{importer} -> {imported}" in direction_violations(graph)
