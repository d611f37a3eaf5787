"""Episodes on a Ray cluster: :class:`RayExecutor`, one gateway actor per node (extra ``.[ray]``).

Each alive node with CPUs gets one async actor, pinned to it (``NodeAffinitySchedulingStrategy(node_id,
soft=False)``, ``num_cpus=0``), which owns one gateway (:func:`~ares_gateway.episodes.episode.episode_gateway`)
and runs up to ``per_node`` episodes at once with :func:`~ares_gateway.episodes.driver.drive_episode`,
their sandboxes on its node. The scheduler sends each episode to the least-loaded actor; the
:class:`~ares_gateway.episodes.driver.EpisodeRecord` comes back as plain data and the driver writes it
into the same OUT layout as a local run, with the node in ``"node"``.

An actor that dies mid-episode (its process or its node lost): the episode is run again on another
actor, under the same attempt number, so it finishes once. The policy travels to each actor by value
(cloudpickle): the scripted and oracle policies, an ``upstream`` or ``tito`` policy over HTTP engines.

Task directories must be readable at the same path on every node (a shared filesystem), or shipped
with Ray's runtime environment (``RayExecutor(runtime_env={"working_dir": ...})``).

**Ray on loopback.** On a machine whose own address must not be used, start Ray with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment (Ray then takes 127.0.0.1 as the node
address; ``RAY_NODE_IP_ADDRESS`` / ``_node_ip_address`` alone still left its GCS on the host address here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec, drive_episode
from ares_gateway.episodes.episode import episode_gateway
from ares_gateway.episodes.tasks import Task

log = logging.getLogger(__name__)

__all__ = ["NoNodesError", "RayExecutor"]


class NoNodesError(RuntimeError):
    """The Ray cluster has no alive node that can run episodes (none with a CPU); start workers first."""


def _ray() -> Any:
    try:
        import ray
    except Exception as exc:
        from ares_gateway.trainers._common import MissingExtraError

        raise MissingExtraError("ray", "ray", exc) from exc
    return ray


class _NodeGateway:
    """The per-node actor: one gateway, episodes on this node (made a Ray actor class at start)."""

    def __init__(self) -> None:
        self.gateway: Any = None
        self.policy: Any = None
        self.node = ""
        self.answered = 0

    async def start(self, harness: str, time_limit: float, policy: Any) -> str:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.policy = policy
        self.gateway = episode_gateway(harness, time_limit=time_limit)
        await self.gateway.start()
        return self.node

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        record = await drive_episode(spec, policy=self.policy, gateway=self.gateway)
        record.result.node = self.node
        return record

    def turns_answered(self) -> int:
        return int(self.gateway.metrics.answered_total) if self.gateway is not None else 0

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.close()
            self.gateway = None


def _collect_garbage() -> list[str]:
    """On one node: remove the sandboxes whose owner process is gone (a dead actor's)."""
    from sandbox import collect_garbage

    return list(collect_garbage(("local", "docker")).removed)


class RayExecutor:
    """Runs episodes on a Ray cluster (see the module docstring).

    Args:
        address: the cluster (``"auto"``, ``"ray://..."``, ``"127.0.0.1:6379"``); ``None``: the one this
            process is connected to, else a local one.
        per_node: episodes at once on each node.
        runtime_env: Ray's runtime environment for the actors (e.g. ``{"working_dir": "tasks/"}``).
        init_options: more ``ray.init`` arguments.
    """

    kind = "ray"

    def __init__(self, address: str | None = None, *, per_node: int = 4, runtime_env: Mapping[str, Any] | None = None,
                 init_options: Mapping[str, Any] | None = None) -> None:
        if per_node < 1:
            raise ValueError(f"per_node must be at least 1, got {per_node}")
        self.address = address
        self.per_node = per_node
        self.runtime_env = dict(runtime_env or {})
        self.init_options = dict(init_options or {})
        self._actors: dict[str, Any] = {}  # node id -> actor handle
        self._load: dict[str, int] = {}
        self._answered = 0
        self._owns_ray = False
        #: Keys of episodes run again because the actor running them died.
        self.reruns: list[str] = []
        #: Nodes whose actor died; :meth:`close` removes what it left there.
        self.lost: list[str] = []
        #: Sandboxes removed from those nodes at close.
        self.collected: list[str] = []

    @property
    def slots(self) -> int:
        return max(1, self.per_node * max(1, len(self._actors)))

    @property
    def nodes(self) -> list[str]:
        """The node ids with a live gateway actor."""
        return list(self._actors)

    async def start(self, *, harness: str, tasks: Sequence[Task], policy: Any, time_limit: float | None) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=self.address, **self.init_options)
            self._owns_ray = True
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        if not nodes:
            raise NoNodesError("the Ray cluster has no alive node with a CPU to run episodes on")
        longest = max([time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
        actor_cls = ray.remote(num_cpus=0, max_concurrency=self.per_node + 4, max_restarts=0)(_NodeGateway)
        started = []
        for n in nodes:
            opts: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)}
            if self.runtime_env:
                opts["runtime_env"] = self.runtime_env
            actor = actor_cls.options(**opts).remote()
            started.append((n["NodeID"], actor, actor.start.remote(harness, longest, policy)))
        for node_id, actor, ref in started:
            await ref
            self._actors[node_id] = actor
            self._load[node_id] = 0

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        ray = _ray()
        while True:
            if not self._actors:
                raise NoNodesError(f"no node is left to run {spec.key} on: every gateway actor died")
            node = min(self._actors, key=lambda k: self._load[k])
            actor = self._actors[node]
            self._load[node] += 1
            ref = actor.run.remote(spec)
            try:
                record: EpisodeRecord = await ref
                self._answered += record.result.turns
                return record
            except asyncio.CancelledError:
                # Interrupted: the actor's episode is cancelled too, and removes its sandbox there.
                ray.cancel(ref)
                raise
            except ray.exceptions.RayActorError as exc:
                # The actor (or its node) is gone: the episode runs again elsewhere, same attempt number.
                log.warning("the gateway actor on node %s died running %s (%s): running it on another node",
                            node[:12], spec.key, type(exc).__name__)
                if self._actors.pop(node, None) is not None:
                    self.lost.append(node)
                self.reruns.append(spec.key)
            finally:
                if node in self._load:
                    self._load[node] -= 1

    def turns_answered(self) -> int:
        """Turns of the episodes finished so far (the actors are not polled)."""
        return self._answered

    def describe(self) -> list[str]:
        return [f"ray: {len(self._actors)} node(s), {self.per_node} episode(s) each"]

    async def close(self) -> None:
        ray = _ray()
        for actor in list(self._actors.values()):
            try:
                await asyncio.wait_for(actor.close.remote(), timeout=60)
            except Exception:  # a dead actor has nothing left to close
                pass
            ray.kill(actor)
        self._actors.clear()
        # What a dead actor left on its node (its sandboxes' owner process is gone), where the node lives.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        collect = ray.remote(num_cpus=0, max_retries=0)(_collect_garbage)
        for node in self.lost:
            try:
                ref = collect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                self.collected.extend(await asyncio.wait_for(ref, timeout=120))
            except Exception as exc:  # the node itself is gone: nothing of it to reach
                log.warning("could not clean node %s after its actor died: %s", node[:12], type(exc).__name__)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
