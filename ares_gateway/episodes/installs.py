"""Agent CLIs installed once on this host for local sandboxes (what ``run`` and ``demo`` do before
their episodes start; ``python3 -m harnesses.provision`` does the same by hand).

Processes installing the same agent version into the same root at once take turns: each holds a
lock file (``<root>/<name>/.<version>.lock``, ``flock``) while it installs, and one that waited finds
the finished install and reuses it. An install goes into a fresh directory beside its final place
(``<root>/<name>/.<version>.<random>``) and is published, once complete, by atomically renaming a
symlink ``<root>/<name>/<version>`` onto it: a reader sees the whole install or none. The directory
itself is not moved because virtual environments and npm prefixes hold their absolute paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import AsyncIterator

from harnesses import registry
from harnesses.base import INSTALL_ROOT

__all__ = ["ensure_local_install", "install_root"]

#: How often a process waiting for another's install checks the lock (seconds).
_LOCK_POLL = 0.1


async def ensure_local_install(
    harness: str, *, version: str | None = None, quiet: bool = False, root: str | None = None
) -> str:
    """Make the harness's CLI available to local sandboxes once, before many episodes start.

    Returns the install root to give the harness: ``/opt/ares-agents`` when it holds the pinned
    version or is writable (installed there now), else a per-user cache directory (which local
    sandboxes see read-only); ``root`` names the one root to use instead. The harness's own install
    steps do the work (in a non-isolated local sandbox as this user, as ``python3 -m
    harnesses.provision`` does); without this each isolated local sandbox would install its own copy.
    Concurrent calls (in this process or others) install once: the others wait and reuse it. A failed
    install raises the harness's :class:`~harnesses.HarnessInstallError`, whose message names the
    step and its output, and leaves nothing published.
    """
    probe = registry.create(harness, version=version)
    candidates = [root] if root is not None else _install_candidates()
    found = await asyncio.to_thread(_install_root, probe.name, probe.version, candidates)
    if found is not None:
        return found
    chosen = next((r for r in candidates if _writable(r)), candidates[-1])
    parent = os.path.join(chosen, probe.name)
    os.makedirs(parent, exist_ok=True)
    async with _flocked(os.path.join(parent, f".{probe.version}.lock")):
        if _complete(chosen, probe.name, probe.version):  # another process installed it while we waited
            return chosen
        if not quiet:
            print(f"installing {probe.name} {probe.version} under {chosen} (once; later runs reuse it) ...",
                  flush=True)
        await _install_here(probe.name, probe.version, chosen)
    return chosen


@contextlib.asynccontextmanager
async def _flocked(path: str) -> AsyncIterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (polled, so waiting stays cancellable); the kernel
    drops it if this process dies, so a crashed installer never blocks the next one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(_LOCK_POLL)
        yield
    finally:
        os.close(fd)  # releases the lock


async def _install_here(name: str, version: str, root: str) -> None:
    """Install into a fresh directory and publish it; the caller holds the lock."""
    from harnesses import HarnessContext
    from sandbox import LocalSandbox, SandboxSpec

    parent = os.path.join(root, name)
    final = os.path.join(parent, version)
    _remove_leftovers(parent, version)
    staging = os.path.join(parent, f".{version}.{uuid.uuid4().hex[:12]}")
    try:
        async with LocalSandbox(SandboxSpec(), isolate=False) as sb:
            h = registry.create(name, version=version, user=None, install_root=root)
            ctx = HarnessContext(workdir=sb.workdir, session_id="install-" + uuid.uuid4().hex[:8],
                                 base_url="http://127.0.0.1:9", token="unused")
            await h.prepare(sb, ctx)
            await h.install_at(sb, staging)
        _publish(staging, final)
    except BaseException:
        _remove(staging)
        raise


def _remove_leftovers(parent: str, version: str) -> None:
    """Under the lock every unpublished sibling is the leftover of an installer that died."""
    final = os.path.join(parent, version)
    published = os.path.realpath(final) if os.path.islink(final) else None
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if entry.startswith(f".{version}.") and not entry.endswith(".lock") and path != published:
            _remove(path)


def _publish(staging: str, final: str) -> None:
    """Point ``final`` at ``staging`` in one rename (an older incomplete install there is removed)."""
    old = None
    if os.path.islink(final):
        old = os.path.realpath(final)
    elif os.path.lexists(final):  # an incomplete install made in place (no marker, checked under the lock)
        old = f"{final}.stale-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    link = f"{staging}.link"
    os.symlink(os.path.basename(staging), link)
    os.replace(link, final)
    if old is not None and old != os.path.realpath(staging):
        _remove(old)


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _complete(root: str, name: str, version: str) -> bool:
    return os.path.isfile(os.path.join(root, name, version, ".ares-complete"))


def _install_candidates() -> list[str]:
    return [INSTALL_ROOT, os.path.join(os.path.expanduser("~"), ".cache", "ares-gateway", "agents")]


def _install_root(name: str, version: str, candidates: list[str] | None = None) -> str | None:
    for root in candidates if candidates is not None else _install_candidates():
        if _complete(root, name, version):
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
