"""Episodes: tasks run by a real agent harness in a sandbox, every LLM call answered by a policy.

* :mod:`~ares_gateway.episodes.config`: :class:`EpisodeConfig` (what each episode runs: harness, sandbox,
  limits; :mod:`~ares_gateway.episodes.episode_spec`) and :class:`RunConfig` (how a run runs them:
  concurrency, attempts, output, executor), taken by every entry point that plays episodes;
  :class:`EpisodeRecord` (:mod:`~ares_gateway.episodes.driver`) is one finished episode wherever it goes;
* :mod:`~ares_gateway.episodes.tasks`: a task (``task.toml``, ``instruction.md``) and datasets of them;
* :mod:`~ares_gateway.episodes.selectors`: presets (``DATASET-HARNESS``) and task selectors;
* :mod:`~ares_gateway.episodes.verifier`: running a task's tests and reading the reward they write;
* :mod:`~ares_gateway.episodes.episode`: :class:`TaskEpisode`, the one episode loop (sandbox up,
  agent launched, agent done, verifier, sandbox down) shared by :class:`GatewayEnv` and the runner;
* :mod:`~ares_gateway.episodes.env`: :class:`GatewayEnv`, a dm_env-style environment, one step per LLM call;
* :mod:`~ares_gateway.episodes.rollouts`: :func:`run_rollouts`, many episodes at once, answered by a policy,
  composed of the :mod:`~ares_gateway.episodes.scheduler` (which episode runs when), an
  :mod:`~ares_gateway.episodes.executor` (where: :class:`LocalExecutor` by default), the
  :mod:`~ares_gateway.episodes.driver` (one episode from sandbox to samples) and
  :mod:`~ares_gateway.episodes.output` (results.json, episodes.jsonl, trajectories, progress, TensorBoard);
* :mod:`~ares_gateway.episodes.stream`: :class:`RolloutSource` (and :class:`BlockingRolloutSource`), the
  same episodes streamed to a trainer as they finish, one by one or as complete GRPO groups, with
  back-pressure, weight-update fencing and staleness masking;
* :mod:`~ares_gateway.episodes.failures`: which failed episodes are the infrastructure's (retried on a fresh
  sandbox, ``infra_error`` when they persist, never trained on) and which the agent's;
* :mod:`~ares_gateway.episodes.installs`: agent CLIs installed once on this host for local sandboxes;
* :mod:`~ares_gateway.episodes.stats`: where episode statistics go (TensorBoard, logging);
* :mod:`~ares_gateway.episodes.preflight`: the start-up checks of a run.
"""

from ares_gateway.episodes.config import EpisodeConfig, RunConfig
from ares_gateway.episodes.driver import EpisodeRecord, renamed_names
from ares_gateway.episodes.stream import (
    BlockingRolloutSource,
    NoFenceError,
    RolloutGroup,
    RolloutSource,
    RolloutSourceError,
    SourceClosedError,
)

__all__ = [
    "BlockingRolloutSource",
    "EpisodeConfig",
    "EpisodeRecord",
    "NoFenceError",
    "RolloutGroup",
    "RolloutSource",
    "RolloutSourceError",
    "RunConfig",
    "SourceClosedError",
]


__getattr__ = renamed_names(__name__)
