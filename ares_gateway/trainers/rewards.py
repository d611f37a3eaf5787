"""Rewards computed from what an episode recorded, for trainers that take more than the verifier's.

The **format reward** of an episode is the share of the agent's LLM calls whose answer its harness
could parse into an action: the answers are the main-line sample's sampled spans (the token ids the
gateway recorded, decoded), the parse is the harness's own rule (mini-swe-agent's text mode: exactly
one match of its action regex), and the count of calls is the episode's turns (every call the gateway
answered). mini-swe-agent drops an answer without an action from its history, so the main line holds
the parsed answers and the dropped ones count only in the turns: parsed / turns is the share over
all the episode's answers. Nothing here reads the model's logprobs.

::

    from ares_gateway.trainers.rewards import FormatRule, format_reward
    rule = FormatRule.mini_swe_agent_text(LENIENT_ACTION_REGEX)
    score = format_reward(episode, rule, decode=tokenizer.decode)   # 0.0 .. 1.0
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ares_gateway.trainers.episodes import EpisodeSample, sample_turns

__all__ = ["FormatRule", "FormatScore", "format_reward", "format_rewards_column", "format_score",
           "from_column"]


@dataclass(frozen=True)
class FormatRule:
    """How a harness parses an answer into an action: ``pattern`` must match exactly ``count`` times."""

    pattern: str
    count: int = 1

    @classmethod
    def mini_swe_agent_text(cls, action_regex: str | None = None) -> FormatRule:
        """mini-swe-agent's text mode: exactly one match of its action regex (default: mini's own)."""
        return cls(action_regex or r"```mswea_bash_command\s*\n(.*?)\n```", 1)

    def parses(self, answer: str) -> bool:
        """Whether the harness would take an action from ``answer``."""
        return len(re.findall(self.pattern, answer, re.DOTALL)) == self.count


@dataclass(frozen=True)
class FormatScore:
    """One episode's format facts: answers parsed and LLM calls made; ``reward`` their ratio."""

    parsed: int
    calls: int

    @property
    def reward(self) -> float:
        return self.parsed / self.calls if self.calls else 0.0


def format_score(episode: EpisodeSample, rule: FormatRule, *,
                 decode: Callable[[list[int]], str]) -> FormatScore:
    """The episode's parsed answers (in its main-line sample) and its LLM calls (its turns; at least
    the answers found). An episode that recorded no model turn scores 0 of 0."""
    answers = ([decode(t.completion_ids) for t in sample_turns(episode.sample)] if episode.sample is not None
               else [])
    parsed = sum(1 for a in answers if rule.parses(a))
    return FormatScore(parsed=parsed, calls=max(int(episode.turns or 0), len(answers)))


def format_reward(episode: EpisodeSample, rule: FormatRule, *, decode: Callable[[list[int]], str]) -> float:
    """The share of the episode's LLM calls whose answer the harness parsed (0.0 when none was made)."""
    return format_score(episode, rule, decode=decode).reward


def format_rewards_column(episodes: Sequence[EpisodeSample], rule: FormatRule, *,
                          decode: Callable[[list[int]], str]) -> list[float]:
    """:func:`format_reward` of each episode, in order: a rollout's extra column for a TRL reward function."""
    return [format_reward(e, rule, decode=decode) for e in episodes]


def from_column(name: str) -> Callable[..., list[float]]:
    """A TRL reward function named ``name`` returning the rollout's extra column ``name`` as floats."""

    def reward(completions: Sequence[Any] | None = None, **columns: Any) -> list[float]:
        if name not in columns:
            raise KeyError(f"the rollout returned no {name!r} column: add it to the rollout's output")
        return [float(x) for x in columns[name]]

    reward.__name__ = name
    return reward
