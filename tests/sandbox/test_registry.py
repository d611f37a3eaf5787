"""The backend registry: one entry per backend module, each entry true to its module; and the helpers the
backends share."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sandbox
from sandbox import registry
from sandbox.errors import BackendUnavailableError
from sandbox.gc import collect_garbage
from sandbox.protocol import BaseSandbox
from sandbox.spec import format_size, parse_size

PACKAGE = Path(sandbox.__file__).parent


@pytest.mark.parametrize("name", registry.BACKENDS)
def test_every_entry_names_its_class_and_gc_functions(name: str) -> None:
    entry = registry.get(name)
    cls = entry.sandbox_class()
    assert issubclass(cls, BaseSandbox) and cls.__name__ == entry.class_name
    module = entry.load()
    assert callable(module.gc_candidates) and callable(module.gc_remove)
    assert sandbox.backend_class(name) is cls
    assert getattr(sandbox, entry.class_name) is cls  # the package root's lazy names


def test_every_backend_module_is_registered() -> None:
    """A module that defines gc_candidates is a backend: it has an entry, so `gc` and `create` find it."""
    defining = set()
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "gc_candidates" for n in tree.body):
            defining.add(path.stem)
    assert defining == {e.module for e in registry.REGISTRY.values()}
    assert sandbox.BACKENDS == registry.BACKENDS == ("local", "docker", "daytona", "kubernetes", "modal")


def test_an_unknown_backend_is_refused_with_the_names_there_are() -> None:
    for call in (lambda: sandbox.backend_class("podman"), lambda: collect_garbage(["podman"]),
                 lambda: sandbox.create(backend="podman")):
        with pytest.raises(ValueError) as info:
            call()
        assert "'podman'" in str(info.value)
        assert all(name in str(info.value) for name in registry.BACKENDS), info.value


def test_a_missing_sdk_names_the_extra() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        registry.import_sdk("no_such_sdk_module", backend="Nimbus", extra="nimbus")
    assert str(info.value) == ("the Nimbus backend needs the no_such_sdk_module package: "
                               "pip install 'ares-gateway[nimbus]'")
    with pytest.raises(BackendUnavailableError):
        registry.import_sdk("json", backend="Json", extra="json", submodules=("no_such_part",))
    sdk = registry.import_sdk("json", backend="Json", extra="json", submodules=("decoder",))
    assert sdk.__name__ == "json"


def test_importing_the_package_imports_no_container_or_cloud_backend() -> None:
    code = ("import sys, sandbox; sandbox.collect_garbage; "
            "print(sorted(m for m in sys.modules if m in ('sandbox.docker', 'sandbox.daytona', "
            "'sandbox.kubernetes', 'sandbox.modal', 'docker', 'daytona', 'modal', 'kubernetes_asyncio')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("n", [0, 1000, 1 << 10, 256 << 20, 3 << 29, 8 << 30, (1 << 30) + 1])
def test_sizes_read_back_as_they_were_set(n: int) -> None:
    text = format_size(n)
    assert parse_size(text.replace(" bytes", "").replace(" ", "")) == n, text


def test_size_formats() -> None:
    assert [format_size(n) for n in (256 << 20, 3 << 29, 1000, (1 << 30) + 1)] == [
        "256 MiB", "1.5 GiB", "1000 bytes", "1073741825 bytes"]
