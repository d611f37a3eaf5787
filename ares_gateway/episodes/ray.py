"""Episodes on a Ray cluster: :class:`RayExecutor`, one gateway actor per node (extra ``.[ray]``).

Each alive node with CPUs gets one async actor, pinned to it (``NodeAffinitySchedulingStrategy(node_id,
soft=False)``, ``num_cpus=0``), which owns one gateway
(:func:`~ares_gateway.episodes.episode.episode_gateway`)
and runs up to ``per_node`` episodes at once with :func:`~ares_gateway.episodes.driver.drive_episode`,
their sandboxes on its node. The scheduler sends each episode to the least-loaded actor; the
:class:`~ares_gateway.episodes.driver.EpisodeRecord` comes back as plain data and the driver writes it
into the same OUT layout as a local run, with the node in ``"node"``.

Before any episode, each actor checks that its node can run the run's sandboxes (``docker``: the engine
answers and has the image; ``local``: the harness's CLI is installed on the node, installed there now
when missing); nodes that cannot are left out, and a cluster where none can is a :class:`NoNodesError`
with each node's reason.

An actor that dies mid-episode (its process or its node lost): the episode is run again on another
actor, under the same attempt number, so it finishes once; at close, every live node removes what a
dead owner left (the sandbox janitor's own gc). Cancelling an episode (Ctrl-C, ``stop``) cancels it on
its actor, and :meth:`RayExecutor.close` waits until every actor's episodes have removed their sandboxes.

The policy travels to each actor by value (cloudpickle): the scripted and oracle policies, an
``upstream`` or ``tito`` policy over HTTP engines (one engine server reached from every node), a
``tito`` policy on in-process llama.cpp (each actor loads its own copy of the model), or an external
policy (``http``): its requests wait on each actor's gateway, listed by :meth:`RayExecutor.describe`
(``host=`` makes them reachable from outside the node; the admin token is given, never printed).

Policy versions and the weight-update fence reach every node's gateway:
:meth:`RayExecutor.set_policy_version`,
:meth:`~RayExecutor.pause_sampling`, :meth:`~RayExecutor.resume_sampling` and
:meth:`~RayExecutor.weight_update`
call each actor at once and return when all have answered. A pause's report adds the nodes' up (the drain:
the slowest node's); a node whose pause fails has the others resumed, and the error names it.

Task directories must be readable at the same path on every node (a shared filesystem), or shipped
with Ray's runtime environment (``RayExecutor(runtime_env={"working_dir": ...})``).

**Ray on loopback.** On a machine whose own address must not be used, start Ray with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment (Ray then takes 127.0.0.1 as the node
address; ``RAY_NODE_IP_ADDRESS`` / ``_node_ip_address`` alone still left its GCS on the host address here).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from ares_gateway.core.canonical import next_policy_version
from ares_gateway.core.errors import SamplingNotPausedError, SamplingPausedError, StatusError
from ares_gateway.core.fence import PauseReport, check_pause
from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec, drive_episode
from ares_gateway.episodes.episode import episode_gateway, one_line
from ares_gateway.episodes.episode_spec import EpisodeConfig
from ares_gateway.episodes.executor import fenced_update
from ares_gateway.episodes.tasks import Task
from ares_gateway.episodes.warm import WarmPool, check_warm
from ares_gateway.extras import require_extra
from ares_gateway.policies.base import Policy
from sandbox.start_rate import ENV_VAR as START_RATE_ENV
from sandbox.start_rate import start_rates

log = logging.getLogger(__name__)

__all__ = ["ClusterUnreachableError", "NoNodesError", "RayExecutor", "check_cluster_reachable",
           "collect_on_nodes"]

#: Seconds an actor's close may take: its episodes' cancellation removes their sandboxes first.
CLOSE_TIMEOUT = 120.0
#: Seconds to reach the cluster's address before giving up (:class:`RayExecutor`'s ``connect_timeout``,
#: ``run --ray-connect-timeout``). ``ray.init`` itself retries an address that does not answer for many
#: minutes, saying nothing.
CONNECT_TIMEOUT = 20.0

# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the Ray
# Client server) answers with a SETTINGS frame of its own (frame type 4, the header's fourth byte).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


class NoNodesError(RuntimeError):
    """The Ray cluster has no alive node that can run the run's episodes; the message says why for each."""


class ClusterUnreachableError(ConnectionError):
    """The Ray cluster's address did not answer as a Ray cluster in time; the message names it and why."""

    def __init__(self, address: str | None, timeout: float, why: str) -> None:
        super().__init__(f"cannot reach the Ray cluster at {address or 'auto'} within {timeout:g} s: {why}")
        self.address = address
        self.timeout = timeout


def _gcs_endpoint(address: str) -> tuple[str, int] | None:
    """Where ``ray.init(address=...)`` connects: ``(host, port)``, or ``None`` when it starts a cluster of
    its own. Ray's own resolution (``auto``: ``RAY_ADDRESS`` or the last ``ray start``; ``localhost``: the
    node's address, 127.0.0.1 under ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), so the probe reaches what
    Ray would."""
    if address == "local":
        return None
    if address.startswith("ray://"):
        hostport: str | None = address[len("ray://"):].split("/", 1)[0]
    else:
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # a Ray without it: the address as given
            hostport = None if address == "auto" else address
        else:
            hostport = canonicalize_bootstrap_address(address)  # ConnectionError: no cluster for "auto"
    if hostport is None:
        return None
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{hostport!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_cluster_reachable(address: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise :class:`ClusterUnreachableError` unless the Ray cluster at ``address`` answers within
    ``timeout`` seconds: a TCP connection to its GCS (or Ray Client server, ``ray://``) that answers as a
    gRPC server does. ``None`` and ``"local"`` have nothing to reach (``ray.init`` starts a cluster)."""
    if address is None:
        return
    started = time.monotonic()
    try:
        endpoint = _gcs_endpoint(address)
    except ConnectionError as exc:  # "auto" without a cluster
        raise ClusterUnreachableError(address, timeout,
                                      one_line(str(exc), 300) or type(exc).__name__) from None
    except ValueError as exc:
        raise ClusterUnreachableError(address, timeout, f"{one_line(str(exc), 200)}: give HOST:PORT (e.g. "
                                                        "127.0.0.1:6379), ray://HOST:PORT or auto") from None
    if endpoint is None:
        return
    host, port = endpoint
    hint = "start it (ray start --head) or give the address `ray status` shows on its head node"
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # TLS first: the gRPC check below would need the cluster's certificates
            conn.settimeout(max(0.05, timeout - (time.monotonic() - started)))
            conn.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                piece = conn.recv(9 - len(head))
                if not piece:
                    break
                head += piece
    except TimeoutError:
        raise ClusterUnreachableError(address, timeout, f"{host}:{port} did not answer; {hint}") from None
    except ConnectionRefusedError:
        raise ClusterUnreachableError(address, timeout,
                                      f"connection refused at {host}:{port} (nothing listens "
                                                        f"there); {hint}") from None
    except OSError as exc:
        raise ClusterUnreachableError(address, timeout,
                                      f"{host}:{port}: {exc.strerror or exc}; {hint}") from None
    if len(head) < 9 or head[3] != 4:
        raise ClusterUnreachableError(address, timeout,
                                      f"{host}:{port} answers, but not as a Ray cluster's GCS "
                                                        "(a gRPC server): give the GCS port (6379 by "
                                                        "default), not the dashboard's or another service's")


def _ray() -> Any:
    return require_extra("ray", "ray")


#: A node call's outcome when its actor died.
_LOST = object()


class _NodeGateway:
    """The per-node actor: one gateway, episodes on this node (made a Ray actor class at start)."""

    def __init__(self) -> None:
        self.gateway: Any = None
        self.policy: Policy | None = None
        self.node = ""
        self.options: dict[str, Any] = {}
        self.running: set[asyncio.Task[Any]] = set()
        self.tasks_moved: tuple[str, str] | None = None
        self.pool: WarmPool | None = None

    async def start(self, harness: str, time_limit: float, policy: Policy, sandbox: str, image: str | None,
                    tasks: list[Task], host: str, admin_token: str | None,
                    tasks_root: str | None = None, policy_version: int | None = None,
                    warm: int = 0) -> dict[str, Any]:
        """Check this node can run the episodes, then start its gateway; ``{"node", "ok", "why", "url"}``.
        ``tasks_root``: the driver's ``working_dir``, which Ray unpacked here as this actor's cwd;
        ``policy_version``: the run's version so far; ``warm``: this node's warm pool size."""
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        here = os.getcwd()
        if tasks_root and here != tasks_root:  # both real paths (getcwd, and _tasks_root on the driver)
            self.tasks_moved = (tasks_root, here)
            tasks = [t.moved(tasks_root, here) for t in tasks]
        try:
            self.options = await _node_check(harness, sandbox, image, tasks)
        except Exception as exc:  # PreflightError: one line saying what to do
            return {"node": self.node, "ok": False, "why": one_line(str(exc)) or type(exc).__name__}
        self.policy = policy
        self.gateway = episode_gateway(harness, time_limit=time_limit, host=host, admin_token=admin_token)
        await self.gateway.start()
        if policy_version is not None:
            self.gateway.set_policy_version(policy_version)
        if warm:
            self.pool = WarmPool(self.gateway, warm)
        return {"node": self.node, "ok": True, "why": "", "url": self.gateway.url}

    def _here(self, spec: EpisodeSpec) -> EpisodeSpec:
        """``spec`` as this node runs it."""
        if self.options:  # this node's install root, not the driver's
            spec = dataclasses.replace(spec, episode=dataclasses.replace(
                spec.episode, harness_options={**spec.episode.harness_options, **self.options}))
        if self.tasks_moved:  # this node's copy of the task folders
            spec = dataclasses.replace(spec, task=spec.task.moved(*self.tasks_moved))
        return spec

    async def expect(self, specs: list[EpisodeSpec]) -> None:
        """Episodes the driver will run here next: this node's warm pool sets them up ahead."""
        if self.pool is not None:
            self.pool.expect([self._here(s) for s in specs])

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        task = asyncio.current_task()
        assert task is not None
        self.running.add(task)
        try:
            spec = self._here(spec)
            assert self.policy is not None and self.gateway is not None, "run() before start()"
            record = await drive_episode(spec, policy=self.policy, gateway=self.gateway, warm=self.pool)
            record.result.node = self.node
            return record
        finally:
            self.running.discard(task)

    def turns_answered(self) -> int:
        return int(self.gateway.metrics.answered_total) if self.gateway is not None else 0

    # The fence and the policy version, on this node's gateway (coroutines: they run on the actor's loop,
    # where the gateway lives).

    async def set_policy_version(self, version: int) -> None:
        self.gateway.set_policy_version(version)

    async def pause_sampling(self, mode: str, timeout: float | None) -> PauseReport:
        report: PauseReport = await self.gateway.pause_sampling(mode, timeout=timeout)
        return report

    async def resume_sampling(self, version: int | None) -> float:
        return float(self.gateway.resume_sampling(version))

    async def sampling(self) -> dict[str, Any]:
        """The fence's state and the policy version (``GET /sampling``'s, plus ``"policy_version"``)."""
        return {**self.gateway.fence.snapshot(), "policy_version": self.gateway.policy_version}

    async def close(self) -> int:
        """Cancel what still runs and wait until each episode removed its sandbox; then the gateway.
        Returns how many episodes were cancelled."""
        cancelled = list(self.running)
        for t in cancelled:
            # One already being cancelled (ray.cancel from the driver) is removing its sandbox: a
            # second cancel would interrupt that removal and leave the sandbox behind.
            if not t.cancelling():
                t.cancel()
        if cancelled:
            await asyncio.wait(cancelled, timeout=CLOSE_TIMEOUT)
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()
        if self.gateway is not None:
            await self.gateway.close()
            self.gateway = None
        aclose = getattr(self.policy, "aclose", None)
        if aclose is not None:  # this node's copy: its engine's worker thread or HTTP connections
            with contextlib.suppress(Exception):
                await aclose()
        return len(cancelled)


async def _node_check(harness: str, sandbox: str, image: str | None, tasks: list[Task]) -> dict[str, Any]:
    """On a node: the driver's preflight of one host (the Docker engine and image, the harness
    installed for local sandboxes); the harness options that node's episodes need."""
    from ares_gateway.episodes.episode import resolve_backend
    from ares_gateway.episodes.preflight import preflight

    report = await preflight(policy=None, backend=resolve_backend(sandbox), harness=harness, tasks=tasks,
                             image=image, quiet=True)
    return report.harness_options


def _collect_garbage(backends: tuple[str, ...], dry_run: bool) -> Any:
    """On one node: remove the sandboxes whose owner process is gone (a dead actor's, a dead driver's)."""
    from sandbox import collect_garbage

    return collect_garbage(backends, dry_run=dry_run)


def with_start_rate(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """``runtime_env`` for a node's actor, with this process's cap on sandbox starts (every backend's,
    :func:`sandbox.limit_start_rate`) in its ``env_vars`` when one is set and the caller set none, so
    each node's sandboxes start no faster than this process's would."""
    env = dict(runtime_env)
    every_backend = start_rates().get(None)
    if every_backend is not None:
        env_vars = dict(env.get("env_vars") or {})
        env_vars.setdefault(START_RATE_ENV, repr(every_backend[0]))
        env["env_vars"] = env_vars
    return env


async def collect_on_nodes(nodes: Sequence[str] | None = None, *,
                           backends: Sequence[str] = ("local", "docker"),
                           dry_run: bool = False, timeout: float = 120.0) -> dict[str, Any]:
    """Run the sandbox janitor's gc on ``nodes`` (default: every alive node) of the connected Ray cluster:
    each removes the sandboxes whose owner process is gone. ``{node id: its sandbox.GcReport}``; a node
    that cannot be reached is left out (logged)."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if nodes is None:
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    collect = ray.remote(num_cpus=0, max_retries=0)(_collect_garbage)
    out: dict[str, list[str]] = {}
    for node in nodes:
        try:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            ref = collect.options(scheduling_strategy=strategy).remote(tuple(backends), dry_run)
            out[node] = await asyncio.wait_for(ref, timeout=timeout)
        except Exception as exc:  # the node is gone: nothing of it to reach
            log.warning("could not collect garbage on node %s: %s", node[:12], type(exc).__name__)
    return out


class RayExecutor:
    """Runs episodes on a Ray cluster (see the module docstring).

    Args:
        address: the cluster (``"auto"``, ``"ray://..."``, ``"127.0.0.1:6379"``); ``None``: the one this
            process is connected to, else a local one.
        per_node: episodes at once on each node.
        runtime_env: Ray's runtime environment for the actors (e.g. ``{"working_dir": "tasks/"}``).
        init_options: more ``ray.init`` arguments.
        connect_timeout: seconds to reach ``address`` before :meth:`start` raises
            :class:`ClusterUnreachableError` (``ray.init`` alone retries an address that does not answer
            for many minutes).
        host: the address each actor's gateway listens on (``127.0.0.1``; an external policy polling
            from another machine needs the node's own address).
        admin_token: the actors' gateways' admin token (an external policy's ``/poll``); by default each
            gateway generates its own.
        warm: each node's warm pool (:class:`~ares_gateway.episodes.warm.WarmPool`): the driver hands
            each node up to this many of the planned episodes ahead (:meth:`expect`), which it sets up
            while earlier ones run, and runs each of them on the node that set it up.
    """

    kind = "ray"

    def __init__(self, address: str | None = None, *, per_node: int = 4,
                 runtime_env: Mapping[str, Any] | None = None, init_options: Mapping[str, Any] | None = None,
                 host: str = "127.0.0.1", admin_token: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT, warm: int = 0) -> None:
        if per_node < 1:
            raise ValueError(f"per_node must be at least 1, got {per_node}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be a positive number of seconds, got {connect_timeout}")
        self.address = address
        self.per_node = per_node
        self.runtime_env = dict(runtime_env or {})
        self.init_options = dict(init_options or {})
        self.host = host
        self.connect_timeout = connect_timeout
        self._admin_token = admin_token
        self._actors: dict[str, Any] = {}  # node id -> actor handle
        self._load: dict[str, int] = {}
        self._answered = 0
        self._owns_ray = False
        self._external = False
        #: The control URL of each node's gateway (where an external policy's requests wait).
        self.urls: dict[str, str] = {}
        #: Nodes left out at start, and why (they could not run the run's sandboxes).
        self.refused: dict[str, str] = {}
        #: Keys of episodes run again because the actor running them died.
        self.reruns: list[str] = []
        #: Nodes whose actor died.
        self.lost: list[str] = []
        #: Sandboxes removed at close because their owner was gone (a dead actor's).
        self.collected: list[str] = []
        #: Episodes still running on an actor when it was closed (each removed its sandbox).
        self.cancelled_at_close = 0
        #: Each node's report of the last pause that returned (:meth:`pause_sampling` adds them up).
        self.pause_reports: dict[str, PauseReport] = {}
        self._version: int | None = None
        self._fence = "sampling"  # the nodes' fence as the driver drives it: "sampling", "draining", "paused"
        self._fence_mode: str | None = None
        self.warm = check_warm(warm)
        self._upcoming: deque[EpisodeSpec] = deque()
        self._warm_on: dict[str, str] = {}  # planned episode key -> the node set to warm it
        self._ran: set[str] = set()

    @property
    def slots(self) -> int:
        return max(1, self.per_node * max(1, len(self._actors)))

    @property
    def nodes(self) -> list[str]:
        """The node ids with a live gateway actor."""
        return list(self._actors)

    async def start(self, *, tasks: Sequence[Task], policy: Policy, episode: EpisodeConfig) -> None:
        harness, sandbox, image = episode.harness, episode.sandbox, episode.image
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ares_gateway.policies.base import is_external

        actor_env = with_start_rate(self.runtime_env)
        # A new plan comes with this start (run_rollouts' waves reuse episode keys).
        self._upcoming.clear()
        self._warm_on.clear()
        self._ran.clear()
        tasks_root = self._tasks_root()
        if tasks_root is not None:
            # Ray uploads a local working_dir only for a whole job (ray.init), not per actor.
            if ray.is_initialized():
                job_env = ray.get_runtime_context().runtime_env
                if not job_env.get("working_dir"):
                    raise ValueError(
                        "a local working_dir ships with the Ray job: let RayExecutor connect (address=..., "
                        "not connected yet) or pass the same runtime_env to your own ray.init")
            actor_env.pop("working_dir")
        if not ray.is_initialized():
            init = dict(self.init_options)
            if self.runtime_env:
                init["runtime_env"] = dict(self.runtime_env)  # a copy: Ray puts the uploaded URI in its place
            address = init.pop("address", self.address)
            check_cluster_reachable(address, self.connect_timeout)
            try:
                ray.init(address=address, **init)
            except ConnectionError as exc:  # "auto" without a cluster, a cluster gone since the check
                raise ClusterUnreachableError(address, self.connect_timeout,
                                              one_line(str(exc), 300) or type(exc).__name__) from None
            self._owns_ray = True
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        if not nodes:
            raise NoNodesError(
                "the Ray cluster has no alive node with a CPU to run episodes on: start workers "
                "(ray start --address ...) first")
        self._external = is_external(policy)
        longest = max([episode.time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
        # A node may run up to ``warm`` more than per_node: the episodes it warmed run where they were set up.
        actor_cls = ray.remote(num_cpus=0, max_concurrency=self.per_node + 4 + self.warm,
                               max_restarts=0)(_NodeGateway)
        started = []
        sent = self._version  # the version each actor starts with
        for n in nodes:
            opts: dict[str,
                       Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)}
            if actor_env:
                opts["runtime_env"] = actor_env
            actor = actor_cls.options(**opts).remote()
            ref = actor.start.remote(harness, longest, policy, sandbox, image, list(tasks), self.host,
                                     self._admin_token, tasks_root, policy_version=self._version,
                                     warm=self.warm)
            started.append((n["NodeID"], actor, ref))
        urls: dict[str, str] = {}
        for node_id, actor, ref in started:
            try:
                info = await ref
            except ray.exceptions.RayError as exc:
                info = {"ok": False, "why": f"its gateway actor failed to start: {one_line(str(exc), 300)}"}
            if not info["ok"]:
                self.refused[node_id] = info["why"]
                ray.kill(actor)
                continue
            self._actors[node_id] = actor
            self._load[node_id] = 0
            urls[node_id] = info["url"]
        self.urls = urls  # all at once: a poller reading them sees every node's gateway
        if not self._actors:
            why = "; ".join(f"node {n[:12]}: {w}" for n, w in self.refused.items())
            raise NoNodesError(f"no node of the Ray cluster can run {sandbox} sandboxes for {harness}: {why}")
        if self._version != sent and self._version is not None:  # set while the actors were starting
            self._raise_first(await self._on_every_node({}, "set_policy_version", self._version), "")

    def _tasks_root(self) -> str | None:
        """The driver's path of a local ``working_dir`` (task folders shipped to the nodes by Ray)."""
        wd = self.runtime_env.get("working_dir")
        if isinstance(wd, str | os.PathLike) and "://" not in str(wd) and os.path.isdir(wd):
            return os.path.realpath(wd)
        return None

    def expect(self, specs: Sequence[EpisodeSpec]) -> None:
        """The episodes :meth:`run` will be asked for, in order: with ``warm``, each node is handed up to
        that many of them ahead, to set up while it runs others."""
        if self.warm:
            self._upcoming.extend(specs)
            self._hand_out()

    def _hand_out(self) -> None:
        """Give each live node planned episodes to warm until each has ``warm`` of them."""
        ahead: dict[str, int] = dict.fromkeys(self._actors, 0)
        for node in self._warm_on.values():
            if node in ahead:
                ahead[node] += 1
        while self._upcoming and ahead:
            node = min(ahead, key=lambda k: ahead[k])
            if ahead[node] >= self.warm:
                return
            spec = self._upcoming.popleft()
            if spec.key in self._ran:
                continue
            self._warm_on[spec.key] = node
            ahead[node] += 1
            self._actors[node].expect.remote([spec])

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        ray = _ray()
        warmed_on = self._warm_on.pop(spec.key, None)
        self._ran.add(spec.key)  # it runs now: no node need warm it
        self._hand_out()
        while True:
            if not self._actors:
                raise NoNodesError(f"no node is left to run {spec.key} on: every gateway actor died")
            node = warmed_on if warmed_on in self._actors else min(self._actors, key=lambda k: self._load[k])
            warmed_on = None  # a rerun after the node died goes wherever there is room
            actor = self._actors[node]
            self._load[node] += 1
            ref = actor.run.remote(spec)
            try:
                record: EpisodeRecord = await ref
                self._answered += record.result.turns
                return record
            except asyncio.CancelledError:
                # Interrupted: the actor's episode is cancelled too, and removes its sandbox there
                # (close() waits for that).
                ray.cancel(ref)
                raise
            except ray.exceptions.RayActorError as exc:
                # The actor (or its node) is gone: the episode runs again elsewhere, same attempt number.
                log.warning("the gateway actor on node %s died running %s (%s): running it on another node",
                            node[:12], spec.key, type(exc).__name__)
                self._lose(node)
                self.reruns.append(spec.key)
            finally:
                if node in self._load:
                    self._load[node] -= 1

    def _lose(self, node: str) -> None:
        if self._actors.pop(node, None) is not None:
            self.lost.append(node)
            self.urls.pop(node, None)

    def turns_answered(self) -> int:
        """Turns of the episodes finished so far (the actors are not polled)."""
        return self._answered

    # ------------------------------------------------------------------ policy versions and the fence

    @property
    def policy_version(self) -> int | None:
        """The version last set on the nodes (:meth:`set_policy_version`, or a resume's); ``None``: never
        set."""
        return self._version

    async def set_policy_version(self, version: int) -> None:
        """Set the policy version on every node's gateway (before :meth:`start`: on the gateways it starts).
        Checked here first, as a gateway checks it:
        :class:`~ares_gateway.core.errors.InvalidPolicyVersionError`
        for anything but a non-negative integer,
        :class:`~ares_gateway.core.errors.PolicyVersionBackwardsError`
        for one lower than the current version."""
        checked = next_policy_version(version, self._version)
        outcomes = await self._on_every_node({}, "set_policy_version", checked)
        self._version = checked
        self._raise_first(outcomes, "")

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        """Pause every node's gateway at once (:meth:`Gateway.pause_sampling
        <ares_gateway.gateway.Gateway.pause_sampling>`); return once none has a generation in flight.

        The report adds the nodes' up: ``drain_seconds`` is the slowest node's, ``in_flight``, ``aborted`` and
        ``parked`` are summed; each node's own is in :attr:`pause_reports`. When a node's pause fails (its
        drain timed out, its gateway was paused already), the nodes that paused are resumed and the
        node's error is raised, of the same class, its message starting with ``node <id>``. Cancelled, the
        nodes still draining are cancelled and those paused resumed. A node whose actor died is left out
        (its episodes run again elsewhere). Raises ``RuntimeError`` before :meth:`start`."""
        check_pause(mode, timeout)
        if self._fence != "sampling":
            raise SamplingPausedError(
                f"sampling is {self._fence} already (mode {self._fence_mode}); resume it before pausing "
                "again")
        if not self._actors:
            raise RuntimeError(
                "RayExecutor.pause_sampling before start(): there are no node gateways to pause yet")
        self._fence, self._fence_mode = "draining", mode
        outcomes: dict[str, Any] = {}
        try:
            await self._on_every_node(outcomes, "pause_sampling", mode, timeout, cancel=True)
            reports = {n: r for n, r in outcomes.items() if isinstance(r, PauseReport)}
            if len(reports) < len(outcomes):
                self._raise_first(outcomes, "; the other nodes were resumed")
            if not reports:
                raise NoNodesError("no node is left to pause: every gateway actor died")
        except BaseException:
            self._fence, self._fence_mode = "sampling", None
            paused = [n for n, r in outcomes.items() if isinstance(r, PauseReport)]
            await self._on_every_node({}, "resume_sampling", None, nodes=paused)
            raise
        self._fence = "paused"
        self.pause_reports = reports
        return PauseReport(mode, max(r.drain_seconds for r in reports.values()),
                           sum(r.in_flight for r in reports.values()),
                           sum(r.aborted for r in reports.values()),
                           sum(r.parked for r in reports.values()))

    async def resume_sampling(self, version: int | None = None) -> float:
        """Resume every node's gateway after :meth:`pause_sampling` returned, with ``version`` (checked here
        first: a bad or lower one raises and leaves them paused). Returns the longest time a node was
        paused. Raises :class:`~ares_gateway.core.errors.SamplingNotPausedError` without a pause that
        returned."""
        if self._fence != "paused":
            raise SamplingNotPausedError("sampling is not paused: pause it first" if self._fence == "sampling"
                                         else "the pause is still draining: resume after "
                                              "pause_sampling returns")
        checked = None if version is None else next_policy_version(version, self._version)
        self._fence, self._fence_mode = "sampling", None
        outcomes = await self._on_every_node({}, "resume_sampling", checked)
        if checked is not None:
            self._version = checked
        self._raise_first(outcomes, "; the other nodes were resumed")
        return max((float(r) for r in outcomes.values()), default=0.0)

    def weight_update(self, version: int | None = None, *, mode: str = "drain",
                      timeout: float | None = None) -> AbstractAsyncContextManager[PauseReport]:
        """``async with executor.weight_update(version):`` :meth:`pause_sampling`, the body (update the
        weights),
        :meth:`resume_sampling` with ``version``; resumed without it when the body raises."""
        return fenced_update(lambda: self.pause_sampling(mode, timeout=timeout), self.resume_sampling,
                             version)

    async def _on_every_node(self, outcomes: dict[str, Any], method: str, *args: Any, cancel: bool = False,
                             nodes: Sequence[str] | None = None) -> dict[str, Any]:
        """Call the actors' ``method(*args)`` at once (``nodes``: only theirs) and fill ``outcomes`` with each
        node's result, or the exception its call raised (a task error's cause). A node whose actor died is
        dropped, as :meth:`run` does, and left out. Cancelled, it still waits for the calls (``cancel``:
        cancelling those still running on their actors) and fills ``outcomes`` with those that finished."""
        ray = _ray()
        refs = {n: getattr(a, method).remote(*args) for n,
                a in self._actors.items() if nodes is None or n in nodes}

        async def outcome(ref: Any) -> Any:
            try:
                return await ref
            except ray.exceptions.RayActorError:
                return _LOST
            except ray.exceptions.RayTaskError as exc:
                return exc.cause if isinstance(exc.cause, BaseException) else exc
            except Exception as exc:  # the call cancelled on its actor, an object lost with its node
                return exc

        calls = {n: asyncio.ensure_future(outcome(ref)) for n, ref in refs.items()}
        if calls:
            try:
                await asyncio.wait(calls.values())
            except asyncio.CancelledError:
                if cancel:
                    for n, ref in refs.items():
                        if not calls[n].done():
                            ray.cancel(ref)
                await asyncio.wait(calls.values(), timeout=CLOSE_TIMEOUT)
                raise
            finally:
                for n, call in calls.items():
                    if not call.done():
                        continue
                    result = call.result()
                    if result is _LOST:
                        log.warning("the gateway actor on node %s died (%s): left out", n[:12], method)
                        self._lose(n)
                    else:
                        outcomes[n] = result
        return outcomes

    @staticmethod
    def _raise_first(outcomes: dict[str, Any], then: str) -> None:
        """Raise the first node's error among ``outcomes`` as its own class, the message naming the node."""
        for node, exc in outcomes.items():
            if not isinstance(exc, BaseException):
                continue
            message = f"node {node[:12]}: {getattr(exc, 'message', None) or one_line(str(exc), 300)}{then}"
            error: BaseException = RuntimeError(message)
            if isinstance(exc, StatusError):
                with contextlib.suppress(TypeError):  # a subclass with a constructor of its own
                    error = type(exc)(message, status=exc.status, param=exc.param)
            raise error from exc

    def describe(self) -> list[str]:
        lines = [f"ray: {len(self._actors)} node(s), {self.per_node} episode(s) each"]
        lines += [f"ray: node {n[:12]} left out: {why}" for n, why in self.refused.items()]
        if self._external:
            lines += [f"ray: node {n[:12]}: requests wait on {url}/poll" for n, url in self.urls.items()]
        return lines

    async def close(self) -> None:
        ray = _ray()
        for actor in list(self._actors.values()):
            try:
                self.cancelled_at_close += await asyncio.wait_for(actor.close.remote(),
                                                                  timeout=CLOSE_TIMEOUT + 10)
            except Exception:  # a dead actor has nothing left to close
                pass
            ray.kill(actor)
        self._actors.clear()
        self._fence, self._fence_mode = "sampling", None  # the next start's gateways begin sampling
        if self.lost:
            # Every node still alive removes what
            # dead actors left (their owner process is gone); a lost node's machine, where it lives on,
            # is collected once it rejoins, or with ``ares-gateway gc --ray``.
            found = await collect_on_nodes()
            self.collected.extend(name for report in found.values() for name in report.removed)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
