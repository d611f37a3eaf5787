"""Training samples as the viewer shows them: a list without tokens, one sample's tokens a window at a time.

A 200-turn session's sample holds ~157k tokens: the page asks for a window (a few thousand) and is
told the whole sample's counts (tokens, trained tokens: the loss mask's sum) up front.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ares_gateway.viewer")

#: A token is marked low-probability below this probability (logprob < ln of it).
LOW_PROBABILITY = 0.1


class SampleSet:
    """The samples of one episode (``Sample.to_dict()`` dicts, as ``trajectories/*.jsonl`` holds them)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self._summaries: list[dict[str, Any]] | None = None

    def summaries(self) -> list[dict[str, Any]]:
        """Per sample: index, line (side call; the main line the trainer adapters train; foreign: a
        conversation that does not extend the session's first request), branch (the tree's leaf), sizes,
        trained tokens, reward, turns, the policy versions of its trained responses."""
        if self._summaries is None:
            out = []
            for i, s in enumerate(self.rows):
                meta = s.get("metadata") or {}
                mask = s.get("loss_mask") or []
                out.append(
                    {"index": i, "side_call": bool(meta.get("side_call")), "branch": meta.get("branch"),
                     "main_line": bool(meta.get("main_line")), "foreign": bool(meta.get("foreign")),
                     "segment": meta.get("segment"), "tokens": len(s.get("tokens") or []),
                     "response_length": s.get("response_length"), "trained": int(sum(mask)),
                     "reward": s.get("reward"), "turn_ids": meta.get("turn_ids"),
                     "trained_turn_ids": meta.get("trained_turn_ids"),
                     "start_reason": meta.get("start_reason"), "truncated": meta.get("truncated"),
                     "policy_versions": meta.get("policy_versions"),
                     "mixed_versions": bool(meta.get("mixed_versions"))})
            self._summaries = out
        return self._summaries

    def window(self, index: int, *, offset: int, limit: int,
               pieces: Callable[[int], str] | None) -> dict[str, Any]:
        """Tokens ``offset`` .. ``offset + limit`` of sample ``index``: ``[id, piece, trained, logprob]``
        each (``logprob`` ``None`` for prompt tokens); the whole sample's counts beside them."""
        s = self.rows[index]
        tokens = s.get("tokens") or []
        n = len(tokens)
        rlen = int(s.get("response_length") or 0)
        prompt = n - rlen
        mask = s.get("loss_mask") or []
        lps = s.get("logprobs") or []
        offset = max(0, min(offset, n))
        out = []
        for pos in range(offset, min(n, offset + limit)):
            tid = int(tokens[pos])
            r = pos - prompt
            trained = int(mask[r]) if 0 <= r < len(mask) else 0
            lp = float(lps[r]) if 0 <= r < len(lps) and trained else None
            if lp is not None and not math.isfinite(lp):
                lp = None
            out.append([tid, pieces(tid) if pieces else None, trained, lp])
        return {"summary": self.summaries()[index], "total": n, "prompt_length": prompt,
                "trained": int(sum(mask)), "offset": offset, "tokens": out,
                "low_logprob": math.log(LOW_PROBABILITY), "pieces": pieces is not None}


class TokenPieces:
    """Token id -> its text, from the run's model's tokenizer (loaded once, on first use; none when the
    ``model`` extra's ``tokenizers`` is missing or the file does not load: the page shows ids then)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._loaded: dict[str, Callable[[int], str] | None] = {}
        self._lock = threading.Lock()

    def for_model(self, default: str | None) -> Callable[[int], str] | None:
        """id -> text with the tokenizer given at construction, else ``default`` (the run's model)."""
        path = self.path or default
        if not path:
            return None
        with self._lock:
            if path not in self._loaded:
                self._loaded[path] = self._load(path)
            return self._loaded[path]

    @staticmethod
    def _load(path: str) -> Callable[[int], str] | None:
        try:
            from ares_gateway.tokens import load_tokenizer

            tok = load_tokenizer(path)
        except Exception as exc:  # no tokenizers package, a missing or unreadable file: ids only
            log.info("viewer: no text pieces for tokens (%s cannot be loaded: %s)", path, exc)
            return None
        cache: dict[int, str] = {}

        def piece(tid: int) -> str:
            text = cache.get(tid)
            if text is None:
                text = cache[tid] = tok.decode([tid])
            return text

        return piece
