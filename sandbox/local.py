"""``LocalSandbox``: the embedded default, needs no service.

Each sandbox gets a private directory (``$ARES_SANDBOX_LOCAL_ROOT`` or ``/tmp/ares-sandboxes``, then
the sandbox id) holding its workspace and its ``/tmp``.  Commands run in their own session and process
group with an environment scrubbed to what the spec passes (plus ``PATH`` and ``HOME`` defaults and
``ARES_SANDBOX_ID``, by which leftover processes are found and killed).

When bubblewrap (``bwrap``) is installed and works, commands run inside it: the host filesystem
read-only, the workspace bind-mounted read-write at the spec's ``workdir``, a private ``/tmp``, fresh
``/dev`` and ``/proc`` and a private PID namespace (``network="none"`` also unshares the network).
Without it there is NO isolation, only a private working directory, and :attr:`description` says so.

``SandboxSpec(hardened=True)`` (bubblewrap and root needed) shows the sandbox only the system
directories, ``/opt/ares-agents`` and ``spec.readonly_paths`` read-only, plus its workdir, ``/tmp`` and
``/home`` (where an ``agent`` user, uid :data:`AGENT_UID`, has its home) writable; a non-root user runs
with no capabilities, an empty bounding set and ``no_new_privs``; root runs with :data:`ROOT_CAPS`
only, ``HOME=/root`` (an empty private directory) and an environment that loads nothing the agent
wrote (:meth:`LocalSandbox._command_env`); every command, root's included, runs under
:func:`seccomp_filter` (loaded by :mod:`sandbox._confine` in front of ``nsenter``); file transfers run
inside the sandbox (as root there, with the same limits), so a symlink the agent plants never
redirects them onto the host.
``forward()`` runs :mod:`sandbox._relay` on the host inside the sandbox's network namespace only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import posixpath
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import _cgroup as cgroups
from . import _disk as loopdisk
from . import janitor
from ._hardening import (
    CONFINE_SCRIPT,
    DROP_PRIVS,
    FILTER_FILE,
    HARDENED_SYSTEM_PATHS,
    ROOT_CAPS,
    ROOT_ENV_DROP,
    ROOT_ENV_DROP_PREFIXES,
    ROOT_PRIVS,
    SECCOMP_DENIED,
    SECCOMP_NOSYS,
    bwrap_available,
    host_etc_secrets,
    root_binds,
    seccomp_filter,
)
from ._local_process import LocalProcess, group_alive, start_time
from .errors import ExecError, FileTransferError, ForwardError, SandboxStartError
from .protocol import (
    BaseSandbox,
    ExecResult,
    extract_single_file,
    extract_tar,
    filter_tar,
    tar_directory,
    tar_single_file,
)
from .spec import SandboxSpec, format_size

log = logging.getLogger(__name__)
#: Whether this process has said that a keeper could not be spared from the OOM killer.
_oom_warned = False

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ID_VAR = "ARES_SANDBOX_ID"
# Relays carry their own tag: kill_processes() spares them, stop() and gc remove them.
_RELAY_VAR = "ARES_SANDBOX_RELAY"
_OWNER_FILE = "owner.json"
# Which cgroups a sandbox made (read by gc when its owner died), and where its disk image lives.
_CGROUP_FILE = "cgroups.json"
_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
_CWD_MISSING = 201
_CWD_MARK = "ares-exec: no such directory: "

# The threads that set a sandbox's cgroups and disk up (start() waits for one even when cancelled).
_LIMITS_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ares-sandbox-limits")

AGENT_USER = "agent"
AGENT_UID = 1000


def local_root() -> Path:
    return Path(os.environ.get("ARES_SANDBOX_LOCAL_ROOT") or "/tmp/ares-sandboxes")


def _kill_tagged_processes(sandbox_id: str, var: str = _ID_VAR) -> int:
    """SIGKILL every process whose environment carries ``ARES_SANDBOX_ID=<sandbox_id>`` (or ``var``)."""
    needle = f"{var}={sandbox_id}".encode()
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


class LocalSandbox(BaseSandbox):
    backend = "local"
    # Set up by _start (root and bubblewrap): the sandbox's cgroups and its disk; what of
    # spec.resources is enforced (name -> how) and what is not (name -> why).
    _cgroup: cgroups.SandboxCgroup | None = None
    _disk: loopdisk.LoopDisk | None = None
    _enforced: dict[str, str] | None = None
    _unenforced: dict[str, str] | None = None

    def __init__(self, spec: SandboxSpec | None = None, *, isolate: bool | None = None) -> None:
        super().__init__(spec)
        self.isolated = bwrap_available() if isolate is None else isolate
        if self.isolated and not bwrap_available():
            raise SandboxStartError(
                "isolate=True needs bubblewrap: apt-get install bubblewrap (and user namespaces)")
        self.root = local_root() / self.id
        self._pgids: set[int] = set()
        # With bubblewrap and root: one long-lived PID/mount namespace per sandbox (a "keeper"), which
        # commands join with nsenter, so that processes a command leaves in the background survive it.
        self._keeper: subprocess.Popen[bytes] | None = None
        self._ns_pid: int | None = None
        self._ns_init: int | None = None
        self._relays: list[subprocess.Popen[bytes]] = []
        self._users: dict[str, pwd.struct_passwd] = {}
        # The keeper's processes (bwrap, the namespace's init, its sleep) as the host started them:
        # pid -> start time.  kill_processes() spares a pid only while it is still that very process.
        self._keeper_ids: dict[int, int] = {}
        #: Why the keeper could not be spared from the OOM killer (None: it was, or there was no need).
        self.oom_note: str | None = None

    @property
    def hardened(self) -> bool:
        return self.spec.hardened

    @property
    def _isolation_description(self) -> str:
        if self.isolated and self.hardened:
            return (
                f"local sandbox {self.id} in {self.root} (bubblewrap, hardened: only system directories and "
                f"/opt/ares-agents read-only, private {self.spec.workdir}, /tmp and /home, PID "
                "namespace, non-root "
                "users without capabilities, root with a reduced capability set and a clean "
                "environment, a seccomp "
                f"filter on every command, network={self.spec.network})"
            )
        if self.isolated:
            return (
                f"local sandbox {self.id} in {self.root} (bubblewrap: read-only host filesystem, private "
                f"{self.spec.workdir} and /tmp, PID namespace, network={self.spec.network})"
            )
        return (
            f"local sandbox {self.id} in {self.root} WITHOUT ISOLATION (bubblewrap not available): commands "
            "run as host processes with a private working directory and a scrubbed environment only"
        )

    @property
    def workdir(self) -> str:
        return self.spec.workdir if self.isolated else str(self.root / "work")

    @property
    def description(self) -> str:
        return f"{self._isolation_description}; {self._limits_description()}"

    @property
    def limits_enforced(self) -> frozenset[str]:
        """Which of ``memory``, ``pids`` and ``disk`` of ``spec.resources`` this sandbox enforces (after
        start)."""
        return frozenset(self._enforced or ())

    def _limits_description(self) -> str:
        if self._cgroup is not None:
            text = f"{self._cgroup.describe()}, nested namespaces included"
        elif self.isolated and self._ns_pid is not None:
            text = ("processes tracked by PID namespace only (no cgroup: a nested PID namespace escapes "
                    "kill_processes)")
        else:
            text = f"processes tracked by their {_ID_VAR} variable only (no cgroup)"
        if self._enforced:
            text += "; limits enforced: " + ", ".join(f"{k} {v}" for k, v in sorted(self._enforced.items()))
        if self._unenforced:
            text += "; limits NOT enforced: " + ", ".join(f"{k} ({v})" for k,
                                                          v in sorted(self._unenforced.items()))
        if self._enforced is None and any(self._wanted_limits().values()):
            text += "; limits not set up (not started)"
        if self.oom_note:
            text += f"; {self.oom_note}"
        return text

    def _wanted_limits(self) -> dict[str, int | None]:
        res = self.spec.resources
        return {"memory": res.memory_bytes, "pids": res.pids, "disk": res.disk_bytes}

    # -- paths -------------------------------------------------------------------------------------
    def _host_path(self, remote: str) -> Path:
        """Where a path inside the sandbox lives on the host."""
        remote = posixpath.normpath(remote)
        work_roots = {self.spec.workdir, str(self.root / "work")}
        for base in work_roots:
            if remote == base or remote.startswith(base.rstrip("/") + "/"):
                rel = posixpath.relpath(remote, base)
                return (self.root / "work" / rel).resolve() if rel != "." else self.root / "work"
        if self.isolated and (remote == "/tmp" or remote.startswith("/tmp/")):
            return self.root / "tmp" / posixpath.relpath(remote, "/tmp")
        return Path(remote)

    # -- lifecycle -------------------------------------------------------------------------------
    async def _start(self) -> None:
        if self.spec.network not in ("host", "none"):
            raise SandboxStartError(
                f"the local backend supports network 'host' or 'none', not {self.spec.network!r}")
        if self.spec.network == "none" and not self.isolated:
            raise SandboxStartError(
                "network='none' needs bubblewrap for the local backend: apt-get install bubblewrap")
        if self.hardened:
            if not self.isolated:
                raise SandboxStartError(
                    "SandboxSpec(hardened=True) needs bubblewrap: apt-get install bubblewrap")
            if os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"):
                raise SandboxStartError(
                    "SandboxSpec(hardened=True) on the local backend needs root and nsenter/setpriv "
                    "(util-linux): run as root, or use the docker backend"
                )
        owner = json.dumps({"id": self.id, "labels": self.labels()})
        try:
            self.root.mkdir(parents=True, exist_ok=False)
            (self.root / _OWNER_FILE).write_text(owner)
        except OSError as exc:
            raise SandboxStartError(
                f"cannot create the local sandbox directory {self.root}: {exc}; set ARES_SANDBOX_LOCAL_ROOT "
                "to a writable directory"
            ) from exc
        # Limits first: the cgroups are recorded beside owner.json (gc finds them), then the disk is
        # mounted over the sandbox's directory, and everything it writes is made on it.
        setup = _LIMITS_POOL.submit(self._set_up_limits, owner)
        try:
            await asyncio.wrap_future(setup)
        except asyncio.CancelledError:
            # A setup already running goes on in its thread: wait for it (a mkfs and a mount at most),
            # else start()'s cleanup runs first and the disk it then mounts outlives the sandbox.
            concurrent.futures.wait([setup])
            raise
        try:
            (self.root / "work").mkdir(exist_ok=False)
            (self.root / "tmp").mkdir(mode=0o1777)
            os.chmod(self.root / "tmp", 0o1777)
        except OSError as exc:
            raise SandboxStartError(f"cannot create the local sandbox directory {self.root}: {exc}") from exc
        if self.hardened:
            self._write_user_db()
            # The sandbox's own copy of the filter, outside every bind (the agent never sees it); built
            # here so that a missing libseccomp fails start(), saying what to install.
            (self.root / FILTER_FILE).write_bytes(seccomp_filter())
        if self.isolated and os.geteuid() == 0 and shutil.which("nsenter"):
            # Spawned from the loop's own thread: bwrap --die-with-parent ties the namespace to it.
            # in the sandbox's "keeper" cgroup: kill_processes() spares it, stop() does not
            self._start_keeper()
            if self._cgroup is not None and self._cgroup.memory is not None:
                # Never the OOM killer's pick (tiny anyway): its death would end the sandbox's namespace.
                failed = cgroups.spare_from_oom(list(self._keeper_ids))
                if failed:
                    self.oom_note = (
                        f"its keeper is NOT spared from the OOM killer (writing oom_score_adj failed: "
                        f"{failed}; lowering it needs CAP_SYS_RESOURCE): an agent that fills the memory "
                        "limit may end the sandbox's namespace")
                    # Once per process at warning level (it is the host's doing, the same for every
                    # sandbox); each sandbox's description says it too.
                    global _oom_warned
                    log.log(logging.DEBUG if _oom_warned else logging.WARNING, "sandbox %s: %s", self.id,
                            self.oom_note)
                    _oom_warned = True

    def _set_up_limits(self, owner: str) -> None:
        """The cgroups (tracking; memory and pids) and the disk of this sandbox, where root and the host
        allow."""
        wanted = self._wanted_limits()
        self._enforced, self._unenforced = {}, {}
        layout = cgroups.layout() if self.isolated and os.geteuid() == 0 else None
        if layout is not None:
            try:
                self._cgroup = cgroups.SandboxCgroup.create(self.id, layout, memory=wanted["memory"],
                                                           pids=wanted["pids"])
                (self.root / _CGROUP_FILE).write_text(self._cgroup.record())
            except OSError as exc:
                raise SandboxStartError(f"cannot create the cgroups of sandbox {self.id}: {exc}") from exc
        for name in ("memory", "pids"):
            value = wanted[name]
            if value is None:
                continue
            hier = None if layout is None else (layout.memory if name == "memory" else layout.pids)
            if hier is not None:
                self._enforced[name] = f"{format_size(value) if name == 'memory' else value} ({hier.label})"
            elif not self.isolated:
                self._unenforced[name] = "needs bubblewrap"
            elif os.geteuid() != 0:
                self._unenforced[name] = "needs root"
            else:
                self._unenforced[name] = f"no usable {name} cgroup controller"
        disk = wanted["disk"]
        if disk is None:
            return
        reason = "needs bubblewrap" if not self.isolated else loopdisk.unavailable_reason()
        if reason is not None:
            self._unenforced["disk"] = reason
            return
        self._disk = loopdisk.LoopDisk(_disk_image(self.id), self.root, disk)
        try:
            self._disk.create()
            # The mount hides what was written beneath: again on the sandbox's own filesystem.
            (self.root / _OWNER_FILE).write_text(owner)
            if self._cgroup is not None:
                (self.root / _CGROUP_FILE).write_text(self._cgroup.record())
        except OSError as exc:
            raise SandboxStartError(
                f"cannot make the {format_size(disk)} disk of sandbox {self.id}: {exc}") from exc
        self._enforced["disk"] = f"{format_size(disk)} (own ext4 filesystem, loop-mounted)"

    def _cgroup_prefix(self, part: str = "cmds") -> list[str]:
        """What goes at the very front of a command's argv: it joins the sandbox's ``cmds`` cgroups (or
        the keeper's) before nsenter or bwrap, so everything the command starts is found and killed."""
        return self._cgroup.join_prefix(part) if self._cgroup is not None else []

    def _write_user_db(self) -> None:
        """The hardened sandbox's /etc/passwd and /etc/group: the host's plus the ``agent`` user."""
        def merged(path: str, line: str, ident: int) -> str:
            try:
                host = Path(path).read_text().splitlines()
            except OSError:
                host = []
            kept = [entry for entry in host
                    if entry.split(":", 1)[0] != AGENT_USER and entry.split(":")[2:3] != [str(ident)]]
            return "\n".join([*kept, line, ""])

        home = self.root / "home" / AGENT_USER
        home.mkdir(parents=True)
        os.chown(home, AGENT_UID, AGENT_UID)
        os.chmod(home, 0o755)
        os.chown(self.root / "work", AGENT_UID, AGENT_UID)  # as /workspace in the agent image
        (self.root / "passwd").write_text(
            merged("/etc/passwd",
                   f"{AGENT_USER}:x:{AGENT_UID}:{AGENT_UID}:agent:/home/{AGENT_USER}:/bin/bash", AGENT_UID))
        (self.root / "group").write_text(merged("/etc/group", f"{AGENT_USER}:x:{AGENT_UID}:", AGENT_UID))
        (self.root / "empty").write_bytes(b"")  # what the host's /etc secrets read as inside
        os.chmod(self.root / "empty", 0o600)
        self._users[AGENT_USER] = pwd.struct_passwd(
            (AGENT_USER, "x", AGENT_UID, AGENT_UID, "agent", f"/home/{AGENT_USER}", "/bin/bash"))

    def _start_keeper(self) -> None:
        argv = [*self._cgroup_prefix("keeper"), *self._bwrap_prefix(), "--", "sleep", "infinity"]
        self._keeper = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={"PATH": DEFAULT_PATH, _ID_VAR: self.id}, start_new_session=True, cwd=str(self.root),
        )
        deadline = time.monotonic() + 10
        children = Path(f"/proc/{self._keeper.pid}/task/{self._keeper.pid}/children")
        while time.monotonic() < deadline:
            if self._keeper.poll() is not None:
                err = self._keeper.stderr.read().decode(errors="replace") if self._keeper.stderr else ""
                raise SandboxStartError(f"bubblewrap failed to start the sandbox namespace: {err.strip()}")
            try:
                pids = children.read_text().split()
            except OSError:
                pids = []
            if pids:  # the namespace's init; its child (sleep) has the sandbox's final root
                inner = Path(f"/proc/{pids[0]}/task/{pids[0]}/children")
                with contextlib.suppress(OSError):
                    grandchildren = inner.read_text().split()
                    if grandchildren:
                        self._ns_init = int(pids[0])
                        self._ns_pid = int(grandchildren[0])
                        for pid in (self._keeper.pid, self._ns_init, self._ns_pid):
                            start = start_time(pid)
                            if start is not None:
                                self._keeper_ids[pid] = start
                        return
            time.sleep(0.01)
        raise SandboxStartError("bubblewrap did not start the sandbox namespace within 10 s")

    def _remove_sync(self) -> None:
        for relay in self._relays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                relay.kill()
            with contextlib.suppress(Exception):
                relay.wait(5)
        self._relays.clear()
        if self._cgroup is not None:
            self._cgroup.kill(None)
        if self._keeper is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._keeper.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self._keeper.wait(5)
        for pgid in list(self._pgids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._pgids.clear()
        _kill_tagged_processes(self.id)
        _kill_tagged_processes(self.id, _RELAY_VAR)
        left: list[str] = []
        if self._cgroup is not None:
            left = self._cgroup.remove()
        if self._disk is not None:
            self._disk.remove()
        if left:  # keep owner.json and cgroups.json for gc (ares-gateway gc), say what is left
            print(f"sandbox {self.id}: could not remove {left}; `ares-gateway gc` retries", file=sys.stderr)
            return
        shutil.rmtree(self.root, ignore_errors=True)

    # -- exec ----------------------------------------------------------------------------------------
    def _argv(self, command: str, cwd: str, user: str | None) -> list[str]:
        inner = ["/bin/sh", "-c", command]
        if not self.isolated:
            return inner
        switch: list[str] = []
        if user is not None:
            info = self._lookup_user(user)
            if self.hardened and info.pw_uid != 0:
                switch = ["setpriv", f"--reuid={info.pw_uid}", f"--regid={info.pw_gid}", *DROP_PRIVS]
            elif not self.hardened:
                switch = ["setpriv", f"--reuid={info.pw_uid}", f"--regid={info.pw_gid}", "--init-groups"]
        if self.hardened and not switch:
            switch = ["setpriv", *ROOT_PRIVS]
        if self._ns_pid is not None:
            # Join the sandbox's namespaces; cd inside (nsenter's --wd resolves outside the new root).
            return [
                *self._nsenter(), *switch, "sh", "-c",
                f'cd "$0" 2>/dev/null || {{ echo "{_CWD_MARK}$0" >&2; exit {_CWD_MISSING}; }}; exec '
                '/bin/sh -c "$1"', cwd, command,
            ]
        return [*self._bwrap_prefix(), "--chdir", cwd, *switch, *inner]

    def user_switch_argv(self, user: str) -> list[str]:
        """What ``exec(user=user)`` puts between the sandbox's namespaces and the command (setpriv), for
        a root process inside; the host's own ``setpriv`` when not isolated."""
        info = self._lookup_user(user)
        if self.hardened and info.pw_uid != 0:
            return ["setpriv", f"--reuid={info.pw_uid}", f"--regid={info.pw_gid}", *DROP_PRIVS, "--"]
        return ["setpriv", f"--reuid={info.pw_uid}", f"--regid={info.pw_gid}", "--init-groups", "--"]

    def _nsenter(self) -> list[str]:
        assert self._ns_pid is not None
        return [*self._confine_prefix(), "nsenter", "-t", str(self._ns_pid), "-m", "-p", "-i", "-u", "-r",
                *(["-n"] if self.spec.network == "none" else [])]

    def _confine_prefix(self) -> list[str]:
        """In front of a hardened sandbox's nsenter: the launcher that puts the command (and all it
        starts, the namespaces' root included) under :func:`seccomp_filter`."""
        if not self.hardened:
            return []
        return [sys.executable, "-I", "-S", str(CONFINE_SCRIPT), str(self.root / FILTER_FILE), "--"]

    def _bwrap_prefix(self) -> list[str]:
        if self.hardened:
            return self._hardened_bwrap_prefix()
        argv = [
            "bwrap", *root_binds(self.spec.workdir), "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.root / "tmp"), "/tmp",
            "--bind", str(self.root / "work"), self.spec.workdir,
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
        ]
        if self.spec.network == "none":
            argv.append("--unshare-net")
        return argv

    def _hardened_bwrap_prefix(self) -> list[str]:
        argv = ["bwrap"]
        # bwrap makes missing parents of a mount point 0700; every user must traverse them (/opt).
        targets = [*HARDENED_SYSTEM_PATHS, *map(str, self.spec.readonly_paths), self.spec.workdir]
        parents = sorted({str(parent) for t in targets for parent in Path(t).parents if str(parent) != "/"},
                         key=lambda d: d.count("/"))
        for parent in parents:
            argv += ["--perms", "0755", "--dir", parent]
        for path in HARDENED_SYSTEM_PATHS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--ro-bind", str(self.root / "passwd"), "/etc/passwd", "--ro-bind", str(self.root / "group"),
                 "/etc/group"]
        # Root inside reads every file of the host's /etc (CAP_DAC_OVERRIDE): its secrets read as empty.
        for secret in host_etc_secrets():
            argv += (["--perms", "0700", "--tmpfs", secret] if os.path.isdir(secret)
                     else ["--ro-bind", str(self.root / "empty"), secret])
        for path in self.spec.readonly_paths:
            argv += ["--ro-bind-try", str(path), str(path)]
        argv += [
            "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.root / "tmp"), "/tmp",
            "--bind", str(self.root / "home"), "/home",
            # Root's own HOME (empty, 0700), never the agent's directories.
            "--perms", "0700", "--dir", "/root",
            "--bind", str(self.root / "work"), self.spec.workdir,
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
        ]
        if self.spec.network == "none":
            argv.append("--unshare-net")
        return argv

    def _lookup_user(self, user: str) -> pwd.struct_passwd:
        known = (self._users.get(user)
                 or next((u for u in self._users.values() if str(u.pw_uid) == user), None))
        if known is not None:
            return known
        try:
            return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError as exc:
            raise ExecError(
                f"no user {user!r} on this host: the local backend runs commands as host users") from exc

    def _command_env(self, env: dict[str, str], user: str | None) -> dict[str, str]:
        """A command's whole environment.  Root in a hardened sandbox gets one of its own: ``HOME=/root``,
        the system ``PATH``, no ``PYTHON*``/``LD_*``/``BASH_ENV``... from the caller, no user site
        (``PYTHONNOUSERSITE``), so that nothing the agent wrote is loaded as root's code."""
        if self.hardened and (user is None or self._lookup_user(user).pw_uid == 0):
            kept = {k: v for k, v in env.items()
                    if not k.startswith(ROOT_ENV_DROP_PREFIXES) and k not in ROOT_ENV_DROP}
            return {**kept, "HOME": "/root", "PATH": DEFAULT_PATH, "PYTHONNOUSERSITE": "1", _ID_VAR: self.id}
        home = self.workdir
        if self.hardened and user is not None and self._lookup_user(user).pw_name == AGENT_USER:
            home = f"/home/{AGENT_USER}"
        return {"PATH": DEFAULT_PATH, "HOME": home, **env, _ID_VAR: self.id}

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        full_env = self._command_env(env, user)
        host_cwd = self._host_path(cwd)
        # A hardened sandbox's cwd is checked inside (its paths are not the host's).
        if not self.hardened and not host_cwd.is_dir():
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        kwargs: dict[str, object] = {}
        if user is not None:
            info = self._lookup_user(user)
            if not self.isolated:
                if os.geteuid() != 0 and info.pw_uid != os.geteuid():
                    raise ExecError(f"cannot run as {user!r}: the local backend needs root to switch users")
                if info.pw_uid != os.geteuid():
                    kwargs.update(user=info.pw_uid, group=info.pw_gid, extra_groups=[])
            elif os.geteuid() != 0 and info.pw_uid != os.geteuid():
                raise ExecError(f"cannot run as {user!r}: the local backend needs root to switch users")
        argv = [*self._cgroup_prefix(), *self._argv(command, cwd, user)]
        started = time.monotonic()
        try:
            # Not asyncio.create_subprocess_exec: under uvloop the child inherits the parent's fds and
            # uvloop's own copies of its stdio pipes (no close_fds), so a process the command leaves in the
            # background (a detached agent) holds the exec's stdout open and the exec never returns.
            proc = LocalProcess(argv, cwd=str(host_cwd) if not self.isolated else str(self.root),
                                env=full_env, popen_kwargs=kwargs)
        except OSError as exc:
            raise ExecError(f"cannot start {argv[0]}: {exc}") from exc
        self._pgids.add(proc.pid)
        timed_out = False
        try:
            out, err = await proc.communicate(timeout)
        except TimeoutError:
            timed_out = True
            await asyncio.to_thread(self._kill_group, proc)
            try:
                out, err = await proc.communicate(5)
            except TimeoutError:  # a process that left the group still holds the pipes
                out, err = proc.abandon()
        except asyncio.CancelledError:
            self._kill_group(proc)
            proc.abandon()
            raise
        finally:
            # The shell may have left background jobs in its group; they live until stop().
            if proc.returncode is not None and not group_alive(proc.pid):
                self._pgids.discard(proc.pid)
        code = proc.returncode if proc.returncode is not None else -9
        if code == _CWD_MISSING and err.startswith(_CWD_MARK.encode()):
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        return ExecResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=-9 if timed_out else code,
            timed_out=timed_out,
            duration=time.monotonic() - started,
        )

    # -- forwarding and killing -------------------------------------------------------------------
    async def _forward(self, port: int, host_socket: str) -> None:
        if self._ns_pid is None:
            raise ForwardError(
                "forward() on the local backend needs bubblewrap and root (a network namespace that "
                "lives between commands); use the docker backend otherwise"
            )
        ready = self.root / f"relay-{port}.ready"
        log = self.root / f"relay-{port}.log"
        argv = ["nsenter", "-t", str(self._ns_pid), "-n", "--", sys.executable, "-I", str(_RELAY_SCRIPT),
                "--listen", f"127.0.0.1:{port}", "--unix", host_socket, "--ready-file", str(ready),
                "--watch-pid", str(self._ns_pid), "--exit-on-stdin-eof"]
        relay = self._spawn_relay(argv, log)
        self._relays.append(relay)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if relay.poll() is not None or time.monotonic() > deadline:
                relay.kill()
                detail = log.read_text(errors="replace").strip()[-500:]
                raise ForwardError(
                    f"the relay for port {port} of sandbox {self.id} did not start: {detail or 'no output'}")
            await asyncio.sleep(0.01)

    def _spawn_relay(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        # stdin stays an open pipe: when this process dies the relay reads EOF and exits.
        with open(log, "wb") as log_fh:
            return subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log_fh, close_fds=True,
                start_new_session=True, cwd=str(self.root), env={"PATH": DEFAULT_PATH, _RELAY_VAR: self.id},
            )

    def _kill_group(self, proc: LocalProcess) -> None:
        """Kill a command's process group: by its id while its leader is not reaped (the id is then
        still its own); else only the sandbox's processes in a group of that id (the id may be reused)."""
        if proc.returncode is None:
            proc.kill_group()
            return
        for pid in self._members(None):
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == proc.pid:
                    os.kill(pid, signal.SIGKILL)

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        uid = None if user is None else self._lookup_user(user).pw_uid
        return await asyncio.to_thread(self._kill_sync, uid, timeout)

    def _members(self, uid: int | None) -> list[int]:
        """Live (non-zombie) processes of this sandbox, its keeper and the caller excepted: those of its
        command cgroups (whatever namespace they made), of its PID namespace, or tagged with its id."""
        # The keeper's processes are spared only while /proc shows the very processes started (a pid
        # the keeper had may be another's by now); with the keeper gone (OOM-killed) its namespace is
        # gone too, and the sandbox's processes are found by cgroup and by tag.
        keep = {os.getpid(), *(pid for pid, start in self._keeper_ids.items() if start_time(pid) == start)}
        ns: str | None = None
        if self._ns_pid is not None and self._ns_pid in keep:
            with contextlib.suppress(OSError):
                ns = os.readlink(f"/proc/{self._ns_pid}/ns/pid")
        needle = f"{_ID_VAR}={self.id}".encode()
        grouped = self._cgroup.members("cmds") if self._cgroup is not None else set()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in keep:
                continue
            base = f"/proc/{entry}"
            try:
                if int(entry) in grouped:
                    pass
                elif ns is not None:
                    if os.readlink(f"{base}/ns/pid") != ns:
                        continue
                else:
                    with open(f"{base}/environ", "rb") as fh:
                        if needle not in fh.read().split(b"\0"):
                            continue
                with open(f"{base}/status", "rb") as fh:
                    status = dict(line.split(b":", 1) for line in fh.read().splitlines() if b":" in line)
                if status[b"State"].split()[0] in (b"Z", b"X"):
                    continue
                # The real or effective uid, as the host sees it (a nested user namespace maps back to it);
                # not the owner of /proc/PID, which a non-dumpable process sets to root.
                if uid is not None and uid not in [int(u) for u in status[b"Uid"].split()[:2]]:
                    continue
            except (OSError, IndexError, KeyError, ValueError):
                continue
            found.append(int(entry))
        return found

    def _kill_sync(self, uid: int | None, timeout: float) -> int:
        if self._disk is not None:
            self._disk.full()  # looked at before the tests run (sticky), as the agent left it
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while True:
            alive = self._members(uid)
            if not alive:
                return len(killed)
            if time.monotonic() > deadline:
                raise ExecError(
                    f"processes {alive[:20]} of sandbox {self.id} survived SIGKILL for {timeout} s")
            if uid is None and self._cgroup is not None:
                self._cgroup.kill("cmds")  # at once, forks in flight included (cgroup v2)
            killed.update(alive)
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    async def _limits_reached(self) -> frozenset[str]:
        hit = self._cgroup.limits_reached() if self._cgroup is not None else set()
        if self._disk is not None and await asyncio.to_thread(self._disk.full):
            hit.add("disk")
        return frozenset(hit)

    # -- files -----------------------------------------------------------------------------------
    def _tar_inside(self, args: list[str], *, stdin: object = None, stdout: object = None) -> None:
        """Run ``tar`` as root inside the sandbox's namespaces (hardened transfers)."""
        proc = subprocess.run(
            [*self._nsenter(), "setpriv", *ROOT_PRIVS, "tar", *args], stdin=stdin, stdout=stdout,
            stderr=subprocess.PIPE,  # type: ignore[call-overload]
            cwd=str(self.root), env={"PATH": DEFAULT_PATH}, check=False, close_fds=True,
        )
        if proc.returncode != 0:
            raise FileTransferError(f"tar {' '.join(args[:3])} in sandbox {self.id} failed: "
                                    f"{proc.stderr.decode(errors='replace').strip()[-500:]}")

    def _hardened_transfer(self, kind: str, local: Path, remote: str) -> None:
        """One transfer through ``tar`` inside the sandbox: paths and symlinks resolve in its view only."""
        parent, name = posixpath.split(remote)
        parent = parent or "/"
        if kind in ("upload_file", "upload_dir"):
            spool = tar_single_file(local, name) if kind == "upload_file" else tar_directory(local)
            dest = parent if kind == "upload_file" else remote
            try:
                self._mkdir_inside(dest)
                # --no-same-owner: files belong to root, as a host-side copy by root would.
                self._tar_inside(["-x", "--no-same-owner", "-f", "-", "-C", dest], stdin=spool)
            finally:
                spool.close()
            return
        with tempfile.TemporaryFile() as out:
            if kind == "download_file":
                self._tar_inside(["-c", "-h", "-f", "-", "-C", parent, "--", name], stdout=out)
                out.seek(0)
                extract_single_file(out, local)
            else:
                self._tar_inside(["-c", "-f", "-", "-C", remote, "."], stdout=out)
                out.seek(0)
                extract_tar(out, local)

    def _mkdir_inside(self, path: str) -> None:
        proc = subprocess.run([*self._nsenter(), "setpriv", *ROOT_PRIVS, "mkdir", "-p", "--", path],
                              capture_output=True, check=False, cwd=str(self.root),
                              env={"PATH": DEFAULT_PATH})
        if proc.returncode != 0:
            raise FileTransferError(f"creating {path} in sandbox {self.id} failed: "
                                    f"{proc.stderr.decode(errors='replace').strip()[-300:]}")

    async def _upload_file(self, local_path: Path, remote_path: str) -> None:
        if self.hardened:
            return await self._files(lambda: self._hardened_transfer("upload_file", local_path, remote_path),
                                     remote_path)
        dest = self._host_path(remote_path)

        def copy() -> None:
            if not local_path.is_file():
                raise FileTransferError(f"{local_path} is not a file: pass an existing local file")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_path, dest)
            shutil.copymode(local_path, dest)

        await self._files(copy, remote_path)

    async def _upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        if self.hardened:
            return await self._files(lambda: self._hardened_transfer("upload_dir", local_dir, remote_dir),
                                     remote_dir)
        dest = self._host_path(remote_dir)

        def copy() -> None:
            if not local_dir.is_dir():
                raise FileTransferError(f"{local_dir} is not a directory: pass an existing local directory")
            shutil.copytree(local_dir, dest, symlinks=True, dirs_exist_ok=True)

        await self._files(copy, remote_dir)

    async def _download_file(self, remote_path: str, local_path: Path) -> None:
        if self.hardened:
            return await self._files(
                lambda: self._hardened_transfer("download_file", local_path, remote_path),
                remote_path)
        src = self._host_path(remote_path)

        def copy() -> None:
            if not src.is_file():
                raise FileTransferError(f"{remote_path} is not a file in sandbox {self.id}")
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, local_path)

        await self._files(copy, remote_path)

    async def _download_dir(self, remote_dir: str, local_dir: Path) -> None:
        if self.hardened:
            return await self._files(lambda: self._hardened_transfer("download_dir", local_dir, remote_dir),
                                     remote_dir)
        src = self._host_path(remote_dir)

        def copy() -> None:
            if not src.is_dir():
                raise FileTransferError(f"{remote_dir} is not a directory in sandbox {self.id}")
            shutil.copytree(src, local_dir, symlinks=True, dirs_exist_ok=True)

        await self._files(copy, remote_dir)

    async def _archive_dir(self, remote_dir: str, local_path: Path, limit: int) -> int:
        if self.hardened:  # tar as root inside: paths and links resolve in the sandbox's view only
            argv = [*self._nsenter(), "setpriv", *ROOT_PRIVS, "tar", "-c", "-f", "-", "-C", remote_dir, "."]
        else:  # the host's view is the sandbox's (read-only bubblewrap binds, or no isolation)
            argv = ["tar", "-c", "-f", "-", "-C", str(self._host_path(remote_dir)), "."]

        def stream() -> int:
            with tempfile.TemporaryFile() as err:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                        cwd=str(self.root), env={"PATH": DEFAULT_PATH}, close_fds=True,
                                        start_new_session=True)
                assert proc.stdout is not None
                try:
                    with open(local_path, "wb") as out:
                        size = filter_tar(proc.stdout, out, limit=limit)  # type: ignore[arg-type]
                    while proc.stdout.read(1 << 16):  # the end-of-archive padding
                        pass
                    code = proc.wait(60)
                finally:
                    if proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    proc.stdout.close()
                if code != 0:
                    err.seek(0)
                    raise FileTransferError(f"tar of {remote_dir} in sandbox {self.id} failed (exit {code}): "
                                            f"{err.read().decode(errors='replace').strip()[-500:]}")
                return size

        try:
            return await asyncio.to_thread(stream)
        except OSError as exc:
            raise FileTransferError(f"archiving {remote_dir} of sandbox {self.id} failed: {exc}") from exc

    async def _files(self, fn: Callable[[], None], what: str) -> None:
        try:
            await asyncio.to_thread(fn)
        except OSError as exc:
            raise FileTransferError(f"file transfer for {what} in sandbox {self.id} failed: {exc}") from exc


# -- garbage collection hooks (see janitor.collect_garbage) -----------------------------------------


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    root = local_root()
    found: list[tuple[str, dict[str, str]]] = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        try:
            info = json.loads((entry / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        labels = info.get("labels") or {}
        if janitor.OWNER_LABEL in labels:
            found.append((entry.name, labels))
    return found


def gc_remove(ref: str) -> None:
    """Remove a leftover sandbox: its processes (by cgroup and by tag), cgroups, disk and directory."""
    root = local_root() / ref
    group: cgroups.SandboxCgroup | None = None
    with contextlib.suppress(OSError, ValueError):
        group = cgroups.SandboxCgroup.from_record(ref, json.loads((root / _CGROUP_FILE).read_text()))
    extra = [d for d in cgroups.leftover_dirs(ref) if group is None or d not in group.dirs]
    if extra:
        found = cgroups.SandboxCgroup.from_record(
            ref, {"dirs": [*(group.dirs if group else []), *map(str, extra)]})
        group = found
    if group is not None:
        group.kill(None)
    _kill_tagged_processes(ref)
    _kill_tagged_processes(ref, _RELAY_VAR)
    left = group.remove() if group is not None else []
    loopdisk.remove(_disk_image(ref), root)
    if left:
        raise OSError(f"could not remove {left} (processes that do not die?)")
    shutil.rmtree(root, ignore_errors=True)


def _disk_image(sandbox_id: str) -> Path:
    # Beside the sandbox's directory (its mount point), not in a shared folder left behind.
    return local_root() / f".{sandbox_id}.disk.img"


# The isolation's parts live in sandbox._hardening; these names are imported from here too.
__all__ = ["AGENT_UID", "AGENT_USER", "DEFAULT_PATH", "HARDENED_SYSTEM_PATHS", "ROOT_CAPS", "SECCOMP_DENIED",
           "SECCOMP_NOSYS", "LocalSandbox", "bwrap_available", "gc_candidates", "gc_remove", "local_root",
           "seccomp_filter"]
