"""One task episode over a real sandbox and a real agent harness (used by :class:`GatewayEnv`).

:class:`TaskEpisode` does the infrastructure around one agent run and never raises for what the
sandbox, the install or the agent did:

1. :meth:`~TaskEpisode.start`: create and start the sandbox from the task's spec, prepare the agent
   user and the workdir (the task's ``environment/workspace/``), install (or reuse) the agent CLI,
   write its config, and launch it detached, as an asyncio task that ends when the agent exits.
   A failure raises :class:`EpisodeSetupError` with an exit reason (``sandbox_error``,
   ``install_error``, ``agent_error``).
   Once the agent is set up (before its launch), a second sandbox for grading starts in the
   background from the same spec (no relay, nothing of the agent's in it), unless the task sets
   ``[verifier] sandbox = "agent"``. :meth:`~TaskEpisode.prepare` does all of this but the launch,
   ahead of the episode in a warm pool (:mod:`~ares_gateway.episodes.warm`).
2. :meth:`~TaskEpisode.finish`: stop the agent when it is still running (a limit was hit), read its
   logs, run the task's tests with their own timeout and read the reward (not after a setup failure
   or an agent crash: reward 0.0 with the error), and return its
   :class:`~ares_gateway.episodes.result.EpisodeResult` (the logs in :attr:`TaskEpisode.logs`). By default
   the tests run in the grading sandbox, into which only a copy of the agent's final workdir goes
   (:func:`~ares_gateway.episodes.verifier.copy_workspace`): no process, file outside the workdir,
   environment or pid the agent left is there. ``[verifier] sandbox = "agent"`` runs them in the
   agent's own sandbox with its processes still running (a service it started).
3. :meth:`~TaskEpisode.close`: stop the agent and remove both sandboxes (idempotent, also after a
   cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import posixpath
import secrets
import shlex
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sandbox as sandbox_mod
from ares_gateway.core.sessions import SessionInfo
from ares_gateway.episodes import workspaces
from ares_gateway.episodes.failures import AGENT_SANDBOX, GRADING_SANDBOX
from ares_gateway.episodes.result import EpisodeResult
from ares_gateway.episodes.tasks import Task, prepare_workdir
from ares_gateway.episodes.verifier import (
    VerifierResult,
    WorkspaceCopyError,
    copy_workspace,
    prepare_tests,
    run_tests,
    workspace_limit,
)
from ares_gateway.side_calls import SideCallDetector, with_harness_checks
from harnesses import BaseHarness, HarnessContext, HarnessError, HarnessInstallError, HarnessResult, registry
from harnesses.base import Prepared
from sandbox.local import HARDENED_SYSTEM_PATHS

if TYPE_CHECKING:
    from ares_gateway.gateway import Gateway

log = logging.getLogger(__name__)

#: The port of the agent's LLM endpoint on the sandbox's own loopback: a relay there forwards it to
#: the session's unix socket (``Gateway.agent_socket``). Below Linux's ephemeral range, so no
#: outgoing connection of the agent ever holds it first.
AGENT_PORT = 18790
#: How an episode's sandbox is networked (``EpisodeResult.network``).
NETWORK_MODES = (
    "relay",  # network "none": the sandbox reaches only its own session's LLM endpoint (the default;
    # remote sandboxes and Docker with --tunnel exec reach it over the exec tunnel, sandbox/tunnel.py)
    "internet",  # the task sets [environment] allow_internet = true: the host's network
    "host",  # no relay on this host (local without bubblewrap/root): the gateway's TCP URL
)
#: The image container backends use for tasks that bring none (the agents image has every CLI).
DEFAULT_IMAGE = "ares-gateway/agents:latest"
#: How an episode ended.
EXIT_REASONS = (
    "completed",  # the agent exited by itself (exit 0); the tests gave the reward
    "step_limit",  # truncated: the step limit was hit, the agent stopped; the tests still ran
    "time_limit",  # truncated: the wall-clock limit was hit, the agent stopped; the tests still ran
    # truncated: the session was ended with truncated=true (POST /sessions/{id}/end); the tests ran
    "truncated",
    "agent_error",  # the agent crashed (non-zero exit) or could not be launched: reward 0.0
    "install_error",  # the agent CLI could not be installed: reward 0.0
    "sandbox_error",  # the sandbox could not be created, started or used: reward 0.0
    "cancelled",  # the episode was cancelled (Ctrl-C): no reward
    "memory_limit",  # the sandbox's memory limit killed a process of the agent's: reward 0.0, no tests
    "pids_limit",  # the sandbox refused a fork at its process limit: reward 0.0, no tests
    "disk_limit",  # the sandbox's writable space filled up: reward 0.0, no tests
)
#: The label that marks an episode's grading sandbox (it carries the episode's other labels too).
GRADING_LABEL = "ares-gateway.role"
#: What an episode's sandbox may take when its task names no limit (Harbor's ``memory_mb`` /
#: ``storage_mb``; ``pids`` has no task field). Enough for the four harnesses and a build; a fork
#: bomb or a runaway allocation ends the episode (``*_limit``) instead of taking the host. The disk
#: default applies to local sandboxes only: a Docker engine that cannot bound a writable layer (a
#: remote one, one not on overlay2) refuses to start a sandbox with a disk limit, so there a task
#: that wants one names it (``storage_mb``).
DEFAULT_RESOURCES = sandbox_mod.Resources(memory="4g", pids=1024, disk="10g")
_LOG_LIMIT = 1024 * 1024
_ARTIFACT_LIMIT = 4 * 1024 * 1024


class EpisodeSetupError(Exception):
    """Starting an episode failed; ``reason`` is one of :data:`EXIT_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def harness_side_call_detector(*harnesses: str | BaseHarness | type[BaseHarness]) -> SideCallDetector:
    """A gateway side-call detector: the default one, or any of the harnesses' ``is_side_call`` over the
    raw body. Pass it as ``Gateway(side_call_detector=...)``."""
    checks = []
    for h in harnesses:
        if isinstance(h, str):
            h = registry.get_class(h)  # type: ignore[assignment]
        checks.append(h.is_side_call)  # type: ignore[union-attr]
    return with_harness_checks(checks)


#: How long past an episode's time limit a parked request may wait for its answer.
REQUEST_GRACE_S = 120.0


def episode_gateway(harnesses: str | BaseHarness | Sequence[str | BaseHarness], *, time_limit: float,
                    host: str = "127.0.0.1", port: int = 0, admin_token: str | None = None,
                    data_dir: str | None = None) -> Any:
    """The gateway episodes run against, built here only (``run_rollouts``, ``GatewayEnv``, the CLI and
    the executors' nodes use it): the harnesses' side-call detector, a request timeout of the longest
    episode's ``time_limit`` plus :data:`REQUEST_GRACE_S`, and a control API closed to everyone without
    ``admin_token`` (a random one by default: in-process policies need none)."""
    from ares_gateway.gateway import Gateway

    hs = [harnesses] if isinstance(harnesses, (str, BaseHarness)) else list(harnesses)
    return Gateway(host=host, port=port, request_timeout=time_limit + REQUEST_GRACE_S,
                   side_call_detector=harness_side_call_detector(*hs),
                   admin_token=admin_token or secrets.token_urlsafe(32), data_dir=data_dir)


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``docker`` when an engine answers, else ``local``; other names as they are."""
    if backend == "auto":
        from sandbox.docker import engine_available

        return "docker" if engine_available() else "local"
    if backend not in sandbox_mod.BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}: use auto, {', '.join(sandbox_mod.BACKENDS)}")
    return backend


#: The longest one-line error an episode reports (the whole output stays in its logs).
ERROR_LIMIT = 600


def one_line(text: str | None, limit: int = ERROR_LIMIT) -> str | None:
    """``text`` as one line of at most about ``limit`` characters: its first line (what failed) and as
    many of its last lines (the cause: a traceback's exception, a command's last words) as fit, joined
    with `` | ``. ``None`` stays ``None``; whitespace only gives ``""``."""
    if text is None:
        return None
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    head = lines[0]
    if len(lines) == 1:
        return head if len(head) <= limit else head[: limit - 3] + "..."
    if len(head) > limit // 2:
        head = head[: limit // 2 - 3] + "..."
    budget = limit - len(head)
    tail: list[str] = []
    for line in reversed(lines[1:]):
        if len(line) + 3 > budget:
            if not tail and budget > 40:
                tail.append("..." + line[-(budget - 6):])
            break
        tail.insert(0, line)
        budget -= len(line) + 3
    skipped = len(lines) - 1 - len(tail)
    return " | ".join([head, *(["..."] if skipped else []), *tail])


def last_lines(text: str, limit: int = 400) -> str:
    """The last non-empty lines of ``text`` (an agent's stderr: where the cause is) as one line."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    picked: list[str] = []
    budget = limit
    for line in reversed([line for line in lines if line]):
        if len(line) + 3 > budget:
            if not picked:
                picked.append("..." + line[-(limit - 3):])
            break
        picked.insert(0, line)
        budget -= len(line) + 3
    return " | ".join(picked)


def with_default_resources(res: sandbox_mod.Resources, backend: str = "local") -> sandbox_mod.Resources:
    """``res`` with :data:`DEFAULT_RESOURCES` filled in where it names no limit (the disk on the
    local backend only)."""
    disk = DEFAULT_RESOURCES.disk if backend == "local" else None
    return dataclasses.replace(
        res,
        memory=res.memory if res.memory is not None else DEFAULT_RESOURCES.memory,
        pids=res.pids if res.pids is not None else DEFAULT_RESOURCES.pids,
        disk=res.disk if res.disk is not None else disk,
    )


def local_can_harden() -> bool:
    """Whether the local backend can run a hardened sandbox with a relay here."""
    from sandbox.local import bwrap_available

    return (bwrap_available() and os.geteuid() == 0 and shutil.which("nsenter") is not None
            and shutil.which("setpriv") is not None)


def unrelayed_isolation(task: Task, backend: str) -> tuple[str, bool]:
    """The network mode and hardening of a sandbox of ``task`` on ``backend`` that has no relay (a
    grading sandbox): ``"none"``, hardened where the local backend can; the host's network where the task
    opts into the internet or the local backend cannot isolate."""
    hardened = backend == "local" and local_can_harden()
    network = "host" if task.config.allow_internet or (backend == "local" and not hardened) else "none"
    return network, hardened


def _refused(error: str) -> VerifierResult:
    from ares_gateway.episodes.verifier import Reward

    return VerifierResult(Reward(0.0), None, error)


#: How long :meth:`TaskEpisode.close` waits for a grading sandbox still starting before cancelling it.
GRADER_START_WAIT = 120.0


async def remove_sandbox(sb: sandbox_mod.BaseSandbox) -> None:
    """Stop and remove a sandbox; never raises (a failure falls back to the synchronous removal)."""
    try:
        await sb.stop()
    except BaseException as exc:
        log.warning("removing sandbox %s failed (%s); removing it synchronously", sb.id, exc)
        with contextlib.suppress(Exception):
            sb.stop_and_remove()
        if not isinstance(exc, Exception):
            raise


def _describe(exc: BaseException) -> str:
    """What an exception says, never empty: a harness error without detail says so."""
    if isinstance(exc, HarnessError) and not exc.detail.strip():
        return f"{str(exc).rstrip(': ')} (no error output; the agent's logs may say more)"
    text = str(exc).strip()
    return text or type(exc).__name__


class TaskEpisode:
    """The sandbox and agent of one episode of ``task`` (see the module docstring)."""

    def __init__(
        self,
        task: Task,
        harness: str | BaseHarness,
        *,
        sandbox: str = "auto",
        image: str | None = None,
        model: str = "ares-policy",
        labels: Mapping[str, str] | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        gateway: Gateway | None = None,
        save_workspace: str | os.PathLike[str] | None = None,
    ) -> None:
        self.task = task
        #: Where the agent's final workdir is saved before the tests run (``None``: not saved).
        self.save_workspace = Path(save_workspace) if save_workspace is not None else None
        #: The gateway whose session this episode runs; it serves the session's agent socket.
        self.gateway = gateway
        #: How the sandbox is networked, one of :data:`NETWORK_MODES` (set by :meth:`start`).
        self.network = ""
        self.harness = registry.create(harness) if isinstance(harness, str) else harness
        self.backend = resolve_backend(sandbox)
        self.image = image if image is not None else (DEFAULT_IMAGE if self.backend == "docker" else None)
        self.model = model
        self.labels = dict(labels or {})
        self.sandbox_options = dict(sandbox_options or {})
        self.sandbox: sandbox_mod.BaseSandbox | None = None
        #: The sandbox the tests run in by default (``[verifier] sandbox = "fresh"``): started in the
        #: background once the agent is set up, from the agent's spec without its relay; ``None`` until then.
        self.grading_sandbox: sandbox_mod.BaseSandbox | None = None
        self._grader: asyncio.Task[None] | None = None
        self._grader_seconds = 0.0
        #: The agent user's uid in its sandbox, read before the agent ran (the copy's owner).
        self._agent_uid: str | None = None
        self.ctx: HarnessContext | None = None
        self.prep: Prepared | None = None
        self.agent: asyncio.Task[HarnessResult] | None = None
        self.setup_error: EpisodeSetupError | None = None
        self.setup_seconds = 0.0
        self._launched_at: float | None = None
        self._agent_seconds = 0.0
        self._install_reused: bool | None = None
        self._closed = False
        #: The agent's and the verifier's logs, read when the episode finishes: ``stdout.log``,
        #: ``stderr.log``, the harness's artifacts, ``verifier.log``.
        self.logs: dict[str, str] = {}
        #: The session :meth:`prepare` set this episode up for (``None``: not prepared yet).
        self.session: SessionInfo | None = None
        #: Prepared ahead by a warm pool rather than when the episode began.
        self.warm = False

    # ------------------------------------------------------------------ start

    async def start(self, session: SessionInfo, *, time_budget: float) -> None:
        """Start the sandbox, prepare the workdir, install and launch the agent; raises
        :class:`EpisodeSetupError` (the caller still calls :meth:`finish` / :meth:`close`). An episode
        :meth:`prepare` already set up (a warm one) only launches its agent, or raises the error its
        set-up ended with."""
        if self.session is None:
            await self.prepare(session)
        elif self.session.session_id != session.session_id:
            raise ValueError(f"this episode was prepared for session {self.session.session_id}, "
                             f"not {session.session_id}")
        if self.setup_error is not None:
            raise self.setup_error
        self._launch(session, time_budget)

    async def prepare(self, session: SessionInfo) -> None:
        """Everything before the agent's launch, for ``session``: the sandbox started, the workdir
        prepared, the harness installed and configured. Ahead of the episode in a warm pool
        (:class:`~ares_gateway.episodes.warm.WarmPool`); :meth:`start` then launches the agent. Raises
        :class:`EpisodeSetupError`, which :meth:`start` raises again."""
        if self.session is not None:
            raise RuntimeError("this episode is already prepared")
        self.session = session
        started = time.monotonic()
        try:
            await self._prepare(session)
        except EpisodeSetupError as exc:
            self.setup_error = exc
            raise
        except Exception as exc:  # anything unforeseen is still an episode failure, not a crash
            self.setup_error = EpisodeSetupError("sandbox_error", f"{type(exc).__name__}: {_describe(exc)}")
            raise self.setup_error from exc
        finally:
            self.setup_seconds = time.monotonic() - started

    async def _prepare(self, session: SessionInfo) -> None:
        task, harness = self.task, self.harness
        if self.backend == "local" and task.needs_image:
            log.warning("task %s defines its own image; the local sandbox runs it on this host's tools",
                        task.name)
        spec = task.sandbox_spec(
            default_image=self.image,
            labels={"ares-gateway.session": session.session_id, "ares-gateway.harness": harness.name,
                    **self.labels},
        )
        spec = dataclasses.replace(spec, resources=with_default_resources(spec.resources, self.backend))
        plain = spec
        spec, base_url = await self._isolate(spec, session)
        try:
            sb = sandbox_mod.create(spec, backend=self.backend, **self.sandbox_options)
            self.sandbox = sb
            await sb.start()
        except Exception as exc:
            raise EpisodeSetupError("sandbox_error",
                                    f"starting the {self.backend} sandbox failed: {_describe(exc)}") from exc
        workdir = sb.workdir if task.workdir == sb.spec.workdir else task.workdir
        ctx = HarnessContext(workdir=workdir, session_id=session.session_id, base_url=base_url,
                             token=session.token, model=self.model)
        self.ctx = ctx
        try:
            self.prep = await harness.prepare(sb, ctx)
            await prepare_workdir(sb, task, user=self.prep.user)
        except HarnessError as exc:
            raise EpisodeSetupError("agent_error", _describe(exc)) from exc
        except sandbox_mod.SandboxError as exc:
            raise EpisodeSetupError(
                "sandbox_error", f"preparing the workdir failed: {_describe(exc)}"
            ) from exc
        try:
            info = await harness.install(sb)
            self._install_reused = info.reused
        except HarnessInstallError as exc:
            raise EpisodeSetupError("install_error", _describe(exc)) from exc
        except sandbox_mod.SandboxError as exc:
            raise EpisodeSetupError(
                "install_error", f"harness {harness.name!r}: install failed: {exc}"
            ) from exc
        try:
            await harness.write_config(sb, ctx)
        except (HarnessError, sandbox_mod.SandboxError) as exc:
            raise EpisodeSetupError("agent_error", f"writing the agent's config failed: {exc}") from exc
        if task.config.grading == "fresh" and self.prep.user not in (None, "root", "0"):
            # Read now, before the agent ran: what its sandbox says later is the agent's to say.
            uid = await sb.exec("id -u", user=self.prep.user, cwd="/", timeout=30)
            self._agent_uid = uid.stdout.strip() if uid.ok and uid.stdout.strip().isdigit() else None
            if self._agent_uid is None:
                raise EpisodeSetupError("sandbox_error",
                                        f"cannot read the uid of the agent's user {self.prep.user!r}: "
                                        f"{(uid.stderr or uid.stdout).strip()[-300:]}")
        if task.config.grading == "fresh":
            # The grading sandbox: the agent's spec (its image, resources and network mode) without the
            # relay to the session and without the agent's install mounted; it starts now, in the
            # background, and is ready by the time the agent is done (a warm episode's with it).
            grading_spec = dataclasses.replace(
                spec, forwards={}, readonly_paths=plain.readonly_paths,
                labels={**spec.labels, GRADING_LABEL: "grading"})
            self._grader = asyncio.create_task(self._start_grader(grading_spec),
                                               name=f"ares-grader-{session.session_id}")

    def _launch(self, session: SessionInfo, time_budget: float) -> None:
        """Launch the agent."""
        task, harness, sb, ctx = self.task, self.harness, self.sandbox, self.ctx
        assert sb is not None and ctx is not None
        self._launched_at = time.monotonic()
        self.agent = asyncio.create_task(
            harness.launch_and_wait(sb, ctx, task.instruction, time_budget),
            name=f"ares-agent-{session.session_id}",
        )

    async def _isolate(
        self, spec: sandbox_mod.SandboxSpec, session: SessionInfo
    ) -> tuple[sandbox_mod.SandboxSpec, str]:
        """The sandbox's network and the base URL the agent gets.

        By default the sandbox has no network (``network="none"``; local: hardened bubblewrap, the
        agent as an unprivileged user) and one relay: ``127.0.0.1:AGENT_PORT`` inside reaches the
        session's own unix socket, which serves only that session's LLM endpoints. A task that sets
        ``[environment] allow_internet = true`` gets the host's network (a remote sandbox: the
        internet). A remote sandbox (Daytona, Kubernetes, Modal) has no socket to mount: its backend
        carries the forward over the provider's exec channel (``sandbox/tunnel.py``), so it too runs
        with its network blocked, and reaches its session that way even with open egress. A local
        backend without bubblewrap and root keeps the TCP URL and says so.
        """
        task = self.task
        hardened = self.backend == "local" and local_can_harden()
        readonly = tuple(spec.readonly_paths)
        root = getattr(self.harness, "install_root", None)
        if hardened and root and not any(
            root == p or root.startswith(p + "/") for p in HARDENED_SYSTEM_PATHS
        ):
            readonly = (*readonly, root)  # the install provisioned on this host, read-only inside
        gw = self.gateway
        remote = sandbox_mod.backend_class(self.backend).remote
        if task.config.allow_internet:
            self.network = "internet"
            spec = dataclasses.replace(spec, network="host", hardened=hardened, readonly_paths=readonly)
            if remote and gw is not None:
                # The internet, and its session still over the tunnel: the host's loopback URL means
                # nothing on another machine.
                log.warning("task %s sets [environment] allow_internet = true: its sandbox has open egress",
                            task.name)
                sock = await gw.agent_socket(session.session_id)
                return dataclasses.replace(spec, forwards={AGENT_PORT: sock}), \
                    f"http://127.0.0.1:{AGENT_PORT}/s/{session.session_id}"
            log.warning("task %s sets [environment] allow_internet = true: its sandbox shares the host's "
                        "network (the agent can reach the host's loopback services and the internet)",
                        task.name)
            return spec, session.base_url
        reason = None
        if gw is None:
            reason = "the episode was given no gateway to serve the session's socket"
        elif self.backend == "local" and not hardened:
            reason = "the local backend needs bubblewrap, root, nsenter and setpriv to isolate"
        if reason is not None or gw is None:
            self.network = "host"
            log.warning("task %s: %s; the sandbox keeps the host's network and reaches the gateway at %s",
                        task.name, reason, session.base_url)
            return dataclasses.replace(spec, network="host", hardened=hardened, readonly_paths=readonly), \
                session.base_url
        sock = await gw.agent_socket(session.session_id)
        self.network = "relay"
        spec = dataclasses.replace(spec, network="none", hardened=hardened, readonly_paths=readonly,
                                   forwards={AGENT_PORT: sock})
        return spec, f"http://127.0.0.1:{AGENT_PORT}/s/{session.session_id}"

    async def _start_grader(self, spec: sandbox_mod.SandboxSpec) -> None:
        started = time.monotonic()
        try:
            gsb = sandbox_mod.create(spec, backend=self.backend, **self.sandbox_options)
            self.grading_sandbox = gsb
            await gsb.start()
        finally:
            self._grader_seconds = time.monotonic() - started

    # ------------------------------------------------------------------ finish

    async def stop_agent(self) -> None:
        """Stop a running agent: cancel the wait, then kill its process group and session in the sandbox."""
        agent = self.agent
        if agent is None or agent.done():
            return
        agent.cancel()
        await asyncio.gather(agent, return_exceptions=True)
        if self._launched_at is not None:
            self._agent_seconds = time.monotonic() - self._launched_at
        if self.sandbox is not None and self.prep is not None and self.sandbox.state == "running":
            try:
                await self.harness.kill(self.sandbox, self.prep)
            except Exception as exc:
                log.warning("could not kill the agent in sandbox %s: %s", self.sandbox.id, exc)

    async def finish(self, *, truncation: str | None = None) -> EpisodeResult:
        """End the episode: stop the agent if it still runs, read the logs (into :attr:`logs`), verify,
        and say how it ended: its result, with ``attempt``, ``turns`` and ``duration`` left 0 (what the
        gateway recorded is the driver's to add).

        ``truncation`` (``step_limit`` / ``time_limit``) says that a limit ended it. Never raises
        for what the agent, the sandbox or the tests did.
        """
        out = EpisodeResult(task=self.task.name, attempt=0, reward=0.0, turns=0, duration=0.0,
                            exit_reason="completed", harness=self.harness.name, sandbox=self.backend,
                            setup_seconds=self.setup_seconds, install_reused=self._install_reused,
                            warm=self.warm, network=self.network)
        if self.setup_error is not None:
            out.exit_reason, out.error = self.setup_error.reason, one_line(self.setup_error.message)
            await self._read_logs()
            return out
        if self.agent is None:
            out.exit_reason, out.error = "sandbox_error", "the episode was never started"
            return out
        result: HarnessResult | None = None
        if truncation is not None:
            await self.stop_agent()
            out.exit_reason, out.truncated = truncation, True
        else:
            try:
                result = await self.agent
            except asyncio.CancelledError:
                if not self.agent.cancelled():
                    raise  # we are being cancelled ourselves
                out.exit_reason, out.error = "cancelled", "the agent was stopped"
            except HarnessError as exc:
                out.exit_reason, out.error = "agent_error", _describe(exc)
            except sandbox_mod.SandboxError as exc:
                # The agent could have brought its own sandbox down: the agent's once the policy had a say.
                out.exit_reason, out.error = (
                    "sandbox_error", f"the sandbox failed while the agent ran: {_describe(exc)}"
                )
                out.failure_site = AGENT_SANDBOX
            except Exception as exc:
                out.exit_reason, out.error = "agent_error", f"{type(exc).__name__}: {exc}"
            if self._launched_at is not None:
                self._agent_seconds = time.monotonic() - self._launched_at
        if result is not None:
            out.agent_exit_code = result.exit_code
            if result.timed_out:
                out.exit_reason, out.truncated = "time_limit", True
            elif result.exit_code != 0:
                out.exit_reason = "agent_error"
                how = (f"exited with code {result.exit_code}" if result.exit_code is not None
                       else "stopped without reporting an exit code (killed?)")
                # The cause is at the end of what it printed (a traceback's last line, an error message).
                out.error = (
                    f"the agent {how}: "
                    f"{last_lines(result.stderr_tail) or last_lines(result.stdout_tail) or '(no output)'}"
                )
        sb = self.sandbox
        if out.exit_reason == "agent_error" and sb is not None and sb.state != "running":
            # Its sandbox was stopped under it, so the agent died with it (whether the harness saw the
            # sandbox go or its process killed first is a race): the verdict of a sandbox error raised
            # while it ran, not of an agent CLI that failed by itself.
            out.exit_reason = "sandbox_error"
            out.error = f"the sandbox failed while the agent ran: it is {sb.state}; {out.error}"
            out.failure_site = AGENT_SANDBOX
        out.agent_seconds = self._agent_seconds
        await self._note_limits(out)
        out.error = one_line(out.error)
        await self._read_logs()
        if out.exit_reason in ("completed", "step_limit", "time_limit"):
            started = time.monotonic()
            out.grading = self.task.config.grading
            if out.grading == "fresh":
                # Nothing the agent started runs while its workdir is archived (the tests run elsewhere);
                # the grading sandbox, started while the agent ran, is usually up by now.
                grader_error, quiet_error = await asyncio.gather(
                    self._grader_ready(), self.kill_agent_processes()
                )
                out.grading_setup_seconds = self._grader_seconds
                if grader_error is not None:
                    out.exit_reason, out.error = "sandbox_error", one_line(grader_error)
                    out.failure_site = GRADING_SANDBOX
                    out.verify_seconds = time.monotonic() - started
                    return out
                verdict = await self.verify(out) if quiet_error is None else _refused(quiet_error)
            else:
                # [verifier] sandbox = "agent": the tests need what the agent left running, so nothing is
                # killed; its processes can act while the tests run (docs/rollouts.md says what that costs).
                verdict = await self.verify(out)
            out.verify_seconds = time.monotonic() - started
            out.reward = verdict.reward.value
            out.reward_parts = dict(verdict.reward.parts)
            out.reward_source = verdict.reward.source
            out.verifier_error = one_line(verdict.error)
            out.verifier_crashed = verdict.crashed
            if verdict.crashed:
                out.failure_site = verdict.failure_site
            if verdict.script is not None:
                self.logs["verifier.log"] = (
                    f"exit code {verdict.script.exit_code} (timed out: {verdict.script.timed_out}, "
                    f"{verdict.script.duration:.1f} s)\n--- stdout\n{verdict.script.stdout}\n"
                    f"--- stderr\n{verdict.script.stderr}\n"
                )
            if verdict.error is not None:
                self.logs.setdefault("verifier.log", "")
                self.logs["verifier.log"] += f"error: {verdict.error}\n"
        return out

    async def _note_limits(self, out: EpisodeResult) -> None:
        """A resource limit the sandbox hit while the agent ran ends the episode as ``<name>_limit``
        (whatever else the agent did): the tests do not run, the reward is 0.0."""
        sb = self.sandbox
        if sb is None or out.exit_reason == "cancelled":
            return
        reached = await sb.limits_reached()
        if not reached:
            return
        name = next(n for n in ("memory", "pids", "disk") if n in reached)
        res = sb.spec.resources
        amount = {"memory": res.memory, "pids": res.pids, "disk": res.disk}[name]
        was = (
            f" (before: {out.exit_reason}{': ' + out.error if out.error else ''})"
            if out.exit_reason != "completed" else ""
        )
        out.exit_reason, out.truncated = f"{name}_limit", False
        out.error = f"the sandbox hit its {name} limit ({amount}){was}"

    async def kill_agent_processes(self) -> str | None:
        """Kill every process in the sandbox (the agent's detached ones too) and wait until none is left.

        Returns why the tests must not run (something survived), or ``None``. A backend that cannot
        kill everything (Daytona) keeps the harness's kill of the agent's process group and session.
        """
        sb = self.sandbox
        if sb is None or sb.state != "running":
            return None
        try:
            killed = await sb.kill_processes(timeout=30.0)
        except sandbox_mod.NotSupportedError:
            log.warning("the %s backend cannot kill every process: only the agent's process group and "
                        "session were killed before the tests", sb.backend)
            return None
        except sandbox_mod.SandboxError as exc:
            return ("processes the agent left survived being killed, so the tests were not run: "
                    f"{_describe(exc)}")
        if killed:
            log.info("killed %d process(es) left in sandbox %s before the tests", killed, sb.id)
        return None

    async def _grader_ready(self) -> str | None:
        """Wait for the grading sandbox to be started; why it is not usable, or ``None``."""
        if self._grader is None:
            return "the grading sandbox was never started"
        try:
            await asyncio.shield(self._grader)
        except asyncio.CancelledError:
            if not self._grader.cancelled():
                raise  # we are being cancelled ourselves
            return "starting the grading sandbox was cancelled"
        except Exception as exc:
            return f"starting the {self.backend} grading sandbox failed: {_describe(exc)}"
        return None

    async def verify(self, out: EpisodeResult | None = None) -> VerifierResult:
        """Run the task's tests (their own timeout) and read the reward; never raises.

        ``[verifier] sandbox = "fresh"`` (the default): prepare the tests in the grading sandbox, copy
        the agent's workdir into it (the agent's processes must be gone: :meth:`kill_agent_processes`)
        and run them there; ``"agent"``: run them in the agent's sandbox. ``out`` gets the copy's size.

        A crash says where its cause lies (``VerifierResult.failure_site``): in the agent's sandbox
        (it is not running, the copy out of it failed, the verifier's setup in it failed; also the
        grading sandbox when the agent's copy made it hit a limit) or in the grading sandbox.
        """
        from ares_gateway.episodes.verifier import Reward

        sb = self.sandbox
        if sb is None or sb.state != "running":
            return VerifierResult(Reward(0.0), None, "the sandbox is not running", crashed=True,
                                  failure_site=AGENT_SANDBOX)
        verifier_user = self.task.config.verifier_user
        if (verifier_user is not None and self.prep is not None
                and verifier_user in {self.prep.user, self._agent_uid}):
            return VerifierResult(Reward(0.0), None, (
                f"task {self.task.name}: [verifier] user = {verifier_user!r} is the agent's user; the tests "
                "never run as the user whose work they judge: drop that line of task.toml (root runs them) "
                "or name another user"))
        if self.task.config.grading == "agent":
            # Everything here runs in the agent's sandbox, which the agent may have broken (a full disk,
            # a removed /tmp): a crash is the agent's once the policy had a say.
            if self.save_workspace is not None and self.ctx is not None:
                workspaces.note(out, await workspaces.save_from_sandbox(
                    sb, self.ctx.workdir, self.save_workspace, limit=workspace_limit(self.task),
                    episode=self.task.name))
            verdict = await run_tests(sb, self.task)
            return dataclasses.replace(verdict, failure_site=AGENT_SANDBOX) if verdict.crashed else verdict
        gsb, ctx = self.grading_sandbox, self.ctx
        if gsb is None or gsb.state != "running" or ctx is None:
            return VerifierResult(Reward(0.0), None, "the grading sandbox is not running", crashed=True,
                                  failure_site=GRADING_SANDBOX)
        # The verifier's own setup first, while nothing of the agent's is in the grading sandbox: its
        # failure is the infrastructure's, whatever the agent did.
        failed = await prepare_tests(gsb, self.task)
        if failed is not None:
            return dataclasses.replace(failed, failure_site=GRADING_SANDBOX)
        workdir = gsb.workdir if self.task.workdir == gsb.spec.workdir else self.task.workdir
        # The saved workspace is the archive the copy makes anyway, written into the run, not to /tmp.
        final, limit = self.save_workspace, workspace_limit(self.task)
        keep, why = workspaces.prepare(final) if final is not None else (None, None)
        if why is not None:
            workspaces.note(out, workspaces.SavedWorkspace(error=why))

        async def save(*, too_large: bool = False, error: str | None = None, whole: bool = False) -> None:
            if keep is not None and final is not None:
                saved = await workspaces.seal_async(keep, final, limit=limit, too_large=too_large,
                                                    error=error, episode=self.task.name, whole=whole)
                workspaces.note(out, saved, self._agent_uid)

        try:
            size = await copy_workspace(sb, gsb, src_workdir=ctx.workdir, dst_workdir=workdir,
                                        user=self._agent_uid, limit=limit,
                                        timeout=max(60.0, self.task.config.verifier_timeout), keep=keep)
        except WorkspaceCopyError as exc:
            await save(too_large=not exc.crashed, error=str(exc))
            if not exc.crashed:  # a verdict on what the agent left (too large to grade)
                return VerifierResult(Reward(0.0), None, str(exc))
            site = exc.site if exc.site == AGENT_SANDBOX else await self._grading_site(gsb)
            return VerifierResult(Reward(0.0), None, str(exc), crashed=True, failure_site=site)
        except sandbox_mod.SandboxError as exc:
            await save(error=str(exc))
            return VerifierResult(Reward(0.0), None,
                                  f"copying the workdir into the grading sandbox failed: {_describe(exc)}",
                                  crashed=True,
                                  failure_site=await self._grading_site(gsb))
        await save(whole=True)
        if out is not None:
            out.copied_bytes = size
        verdict = await run_tests(gsb, self.task, prepared=True)
        return (
            dataclasses.replace(verdict, failure_site=await self._grading_site(gsb))
            if verdict.crashed else verdict
        )

    @staticmethod
    async def _grading_site(gsb: sandbox_mod.BaseSandbox) -> str:
        """Where a failure in the grading sandbox after the agent's workdir went in lies: the agent's
        when that sandbox hit a limit (its copy filled the disk, its code run by the tests took the
        memory or the processes), else the grading sandbox's."""
        return AGENT_SANDBOX if await gsb.limits_reached() else GRADING_SANDBOX

    async def _read_logs(self) -> None:
        """The agent's stdout/stderr and the harness's artifacts, read from the sandbox (best effort)."""
        sb, prep, ctx = self.sandbox, self.prep, self.ctx
        if sb is None or prep is None or ctx is None or sb.state != "running":
            return
        wanted = {
            "stdout.log": (posixpath.join(prep.state_dir, "stdout.log"), _LOG_LIMIT),
            "stderr.log": (posixpath.join(prep.state_dir, "stderr.log"), _LOG_LIMIT),
        }
        for name, path in self.harness.artifact_paths(ctx, prep).items():
            wanted.setdefault(name, (path, _ARTIFACT_LIMIT))
        for name, (path, limit) in wanted.items():
            # A glob picks the newest match (some agents name their logs by date).
            quoted = path if any(c in path for c in "*?[") else shlex.quote(path)
            cmd = f'f=$(ls -t {quoted} 2>/dev/null | head -n 1); [ -n "$f" ] && tail -c {limit} "$f"'
            try:
                r = await sb.exec(["sh", "-c", cmd], user=prep.user, cwd="/", timeout=60)
            except Exception as exc:
                log.debug("could not read %s: %s", path, exc)
                continue
            if r.ok:
                self.logs[name] = r.stdout

    # ------------------------------------------------------------------ close

    async def close(self) -> None:
        """Stop the agent and remove the sandbox. Idempotent; safe after a cancellation."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stop_agent()
        except Exception as exc:
            log.warning("stopping the agent failed: %s", exc)
        finally:
            grader = self._grader
            try:
                if grader is not None and not grader.done():
                    # Let a start under way finish (a backend's thread may still be creating the
                    # sandbox), then remove it; cancel it only when it hangs.
                    await asyncio.wait({grader}, timeout=GRADER_START_WAIT)
                    if not grader.done():
                        grader.cancel()
                if grader is not None:
                    await asyncio.gather(grader, return_exceptions=True)
            finally:
                await asyncio.gather(
                    *(remove_sandbox(s) for s in (self.sandbox, self.grading_sandbox) if s is not None)
                )
