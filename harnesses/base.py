"""The harness template: install an agent CLI in a sandbox, point it at a gateway session, run it.

A harness never knows about tasks or about the gateway's code: it gets a :class:`HarnessContext`
(workdir, session id, session base URL, token, model label) and a prompt, and reports a
:class:`HarnessResult`. ``run()`` is the template:

1. ``prepare``: the non-root ``agent`` user (when the sandbox lets us create it) and the workdir;
2. ``install``: reuse a preinstalled CLI of the pinned version (an image built from ``docker/agents``,
   or a provisioned host prefix), else install it under ``/opt/ares-agents/<name>/<version>`` (or,
   when that is read-only, under the agent's home);
3. ``write_config``: the agent's own configuration files (e.g. Codex's ``config.toml``);
4. ``launch_and_wait``: a detached process group (it survives a dropped exec connection) polled with a
   time budget; on overrun the whole group (and session) is killed and the result says so.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import os
import posixpath
import re
import shlex
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from sandbox import ExecResult, Sandbox, SandboxError, SandboxStateError
from sandbox.protocol import USER_SWITCH

#: Where CLIs are installed (and found preinstalled): ``<root>/<harness>/<version>``.
INSTALL_ROOT = "/opt/ares-agents"
#: Environment every agent gets: no telemetry, no update checks, no browser.
QUIET_ENV: dict[str, str] = {
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "NO_UPDATE_NOTIFIER": "1",
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "BROWSER": "/bin/false",
    "TERM": "xterm-256color",
    "LANG": "C.UTF-8",
}
#: The time budget of ``run()`` when none is given (seconds).
DEFAULT_TIME_BUDGET = 600.0
_TAIL = 4000
_CA_PATH = "/tmp/ares-harness-ca.pem"
_ARTIFACT_LIMIT = 4 * 1024 * 1024


class HarnessError(Exception):
    """A harness could not do its job; the message names the harness and what failed."""

    def __init__(self, harness: str, step: str, detail: str) -> None:
        self.harness = harness
        self.step = step
        self.detail = detail
        super().__init__(f"harness {harness!r}: {step} failed: {detail}")


class HarnessInstallError(HarnessError):
    """Installing the agent CLI failed at ``step``."""


class HarnessLaunchError(HarnessError):
    """Preparing or starting the agent failed."""



def npm_install_steps(prefix: str, package: str, version: str) -> list[tuple[str, str]]:
    """The install steps of an npm-distributed CLI: check node/npm, then a pinned global install under
    ``prefix``."""
    q = shlex.quote(prefix)
    return [
        ("check node and npm", "command -v node >/dev/null && command -v npm >/dev/null || "
                               "{ echo 'node and npm are needed (apt-get install nodejs npm)' "
                               ">&2; exit 127; }"),
        (f"npm install {package}@{version}",
         f"mkdir -p {q} && npm install -g --no-audit --no-fund --loglevel=error --prefix {q} "
         f"{package}@{version}"),
    ]


def pip_install_step(prefix: str, package: str, version: str) -> tuple[str, str]:
    """The install step of a PyPI-distributed agent: a pinned install into the virtual environment at
    ``prefix``."""
    return (f"pip install {package}=={version}",
            f"{shlex.quote(prefix)}/bin/pip install --quiet --disable-pip-version-check {package}=={version}")


def pip_version_command(prefix: str, package: str) -> str:
    """A command printing the version of ``package`` installed in the virtual environment at ``prefix``."""
    return (f"{shlex.quote(prefix)}/bin/python -c \"import importlib.metadata as m; "
            f"print(m.version('{package}'))\"")


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    """A request header by lower-case ``name``, whatever case the mapping keeps.

    Gateway handlers pass multidict's ``CIMultiDict``, which looks up case-insensitively (as
    httpx's headers do), so other mappings get a direct lookup; a plain dict is case-sensitive,
    so it is scanned.
    """
    if not isinstance(headers, dict):
        return headers.get(name)
    for k, v in headers.items():
        if k.lower() == name:
            return v
    return None


@dataclass(frozen=True)
class HarnessContext:
    """What a harness needs to point an agent at one gateway session (nothing task-specific)."""

    workdir: str
    session_id: str
    base_url: str  # http://HOST:PORT/s/{session_id}, no /v1
    token: str
    model: str = "ares-policy"

    @property
    def openai_base_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1"


@dataclass
class HarnessResult:
    """How one agent run ended."""

    harness: str
    version: str
    exit_code: int | None  # None when the process was killed before it reported one
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    duration: float  # seconds from launch to exit (or kill)
    install_seconds: float = 0.0
    install_reused: bool = False
    user: str | None = None
    #: Agent logs kept as artifacts (name -> text, each capped at 4 MiB).
    artifacts: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class InstallInfo:
    prefix: str
    version: str
    reused: bool
    seconds: float


@dataclass
class Prepared:
    """Per sandbox: who runs the agent, where its home and state are, where its CLI is."""

    user: str | None
    home: str
    state_dir: str
    install: InstallInfo | None = None
    #: The current run's time budget (seconds), set by ``launch_and_wait`` before the agent's
    #: environment and command are built, so a harness can size its per-command limits from it.
    time_budget: float | None = None
    #: The current run's launcher directory: its pid record and exit code (root's, 0700, where
    #: ``control_is_root``; else in the run user's state directory, when the agent runs as the
    #: sandbox's own user and nothing is out of its reach anyway).
    control: str | None = None
    control_is_root: bool = False


class BaseHarness(abc.ABC):
    """One agent CLI. Subclasses set ``name`` and ``default_version`` and fill in the hooks."""

    name: ClassVar[str]
    #: The agent whose action format this harness speaks, where it is another's (tiny-agent:
    #: mini-swe-agent's):
    #: what the scripted and oracle policies write for it. ``None``: its own (``name``).
    scripted_format: ClassVar[str | None] = None
    default_version: ClassVar[str]
    #: Executable (relative to the install prefix) whose ``--version`` proves an install.
    probe: ClassVar[str]

    def __init__(
        self,
        *,
        version: str | None = None,
        user: str | None = "agent",
        install_root: str = INSTALL_ROOT,
        install_timeout: float = 900.0,
        extra_env: Mapping[str, str] | None = None,
        ca_bundle: str | None = None,
        wrapper: str | None = None,
        command_timeout: float | None = None,
    ) -> None:
        self.version = version or self.default_version
        self.user = user
        self.install_root = install_root
        self.install_timeout = install_timeout
        self.extra_env = dict(extra_env or {})
        #: A CA bundle (host path) uploaded for installs; default: the host's own, when it sets one.
        self.ca_bundle = ca_bundle if ca_bundle is not None else _host_ca_bundle()
        #: A command prefix the agent runs under (e.g. ``nice -n 5`` or ``strace -f -o FILE``).
        self.wrapper = wrapper
        if command_timeout is not None and not command_timeout > 0:
            raise ValueError(f"command_timeout must be a positive number of seconds, got {command_timeout!r}")
        #: The longest one agent command (a build, a test suite) may run, in seconds; ``None``: the
        #: run's whole time budget, so only the episode's own limit ends a command.
        self.command_timeout = command_timeout
        self._prepared: dict[str, Prepared] = {}

    # ------------------------------------------------------------------ limits

    def command_limit(self, prep: Prepared) -> int:
        """Whole seconds one agent command may run: ``command_timeout``, else the run's time budget.

        Each agent's own per-command limit (mini-swe-agent's ``environment.timeout``, Claude Code's
        ``BASH_DEFAULT_TIMEOUT_MS``/``BASH_MAX_TIMEOUT_MS``, Codex's ``background_terminal_max_timeout``)
        is set from it, so a command is cut short by the episode's time limit, not by the agent's
        default (30 s, 2 min, 5 min).
        """
        budget = prep.time_budget if prep.time_budget is not None else DEFAULT_TIME_BUDGET
        limit = self.command_timeout if self.command_timeout is not None else budget
        return max(1, math.ceil(limit))

    # ------------------------------------------------------------------ hooks

    @abc.abstractmethod
    def install_steps(self, prefix: str) -> Sequence[tuple[str, str]]:
        """``(step name, shell command)`` pairs that install the pinned version under ``prefix``."""

    def version_command(self, prefix: str) -> str:
        return f"{shlex.quote(posixpath.join(prefix, self.probe))} --version"

    def parse_version(self, output: str) -> str | None:
        match = re.search(r"\d+\.\d+\.\d+[\w.\-]*", output)
        return match.group(0) if match else None

    @abc.abstractmethod
    def agent_env(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        """Environment variables that redirect the agent to the session and keep it quiet."""

    @abc.abstractmethod
    def agent_command(self, ctx: HarnessContext, prep: Prepared, prompt: str) -> str:
        """The shell command that runs the agent in the foreground (stdin is /dev/null)."""

    async def write_config(self, sandbox: Sandbox, ctx: HarnessContext) -> None:
        """Write the agent's configuration files (default: none)."""
        return None

    def cleanup_command(self, prep: Prepared) -> str | None:
        """A shell command that stops what the agent started outside its process group (e.g. tmux)."""
        return None

    def artifact_paths(self, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        """Files to keep as artifacts: name -> path or shell glob inside the sandbox."""
        return {}

    @staticmethod
    def is_side_call(body: Mapping[str, object], headers: Mapping[str, str]) -> bool:
        """Whether a raw request body (with its headers) is a side call rather than the main line."""
        return False

    # ------------------------------------------------------------------ template

    async def run(
        self, sandbox: Sandbox, ctx: HarnessContext, prompt: str, *, time_budget: float = DEFAULT_TIME_BUDGET
    ) -> HarnessResult:
        """Prepare the user and workdir, install (or reuse) the CLI, write config, launch and wait."""
        await self.prepare(sandbox, ctx)
        await self.install(sandbox)
        await self.write_config(sandbox, ctx)
        return await self.launch_and_wait(sandbox, ctx, prompt, time_budget)

    async def prepare(self, sandbox: Sandbox, ctx: HarnessContext) -> Prepared:
        """Ensure the run user (``agent`` when it can be created here, else the sandbox's) and the workdir."""
        user = self.user
        if sandbox.backend == "local" and not getattr(sandbox, "isolated", True):
            user = None  # a non-isolated local sandbox is the host itself: never add users there
        if user is not None and user != "root":
            probe = await sandbox.exec(f"id -u {shlex.quote(user)}",
                                       user="root" if sandbox.backend != "local" else None,
                                       timeout=30)
            if not probe.ok:
                created = await self._root_exec(
                    sandbox,
                    f"useradd --create-home --shell /bin/bash {shlex.quote(user)} 2>&1 || "
                    f"adduser -D {shlex.quote(user)} 2>&1",
                    timeout=60,
                )
                if not created.ok:
                    user = None  # e.g. the local backend's read-only /etc: run as the sandbox's user
        if user is not None:
            # The user must be able to live here (a host user of the local backend may have no home).
            home_ok = await sandbox.exec('mkdir -p "$HOME/.ares" && test -w "$HOME/.ares"', user=user,
                                         cwd="/", timeout=30)
            if not home_ok.ok:
                user = None
        mk = await self._root_exec(
            sandbox,
            f"mkdir -p {shlex.quote(ctx.workdir)}"
            + (f" && chown {shlex.quote(user)}: {shlex.quote(ctx.workdir)}" if user else ""),
            timeout=60,
        )
        if not mk.ok:
            raise HarnessLaunchError(self.name, f"creating the workdir {ctx.workdir}",
                                     _tail(mk.stderr or mk.stdout))
        home_r = await sandbox.exec('printf %s "$HOME"', user=user, cwd=ctx.workdir, timeout=30)
        home = home_r.stdout.strip() or ctx.workdir
        state_dir = posixpath.join(home, ".ares", self.name, ctx.session_id)
        r = await sandbox.exec(f"mkdir -p {shlex.quote(state_dir)}", user=user, cwd=ctx.workdir, timeout=30)
        if not r.ok:
            raise HarnessLaunchError(self.name, f"creating the state directory {state_dir}", _tail(r.stderr))
        prep = self._prepared.get(sandbox.id)
        install = prep.install if prep else None
        prep = Prepared(user=user, home=home, state_dir=state_dir, install=install)
        self._prepared[sandbox.id] = prep
        return prep

    async def install(self, sandbox: Sandbox) -> InstallInfo:
        """Reuse a preinstalled CLI of the pinned version, else install it; raises HarnessInstallError."""
        prep = self._prepared.get(sandbox.id)
        if prep is None:
            raise HarnessLaunchError(self.name, "install", "call prepare() (or run()) first")
        if prep.install is not None:
            return prep.install
        started = time.monotonic()
        shared = posixpath.join(self.install_root, self.name, self.version)
        private = posixpath.join(prep.home, ".ares-agents", self.name, self.version)
        for prefix in (shared, private):
            if await self._installed_version(sandbox, prefix, prep) == self.version:
                prep.install = InstallInfo(prefix, self.version, True, time.monotonic() - started)
                return prep.install
        # Install where we may write: the shared prefix as root, else the run user's home.
        writable = await self._root_exec(
            sandbox, f"mkdir -p {shlex.quote(shared)} && test -w {shlex.quote(shared)}", timeout=30
        )
        if writable.ok:
            prefix, install_user = shared, None
        else:
            prefix, install_user = private, prep.user
        await self.install_at(sandbox, prefix, user=install_user)
        prep.install = InstallInfo(prefix, self.version, False, time.monotonic() - started)
        return prep.install

    async def install_at(self, sandbox: Sandbox, prefix: str, *, user: str | None = None) -> None:
        """Install the pinned version under ``prefix`` as ``user`` (no reuse check), verify its version
        and mark it complete (``.ares-complete``, written last). Call :meth:`prepare` first; raises
        :class:`HarnessInstallError`."""
        prep = self._prepared.get(sandbox.id)
        if prep is None:
            raise HarnessLaunchError(self.name, "install", "call prepare() (or run()) first")
        await self._run_install_steps(sandbox, prefix, user, prep)
        got = await self._installed_version(sandbox, prefix, prep, marker=False)
        if got != self.version:
            raise HarnessInstallError(
                self.name, "checking the installed version",
                f"{self.version_command(prefix)} reports {got!r}, expected {self.version!r}",
            )
        await sandbox.exec(
            f"chmod -R a+rX {shlex.quote(prefix)} 2>/dev/null; touch {shlex.quote(prefix)}/.ares-complete",
            user=user, timeout=120)

    async def _run_install_steps(self, sandbox: Sandbox, prefix: str, user: str | None,
                                 prep: Prepared) -> None:
        env = {**QUIET_ENV, "HOME": prep.home if user or sandbox.backend == "local" else "/root"}
        if self.ca_bundle:
            # Registries reached through a TLS-inspecting proxy need its CA inside the sandbox too.
            try:
                await sandbox.upload_file(self.ca_bundle, _CA_PATH)
            except Exception as exc:
                raise HarnessInstallError(self.name, "uploading the CA bundle",
                                          f"{self.ca_bundle}: {exc}") from exc
            await sandbox.exec(["chmod", "644", _CA_PATH],
                               user=None if sandbox.backend == "local" else "root",
                               cwd="/", timeout=30)
            env.update({"NODE_EXTRA_CA_CERTS": _CA_PATH, "NPM_CONFIG_CAFILE": _CA_PATH, "PIP_CERT": _CA_PATH,
                        "SSL_CERT_FILE": _CA_PATH, "REQUESTS_CA_BUNDLE": _CA_PATH})
        deadline = time.monotonic() + self.install_timeout
        for step, command in self.install_steps(prefix):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HarnessInstallError(self.name, f"install step {step!r}",
                                          "install time budget exhausted")
            r = await sandbox.exec(["sh", "-c", command], user=user, env=env, cwd="/", timeout=remaining)
            if r.timed_out:
                raise HarnessInstallError(self.name, f"install step {step!r}",
                                          f"timed out after {r.duration:.0f} s")
            if r.exit_code != 0:
                raise HarnessInstallError(
                    self.name, f"install step {step!r}",
                    f"exit {r.exit_code}: {_tail(r.stderr, 1500) or _tail(r.stdout, 1500)}",
                )

    async def _installed_version(
        self, sandbox: Sandbox, prefix: str, prep: Prepared, *, marker: bool = True
    ) -> str | None:
        cmd = self.version_command(prefix)
        if marker:  # an install that was interrupted has no marker and is redone
            cmd = f"test -f {shlex.quote(prefix)}/.ares-complete && {cmd}"
        r = await sandbox.exec(["sh", "-c", cmd], user=prep.user, env={**QUIET_ENV, "HOME": prep.home},
                               cwd="/", timeout=60)
        return self.parse_version(r.stdout + "\n" + r.stderr) if r.ok else None

    async def launch_and_wait(
        self, sandbox: Sandbox, ctx: HarnessContext, prompt: str, time_budget: float
    ) -> HarnessResult:
        """Start the agent detached in its own session and process group; wait up to ``time_budget`` s."""
        prep = self._prepared.get(sandbox.id)
        if prep is None or prep.install is None:
            raise HarnessLaunchError(self.name, "launch", "call prepare() and install() (or run()) first")
        st = prep.state_dir
        run_id = uuid.uuid4().hex[:8]
        prep.time_budget = time_budget
        env = {**QUIET_ENV, **self.agent_env(ctx, prep), **self.extra_env, "HOME": prep.home}
        bin_dir = posixpath.join(prep.install.prefix, posixpath.dirname(self.probe))
        script = "\n".join(
            [
                "#!/bin/sh",
                # The environment a command of the run user gets in this sandbox, as it was captured.
                f". {st}/env.sh",
                f"cd {shlex.quote(ctx.workdir)} || exit 97",
                *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
                f'export PATH={shlex.quote(bin_dir)}:"$PATH"',
                # A subshell, so an ``exit`` in the agent's command still ends run.sh with its status.
                f"( {self._wrapped(self.agent_command(ctx, prep, prompt))} ) >{st}/stdout.log "
                f"2>{st}/stderr.log </dev/null", "",
            ]
        )
        write = await sandbox.exec(
            ["sh", "-c", f"rm -f {st}/exit_code {st}/pid && export -p >{st}/env.sh && "
                         f"printf %s {shlex.quote(script)} >{st}/run.sh && chmod 700 {st}/run.sh"],
            user=prep.user, cwd=ctx.workdir, timeout=30,
        )
        if not write.ok:
            raise HarnessLaunchError(self.name, "writing the launch script", _exec_failure(write))
        # Who watches the agent: root, where the agent runs as a user of its own. Root starts it, keeps
        # its pid (with its start time) and its exit code in a directory only root can write, and
        # polls and kills by that record; nothing the agent writes (its state directory) is read back
        # to decide whether it lives, how it ended or what to kill.
        root = prep.user is not None and prep.user != "root"
        control = f"/tmp/.ares-run-{uuid.uuid4().hex}" if root else f"{st}/run-{run_id}"
        switch = _user_switch(sandbox, prep.user) if root else []
        prep.control = control
        prep.control_is_root = root
        started = time.monotonic()
        launch = await self._control_exec(
            sandbox, prep, ["sh", "-c", _LAUNCH, "ares-launch", control, "1" if root else "0",
                            *switch, "env", "-i", "/bin/sh", f"{st}/run.sh"], timeout=30)
        if not launch.ok or launch.stdout.strip() != "launched":
            raise HarnessLaunchError(self.name, "launching the agent", _exec_failure(launch))
        try:
            exit_code, timed_out = await self._wait(sandbox, prep, started, time_budget)
        except BaseException:
            # Cancelled (or the sandbox failed under us): never leave the agent running.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.kill(sandbox, prep))
            raise
        duration = time.monotonic() - started
        if timed_out:
            await self.kill(sandbox, prep)
        artifacts = await self._collect(sandbox, ctx, prep)
        return HarnessResult(
            harness=self.name,
            version=prep.install.version,
            exit_code=exit_code,
            timed_out=timed_out,
            stdout_tail=artifacts.pop("_stdout", ""),
            stderr_tail=artifacts.pop("_stderr", ""),
            duration=duration,
            install_seconds=prep.install.seconds,
            install_reused=prep.install.reused,
            user=prep.user,
            artifacts=artifacts,
        )

    async def _wait(self, sandbox: Sandbox, prep: Prepared, started: float,
                    time_budget: float) -> tuple[int | None, bool]:
        """Poll the launcher's record until the budget runs out: ``(exit_code, timed_out)``."""
        control = prep.control
        assert control is not None
        while True:
            remaining = time_budget - (time.monotonic() - started)
            if remaining <= 0:
                return None, True
            chunk = min(remaining, 20.0)
            # Wait inside the sandbox (cheap), in short chunks: a dropped exec costs at most one chunk.
            try:
                waited = await self._control_exec(
                    sandbox, prep, ["sh", "-c", _POLL, "ares-poll", control, str(int(chunk * 5))],
                    timeout=chunk + 15)
                out = waited.stdout.strip()
                if out.startswith("exit ") and out[5:].lstrip("-").isdigit():
                    return int(out[5:]), False
                # the launcher died without an exit code (killed from outside)
                if out == "gone" and waited.ok:
                    return None, False
                if not waited.ok and not waited.timed_out:
                    await asyncio.sleep(0.5)
            except SandboxStateError:
                raise  # the sandbox is gone: nothing left to wait for
            except SandboxError:
                # A failed exec (a dropped connection, a busy daemon) is not the agent's end: poll again.
                await asyncio.sleep(1.0)

    async def _control_exec(self, sandbox: Sandbox, prep: Prepared, argv: list[str], *,
                            timeout: float) -> ExecResult:
        """One step of the launcher's: as root where the agent runs as a user of its own, else as the run
        user."""
        if prep.control_is_root:
            return await self._root_exec(sandbox, shlex.join(argv), timeout=timeout)
        return await sandbox.exec(argv, user=prep.user, cwd="/", timeout=timeout)

    def _wrapped(self, command: str) -> str:
        if not self.wrapper:
            return command
        return f"{self.wrapper} sh -c {shlex.quote(command)}"

    async def kill(self, sandbox: Sandbox, prep: Prepared) -> None:
        """Kill the agent's process group and session (and the harness's extra processes)."""
        if prep.control:
            await self._control_exec(sandbox, prep, ["sh", "-c", _KILL, "ares-kill", prep.control],
                                     timeout=30)
        extra = self.cleanup_command(prep)
        if extra:
            await sandbox.exec(["sh", "-c", f"{extra}; true"], user=prep.user, cwd="/", timeout=30)

    async def _collect(self, sandbox: Sandbox, ctx: HarnessContext, prep: Prepared) -> dict[str, str]:
        st = prep.state_dir
        out: dict[str, str] = {}
        wanted = {"_stdout": f"{st}/stdout.log", "_stderr": f"{st}/stderr.log",
                  **self.artifact_paths(ctx, prep)}
        for name, path in wanted.items():
            limit = _TAIL if name.startswith("_") else _ARTIFACT_LIMIT
            # A glob picks the newest match (Codex names its session log by date and id).
            # Regular files only: a FIFO or a device the agent put there would block the read.
            r = await sandbox.exec(
                ["sh", "-c", f"f=$(ls -t {path} 2>/dev/null | head -n 1); [ -n \"$f\" ] && [ -f \"$f\" ] && "
                             f"[ ! -h \"$f\" ] && tail -c {limit} \"$f\" </dev/null"],
                user=prep.user, cwd=ctx.workdir, timeout=60,
            )
            if r.ok:
                out[name] = r.stdout
        return out

    async def _root_exec(self, sandbox: Sandbox, command: str, *, timeout: float) -> ExecResult:
        # The local backend runs as the host user (root in CI); container backends take a user name.
        return await sandbox.exec(["sh", "-c", command], user=None if sandbox.backend == "local" else "root",
                                  cwd="/", timeout=timeout)


#: ``_ares_start LINE`` sets ``t`` to the start time in a line of /proc/PID/stat; ``_ares_same PID
#: START`` succeeds while /proc/PID is the process recorded as ``PID START``.
_SAME = (
    '_ares_start() { _s=${1##*) }; set -- $_s; t=${20}; }; '
    '_ares_same() { _l=; [ -n "$1" ] && [ -n "$2" ] || return 1; read -r _l <"/proc/$1/stat" 2>/dev/null '
    '|| return 1; _ares_start "$_l"; [ "$t" = "$2" ]; }; '
    # A record is read only when it is a regular file (never a FIFO, a device or a symlink) and only
    # its first 64 bytes: the launcher's directory is root's, but not where the agent is the sandbox's user.
    '_rd() { v=; [ -f "$1" ] && [ ! -h "$1" ] || return 1; v=$(head -c 64 "$1" </dev/null 2>/dev/null); }; '
)
# $1 the launcher's directory, $2 1 = made by root and 0700 (it must not exist yet), then the argv of
# the agent's run.  The launcher is the leader of a new session: it records "<pid> <start time>",
# runs the argv (which switches to the agent's user) and records its exit status.  A TERM (the first
# of kill()) runs a handler: the launcher lives on until the KILL of its whole group.
_LAUNCH = _SAME + (
    'c=$1; own=$2; shift 2; '
    'if [ "$own" = 1 ]; then mkdir -m 700 "$c" || exit 3; else mkdir -p "$c" || exit 3; fi; '
    'setsid /bin/sh -c \'c=$0; trap : TERM; ' + '_ares_start() { _s=${1##*) }; set -- $_s; t=${20}; }; '
    'l=; read -r l </proc/self/stat; _ares_start "$l"; echo "$$ $t" >"$c/pid.tmp" && mv -f '
    '"$c/pid.tmp" "$c/pid" || exit 3; "$@"; echo $? >"$c/exit_code.tmp" && mv -f "$c/exit_code.tmp" '
    '"$c/exit_code"\' "$c" "$@" >/dev/null 2>&1 </dev/null & '
    'i=0; while [ ! -f "$c/pid" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; '
    '[ -f "$c/pid" ] && echo launched'
)
# $1 the launcher's directory, $2 rounds of 0.2 s.  Prints "exit N" once the launcher recorded the
# agent's exit status, "gone" when the launcher died without one, else "running".
_POLL = _SAME + (
    'c=$1; n=$2; _rd "$c/pid"; set -- $v; p=$1; t0=$2; '
    'i=0; while [ ! -f "$c/exit_code" ] && [ $i -lt "$n" ]; do _ares_same "$p" "$t0" || { sleep '
    '0.3; break; }; sleep 0.2; i=$((i+1)); done; '
    'x=; _rd "$c/exit_code" && x=$v; '
    'case $x in ""|*[!0-9-]*) if _ares_same "$p" "$t0"; then echo running; else echo gone; fi;; *) echo '
    '"exit $x";; esac'
)
# $1 the launcher's directory.  TERM, then (a second later) KILL to the launcher's process group and
# to what is left of its session, each only while the launcher is still the process recorded.
_KILL = _SAME + (
    'c=$1; _rd "$c/pid" || exit 0; set -- $v; p=$1; t0=$2; '
    '_ares_same "$p" "$t0" || exit 0; kill -TERM -"$p" 2>/dev/null; sleep 1; '
    '_ares_same "$p" "$t0" || exit 0; kill -KILL -"$p" 2>/dev/null; '
    'command -v pkill >/dev/null 2>&1 && pkill -KILL -s "$p" 2>/dev/null; exit 0'
)


def _user_switch(sandbox: Sandbox, user: str | None) -> list[str]:
    """The sandbox's argv prefix that runs the rest as ``user`` (see ``BaseSandbox.user_switch_argv``)."""
    assert user is not None
    switch = getattr(sandbox, "user_switch_argv", None)
    if switch is None:
        return ["/bin/sh", "-c", USER_SWITCH, "ares-switch", user]
    return list(switch(user))


def _host_ca_bundle() -> str | None:
    for var in ("ARES_HARNESS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "SSL_CERT_FILE",
                "REQUESTS_CA_BUNDLE"):
        path = os.environ.get(var)
        if path and os.path.isfile(path):
            return path
    return None


def _exec_failure(r: ExecResult) -> str:
    """Why a sandbox command failed, never empty (a timed-out command often printed nothing)."""
    how = f"timed out after {r.duration:.0f} s" if r.timed_out else f"exit {r.exit_code}"
    return f"{how}: {_tail(r.stderr) or _tail(r.stdout) or 'no output'}"


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]
