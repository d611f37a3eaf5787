"""Which failed episodes are the infrastructure's and which the agent's, and the bounded retry of the
infrastructure's: the one place a failure is classified (the retries themselves:
:func:`ares_gateway.episodes.scheduler.run_with_retries`).

An episode failed by the **infrastructure** never judged the policy: its sandbox did not start, its
agent could not be installed or started before its first LLM call, its sandbox or relay was lost
while the agent ran, or the verifier's own machinery failed (not its tests). Such an episode is run
again (:func:`~ares_gateway.episodes.scheduler.run_with_retries`: a fresh episode, so a fresh sandbox and session, the failed one's
sandbox removed by its driver), at most ``retries`` times with exponential backoff; when every try
failed it ends as ``infra_error`` (:data:`INFRA_ERROR`, the last cause in its ``error`` and
``infra_cause``) and the trainer adapters never train on it. An **agent** failure is what the agent
did; it is never retried, its reward is the policy's.

=================================  ==============  =====================================================
exit reason                         kind            why
=================================  ==============  =====================================================
``sandbox_error``                   infrastructure  the sandbox (or the grading sandbox) could not be
                                                    created, started or used, or was lost (a tunnel or
                                                    relay drop) while the agent ran
``install_error``                   infrastructure  the agent CLI could not be installed
``agent_error``, 0 turns            infrastructure  the agent could not be prepared or launched, or
                                                    exited before its first LLM call
``error``                           infrastructure  the executor raised (a worker or runner failure)
``completed`` etc., verifier        infrastructure  the verifier's machinery failed (its directories,
crashed                                             the upload of the tests, the copy of the workdir,
                                                    a sandbox error while verifying): ``verifier_crashed``
``agent_error``, >= 1 turn          agent           the agent crashed or exited non-zero after the
                                                    policy answered it
``memory_limit``, ``pids_limit``,   agent           the agent exceeded its sandbox's limits
``disk_limit``
``completed``, ``step_limit``,      (judged)        the tests ran: the reward is the verdict, also 0.0
``time_limit``, ``truncated``                       (a wrong answer, a test.sh timeout, no reward file)
``cancelled``                       (neither)       stopped by the run (Ctrl-C)
``infra_error``                     infrastructure  every try failed as above (never trained on)
=================================  ==============  =====================================================
"""

from __future__ import annotations

from typing import Literal, Protocol

__all__ = [
    "AGENT_REASONS",
    "DEFAULT_RETRIES",
    "DEFAULT_RETRY_BACKOFF",
    "INFRA_ERROR",
    "INFRA_REASONS",
    "MAX_RETRY_WAIT",
    "check_retries",
    "classify",
    "is_infra_error",
]

#: The exit reason of an episode whose every try failed by the infrastructure.
INFRA_ERROR = "infra_error"
#: Exit reasons that are always the infrastructure's (``agent_error`` is, before the first LLM call).
INFRA_REASONS = frozenset({"sandbox_error", "install_error", "error", INFRA_ERROR})
#: Exit reasons that are the agent's (``agent_error`` is, once the policy answered it).
AGENT_REASONS = frozenset({"agent_error", "memory_limit", "pids_limit", "disk_limit"})
#: How many times an infrastructure failure is retried by default (so at most 3 tries).
DEFAULT_RETRIES = 2
#: Seconds before the first retry; each next one waits twice as long.
DEFAULT_RETRY_BACKOFF = 1.0
#: The longest wait between two tries.
MAX_RETRY_WAIT = 30.0

Kind = Literal["infra", "agent"]


class _Ended(Protocol):
    """What :func:`classify` reads of an episode's result (an ``EpisodeResult``)."""

    exit_reason: str
    turns: int
    verifier_crashed: bool


def classify(result: _Ended) -> Kind | None:
    """``"infra"``, ``"agent"``, or ``None`` (judged by its tests, or cancelled): see the module's table."""
    reason = result.exit_reason
    if reason in INFRA_REASONS:
        return "infra"
    if reason == "agent_error":
        return "agent" if result.turns > 0 else "infra"
    if reason in AGENT_REASONS:
        return "agent"
    if result.verifier_crashed:
        return "infra"
    return None


def is_infra_error(result: _Ended) -> bool:
    """Whether the episode ended as ``infra_error``: excluded from training."""
    return result.exit_reason == INFRA_ERROR


def check_retries(retries: int, backoff: float = DEFAULT_RETRY_BACKOFF) -> None:
    """A ``ValueError`` for a negative ``retries`` or ``backoff``."""
    if retries < 0:
        raise ValueError(f"retries must be 0 or more, got {retries}")
    if backoff < 0:
        raise ValueError(f"retry_backoff must be 0 or more seconds, got {backoff}")
