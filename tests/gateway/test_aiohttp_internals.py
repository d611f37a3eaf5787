"""The aiohttp private names the gateway's HTTP server relies on exist in the installed aiohttp, and the
server uses no other: an aiohttp release that renames one fails here, by name, before any behaviour test
fails in a way that is hard to read."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web_protocol, web_server

from ares_gateway.http import server as server_mod
from ares_gateway.http.server import AIOHTTP_INTERNALS

ROOT = Path(__file__).resolve().parents[2]


def _holder(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), name)


async def _handler(request: object) -> object:  # pragma: no cover - never called
    raise AssertionError


@pytest.mark.parametrize("holder", sorted(AIOHTTP_INTERNALS))
async def test_every_listed_name_exists_in_the_installed_aiohttp(holder: str) -> None:
    target = _holder(holder)
    if target is web_server.Server:  # its names are set in __init__: look at an instance
        target = web_server.Server(_handler)  # type: ignore[arg-type]
    missing = [n for n in AIOHTTP_INTERNALS[holder] if not hasattr(target, n)]
    assert not missing, (f"aiohttp {aiohttp.__version__} has no {missing} on {holder}: "
                         "ares_gateway/http/server.py must follow the change")


def test_the_parse_error_record_takes_the_fields_the_server_gives_it() -> None:
    params = inspect.signature(web_protocol._ErrInfo).parameters
    assert {"status", "exc", "message"} <= set(params), params


def _private_reads(cls: ast.ClassDef) -> set[str]:
    """``self._x`` names a class reads but neither assigns nor defines: its base class's."""
    used: set[str] = set()
    own: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                used.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(t.attr for t in targets if isinstance(t, ast.Attribute))
        elif isinstance(node, ast.FunctionDef):
            own.add(node.name)
    for node in cls.body:  # names a class declares in __slots__ are its own
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in node.targets):
            own.update(ast.literal_eval(node.value))
    return used - own


def test_the_server_uses_no_private_aiohttp_name_it_does_not_list() -> None:
    tree = ast.parse(Path(server_mod.__file__).read_text())
    bases = {"_Connection": "aiohttp.web_protocol.RequestHandler", "_Server": "aiohttp.web_server.Server"}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for name, base in bases.items():
        unlisted = _private_reads(classes[name]) - set(AIOHTTP_INTERNALS[base])
        assert not unlisted, f"{name} reads {sorted(unlisted)} of {base}: list them in AIOHTTP_INTERNALS"
    module_reads = {n.attr for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == "web_protocol" and n.attr.startswith("_")}
    assert module_reads <= set(AIOHTTP_INTERNALS["aiohttp.web_protocol"]), module_reads


def test_no_other_module_touches_aiohttp_private_names() -> None:
    pattern = re.compile(r"from aiohttp[\w.]* import [^\n]*\b_[A-Za-z]|\b(web_protocol|web_server|"
                         r"web_request|web_response|http_parser|streams|base_protocol)\._[A-Za-z]")
    found = []
    for path in (ROOT / "ares_gateway").rglob("*.py"):
        if path.resolve() == Path(server_mod.__file__).resolve():
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, found


def test_the_check_fails_on_an_unlisted_name() -> None:
    """The AST check above can fail: a class reading a private name of its base is caught."""
    cls = ast.parse("class _Connection:\n    def f(self):\n        self._own = 1\n"
                    "        return self._keepalive, self._own\n").body[0]
    assert isinstance(cls, ast.ClassDef)
    assert _private_reads(cls) == {"_keepalive"}
