"""The mypyc build of the request path: it is what runs, and a stale build never does."""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ares_gateway import _native
from ares_gateway._native import COMPILED_MODULES, compiled_modules, stale_modules

_EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


def _fake_build(root: Path, sources: dict[str, bytes], built: list[str], record: dict[str, bytes] | None) -> None:
    for module, text in sources.items():
        path = _native.source_path(module, root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
        if module in built:
            path.with_name(path.stem + _EXT).write_bytes(b"\x7fELF")
    if record is not None:
        (root / "ares_gateway" / "_native.json").write_text(
            json.dumps({m: hashlib.sha256(t).hexdigest() for m, t in record.items()})
        )


def test_stale_modules_compares_sources_with_what_was_compiled(tmp_path: Path) -> None:
    a, b = COMPILED_MODULES[0], COMPILED_MODULES[-1]
    sources = {a: b"x = 1\n", b: b"y = 2\n"}
    # Nothing compiled: nothing stale, whatever the record says.
    _fake_build(tmp_path, sources, [], None)
    assert stale_modules(tmp_path) == []
    # Compiled from these very sources.
    _fake_build(tmp_path, sources, [a, b], sources)
    assert stale_modules(tmp_path) == []
    # One source edited after the build.
    _native.source_path(b, tmp_path).write_bytes(b"y = 3\n")
    assert stale_modules(tmp_path) == [b]
    # Extensions without a record cannot be vouched for.
    (tmp_path / "ares_gateway" / "_native.json").unlink()
    assert stale_modules(tmp_path) == [a, b]


def _probe(env: dict[str, str]) -> tuple[list[str], str]:
    code = (
        "import importlib, json\n"
        "from ares_gateway import _native\n"
        "for m in _native.COMPILED_MODULES: importlib.import_module(m)\n"
        "print(json.dumps(_native.compiled_modules()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _built() -> bool:
    return any(
        _native.source_path(m).with_name(_native.source_path(m).stem + s).exists()
        for m in COMPILED_MODULES
        for s in importlib.machinery.EXTENSION_SUFFIXES
    )


@pytest.mark.skipif(not _built(), reason="a pure-Python install (no C compiler at build time)")
def test_pure_switch_runs_every_compiled_module_from_source() -> None:
    running, _ = _probe({"ARES_GATEWAY_PURE": "1"})
    assert running == []
    running, stderr = _probe({"ARES_GATEWAY_PURE": "0"})
    if stale_modules():  # sources edited since the build: all from source, and a warning that says so
        assert running == []
        assert "changed since it was compiled" in stderr
    else:
        assert running == list(COMPILED_MODULES)


@pytest.mark.skipif(os.environ.get("ARES_CI") != "1", reason="CI builds with a C compiler; elsewhere it may not")
def test_ci_tests_the_compiled_build() -> None:
    # The suite must exercise what users run: a build that quietly fell back to pure Python fails here.
    for m in COMPILED_MODULES:
        importlib.import_module(m)
    if os.environ.get("ARES_GATEWAY_PURE") == "1":
        assert compiled_modules() == []
    else:
        assert compiled_modules() == list(COMPILED_MODULES)
