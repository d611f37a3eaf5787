"""Agent CLIs installed once on this host for local sandboxes (what ``run`` and ``demo`` do before
their episodes start; ``python3 -m harnesses.provision`` does the same by hand)."""

from __future__ import annotations

import asyncio
import os
import uuid

from harnesses import registry
from harnesses.base import INSTALL_ROOT

__all__ = ["ensure_local_install", "install_root"]


async def ensure_local_install(harness: str, *, version: str | None = None, quiet: bool = False) -> str:
    """Make the harness's CLI available to local sandboxes once, before many episodes start.

    Returns the install root to give the harness: ``/opt/ares-agents`` when it holds the pinned
    version or is writable (installed there now), else a per-user cache directory (which local
    sandboxes see read-only). The harness's own install steps do the work (in a non-isolated local
    sandbox as this user, as ``python3 -m harnesses.provision`` does); without this each isolated
    local sandbox would install its own copy. A failed install raises the harness's
    :class:`~harnesses.HarnessInstallError`, whose message names the step and its output.
    """
    probe = registry.create(harness, version=version)
    root = await asyncio.to_thread(_install_root, probe.name, probe.version)
    if root is not None:
        return root
    candidates = _install_candidates()
    root = next((r for r in candidates if _writable(r)), candidates[-1])
    if not quiet:
        print(f"installing {probe.name} {probe.version} under {root} (once; later runs reuse it) ...", flush=True)
    await _install_here(probe.name, probe.version, root)
    return root


async def _install_here(name: str, version: str, root: str) -> None:
    from harnesses import HarnessContext
    from sandbox import LocalSandbox, SandboxSpec

    async with LocalSandbox(SandboxSpec(), isolate=False) as sb:
        h = registry.create(name, version=version, user=None, install_root=root)
        ctx = HarnessContext(workdir=sb.workdir, session_id="install-" + uuid.uuid4().hex[:8],
                             base_url="http://127.0.0.1:9", token="unused")
        await h.prepare(sb, ctx)
        await h.install(sb)


def _install_candidates() -> list[str]:
    return [INSTALL_ROOT, os.path.join(os.path.expanduser("~"), ".cache", "ares-gateway", "agents")]


def _install_root(name: str, version: str) -> str | None:
    for root in _install_candidates():
        if os.path.isfile(os.path.join(root, name, version, ".ares-complete")):
            return root
    return None


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)




def install_root(harness: str, *, version: str | None = None) -> str | None:
    """Where the harness's pinned version is installed for local sandboxes, or ``None``."""
    probe = registry.create(harness, version=version)
    return _install_root(probe.name, probe.version)
