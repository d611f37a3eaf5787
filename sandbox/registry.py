"""The sandbox backends, one entry each: where its class is, how to import its SDK, and its garbage
collection.

A backend is a module of this package that defines

* its sandbox class (a :class:`~sandbox.protocol.BaseSandbox`), named in its entry;
* ``gc_candidates() -> list[tuple[str, dict[str, str]]]``: every sandbox of this backend on this machine
  or account, as ``(ref, labels)``, its owner's labels (:mod:`sandbox.janitor`) among them; an empty list
  when the backend is not reachable;
* ``gc_remove(ref) -> None``: remove one of them.

Modules are imported when first used: the container and cloud backends bring their SDKs, so
``import sandbox`` stays cheap. ``tests/sandbox/test_registry.py`` checks every entry against its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import BackendUnavailableError

if TYPE_CHECKING:
    from .protocol import BaseSandbox


@dataclass(frozen=True)
class Backend:
    """One sandbox backend: its name (``backend=`` everywhere), its module and its class's name."""

    name: str
    module: str
    class_name: str

    def load(self) -> ModuleType:
        """The backend's module (imported now if it was not)."""
        return importlib.import_module(f"{__package__}.{self.module}")

    def sandbox_class(self) -> type[BaseSandbox]:
        cls: type[BaseSandbox] = getattr(self.load(), self.class_name)
        return cls

    def gc_candidates(self) -> list[tuple[str, dict[str, str]]]:
        candidates: Callable[[], list[tuple[str, dict[str, str]]]] = self.load().gc_candidates
        return candidates()

    def gc_remove(self, ref: str) -> None:
        self.load().gc_remove(ref)


_ENTRIES = (
    Backend("local", "local", "LocalSandbox"),
    Backend("docker", "docker", "DockerSandbox"),
    Backend("daytona", "daytona", "DaytonaSandbox"),
    Backend("kubernetes", "kubernetes", "KubernetesSandbox"),
    Backend("modal", "modal", "ModalSandbox"),
)
#: Every backend by name, in the order the docs list them.
REGISTRY: dict[str, Backend] = {b.name: b for b in _ENTRIES}
#: The backends' names.
BACKENDS: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> Backend:
    """The entry of backend ``name``; ``ValueError`` naming the backends there are otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown sandbox backend {name!r}: use one of {', '.join(BACKENDS)}") from None


def import_sdk(module: str, *, backend: str, extra: str, submodules: tuple[str, ...] = ()) -> Any:
    """Import a backend's SDK (and its ``submodules``), or raise :class:`BackendUnavailableError`
    naming the extra that installs it."""
    try:
        sdk = importlib.import_module(module)
        for sub in submodules:
            importlib.import_module(f"{module}.{sub}")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {backend} backend needs the {module} package: pip install 'ares-gateway[{extra}]'"
        ) from exc
    return sdk


__all__ = ["BACKENDS", "REGISTRY", "Backend", "get", "import_sdk"]
