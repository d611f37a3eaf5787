"""Which failed episodes are the infrastructure's and which the agent's, and the bounded retry of the
infrastructure's: the one place a failure is classified (the retries themselves:
:func:`ares_gateway.episodes.scheduler.run_with_retries`).

An episode failed by the **infrastructure** never judged the policy: its sandbox did not start, its
agent could not be installed or started before its first LLM call, the grading sandbox did not start
or was lost, or the verifier's own machinery failed in a part the agent never touched. Such an
episode is run again (:func:`~ares_gateway.episodes.scheduler.run_with_retries`: a fresh episode, so
a fresh sandbox and session, the failed one's sandbox removed by its driver), at most ``retries``
times with exponential backoff; when every try failed it ends as ``infra_error``
(:data:`INFRA_ERROR`, the last cause in its ``error`` and ``infra_cause``) and the trainer adapters
never train on it. An **agent** failure is what the agent did; it is never retried, its reward (0.0)
is the policy's.

Since an ``infra_error`` is left out of training (a GRPO group gives it the group's mean, not 0), a
failure the agent could have caused itself is never the infrastructure's once the policy had a say:
a failure whose cause lies inside the agent's own sandbox (``failure_site`` :data:`AGENT_SANDBOX`:
that sandbox lost or not running, a sandbox error while the agent ran, the copy of its workdir out
of it failing, the verifier's setup failing inside it with ``[verifier] sandbox = "agent"``) is the
agent's when the policy answered at least one of its LLM calls (``turns >= 1``), and the
infrastructure's before that (the policy had no say). A failure in a part the agent never touches
(``failure_site`` :data:`GRADING_SANDBOX`, or none recorded: the grading sandbox failing to start or
lost, the verifier's machinery failing in the fresh grading sandbox before anything of the agent's
is in it, such as the upload of the tests) and an executor that raised stay the infrastructure's
at any turn count.

=================================  ==============  =====================================================
exit reason                         kind            why
=================================  ==============  =====================================================
``sandbox_error``, agent's          infrastructure  the agent's sandbox failed or was lost while the
sandbox, 0 turns                                    agent ran, before the policy answered a call
``sandbox_error``, agent's          agent           the same after the policy answered a call: the agent
sandbox, >= 1 turn                                  may have brought its own sandbox down
``sandbox_error``, elsewhere        infrastructure  the sandbox could not be created, started or
                                                    prepared, or the grading sandbox did not start
``install_error``                   infrastructure  the agent CLI could not be installed
``agent_error``, 0 turns            infrastructure  the agent could not be prepared or launched, or
                                                    exited before its first LLM call
``error``                           infrastructure  the executor raised (a worker or runner failure)
``completed`` etc., verifier        infrastructure  the verifier's machinery failed in the agent's
crashed in the agent's sandbox,                     sandbox (it was not running, the copy of its workdir
0 turns                                             out of it failed, the verifier's setup in it failed)
                                                    before the policy answered a call
``completed`` etc., verifier        agent           the same after the policy answered a call: reward
crashed in the agent's sandbox,                     0.0, trained on, never retried
>= 1 turn
``completed`` etc., verifier        infrastructure  the verifier's machinery failed where the agent never
crashed elsewhere                                   was (the fresh grading sandbox: its directories, the
                                                    upload of the tests, taking the workdir's copy)
``agent_error``, >= 1 turn          agent           the agent crashed or exited non-zero after the
                                                    policy answered it
``memory_limit``, ``pids_limit``,   agent           the agent exceeded its sandbox's limits (also when
``disk_limit``                                      that brought the sandbox down)
``completed``, ``time_limit``,      infrastructure  the agent ended, or ran out of time, without one LLM
``truncated``, 0 turns                              call: the policy was never asked, so the tests say
                                                    nothing of it (an agent that failed to start its
                                                    loop but exited 0, an agent stuck in its start-up)
``completed``, ``step_limit``,      (judged)        the tests ran: the reward is the verdict, also 0.0
``time_limit``, ``truncated``                       (a wrong answer, a test.sh timeout, no reward file,
                                                    a workdir too large to grade)
``cancelled``                       (neither)       stopped by the run (Ctrl-C)
``infra_error``                     infrastructure  every try failed as above (never trained on)
=================================  ==============  =====================================================
"""

from __future__ import annotations

from typing import Literal, Protocol

__all__ = [
    "AGENT_REASONS",
    "AGENT_SANDBOX",
    "DEFAULT_RETRIES",
    "DEFAULT_RETRY_BACKOFF",
    "FAILURE_SITES",
    "GRADING_SANDBOX",
    "INFRA_ERROR",
    "INFRA_REASONS",
    "MAX_RETRY_WAIT",
    "check_retries",
    "classify",
    "is_infra_error",
]

#: The exit reason of an episode whose every try failed by the infrastructure.
INFRA_ERROR = "infra_error"
#: Exit reasons that are always the infrastructure's (``agent_error`` is, before the first LLM call;
#: ``sandbox_error`` is unless its ``failure_site`` is the agent's sandbox after the first one).
INFRA_REASONS = frozenset({"install_error", "error", INFRA_ERROR})
#: Exit reasons that are the agent's (``agent_error`` is, once the policy answered it).
AGENT_REASONS = frozenset({"agent_error", "memory_limit", "pids_limit", "disk_limit"})
#: How many times an infrastructure failure is retried by default (so at most 3 tries).
DEFAULT_RETRIES = 2
#: Seconds before the first retry; each next one waits twice as long.
DEFAULT_RETRY_BACKOFF = 1.0
#: The longest wait between two tries.
MAX_RETRY_WAIT = 30.0

#: ``failure_site``: the failure's cause lies inside the agent's own sandbox (it was lost or not
#: running, a sandbox error while the agent ran, the copy of its workdir out of it failed, the
#: verifier's setup failed in it): the agent's once the policy answered a call.
AGENT_SANDBOX = "agent_sandbox"
#: ``failure_site``: the failure lies in the fresh grading sandbox or the verifier's machinery, which
#: the agent never touched: the infrastructure's at any turn count.
GRADING_SANDBOX = "grading_sandbox"
#: The values of ``failure_site`` (``""``: no such failure, or not recorded: the infrastructure's).
FAILURE_SITES = ("", AGENT_SANDBOX, GRADING_SANDBOX)

#: Exit reasons whose tests ran (their reward is the verdict) when the policy answered a call.
_JUDGED = frozenset({"completed", "step_limit", "time_limit", "truncated"})

Kind = Literal["infra", "agent"]


class _Ended(Protocol):
    """What :func:`classify` reads of an episode's result (an ``EpisodeResult``)."""

    exit_reason: str
    turns: int
    verifier_crashed: bool
    failure_site: str


def classify(result: _Ended) -> Kind | None:
    """``"infra"``, ``"agent"``, or ``None`` (judged by its tests, or cancelled): see the module's table."""
    reason = result.exit_reason
    if reason in INFRA_REASONS:
        return "infra"
    if reason == "agent_error":
        return "agent" if result.turns > 0 else "infra"
    if reason in AGENT_REASONS:
        return "agent"
    if reason == "sandbox_error" or result.verifier_crashed:
        # Where the cause lies decides: the agent's own sandbox is the agent's once the policy had a say
        # (it could have brought that sandbox down itself); before that, and anywhere else, the
        # infrastructure's.
        return "agent" if result.failure_site == AGENT_SANDBOX and result.turns > 0 else "infra"
    if reason in _JUDGED and result.turns == 0:
        return "infra"  # the policy was never asked: the verdict is not its own
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
