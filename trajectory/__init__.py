"""Per-session message trees of an agent's LLM turns, linearized into token-faithful training samples.

Pure Python + numpy, no I/O.  See ``docs/trajectory.md``.

    from trajectory import TrajectoryManager, TurnRecord
    tm = TrajectoryManager(fork_threshold_tokens=1024)
    tm.record_turn(sid, prompt_messages=msgs, response_message=reply, turn=TurnRecord(p_ids, o_ids, o_lps))
    samples = tm.get_trajectory(sid, reward=1.0)   # drains the session
"""

from .manager import TrajectoryManager
from .normalize import (
    ALL_CLIENTS,
    BILLING_HEADER_PREFIX,
    MessageNormalizer,
    NormalizerRegistry,
    default_registry,
    message_key,
    register_normalizer,
    strip_claude_code_billing_header,
    unregister_normalizer,
)
from .staleness import check_max_staleness, is_stale, mask_stale
from .types import Sample, TurnRecord

__all__ = [
    "ALL_CLIENTS",
    "BILLING_HEADER_PREFIX",
    "MessageNormalizer",
    "NormalizerRegistry",
    "Sample",
    "TrajectoryManager",
    "TurnRecord",
    "check_max_staleness",
    "default_registry",
    "is_stale",
    "mask_stale",
    "message_key",
    "register_normalizer",
    "strip_claude_code_billing_header",
    "unregister_normalizer",
]
