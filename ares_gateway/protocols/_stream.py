"""The skeleton the three stream encoders share: what is fed in which order, what ``finish`` still
owes, and that nothing is written after the stream's end.

A protocol's encoder (``ChatStreamEncoder``, ``AnthropicStreamEncoder``,
``ResponsesStreamEncoder``) subclasses :class:`StreamEncoderBase` and writes only its own events:
how a piece of reasoning, text, a signature or a tool call's arguments looks on its wire, how the
stream starts and ends, and its error event. The base decides the rest once for all three:

* ``feed(delta)``: reasoning, then the thinking block's signature, then text, then a tool call
  (opened on its first delta, its arguments appended after);
* ``finish(completion)``: whatever of the whole completion the deltas did not already say
  (:func:`remainder` of reasoning, text and each tool call's arguments; tool calls never fed are
  opened), then the protocol's closing events; so ``start() + finish(c)`` is the full
  synthesized stream of a whole answer;
* after ``finish`` or ``error`` every call returns ``b""``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from ares_gateway.core.canonical import Completion, CompletionDelta, ToolCall
from ares_gateway.protocols._shared import new_id, remainder

_Tool = TypeVar("_Tool")


class StreamEncoderBase(Generic[_Tool]):
    """Implements the ``StreamEncoder`` protocol of :mod:`ares_gateway.core.wire` from the
    hooks below; subclasses call ``super().__init__()`` and keep ``self.tools`` (tool index ->
    whatever they track per tool call)."""

    #: Prefix of the id given to a tool call the policy sent without one.
    tool_id_prefix = "call_"

    def __init__(self) -> None:
        self.closed = False
        self.tools: dict[int, _Tool] = {}

    # -- the StreamEncoder protocol -----------------------------------------------------------

    def start(self) -> bytes:
        return self._start()

    def feed(self, delta: CompletionDelta) -> bytes:
        if self.closed:
            return b""
        out = [self._before_feed()]
        if delta.reasoning:
            out.append(self._reasoning(delta.reasoning))
        if delta.signature:
            out.append(self._signature(delta.signature))
        if delta.text:
            out.append(self._text(delta.text))
        if delta.tool_index is not None:
            i = delta.tool_index
            if i not in self.tools:
                tid = delta.tool_call_id or new_id(self.tool_id_prefix)
                out.append(self._tool_open(i, tid, delta.tool_name or "", delta.tool_type))
            else:
                out.append(self._tool_resume(i))
            if delta.arguments:
                out.append(self._tool_args(i, delta.arguments))
        return b"".join(out)

    def finish(self, completion: Completion) -> bytes:
        if self.closed:
            return b""
        c = completion
        out = [self._before_finish(c)]
        r = remainder(self._fed_reasoning(), c.reasoning)
        if r:
            out.append(self._reasoning(r))
        out.append(self._finish_signature(c))
        t = remainder(self._fed_text(), c.text)
        if t:
            out.append(self._text(t))
        for i, tc in enumerate(c.tool_calls):
            if i not in self.tools:
                out.append(self._tool_open(i, tc.id or new_id(self.tool_id_prefix), tc.name, tc.type))
                out.append(self._fresh_tool_args(i, tc))
            else:
                a = remainder(self._fed_args(i), tc.arguments)
                if a:
                    out.append(self._tool_args(i, a))
        out.append(self._end(c))
        self.closed = True
        return b"".join(out)

    def error(self, status: int, message: str) -> bytes:
        """Bytes that end the stream with an error event in the protocol's shape."""
        if self.closed:
            return b""
        self.closed = True
        return self._error(status, message)

    # -- hooks ----------------------------------------------------------------------------------

    def _start(self) -> bytes:
        raise NotImplementedError

    def _before_feed(self) -> bytes:
        """Events owed before the first delta (a stream that was not started, say)."""
        return b""

    def _before_finish(self, completion: Completion) -> bytes:
        return b""

    def _reasoning(self, text: str) -> bytes:
        raise NotImplementedError

    def _signature(self, signature: str) -> bytes:
        """A delta's signature for the thinking block being streamed (protocols without one drop it)."""
        return b""

    def _finish_signature(self, completion: Completion) -> bytes:
        """The final completion's signature, if the protocol can still place it."""
        return b""

    def _text(self, text: str) -> bytes:
        raise NotImplementedError

    def _tool_open(self, index: int, call_id: str, name: str, tool_type: str) -> bytes:
        raise NotImplementedError

    def _tool_resume(self, index: int) -> bytes:
        """A delta for a tool call opened before: events owed before its arguments go on."""
        return b""

    def _tool_args(self, index: int, args: str) -> bytes:
        raise NotImplementedError

    def _fresh_tool_args(self, index: int, call: ToolCall) -> bytes:
        """The arguments of a tool call ``finish`` had to open itself."""
        return self._tool_args(index, call.arguments) if call.arguments else b""

    def _fed_reasoning(self) -> str:
        raise NotImplementedError

    def _fed_text(self) -> str:
        raise NotImplementedError

    def _fed_args(self, index: int) -> str:
        raise NotImplementedError

    def _end(self, completion: Completion) -> bytes:
        raise NotImplementedError

    def _error(self, status: int, message: str) -> bytes:
        raise NotImplementedError


__all__ = ["StreamEncoderBase"]
