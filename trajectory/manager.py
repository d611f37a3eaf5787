"""TrajectoryManager: per-session message trees in, training samples out."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ._tokens import TokenArray
from .linearize import linearize
from .normalize import MessageKey, NormalizerRegistry, default_registry, message_key
from .tree import Tree
from .types import Sample, TurnRecord
from .view import tree_view

logger = logging.getLogger(__name__)


class _Session:
    __slots__ = ("main", "side", "turns")

    def __init__(self) -> None:
        self.main: Tree | None = None
        self.side: Tree | None = None
        self.turns = 0


class TrajectoryManager:
    """Records every answered turn of every session and linearizes sessions into samples.

    Args:
        fork_threshold_tokens: responses shorter than this many tokens may be rewrite-merged
            (a client's rewritten replay replaces the generated message instead of forking)
            and, when their tokens drift, replaced and masked instead of starting a new
            sample.  0 disables both.
        normalizers: the client-normalizer registry to use (default: the module-wide one,
            see :func:`trajectory.register_normalizer`).

    Not thread-safe: call it from one thread (the gateway's event loop).
    """

    def __init__(
        self, fork_threshold_tokens: int = 1024, *, normalizers: NormalizerRegistry | None = None
    ) -> None:
        if fork_threshold_tokens < 0:
            raise ValueError("fork_threshold_tokens must be >= 0")
        self.fork_threshold_tokens = int(fork_threshold_tokens)
        self.normalizers = normalizers if normalizers is not None else default_registry
        self._sessions: dict[str, _Session] = {}

    # ------------------------------------------------------------------ write
    def record_turn(
        self,
        session_id: str,
        *,
        prompt_messages: Sequence[Mapping[str, Any]],
        response_message: Mapping[str, Any] | None,
        turn: TurnRecord,
        metadata: Mapping[str, Any] | None = None,
    ) -> int | None:
        """Record one answered turn.

        Returns how many leading prompt ids the turn shares with the prompt + output of the turn
        stored before it in the same tree (see :meth:`last_ids`; 0 for the first), or ``None``
        when no tokens were stored (an empty generation, or no prompt messages).

        Args:
            session_id: the episode; sessions never share nodes.
            prompt_messages: the whole request history, canonical chat dicts (fresh
                objects per request are fine; they are not kept, except private copies of
                messages new to the tree).
            response_message: the generated message, or None for an empty generation
                (no output, e.g. stopped at the context limit): recorded, yields no sample.
            turn: the engine's token record for this generation.
            metadata: ``{"side_call": True}`` routes the turn into the session's side-call
                tree; ``{"client": name}`` selects that client's normalizers.

        Empty ``prompt_messages`` is a no-op (logged).
        """
        if not isinstance(turn, TurnRecord):
            raise TypeError(f"turn must be a TurnRecord, got {type(turn).__name__}")
        if not prompt_messages:
            logger.warning("trajectory: session %s: record_turn with no prompt messages ignored", session_id)
            return None
        meta = metadata or {}
        side = bool(meta.get("side_call"))
        client = meta.get("client")
        normalizers = self.normalizers.for_client(client if isinstance(client, str) else None)

        def key_of(message: Any) -> MessageKey:
            return message_key(message, normalizers)

        if response_message is None and turn.output_ids.shape[0]:
            logger.warning(
                "trajectory: session %s: %d output tokens recorded without a response message; no sample",
                session_id,
                turn.output_ids.shape[0],
            )
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session()
        if side:
            if session.side is None:
                session.side = Tree(self.fork_threshold_tokens)
            tree = session.side
        else:
            if session.main is None:
                session.main = Tree(self.fork_threshold_tokens)
            tree = session.main
        session.turns += 1
        return tree.record(prompt_messages, response_message, turn, key_of, seq=session.turns)

    def last_ids(self, session_id: str, *, side_call: bool = False) -> TokenArray | None:
        """Prompt + output ids of the last turn stored in the session's main (or side-call) tree,
        the sequence a continuing prompt extends: a view of the tree's own storage, not to be
        written, valid until the next :meth:`record_turn` (``None``: no turn stored there)."""
        session = self._sessions.get(session_id)
        tree = None if session is None else (session.side if side_call else session.main)
        if tree is None or tree.last is None:
            return None
        return tree.load(tree.last)

    # ------------------------------------------------------------------- read
    def get_trajectory(
        self, session_id: str, *, reward: float = 0.0, max_sample_tokens: int = 0
    ) -> list[Sample]:
        """Linearize the session into samples and drop it (drains; an unknown session gives []).

        The main tree's samples come first (the main line's marked ``metadata["main_line"]``, those of
        conversations that do not extend the first request ``metadata["foreign"]``), then side-call
        samples (``metadata["side_call"]``).
        ``max_sample_tokens > 0`` truncates each sample to that many tokens (flagged
        ``metadata["truncated"]``).
        """
        session = self._sessions.get(session_id)
        samples = self._linearize(session, session_id, reward, max_sample_tokens, consume=True)
        if session is not None:
            del self._sessions[session_id]
            for tree in (session.main, session.side):
                if tree is not None:
                    tree.dispose()
        return samples

    def samples(self, session_id: str, *, reward: float = 0.0, max_sample_tokens: int = 0) -> list[Sample]:
        """Like :meth:`get_trajectory`, but the session stays recorded (more turns may follow).

        Every sample's arrays are private copies, so building samples mid-session is safe.
        """
        return self._linearize(self._sessions.get(session_id), session_id, reward, max_sample_tokens,
                               consume=False)

    @staticmethod
    def _linearize(session: _Session | None, session_id: str, reward: float, max_sample_tokens: int, *,
                   consume: bool) -> list[Sample]:
        """Main-line samples, then side-call samples, of ``session`` (``consume`` lets the trees hand over
        arrays)."""
        if max_sample_tokens < 0:
            raise ValueError("max_sample_tokens must be >= 0")
        samples: list[Sample] = []
        if session is None:
            return samples
        for tree, side in ((session.main, False), (session.side, True)):
            if tree is not None:
                samples.extend(linearize(tree, session_id=session_id, side_call=side, reward=reward,
                                         max_sample_tokens=max_sample_tokens, consume=consume))
        return samples

    def has_session(self, session_id: str) -> bool:
        """Whether anything is recorded for the session."""
        return session_id in self._sessions

    def turn_count(self, session_id: str) -> int:
        """Turns recorded for the session (main and side calls, empty generations included)."""
        session = self._sessions.get(session_id)
        return 0 if session is None else session.turns

    def drop_session(self, session_id: str) -> bool:
        """Forget a session without linearizing it; returns whether it existed."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        for tree in (session.main, session.side):
            if tree is not None:
                tree.dispose()
        return True

    def tree_view(self, session_id: str, *, side_call: bool = False) -> dict[str, Any] | None:
        """The session's main (or side-call) message tree as plain data for display
        (:func:`trajectory.view.tree_view`); ``None`` when it has none."""
        session = self._sessions.get(session_id)
        tree = None if session is None else (session.side if side_call else session.main)
        return None if tree is None else tree_view(tree)

    def session_ids(self) -> list[str]:
        """Ids of the sessions currently held."""
        return list(self._sessions)
