"""Saved workspaces: the agent's final workdir of each episode, kept in the run directory.

At an episode's end, before its tests run, the archive of the agent's workdir that fresh grading
makes anyway (:func:`~ares_gateway.episodes.verifier.copy_workspace`) is written to
``OUT/workspaces/<task>.<attempt>.tar`` instead of a temporary file (``[verifier] sandbox = "agent"``:
the workdir is archived for this alone, :func:`save_from_sandbox`). It is bounded by the same cap as
grading (:func:`~ares_gateway.episodes.verifier.workspace_limit`); a workdir over it is **cut**: the
saved archive holds the members that fit, ends cleanly, and the episode says
``workspace_truncated: true``. The archive is written as ``<name>.tar.part`` and renamed once sealed
(:func:`seal`), so a run killed while saving leaves no file that looks whole.

:func:`check_archive` tells a whole archive from a damaged one without unpacking it (the archive is the
agent's: nothing in it is ever extracted on this host); ``ares-gateway reverify``
(:mod:`~ares_gateway.episodes.reverify`) grades a saved workspace again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ares_gateway.episodes.result import EpisodeResult

log = logging.getLogger(__name__)

__all__ = ["WORKSPACES_DIR", "SavedWorkspace", "check_archive", "cut_archive", "note", "part_path", "prepare",
           "save_from_sandbox", "seal", "seal_async", "workspace_file"]

#: The run directory's folder of saved workspaces.
WORKSPACES_DIR = "workspaces"
_BLOCK = 512


def workspace_file(task: str, attempt: int) -> str:
    """The saved workspace's path relative to the run directory: ``workspaces/<task>.<attempt>.tar``
    (the task's name made safe the way the run's other per-episode files are)."""
    from ares_gateway.episodes.output import episode_key

    return f"{WORKSPACES_DIR}/{episode_key(task, attempt)}.tar"


def part_path(final: str | os.PathLike[str]) -> Path:
    """Where the archive is written before it is sealed: ``<final>.part``."""
    return Path(f"{os.fspath(final)}.part")


@dataclass
class SavedWorkspace:
    """What saving one episode's workspace gave: the sealed file (``None`` when nothing was saved), its
    size, whether it was cut at the cap, and why it could not be saved (``error``)."""

    path: Path | None = None
    bytes: int | None = None
    truncated: bool = False
    error: str | None = None


def check_archive(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a whole tar archive (unreadable, a header cut short, a member's data past the
    end of the file, no end-of-archive blocks), or ``None`` when it is one. Reads the headers only and
    extracts nothing."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if size == 0:
        return "it is empty"
    if size % _BLOCK:
        return f"its size ({size} bytes) is not a whole number of 512-byte tar blocks: it was cut short"
    end = 0
    try:
        with tarfile.open(p, mode="r:") as tar:
            for member in tar:
                data_end = member.offset_data + (member.size if member.isreg() else 0)
                if data_end > size:
                    return f"the data of {member.name!r} runs past the end of the file: it was cut short"
                end = data_end + (-data_end % _BLOCK)
    except (tarfile.TarError, OSError, EOFError) as exc:
        return f"it is not a readable tar archive: {exc}"
    with open(p, "rb") as fh:
        fh.seek(end)
        marker = fh.read(2 * _BLOCK)
    if len(marker) < 2 * _BLOCK or marker.strip(b"\0"):
        return "it has no end-of-archive blocks after its last member: it was cut short"
    return None


def cut_archive(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, limit: int) -> tuple[int, int]:
    """Copy the whole members at the start of the (possibly cut short) tar ``src`` into a proper tar
    ``dst`` of at most ``limit`` bytes, stopping at the first member that is damaged or does not fit.
    Returns (bytes written, members kept). Nothing is extracted: each member's data passes through a
    bounded temporary file."""
    kept = 0
    with open(src, "rb") as fin, tarfile.open(dst, mode="w", format=tarfile.GNU_FORMAT) as tout:
        # close() adds the end-of-archive blocks (two) and pads to a whole record.
        room = (limit // tarfile.RECORDSIZE) * tarfile.RECORDSIZE - 2 * _BLOCK
        tin = None
        try:
            tin = tarfile.open(fileobj=fin, mode="r|")
            for member in tin:
                data = tin.extractfile(member) if member.isreg() else None
                need = _BLOCK * 3 + (member.size + (-member.size % _BLOCK) if member.isreg() else 0)
                if tout.offset + need > room:
                    break
                with tempfile.SpooledTemporaryFile(max_size=8 << 20) as buf:
                    if data is not None:
                        shutil.copyfileobj(data, buf, 1 << 20)
                        if buf.tell() != member.size:
                            break
                        buf.seek(0)
                    tout.addfile(member, buf if data is not None else None)
                kept += 1
        except (tarfile.TarError, OSError, EOFError):
            pass  # the damaged tail: what came before it is kept
        finally:
            if tin is not None:
                with contextlib.suppress(Exception):
                    tin.close()
    return Path(dst).stat().st_size, kept


def seal(part: Path, final: Path, *, limit: int, too_large: bool = False, error: str | None = None,
         episode: str = "", whole: bool = False) -> SavedWorkspace:
    """Turn the archive written to ``part`` into the saved workspace ``final``: a whole archive is
    renamed as it is; one cut short (``too_large``: the workdir passed the cap; else the copy failed
    partway) is cut to its whole members within ``limit`` bytes and marked ``truncated``, with a line
    in the log. ``error`` (the copy's) is kept when nothing could be saved. ``whole``: the archive is
    known to be whole (it was made without an error), so it is not read again (reading the headers of
    20,000 files takes ~1.6 s). Never raises."""
    try:
        if not part.exists():
            return SavedWorkspace(error=error or "no archive of the workdir was made")
        damage = None if whole else check_archive(part)
        if damage is None and not too_large:
            os.replace(part, final)
            return SavedWorkspace(final, final.stat().st_size)
        size, kept = cut_archive(part, final, limit=limit)
        part.unlink(missing_ok=True)
        why = (f"the workdir passes the cap of {limit} bytes" if too_large
               else f"its archive was incomplete ({damage or error})")
        log.warning("workspace of %s truncated: %s; saved the first %d member(s), %d bytes, to %s",
                    episode or final.name, why, kept, size, final)
        return SavedWorkspace(final, size, truncated=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        return SavedWorkspace(error=f"saving the workspace to {final} failed: {exc}")


def prepare(final: Path) -> tuple[Path | None, str | None]:
    """The ``.part`` path to write ``final``'s archive to (its folder made), or ``None`` and why not."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        part = part_path(final)
        part.unlink(missing_ok=True)
    except OSError as exc:
        return None, f"cannot write the workspace to {final.parent}: {exc.strerror or exc}"
    return part, None


async def seal_async(part: Path, final: Path, *, limit: int, too_large: bool = False,
                     error: str | None = None, episode: str = "", whole: bool = False) -> SavedWorkspace:
    """:func:`seal` in a thread (it reads the archive's headers, and may copy it)."""
    return await asyncio.to_thread(seal, part, final, limit=limit, too_large=too_large, error=error,
                                   episode=episode, whole=whole)


def note(out: EpisodeResult | None, saved: SavedWorkspace, uid: str | None = None) -> None:
    """Put what saving gave onto an episode's :class:`~ares_gateway.episodes.result.EpisodeResult`
    (``None``: nothing)."""
    if out is None:
        return
    out.workspace = str(saved.path) if saved.path is not None else None
    out.workspace_bytes = saved.bytes
    out.workspace_truncated = saved.truncated
    out.workspace_error = saved.error
    out.workspace_uid = uid


async def save_from_sandbox(sb: Any, workdir: str, final: Path, *, limit: int,
                            episode: str = "") -> SavedWorkspace:
    """Archive ``workdir`` of the started sandbox ``sb`` into ``final`` (``[verifier] sandbox = "agent"``,
    where no grading copy is made); cut at ``limit`` bytes. Never raises."""
    from sandbox import SandboxError
    from sandbox.errors import ArchiveTooLargeError

    part, why = prepare(final)
    if part is None:
        return SavedWorkspace(error=why)
    try:
        await sb.archive_dir(workdir, part, limit=limit)
    except ArchiveTooLargeError:
        return await seal_async(part, final, limit=limit, too_large=True, episode=episode)
    except (SandboxError, OSError) as exc:
        return await seal_async(part, final, limit=limit, episode=episode,
                                error=f"archiving the workdir {workdir} failed: {exc}")
    return await seal_async(part, final, limit=limit, episode=episode, whole=True)
