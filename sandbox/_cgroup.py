"""Cgroups for local sandboxes: every process a sandbox starts, in whatever namespace it makes, and
the memory and pids limits of ``spec.resources``.

A sandbox gets ``<base>/<id>/`` in each cgroup hierarchy it uses, its limits on that directory, and
two leaves: ``keeper`` (the long-lived bubblewrap namespace) and ``cmds`` (every command and all it
forks).  A process joins a leaf before it execs (:meth:`SandboxCgroup.join_prefix`), so nothing it
forks can start outside.  ``cgroup.procs`` lists host PIDs whatever PID or user namespace a member
made, and only root of the host can move a process out, so killing the leaf's members (at once with
cgroup v2's ``cgroup.kill``) and waiting until the leaf is empty leaves nothing behind.

Layouts, detected at run time from ``/proc/self/mountinfo``:

* cgroup v2 (``/sys/fs/cgroup`` as ``cgroup2``): one hierarchy for tracking, ``memory.max``,
  ``pids.max``, ``memory.events`` and ``pids.events``; the sandboxes live at its root
  (``ares-sandboxes/``), the only place where controllers can be enabled for new groups whatever
  cgroup the owner process sits in.
* hybrid (v1 controllers plus a v2 hierarchy without them): the v2 one tracks and kills, v1
  ``memory`` and ``pids`` enforce (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
  ``memory.oom_control``, ``pids.max``, ``pids.events``).
* v1 only: the v1 ``pids`` (else ``memory``) hierarchy tracks; killing is SIGKILL rounds.

v1 groups are made under the owner's own cgroup of that hierarchy, so a sandbox never escapes its
owner's limits.  Root is needed; without it (or without cgroups) :func:`layout` is ``None``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

BASE_NAME = "ares-sandboxes"
PARTS = ("keeper", "cmds")
# The shell that puts itself into each cgroup.procs file given, then execs the real command.
_JOIN_SCRIPT = (
    'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || { echo "ares-sandbox: cannot join the sandbox\'s '
    'cgroup $f" >&2; exit 125; }; shift; done; shift; exec "$@"'
)


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy and where this process puts its sandboxes in it."""

    mount: Path
    version: int
    controllers: frozenset[str]  # usable for sandbox groups (v1: those of the mount)
    base: Path

    @property
    def label(self) -> str:
        return f"cgroup v{self.version}"


@dataclass(frozen=True)
class Layout:
    """The hierarchies to use: one to track (and kill) processes, and those enforcing each limit."""

    track: Hierarchy
    memory: Hierarchy | None
    pids: Hierarchy | None


def _mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(root within the hierarchy, mount point, fstype, super options) of each cgroup mount."""
    found: list[tuple[str, Path, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        mountpoint = fields[4].replace("\\040", " ")
        found.append((fields[3], Path(mountpoint), rest[0], set(rest[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``""`` for v2, else each v1 controller name."""
    paths: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            paths[""] = path
        for name in controllers.split(","):
            paths[name] = path
    return paths


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _v2_hierarchy(root: str, mount: Path) -> Hierarchy | None:
    base = mount / BASE_NAME
    try:
        base.mkdir(exist_ok=True)
    except OSError:
        return None
    # Controllers for the sandboxes' groups: enabled in the root's subtree (allowed in the real root
    # whatever processes it holds) and in ours (which never holds any).
    wanted = {"memory", "pids"}
    with contextlib.suppress(OSError):
        available = set((mount / "cgroup.controllers").read_text().split()) & wanted
        enabled = set((mount / "cgroup.subtree_control").read_text().split())
        if available - enabled:
            with contextlib.suppress(OSError):
                _write(mount / "cgroup.subtree_control",
                       " ".join(f"+{c}" for c in sorted(available - enabled)))
    controllers: set[str] = set()
    with contextlib.suppress(OSError):
        controllers = set((base / "cgroup.controllers").read_text().split()) & wanted
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        if controllers - enabled:
            try:
                _write(base / "cgroup.subtree_control",
                       " ".join(f"+{c}" for c in sorted(controllers - enabled)))
            except OSError:
                controllers &= enabled
    return Hierarchy(mount=mount, version=2, controllers=frozenset(controllers), base=base)


def _v1_hierarchy(root: str, mount: Path, controller: str, own: str | None) -> Hierarchy | None:
    parent = mount
    if own is not None:
        rel = own
        if root != "/" and (rel == root or rel.startswith(root.rstrip("/") + "/")):
            rel = rel[len(root.rstrip("/")):]
        candidate = mount / rel.lstrip("/")
        if rel.startswith("/") and candidate.is_dir():
            parent = candidate
    base = parent / BASE_NAME
    try:
        base.mkdir(exist_ok=True)
    except OSError:
        return None
    return Hierarchy(mount=mount, version=1, controllers=frozenset({controller}), base=base)


@cache
def layout() -> Layout | None:
    """What this host offers (root only; ``None`` without cgroups or root). Creates the base dirs."""
    if os.geteuid() != 0:
        return None
    own = _own_paths()
    v2: Hierarchy | None = None
    v1: dict[str, Hierarchy] = {}
    for root, mount, fstype, options in _mounts():
        if fstype == "cgroup2" and v2 is None:
            v2 = _v2_hierarchy(root, mount)
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options and controller not in v1:
                    found = _v1_hierarchy(root, mount, controller, own.get(controller))
                    if found is not None:
                        v1[controller] = found
    memory = v2 if v2 is not None and "memory" in v2.controllers else v1.get("memory")
    pids = v2 if v2 is not None and "pids" in v2.controllers else v1.get("pids")
    track = v2 or pids or memory
    if track is None:
        return None
    return Layout(track=track, memory=memory, pids=pids)


def _read_counts(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                counts[key] = int(value.strip())
    return counts


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _procs(group: Path) -> set[int]:
    try:
        return {int(p) for p in (group / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


@dataclass
class SandboxCgroup:
    """The cgroups of one sandbox: ``dirs`` (``<base>/<id>`` per hierarchy), its limits, its leaves."""

    sandbox_id: str
    dirs: list[Path]
    versions: dict[Path, int]
    memory_dir: Path | None = None
    pids_dir: Path | None = None
    memory: int | None = None
    pids: int | None = None
    killable: bool = False
    _removed: bool = field(default=False, repr=False)

    @classmethod
    def create(cls, sandbox_id: str, lay: Layout, *, memory: int | None, pids: int | None) -> SandboxCgroup:
        """Make the groups and set the limits (``None``: no limit). Raises OSError; undoes itself then."""
        hierarchies = [lay.track]
        if memory is not None and lay.memory is not None and lay.memory not in hierarchies:
            hierarchies.append(lay.memory)
        if pids is not None and lay.pids is not None and lay.pids not in hierarchies:
            hierarchies.append(lay.pids)
        group = cls(sandbox_id, [], {})
        try:
            for h in hierarchies:
                d = h.base / sandbox_id
                d.mkdir()
                group.dirs.append(d)
                group.versions[d] = h.version
                if memory is not None and h is lay.memory:
                    group.memory_dir, group.memory = d, memory
                    if h.version == 2:
                        _write(d / "memory.max", str(memory))
                        if (d / "memory.swap.max").exists():
                            _write(d / "memory.swap.max", "0")
                    else:
                        _write(d / "memory.limit_in_bytes", str(memory))
                        if (d / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                            _write(d / "memory.memsw.limit_in_bytes", str(memory))
                if pids is not None and h is lay.pids:
                    group.pids_dir, group.pids = d, pids
                    _write(d / "pids.max", str(pids))
                for part in PARTS:
                    (d / part).mkdir()
            group.killable = lay.track.version == 2 and (group.dirs[0] / "cmds" / "cgroup.kill").exists()
        except BaseException:
            group.remove(timeout=5)
            raise
        return group

    @classmethod
    def from_record(cls, sandbox_id: str, record: dict[str, object]) -> SandboxCgroup:
        """The groups a sandbox recorded (see :meth:`record`), for garbage collection by another process."""
        raw = record.get("dirs")
        dirs = [Path(str(d)) for d in raw] if isinstance(raw, list) else []
        versions = {d: 2 if (d / "cgroup.kill").exists() or (d / "cgroup.events").exists() else 1
                    for d in dirs}
        group = cls(sandbox_id, [d for d in dirs if d.name == sandbox_id], versions)
        group.killable = any(v == 2 for v in versions.values())
        return group

    def record(self) -> str:
        return json.dumps({"id": self.sandbox_id, "dirs": [str(d) for d in self.dirs]})

    def join_prefix(self, part: str) -> list[str]:
        """An argv prefix that puts the command into ``part`` of every hierarchy, then execs it."""
        files = [str(d / part / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", _JOIN_SCRIPT, "sh", *files, "--"]

    def members(self, part: str | None = None) -> set[int]:
        """Host PIDs of the live processes in ``part`` (``None``: every part) of every hierarchy."""
        found: set[int] = set()
        for d in self.dirs:
            for name in (part,) if part else PARTS:
                found |= _procs(d / name)
        return found

    def kill(self, part: str | None) -> None:
        """SIGKILL everything in ``part`` (``None``: the whole sandbox) once: ``cgroup.kill`` where
        there is one (forks in flight included), else each member listed now."""
        if self.killable:
            target = self.dirs[0] / part if part else self.dirs[0]
            with contextlib.suppress(OSError):
                _write(target / "cgroup.kill", "1")
                return
        for pid in self.members(part):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def limits_reached(self) -> set[str]:
        """``memory`` if the OOM killer killed in the sandbox; ``pids`` if a fork was refused.

        Each group and its leaves are read: v1 counts an event in the group of the task it hit
        (a leaf), v2 in the group whose limit it hit and (newer kernels) its ancestors."""
        hit: set[str] = set()
        if self.memory_dir is not None:
            for group in self._with_leaves(self.memory_dir):
                if self.versions.get(self.memory_dir) == 2:
                    events = _read_counts(group / "memory.events")
                    if events.get("oom_kill", 0) > 0 or events.get("oom_group_kill", 0) > 0:
                        hit.add("memory")
                    continue
                control = _read_counts(group / "memory.oom_control")
                if control.get("oom_kill", 0) > 0 or control.get("under_oom", 0) > 0:
                    hit.add("memory")
                elif "oom_kill" not in control and _read_int(group / "memory.failcnt") > 0:
                    hit.add("memory")  # an old kernel without the oom_kill count
        if self.pids_dir is not None:
            for group in self._with_leaves(self.pids_dir):
                if _read_counts(group / "pids.events").get("max", 0) > 0:
                    hit.add("pids")
        return hit

    @staticmethod
    def _with_leaves(d: Path) -> list[Path]:
        return [d, *(d / part for part in PARTS)]

    def remove(self, timeout: float = 10.0) -> list[str]:
        """Kill everything in the sandbox's groups, wait until they are empty, and remove them
        (leaves first).  Returns what could not be removed (never raises)."""
        deadline = time.monotonic() + timeout
        while self.members() and time.monotonic() < deadline:
            self.kill(None)
            time.sleep(0.01)
        left: list[str] = []
        for d in self.dirs:
            for leaf in (*[d / p for p in PARTS], d):
                while True:
                    try:
                        leaf.rmdir()
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        # EBUSY: members (or their exit) not gone yet.
                        if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                            time.sleep(0.01)
                            continue
                        left.append(f"{leaf}: {exc.strerror}")
                        break
                    break
        self._removed = not left
        return left

    def describe(self) -> str:
        track = self.dirs[0] if self.dirs else None
        how = "cgroup.kill" if self.killable else "SIGKILL rounds"
        version = self.versions.get(track, 1) if track is not None else 1
        return f"processes tracked by cgroup v{version} ({how})"


def spare_from_oom(pids: list[int]) -> list[str]:
    """Make these processes the OOM killer's last choice (``oom_score_adj`` -1000; lowering it needs
    CAP_SYS_RESOURCE).  Returns what failed, one ``"PID: error"`` each (empty: all spared)."""
    failed = []
    for pid in pids:
        try:
            _write(Path(f"/proc/{pid}/oom_score_adj"), "-1000")
        except OSError as exc:
            failed.append(f"{pid}: {exc.strerror or exc}")
    return failed


def leftover_dirs(sandbox_id: str) -> list[Path]:
    """``<base>/<sandbox_id>`` in each hierarchy of this host's layout that still exists."""
    lay = layout()
    if lay is None:
        return []
    bases = {h.base for h in (lay.track, lay.memory, lay.pids) if h is not None}
    return [b / sandbox_id for b in bases if (b / sandbox_id).is_dir()]
