"""One finished episode's row: :class:`EpisodeResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EpisodeResult"]


@dataclass
class EpisodeResult:
    """How one finished episode ended, as written to ``results.json`` (its row there).

    A :class:`~ares_gateway.episodes.episode.TaskEpisode` gives one when it finishes (what the sandbox,
    the agent and the tests did; ``attempt``, ``turns`` and ``duration`` still 0, the workspace's absolute
    path); the episode driver then completes it with what the gateway recorded (turns, samples, latency,
    usage, versions) and the run's names, and hands it out inside an
    :class:`~ares_gateway.episodes.driver.EpisodeRecord` with the samples, turn log and logs.
    """

    task: str
    attempt: int
    reward: float
    turns: int
    duration: float
    exit_reason: str
    truncated: bool = False
    error: str | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    session_id: str = ""
    #: Seconds its sandbox took to set up (start, workdir, install): ahead of the episode when ``warm``.
    setup_seconds: float = 0.0
    agent_seconds: float = 0.0
    verify_seconds: float = 0.0
    #: Its sandbox came from the warm pool (``run --warm N``), set up while earlier episodes ran.
    warm: bool = False
    answer_latency: float | None = None  # mean seconds a request of this episode waited for its answer
    #: Where it ran: the Ray node id under a ``RayExecutor``; ``None`` in this process.
    node: str | None = None
    #: How its sandbox was networked (``episode.NETWORK_MODES``): ``relay`` (it reached only its own
    #: session: a relay, or the exec tunnel of a remote sandbox), ``internet`` (the task set
    #: ``allow_internet = true``), ``host`` (no isolation on this host); "" if it never got a sandbox.
    network: str = ""
    #: Where its tests ran: ``fresh`` (a new sandbox holding a copy of the agent's workdir), ``agent``
    #: (the agent's own sandbox, ``[verifier] sandbox = "agent"``), or "" if they did not run.
    grading: str = ""
    #: Seconds the fresh grading sandbox took to start (it starts beside the agent's, in the background).
    grading_setup_seconds: float = 0.0
    #: The policy's per-episode report, where it has one (``tito``: turns, trained tokens, fresh renders,
    #: main-line drift; :meth:`~ares_gateway.policies.tito.TitoPolicy.episode_report`).
    fidelity: dict[str, Any] | None = None
    #: The policy version of the episode's first and last turn that has one, in answer order (the
    #: version of the weights that sampled it, docs/training.md); ``None`` when no turn has one.
    first_version: int | None = None
    last_version: int | None = None
    #: Per-call usage and timing summed over its turns (:func:`~ares_gateway.episodes.usage.episode_usage`:
    #: prompt, completion and reused prompt tokens; seconds parked, with the policy, to streams' first
    #: pieces, of the agent's thinking), each ``None`` where no turn knows it; ``None``: not summed.
    usage: dict[str, Any] | None = None
    #: The verifier's own machinery failed (not its tests); whose failure that is: ``failure_site``.
    verifier_crashed: bool = False
    #: Where the cause of a ``sandbox_error`` or a verifier crash lies, which decides whose failure it
    #: is (:func:`~ares_gateway.episodes.failures.classify`): ``agent_sandbox`` (the agent's own sandbox,
    #: lost or failing while the agent ran or at grading, or the copy of its workdir out of it: the
    #: agent's once the policy answered a call), ``grading_sandbox`` (the fresh grading sandbox or the
    #: verifier's machinery in it, which the agent never touched: the infrastructure's), or ``""``
    #: (neither happened, or the sandbox failed before the agent ran: the infrastructure's).
    failure_site: str = ""
    #: Infrastructure failures retried before this result (each on a fresh sandbox), and their errors.
    retries: int = 0
    retry_errors: list[str] = field(default_factory=list)
    #: ``infra_error`` only: the exit reason of the last failed try (``sandbox_error``,
    #: ``install_error``, ...).
    infra_cause: str | None = None
    #: The task's directory (where ``ares-gateway reverify`` finds its tests again).
    task_dir: str | None = None
    #: The saved workspace (:mod:`~ares_gateway.episodes.workspaces`): its path relative to the run
    #: directory (``workspaces/<task>.<attempt>.tar``; as a ``TaskEpisode`` gives it, the file it was
    #: saved to), its size, whether it was cut at the cap, and why it could not be saved; ``None`` /
    #: ``False`` when none was saved (the tests did not run, or saving was off).
    workspace: str | None = None
    workspace_bytes: int | None = None
    workspace_truncated: bool = False
    workspace_error: str | None = None
    #: The uid the workspace was unpacked as for grading (the agent's; ``None``: the sandbox's default user).
    workspace_uid: str | None = None
    #: The agent CLI that ran (its harness name) and the sandbox backend it ran in.
    harness: str = ""
    sandbox: str = ""
    #: The agent CLI's exit code (``None``: it did not exit by itself, or never started); whether its
    #: install was found in place (``None``: no install was looked for).
    agent_exit_code: int | None = None
    install_reused: bool | None = None
    #: Where the tests' reward was read from (``reward.txt``, ``reward.json``; "" if they did not run).
    reward_source: str = ""
    #: Why the tests gave no verdict of their own (``error`` says it too when nothing failed before).
    verifier_error: str | None = None
    #: The size of the agent's workdir archive copied into the fresh grading sandbox.
    copied_bytes: int | None = None

    @property
    def key(self) -> str:
        return f"{self.task}.{self.attempt}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
