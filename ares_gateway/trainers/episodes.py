"""What every trainer adapter shares: tasks named by prompts, episodes played, one sample per episode.

A trainer's batch entry is one episode: a real agent CLI in a sandbox, every LLM call it makes
answered by the trainer's policy through the gateway, rewarded by the task's verifier. The episode's
recorded turns give one or more :class:`trajectory.Sample` objects (more than one where the agent
rewrote its history, made side calls, or something else sent requests with the session's credentials);
a trainer gets one of them, the **main line** (:func:`main_sample`: the harness CLI's own conversation),
and the others are counted in :attr:`EpisodeSample.other_samples` (the foreign ones also in
:attr:`EpisodeSample.foreign_samples`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ares_gateway.episodes.config import EpisodeConfig, RunConfig, configs_from
from ares_gateway.episodes.episode import one_line
from ares_gateway.episodes.failures import INFRA_ERROR
from ares_gateway.episodes.rollouts import EpisodeResult, run_rollouts
from ares_gateway.episodes.tasks import Dataset, Task, load_dataset
from ares_gateway.extras import MissingExtraError as _MissingExtra
from ares_gateway.policies.base import Policy
from trajectory import Sample, check_max_staleness, mask_stale

__all__ = [
    "EpisodeSample",
    "MissingExtraError",
    "SampledTurn",
    "TokenizerMismatchError",
    "TrainerEntry",
    "TrainerError",
    "UnknownTaskError",
    "exclude_infra_errors",
    "foreign_count",
    "main_sample",
    "play_episodes",
    "require",
    "resolve_dataset",
    "sample_turns",
    "task_name_of",
    "tokenizer_mismatch",
    "trainer_entry",
]


class TrainerError(Exception):
    """Base class of the trainer adapters' errors."""


class TokenizerMismatchError(TrainerError):
    """The trainer's tokenizer and the one the gateway renders with give different ids; the samples
    would not be the sequences the trainer scores."""


#: Texts whose ids must be the same under the trainer's tokenizer and the gateway's.
_PROBE_TEXTS = (
    "def median(xs):\n    xs = sorted(xs)\n    return xs[len(xs) // 2]  # 3.14 é ü 中文 🙂\n",
    "<|im_start|>user\nFix the bug in `slug.py`, then run `pytest -q`.<|im_end|>\n<|im_start|>assistant\n",
    "THOUGHT: ls -la /tmp && cat README.md | head -n 20\n\n```bash\necho 'done'\n```",
)


def tokenizer_mismatch(ours: Any, theirs: Any) -> tuple[str, list[int], list[int]] | None:
    """The first probe text the gateway's tokenizer ``ours`` and a trainer's Hugging Face tokenizer
    ``theirs`` encode differently, with both id lists (``ours``, ``theirs``); ``None`` when they agree.
    Each adapter raises :class:`TokenizerMismatchError` with what its user should change."""
    for text in _PROBE_TEXTS:
        a = list(ours.encode(text))
        b = list(theirs.encode(text, add_special_tokens=False))
        if a != b:
            return text, a, b
    return None


class MissingExtraError(TrainerError, _MissingExtra):
    """A trainer's package is not installed; the message names the extra that installs it (and, where
    the package itself installs apart from the extra, ``install``: the command that does)."""

    def __init__(self, package: str, extra: str, cause: BaseException | None = None, *,
                 install: str | None = None) -> None:
        super().__init__(package, extra, cause)
        if install:
            why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
            # ImportError prints its ``msg``, not its args.
            self.msg = f"{package} is not installed or failed to import{why}: install it with {install}"
            self.args = (self.msg,)


class UnknownTaskError(TrainerError, ValueError):
    """A prompt names no task of the dataset; the message lists the dataset's tasks."""


def require(module: str, extra: str, *, install: str | None = None) -> Any:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``extra`` (or the ``install`` command)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install's own error
        raise MissingExtraError(module.partition(".")[0], extra, exc, install=install) from exc


def resolve_dataset(dataset: Dataset | str | Any) -> Dataset:
    """A task :class:`~ares_gateway.episodes.tasks.Dataset` from itself, a registered name or a folder;
    an empty one is an error (there is nothing to train on)."""
    ds = dataset if isinstance(dataset, Dataset) else load_dataset(dataset)
    if len(ds) == 0:
        raise TrainerError(f"the task dataset {ds.name!r} has no tasks: add task folders to it first")
    return ds


def task_name_of(prompt: Any) -> str:
    """The task name a trainer's prompt carries: a string, or chat messages whose last one's content
    is the name (TRL turns a ``prompt`` column of strings into either)."""
    if isinstance(prompt, Mapping):
        prompt = prompt.get("content", "")
    elif isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt:
        last = prompt[-1]
        prompt = last.get("content", "") if isinstance(last, Mapping) else last
    if isinstance(prompt, list):  # typed content blocks
        prompt = "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in prompt)
    return str(prompt).strip()


def resolve_tasks(dataset: Dataset, prompts: Sequence[Any]) -> list[Task]:
    """The task each prompt names, in order; one :class:`UnknownTaskError` for all that name none."""
    names = [task_name_of(p) for p in prompts]
    known = set(dataset.names)
    unknown = sorted({n for n in names if n not in known})
    if unknown:
        listed = ", ".join(dataset.names)
        raise UnknownTaskError(
            f"prompt(s) {', '.join(repr(n) for n in unknown)} name no task of dataset {dataset.name!r}; "
            f"each prompt must be one of its task names: {listed}"
        )
    return [dataset.task(n) for n in names]


def main_sample(samples: Sequence[Any]) -> tuple[Any | None, int]:
    """The episode's main-line sample and how many others there are.

    The main line is the harness CLI's own conversation: the line of the session's message tree
    that extends the session's first request (the only request no tool command can have sent: the
    agent's commands run only after an answer) and holds the most turns, marked
    ``metadata["main_line"]`` by :mod:`trajectory`; of its samples (more than one where the CLI's
    tokens drifted) the one with the most trained tokens, ties to the earliest. Side calls
    (``metadata["side_call"]``) and conversations that do not extend the first request
    (``metadata["foreign"]``, such as a request a tool command sent with the session's credentials)
    are never chosen, whatever their size. Samples recorded before the main line was marked (no
    ``main_line`` key) fall back to the non-side-call, non-foreign sample with the most trained
    tokens. ``None`` when the episode recorded no token-carrying turn of the main line.
    """
    candidates = [s for s in samples if not s.metadata.get("side_call") and not s.metadata.get("foreign")]
    if any("main_line" in s.metadata for s in samples):
        candidates = [s for s in candidates if s.metadata.get("main_line")]
    best = None
    best_tokens = -1
    for s in candidates:
        n = int(s.loss_mask.sum())
        if n > best_tokens:
            best, best_tokens = s, n
    return best, (len(samples) - 1 if best is not None else len(samples))


def foreign_count(samples: Sequence[Any]) -> int:
    """How many of an episode's samples are foreign: conversations that do not extend the session's
    first request (see :func:`main_sample`), never trained by the adapters."""
    return sum(1 for s in samples if s.metadata.get("foreign"))


@dataclass
class EpisodeSample:
    """One played episode as a trainer sees it."""

    task: str
    reward: float
    exit_reason: str
    turns: int = 0
    session_id: str = ""
    error: str | None = None
    #: The main-line :class:`trajectory.Sample` (``None``: the episode recorded no token-carrying turn).
    sample: Sample | None = None
    #: The episode's other samples (side calls, segments and branches of a history rewrite, foreign
    #: conversations), not given to the trainer.
    other_samples: int = 0
    #: Of :attr:`other_samples`, the foreign ones: conversations that do not extend the session's first
    #: request (sent by something other than the harness CLI, such as one of the agent's tool commands).
    foreign_samples: int = 0
    result: EpisodeResult | None = None
    #: Trained tokens of :attr:`sample` masked as stale (``play_episodes(max_staleness=...)``).
    stale_tokens: int = 0
    #: Left out of training (:func:`exclude_infra_errors`): it failed by the infrastructure on every try
    #: (``infra_error``), or, with ``drop_group_on_infra_error``, a member of its group did. Its entry
    #: is a masked stand-in and its reward no verdict on the policy.
    excluded: bool = False

    @property
    def infra_error(self) -> bool:
        """It failed by the infrastructure on every try (see :mod:`ares_gateway.episodes.failures`)."""
        return self.exit_reason == INFRA_ERROR

    def facts(self) -> dict[str, Any]:
        """The plain facts a trainer logs per completion."""
        return {"task": self.task, "session_id": self.session_id, "reward": self.reward,
                "exit_reason": self.exit_reason, "turns": self.turns, "error": self.error,
                "other_samples": self.other_samples, "foreign_samples": self.foreign_samples}


@dataclass(frozen=True)
class TrainerEntry:
    """One episode as a trainer's sequence: the first turn's prompt, then everything after it.

    ``response_ids`` are the main-line sample's ids after the prompt (the model's answers and, between
    them, tool outputs and the next turns' headers), ``loss_mask`` is 1 exactly on the sampled ids,
    ``logprobs`` the sampler's (0.0 where not sampled); the three have one entry per response id.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    #: The response was cut to the trainer's cap (it had more tokens).
    truncated: bool = False
    #: ``False``: the episode recorded no model turn (or is excluded); the entry is a masked one-token
    #: stand-in.
    sampled: bool = True
    #: The episode is left out of training (:attr:`EpisodeSample.excluded`): drop the entry, or keep the
    #: masked stand-in where the batch must keep its shape.
    excluded: bool = False

    @property
    def sampled_tokens(self) -> int:
        """How many response ids the model sampled (the mask's ones)."""
        return sum(self.loss_mask)

    @property
    def mean_logprob(self) -> float:
        """The mean sampler logprob over the sampled ids (0.0 when none)."""
        picked = [lp for lp, m in zip(self.logprobs, self.loss_mask, strict=True) if m]
        return sum(picked) / len(picked) if picked else 0.0


def trainer_entry(ep: EpisodeSample, *, eos_id: int, encode: Any = None,
                  max_response_tokens: int | None = None) -> TrainerEntry:
    """The trainer's entry of one played episode: its main-line sample split at the first turn's prompt,
    the response cut to ``max_response_tokens`` (``None``: whole).

    An episode that recorded no model turn (a failed install, a sandbox that did not start) becomes a
    masked one-token response (``eos_id``, mask 0, logprob 0.0) after the task name's ids (``encode``,
    a ``str -> ids`` function; default: ``[eos_id]``), so the trainer's batch keeps its shape; its reward
    is set to 0 and its error to "the episode recorded no model turn" when it has none. An excluded
    episode (:attr:`EpisodeSample.excluded`: an ``infra_error``, or its group's) is that masked stand-in
    too, marked ``excluded``, whatever it recorded; its reward stays what :func:`exclude_infra_errors`
    set (one that moves no group baseline), never a reward-0 trained sample.
    """
    if max_response_tokens is not None and max_response_tokens < 1:
        raise ValueError(
            f"max_response_tokens must be at least 1 (or None: no cap), got {max_response_tokens}")
    s = ep.sample
    if ep.excluded or ep.infra_error:
        ep.excluded = True
        ids = [int(t) for t in (encode(ep.task) if encode is not None else [])] or [int(eos_id)]
        return TrainerEntry(prompt_ids=ids, response_ids=[int(eos_id)], loss_mask=[0], logprobs=[0.0],
                            sampled=False, excluded=True)
    if s is not None and s.response_length > 0:
        n = s.prompt_length
        tokens = [int(t) for t in s.tokens.tolist()]
        cut = max_response_tokens or s.response_length
        return TrainerEntry(
            prompt_ids=tokens[:n], response_ids=tokens[n:][:cut],
            loss_mask=[int(m) for m in s.loss_mask.tolist()][:cut],
            logprobs=[float(x) for x in s.logprobs.tolist()][:cut],
            truncated=s.response_length > cut,
        )
    ids = [int(t) for t in (encode(ep.task) if encode is not None else [])] or [int(eos_id)]
    if ep.error is None:
        ep.error = "the episode recorded no model turn"
    ep.reward = 0.0
    return TrainerEntry(prompt_ids=ids, response_ids=[int(eos_id)], loss_mask=[0], logprobs=[0.0],
                        sampled=False)


@dataclass(frozen=True)
class SampledTurn:
    """One model answer of a main-line sample, as a per-call trainer (TRL's harness rollout) takes it."""

    #: Everything before the answer: the first turn's prompt, earlier answers, tool outputs, headers.
    prompt_ids: list[int]
    #: The sampled ids of the answer, and the sampler's logprob of each.
    completion_ids: list[int]
    logprobs: list[float]
    #: The policy version that sampled it, where the engine said (``None``: unknown).
    policy_version: int | None = None


def sample_turns(sample: Sample) -> list[SampledTurn]:
    """The model's answers in a main-line :class:`trajectory.Sample`, in order: each maximal run of
    sampled ids (loss mask 1) after the prompt is one answer, its prompt every id before it. Joined
    back, the turns are the sample: the last turn's prompt plus its completion is the sample's ids up
    to the last sampled one."""
    tokens = [int(t) for t in sample.tokens.tolist()]
    n = int(sample.prompt_length)
    mask = [int(m) for m in sample.loss_mask.tolist()]
    lps = [float(x) for x in sample.logprobs.tolist()]
    versions = {int(a): v for a, _b, v in (sample.metadata.get("policy_versions") or [])}
    turns: list[SampledTurn] = []
    i = 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j]:
            j += 1
        turns.append(
            SampledTurn(prompt_ids=tokens[:n + i], completion_ids=tokens[n + i:n + j], logprobs=lps[i:j],
                        policy_version=versions.get(n + i)))
        i = j
    return turns


async def play_episodes(
    tasks: Sequence[Task],
    *,
    policy: Policy,
    episode: EpisodeConfig | None = None,
    run: RunConfig | None = None,
    max_staleness: int | None = None,
    policy_version: int | None = None,
    drop_group_on_infra_error: bool = False,
    **settings: Any,
) -> list[EpisodeSample]:
    """One episode per entry of ``tasks`` (repeats allowed), each as ``episode`` says, at most
    ``run.concurrency`` at once; the results in the order of ``tasks``. A failed episode is an entry
    with reward 0 and its error. A task's repeats are its attempts (``run.attempts`` must be 1).

    An episode that failed by the infrastructure is run again on a fresh sandbox, at most ``run.retries``
    times (:mod:`ares_gateway.episodes.failures`); one that failed every try (``infra_error``) is
    excluded from training, and with ``drop_group_on_infra_error`` so is every episode of its task in
    this call (its GRPO group): :func:`exclude_infra_errors`.

    ``run.executor`` runs the episodes (default: this process,
    :class:`~ares_gateway.episodes.executor.LocalExecutor`);
    it is started and closed once per wave of :func:`~ares_gateway.episodes.rollouts.run_rollouts`.
    ``max_staleness``: the main-line sample's responses sampled more than this many versions behind
    ``policy_version`` (default: the executor's version once the episodes are done) are masked
    (:func:`trajectory.mask_stale`; :attr:`EpisodeSample.stale_tokens`). ``run.save_workspaces`` and
    ``run.stats`` default to off here (:class:`~ares_gateway.episodes.config.RunConfig`).
    ``settings``: the configs' fields as keyword arguments, deprecated (``sandbox`` defaults to
    ``local`` there)."""
    episode, run = configs_from("play_episodes", episode, run, settings, episode_default={"sandbox": "local"})
    if run.attempts != 1:
        raise ValueError(f"play_episodes plays each entry of tasks once (got attempts={run.attempts}): "
                         "repeat a task in tasks for more episodes of it")
    run = run.resolved(save_workspaces=False, stats="null")
    check_max_staleness(max_staleness)
    by_session: dict[str, list[Any]] = {}

    def keep(result: EpisodeResult, samples: list[Any]) -> None:
        by_session[result.session_id] = samples

    # run_rollouts plans (task, attempt) pairs; repeats of a task become its attempts.
    unique: dict[str, Task] = {}
    for t in tasks:
        unique.setdefault(t.name, t)
    plan: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        plan.setdefault(t.name, []).append(i)
    # run_rollouts gives every task the same number of attempts: tasks repeated a different number of
    # times run in separate waves (a trainer's batch repeats every prompt alike: one wave).
    out_list: list[EpisodeSample | None] = [None] * len(tasks)
    by_count: dict[int, list[Task]] = {}
    for name, idxs in plan.items():
        by_count.setdefault(len(idxs), []).append(unique[name])
    for count, group in sorted(by_count.items()):
        summary = await run_rollouts(group, policy=policy, episode=episode,
                                     run=dataclasses.replace(run, attempts=count), on_samples=keep)
        for e in summary.episodes:
            idx = plan[e.task][e.attempt]
            samples = by_session.get(e.session_id, [])
            sample, others = main_sample(samples)
            out_list[idx] = EpisodeSample(
                task=e.task, reward=float(e.reward), exit_reason=e.exit_reason, turns=e.turns,
                session_id=e.session_id, error=e.error, sample=sample, other_samples=others,
                foreign_samples=foreign_count(samples), result=e,
            )
    if max_staleness is not None:
        current = (policy_version if policy_version is not None
                   else getattr(run.executor, "policy_version", None))
        for o in out_list:
            if o is not None and o.sample is not None:
                o.sample = mask_stale(o.sample, current, max_staleness)
                o.stale_tokens = int(o.sample.metadata["stale_tokens"])
    played = [
        o if o is not None else EpisodeSample(task=tasks[i].name, reward=0.0, exit_reason="cancelled",
                                               error="the episode did not finish (cancelled)")
        for i, o in enumerate(out_list)
    ]
    return exclude_infra_errors(played, drop_group=drop_group_on_infra_error)


def exclude_infra_errors(episodes: Sequence[EpisodeSample], *,
                         drop_group: bool = False) -> list[EpisodeSample]:
    """Mark the episodes that must not be trained on (:attr:`EpisodeSample.excluded`), in place; returns them.

    An ``infra_error`` episode (it failed by the infrastructure on every try) is excluded: no sample,
    and its reward set to the mean of its group's judged rewards (its group: the episodes of the same
    task; 0.0 when none was judged), so it moves neither the group's GRPO baseline nor, masked, the loss.
    With ``drop_group`` every episode of a group that holds one is excluded, each with reward 0.0 (equal
    rewards: no advantage, no gradient from the group), as SkyRL drops a group with a failed trajectory.
    """
    groups: dict[str, list[EpisodeSample]] = {}
    for ep in episodes:
        groups.setdefault(ep.task, []).append(ep)
    for group in groups.values():
        if not any(ep.infra_error for ep in group):
            continue
        judged = [ep.reward for ep in group if not ep.infra_error]
        for ep in group:
            if drop_group or ep.infra_error:
                ep.excluded = True
                ep.sample = None
                ep.reward = 0.0 if drop_group else (sum(judged) / len(judged) if judged else 0.0)
    return list(episodes)


def describe_failure(ep: EpisodeSample) -> str:
    """One line for a log: the task, why it ended, its error."""
    return one_line(f"{ep.task}: {ep.exit_reason}" + (f": {ep.error}" if ep.error else "")) or ep.task
