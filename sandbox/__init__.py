"""Sandboxes for running agents: one async protocol, five backends, and nothing leaked.

>>> import sandbox
>>> async with sandbox.create(sandbox.SandboxSpec(image="ares-gateway/agent-base:latest")) as sb:
...     result = await sb.exec("echo hi", timeout=10)

``create(spec, backend="auto")`` picks Docker when an engine answers, else the local backend.
This package depends on no other package of the project.
"""

from __future__ import annotations

from typing import Any

from . import registry
from .errors import (
    ArchiveTooLargeError,
    BackendUnavailableError,
    ExecError,
    FileTransferError,
    ForwardError,
    ImageBuildError,
    NotSupportedError,
    SandboxError,
    SandboxStartError,
    SandboxStateError,
)
from .gc import GcReport, collect_garbage
from .local import LocalSandbox
from .protocol import LIMIT_NAMES, BaseSandbox, ExecResult, Sandbox
from .registry import BACKENDS
from .spec import Resources, SandboxSpec
from .start_rate import limit_start_rate


def backend_class(backend: str) -> type[BaseSandbox]:
    """The sandbox class of ``backend`` (one of :data:`BACKENDS`), e.g. to read its ``remote`` flag."""
    if backend not in registry.REGISTRY:
        raise ValueError(f"unknown sandbox backend {backend!r}: use one of auto, {', '.join(BACKENDS)}")
    return registry.REGISTRY[backend].sandbox_class()


def create(spec: SandboxSpec | None = None, backend: str = "auto", **options: Any) -> BaseSandbox:
    """A new, not yet started sandbox (use ``async with`` or ``await sb.start()``).

    ``backend`` is ``auto`` (Docker when an engine answers, else local), ``local``, ``docker``,
    ``daytona``, ``kubernetes`` or ``modal``; ``options`` go to the backend's constructor.
    """
    spec = spec or SandboxSpec()
    if backend == "auto":
        from .docker import engine_available

        backend = "docker" if engine_available() else "local"
    return backend_class(backend)(spec, **options)


def __getattr__(name: str) -> Any:
    # The backends' classes, imported when first named (their modules bring their SDKs).
    for entry in registry.REGISTRY.values():
        if entry.class_name == name:
            return entry.sandbox_class()
    raise AttributeError(name)


__all__ = [
    "BACKENDS",
    "LIMIT_NAMES",
    "ArchiveTooLargeError",
    "BackendUnavailableError",
    "BaseSandbox",
    "DaytonaSandbox",
    "DockerSandbox",
    "ExecError",
    "ExecResult",
    "FileTransferError",
    "ForwardError",
    "GcReport",
    "ImageBuildError",
    "KubernetesSandbox",
    "LocalSandbox",
    "ModalSandbox",
    "NotSupportedError",
    "Resources",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxStateError",
    "backend_class",
    "collect_garbage",
    "create",
    "limit_start_rate",
]
