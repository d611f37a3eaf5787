"""Public value types: what the gateway records (:class:`TurnRecord`) and what trainers get
(:class:`Sample`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._tokens import LogprobArray, TokenArray, TokenIdsLike, as_logprob_array, as_token_array


class TurnRecord:
    """One generation exactly as the inference engine saw it.

    Args:
        prompt_ids: the whole prompt as token ids (list, numpy integer array or ``array('i')``).
        output_ids: the generated token ids.
        output_logprobs: empty, or one logprob per output token; anything else raises ``ValueError``.
        finish_reason: the engine's finish reason ("stop", "length", "tool_calls", ...).
        ill_formed: set by the gateway when the output could not be parsed cleanly
            (for example a broken tool call); carried into sample metadata.
        policy_version: the version of the weights that sampled the output (a non-negative
            integer), or ``None`` when none is known; carried into sample metadata
            (``policy_versions``, ``mixed_versions``).

    Token ids are held as int32 arrays; an int32 numpy array is used without copying, so
    do not mutate it while the record is in use.  The manager copies what it keeps.
    """

    __slots__ = ("finish_reason", "ill_formed", "output_ids", "output_logprobs", "policy_version",
                 "prompt_ids")

    prompt_ids: TokenArray
    output_ids: TokenArray
    output_logprobs: LogprobArray | None
    finish_reason: str
    ill_formed: bool
    policy_version: int | None

    def __init__(
        self,
        prompt_ids: TokenIdsLike,
        output_ids: TokenIdsLike,
        output_logprobs: Any = (),
        finish_reason: str = "stop",
        ill_formed: bool = False,
        policy_version: int | None = None,
    ) -> None:
        self.prompt_ids = as_token_array(prompt_ids, what="prompt_ids")
        self.output_ids = as_token_array(output_ids, what="output_ids")
        self.output_logprobs = as_logprob_array(output_logprobs, int(self.output_ids.shape[0]))
        self.finish_reason = str(finish_reason)
        self.ill_formed = bool(ill_formed)
        if policy_version is not None and (
            isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0
        ):
            raise ValueError(f"policy_version must be a non-negative integer or None, not {policy_version!r}")
        self.policy_version = policy_version

    def __repr__(self) -> str:
        return (
            f"TurnRecord(prompt={self.prompt_ids.shape[0]} tokens, output={self.output_ids.shape[0]} tokens, "
            f"logprobs={'yes' if self.output_logprobs is not None else 'no'}, "
            f"finish_reason={self.finish_reason!r}, ill_formed={self.ill_formed}, "
            f"policy_version={self.policy_version})"
        )


@dataclass(eq=False)
class Sample:
    """One training sample.

    Attributes:
        tokens: the whole sequence, leading prompt included (int32 array; ``list()`` or
            ``tokens.tolist()`` converts it).
        response_length: number of tokens after the leading prompt.
        loss_mask: ``response_length`` values, 1 where the token is trained (int32 array, as
            ``tokens``). Its sum is the number of trained tokens whichever way it is taken:
            ``int(loss_mask.sum())``, ``sum(loss_mask)`` or ``loss_mask.tolist()`` (a narrower
            dtype such as int8 wraps under Python's ``sum()``: 6,000 ones would sum to 112).
        logprobs: ``response_length`` engine logprobs (float32); 0.0 wherever the loss mask
            is 0 or the engine gave none.
        reward: the episode reward given to ``get_trajectory``.
        metadata: plain data about the sample (see ``docs/trajectory.md``): ``session_id``,
            ``side_call``, ``foreign``, ``main_line``, ``truncated``, ``ill_formed``, ``used_tools``,
            ``branch``,
            ``num_branches``, ``segment``, ``start_reason``, ``turn_ids``, ``trained_turn_ids``,
            ``masked_turn_ids``, ``finish_reason``, ``rewritten``, ``policy_versions`` (a
            ``[start, end, version]`` list of ``tokens`` positions per trained response; version
            ``None`` where none is known), ``mixed_versions`` (the trained tokens carry more than
            one version).
    """

    tokens: TokenArray
    response_length: int
    loss_mask: npt.NDArray[np.int32]
    logprobs: LogprobArray
    reward: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        """Length of the leading prompt (``len(tokens) - response_length``)."""
        return int(self.tokens.shape[0]) - self.response_length

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form: lists of ints/floats, no numpy types."""
        return {
            "tokens": self.tokens.tolist(),
            "response_length": int(self.response_length),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "reward": float(self.reward),
            "metadata": dict(self.metadata),
        }

    def check(self) -> None:
        """Raise ``AssertionError`` unless the length invariants hold (used by tests and callers)."""
        n = int(self.tokens.shape[0])
        if not 0 <= self.response_length <= n:
            raise AssertionError(f"response_length {self.response_length} outside [0, {n}]")
        if self.loss_mask.dtype != np.int32:
            raise AssertionError(
                f"loss_mask dtype {self.loss_mask.dtype} != int32 (a narrower one wraps when summed)")
        if self.loss_mask.shape != (self.response_length,):
            raise AssertionError(f"loss_mask length {self.loss_mask.shape} != {self.response_length}")
        if self.logprobs.shape != (self.response_length,):
            raise AssertionError(f"logprobs length {self.logprobs.shape} != {self.response_length}")
        if np.any(self.logprobs[self.loss_mask == 0] != 0.0):
            raise AssertionError("nonzero logprob where the loss mask is 0")
