"""Sandboxes for running agents: one async protocol, three backends, and nothing leaked.

>>> import sandbox
>>> async with sandbox.create(sandbox.SandboxSpec(image="ares-gateway/agent-base:latest")) as sb:
...     result = await sb.exec("echo hi", timeout=10)

``create(spec, backend="auto")`` picks Docker when an engine answers, else the local backend.
This package depends on no other package of the project.
"""

from __future__ import annotations

from typing import Any

from .errors import (
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
from .spec import Resources, SandboxSpec

BACKENDS = ("local", "docker", "daytona", "kubernetes", "modal")


def create(spec: SandboxSpec | None = None, backend: str = "auto", **options: Any) -> BaseSandbox:
    """A new, not yet started sandbox (use ``async with`` or ``await sb.start()``).

    ``backend`` is ``auto`` (Docker when an engine answers, else local), ``local``, ``docker``,
    ``daytona``, ``kubernetes`` or ``modal``; ``options`` go to the backend's constructor.
    """
    spec = spec or SandboxSpec()
    if backend == "auto":
        from .docker import engine_available

        backend = "docker" if engine_available() else "local"
    if backend == "local":
        return LocalSandbox(spec, **options)
    if backend == "docker":
        from .docker import DockerSandbox

        return DockerSandbox(spec, **options)
    if backend == "daytona":
        from .daytona import DaytonaSandbox

        return DaytonaSandbox(spec, **options)
    if backend == "kubernetes":
        from .kubernetes import KubernetesSandbox

        return KubernetesSandbox(spec, **options)
    if backend == "modal":
        from .modal import ModalSandbox

        return ModalSandbox(spec, **options)
    raise ValueError(f"unknown sandbox backend {backend!r}: use one of auto, {', '.join(BACKENDS)}")


def __getattr__(name: str) -> Any:
    # The container backends import their SDKs lazily, so `import sandbox` stays cheap.
    if name == "DockerSandbox":
        from .docker import DockerSandbox

        return DockerSandbox
    if name == "DaytonaSandbox":
        from .daytona import DaytonaSandbox

        return DaytonaSandbox
    if name == "KubernetesSandbox":
        from .kubernetes import KubernetesSandbox

        return KubernetesSandbox
    if name == "ModalSandbox":
        from .modal import ModalSandbox

        return ModalSandbox
    raise AttributeError(name)


__all__ = [
    "BACKENDS",
    "LIMIT_NAMES",
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
    "collect_garbage",
    "create",
]
