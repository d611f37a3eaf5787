"""The modules compiled with mypyc, and the guard that keeps a stale build from running.

``setup.py`` compiles :data:`COMPILED_MODULES` (when a C compiler is there) and
writes ``_native.json``: each module's source hash at build time. In an editable
install the extensions sit next to the sources, and Python imports an extension
before a ``.py`` file of the same name, so an edited source would silently not
run. :func:`install_guard` (called first thing by ``ares_gateway/__init__.py``)
checks the hashes; if any compiled module's source changed since it was built,
it warns and imports every compiled module from its source instead (they call
one another natively, so they fall back together). ``ARES_GATEWAY_PURE=1`` does
the same without a warning: the pure-Python gateway, for debugging or comparing.

Only the standard library here: ``setup.py`` reads :data:`COMPILED_MODULES` from
this file before any dependency is installed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: What an agent turn runs through: HTTP, routing, auth, metrics, parking, the handlers, the wire protocols.
COMPILED_MODULES = (
    "ares_gateway._http",
    "ares_gateway._routing",
    "ares_gateway.sessions",
    "ares_gateway.metrics",
    "ares_gateway.broker",
    "ares_gateway.server",
    "ares_gateway.protocols._common",
    "ares_gateway.protocols.openai_chat",
    "ares_gateway.protocols.anthropic_messages",
    "ares_gateway.protocols.openai_responses",
)

_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds ares_gateway/
MANIFEST = Path(__file__).with_name("_native.json")


def source_path(module: str, root: Path = _ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def _has_extension(module: str, root: Path) -> bool:
    base = source_path(module, root).with_suffix("")
    return any(base.with_name(base.name + suffix).exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def stale_modules(root: Path = _ROOT, manifest: Path | None = None) -> list[str]:
    """Compiled modules whose source differs from what was compiled (or cannot be checked)."""
    built = [m for m in COMPILED_MODULES if _has_extension(m, root)]
    if not built:
        return []
    try:
        hashes = json.loads((manifest or root / "ares_gateway" / "_native.json").read_bytes())
    except (OSError, ValueError):
        hashes = {}  # extensions without a record of their sources: assume they are stale
    return [
        m for m in built if hashes.get(m) != hashlib.sha256(source_path(m, root).read_bytes()).hexdigest()
    ]


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the compiled modules from their ``.py`` sources."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname, self.root))


def install_guard(root: Path = _ROOT) -> None:
    """Import the compiled modules from source when ``ARES_GATEWAY_PURE=1`` or their build is stale."""
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    if os.environ.get("ARES_GATEWAY_PURE") != "1":
        stale = stale_modules(root)
        if not stale:
            return
        warnings.warn(
            f"ares_gateway: {', '.join(stale)} changed since it was compiled, so every compiled module "
            "runs from its source (slower); reinstall (`pip install -e .`) to compile them again",
            RuntimeWarning,
            stacklevel=2,
        )
    sys.meta_path.insert(0, _SourceFinder(root))


def compiled_modules() -> list[str]:
    """The modules of :data:`COMPILED_MODULES` that are imported and running compiled."""
    out = []
    for name in COMPILED_MODULES:
        module = sys.modules.get(name)
        if module is not None and not str(getattr(module, "__file__", "")).endswith(".py"):
            out.append(name)
    return out
