"""Helpers for streamed answers: folding deltas into a whole completion."""

from __future__ import annotations

from ares_gateway.core.canonical import Completion, CompletionDelta, ToolCall


class DeltaAccumulator:
    """Folds :class:`CompletionDelta` items into the :class:`Completion` they spell out."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tools: dict[int, dict[str, str]] = {}
        self._signature: str | None = None

    def add(self, delta: CompletionDelta) -> None:
        if delta.text:
            self._text.append(delta.text)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.signature:
            self._signature = delta.signature
        if delta.tool_index is not None:
            slot = self._tools.setdefault(
                delta.tool_index, {"id": "", "name": "", "arguments": "", "type": delta.tool_type}
            )
            if delta.tool_call_id:
                slot["id"] = delta.tool_call_id
            if delta.tool_name:
                slot["name"] = delta.tool_name
            if delta.arguments:
                slot["arguments"] += delta.arguments

    def settle(self, final: Completion | None) -> Completion:
        """The completion to record once the stream ends: the policy's final one if it sent
        one (else what the deltas spell out), carrying the signature the agent was actually
        sent, since the stream encoders never send a second one."""
        if final is None:
            return self.completion()
        if self._signature and final.extra.get("signature") != self._signature:
            return final.model_copy(update={"extra": {**final.extra, "signature": self._signature}})
        return final

    def completion(self, finish_reason: str | None = None) -> Completion:
        calls = [
            ToolCall(
                id=t["id"] or f"call_{i}",
                name=t["name"],
                arguments=t["arguments"] or ("{}" if t["type"] == "function" else ""),
                type=t["type"],  # type: ignore[arg-type]
            )
            for i, t in sorted(self._tools.items())
        ]
        reason = finish_reason or ("tool_calls" if calls else "stop")
        return Completion(
            text="".join(self._text) or None,
            reasoning="".join(self._reasoning) or None,
            tool_calls=calls,
            finish_reason=reason,  # type: ignore[arg-type]
            extra={"signature": self._signature} if self._signature else {},
        )
