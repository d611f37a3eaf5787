"""Render canonical requests to prompt token ids, parse completion ids back into a :class:`Completion`.

:class:`ChatRenderer` sits on a ``renderers`` library renderer (PrimeIntellect's ``renderers``:
hand-written renderers for Qwen3/GLM/DeepSeek/Kimi/... and ``DefaultRenderer``, the model's own
Jinja chat template) and a :class:`~ares_gateway.tokens.tokenizer.ChatTokenizer`:

* :meth:`ChatRenderer.render` — a full render of the conversation with the generation prompt;
* :meth:`ChatRenderer.parse` — completion ids -> text, reasoning and tool calls in the family's format;
* :meth:`ChatRenderer.bridge` — the next turn's prompt as the previous turn's exact prompt + sampled
  ids + only the new messages' tokens. Hand-written renderers bring their own
  ``bridge_to_next_turn``; for the generic template (whose ``bridge_to_next_turn`` always declines)
  this module bridges at the text level and *checks* that the template is append-only for this
  conversation: rendered history must be a prefix of the rendered extension, and the rendered
  assistant turn must start with exactly the text of the sampled ids. When a check fails the
  bridge declines with a reason and the caller starts a fresh render (counted, never silent).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ares_gateway.core.canonical import Completion, Message, Tool, ToolCall, Usage
from ares_gateway.tokens.tokenizer import ChatTokenizer, load_tokenizer

__all__ = ["Bridge", "ChatRenderer", "RenderError", "Rendered"]


class RenderError(ValueError):
    """A request the renderer cannot turn into tokens (e.g. an image for a text-only model)."""


@dataclass(frozen=True)
class Rendered:
    """A full render: the prompt ids and, for template renders, the prompt text they came from."""

    prompt_ids: list[int]
    text: str | None


@dataclass(frozen=True)
class Bridge:
    """The outcome of extending a previous turn.

    ``prompt_ids`` is ``None`` when the extension was refused; ``reason`` then says why
    (the caller renders afresh). ``text`` is the rendered text of the new prompt (template bridges).
    """

    prompt_ids: list[int] | None
    text: str | None = None
    reason: str | None = None


#: Roles templates rarely know, mapped to ones they do.
DEFAULT_ROLE_MAP: Mapping[str, str] = {"developer": "system"}


class ChatRenderer:
    """Message <-> token conversion for one model; build one per model and share it.

    Args:
        tokenizer: the model's :class:`ChatTokenizer`, or a model path for :func:`load_tokenizer`
            (``None``: the embedded SmolLM2 default).
        renderer: a ``renderers`` renderer name (``"qwen3"``, ``"glm-4.5"``, ... or ``"default"`` for the
            model's own chat template). ``None``: the library's map from the model name, else ``default``.
        tool_parser / reasoning_parser: ``renderers`` parser names for the ``default`` renderer
            (e.g. ``"qwen3"`` for Hermes ``<tool_call>`` tokens, ``"think"`` for ``<think>`` text).
        role_map: roles renamed before rendering (``developer`` -> ``system`` by default).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer | str | None = None,
        *,
        renderer: str | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        role_map: Mapping[str, str] | None = None,
    ) -> None:
        import renderers
        from renderers.base import MODEL_RENDERER_MAP

        self.tokenizer = tokenizer if isinstance(tokenizer, ChatTokenizer) else load_tokenizer(tokenizer)
        self._options = {"renderer": renderer, "tool_parser": tool_parser,
                         "reasoning_parser": reasoning_parser,
                         "role_map": None if role_map is None else dict(role_map)}
        name = renderer or MODEL_RENDERER_MAP.get(self.tokenizer.name_or_path) or "default"
        if name == "default":
            config: Any = renderers.DefaultRendererConfig(tool_parser=tool_parser,
                                                          reasoning_parser=reasoning_parser)
        else:
            config = renderers.config_from_name(name)
        self.name = name
        self.renderer: Any = renderers.create_renderer(self.tokenizer, config)
        self.is_template = name == "default"
        self.role_map = dict(DEFAULT_ROLE_MAP if role_map is None else role_map)
        self.stop_token_ids: list[int] = list(self.renderer.get_stop_token_ids())

    def __reduce__(self) -> tuple[Any, ...]:
        # Another process builds its own renderer from the same tokenizer and options.
        return (_rebuild_renderer, (self.tokenizer, self._options))

    # --------------------------------------------------------------- inputs
    def template_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """Canonical messages as chat-template dicts (string content, OpenAI-style tool calls)."""
        return [self._message(m) for m in messages]

    def _message(self, m: Message) -> dict[str, Any]:
        if isinstance(m.content, list):
            bad = sorted(
                {p.type for p in m.content if p.type not in ("text", "thinking", "redacted_thinking")})
            if bad:
                raise RenderError(
                    f"a {m.role} message has {', '.join(bad)} content; the {self.name!r} renderer "
                    "renders text only"
                )
        out: dict[str, Any] = {"role": self.role_map.get(m.role, m.role), "content": m.text()}
        if m.role == "assistant":
            reasoning = m.reasoning
            if reasoning is None and isinstance(m.content, list):
                parts = [p.text or "" for p in m.content if p.type == "thinking"]
                reasoning = "".join(parts) or None
            if reasoning:
                out["reasoning_content"] = reasoning
            if m.tool_calls:
                out["tool_calls"] = [
                    {"id": tc.id, "type": "function",
                     "function": {"name": tc.name, "arguments": tc.arguments}}
                    for tc in m.tool_calls
                ]
        if m.role == "tool":
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                out["name"] = m.name
        return out

    @staticmethod
    def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
        """Function tools in the OpenAI shape chat templates expect; ``None`` when there are none."""
        out = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                },
            }
            for t in tools
            if t.type == "function" and t.name
        ]
        return out or None

    # --------------------------------------------------------------- render
    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> Rendered:
        """Full render of template ``messages`` with the generation prompt."""
        msgs = list(messages)
        if self.is_template:
            text = self.tokenizer.render_text(msgs, tools=tools, add_generation_prompt=True)
            return Rendered(self.tokenizer.encode(text), text)
        return Rendered(list(self.renderer.render_ids(msgs, tools=tools, add_generation_prompt=True)), None)

    def bridge(
        self,
        prev_prompt_ids: Sequence[int],
        prev_output_ids: Sequence[int],
        history: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        prev_prompt_text: str | None = None,
    ) -> Bridge:
        """Extend the previous turn with ``new_messages``.

        ``history`` is the previous prompt's messages followed by the assistant message that turn
        produced, as the agent sent it back. ``prev_prompt_text`` (the previous render's text)
        saves one render.
        """
        if not new_messages:
            return Bridge(None, reason="no new messages after the previous answer")
        if any(m.get("role") == "assistant" for m in new_messages):
            return Bridge(None,
                          reason="an assistant message the engine did not sample follows the previous answer")
        prev = [*prev_prompt_ids, *prev_output_ids]
        if not self.is_template:
            out = self.renderer.bridge_to_next_turn(list(prev_prompt_ids), list(prev_output_ids),
                                                    list(new_messages), tools=tools)
            if out is None:
                return Bridge(None, reason=f"the {self.name!r} renderer declined to extend this turn")
            ids = list(out.token_ids)
            if ids[: len(prev)] != prev:  # the library's contract, checked: never trust a drifting bridge
                return Bridge(
                    None, reason=f"the {self.name!r} renderer's extension does not keep the sampled tokens")
            return Bridge(ids)
        tok = self.tokenizer
        hist = list(history)
        prompt_text = prev_prompt_text
        if prompt_text is None:
            prompt_text = tok.render_text(hist[:-1], tools=tools, add_generation_prompt=True)
        hist_text = tok.render_text(hist, tools=tools, add_generation_prompt=False)
        if not hist_text.startswith(prompt_text):
            return Bridge(None, reason="the template re-renders the earlier prompt once the answer is added "
                                       "(not append-only)")
        next_text = tok.render_text([*hist, *new_messages], tools=tools, add_generation_prompt=True)
        if not next_text.startswith(hist_text):
            return Bridge(None, reason="the template renders the history differently once new messages "
                                       "follow (not append-only)")
        sampled = tok.decode(list(prev_output_ids), skip_special_tokens=False)
        answer = hist_text[len(prompt_text) :]
        if not answer.startswith(sampled):
            return Bridge(None, reason="the answer as sent back renders differently from the sampled tokens")
        # The turn close the sampler did not produce (e.g. ChatML's "\n" after <|im_end|>, or the whole
        # close after a length stop) plus the new messages and the generation prompt.
        delta = answer[len(sampled) :] + next_text[len(hist_text) :]
        return Bridge(prev + tok.encode(delta), next_text)

    # ---------------------------------------------------------------- parse
    def parse(
        self,
        output_ids: Sequence[int],
        *,
        prompt_ids: Sequence[int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        finish_reason: str = "stop",
    ) -> tuple[Completion, list[str]]:
        """A canonical completion from sampled ids; also the raw text of tool calls that did not parse."""
        from renderers import ToolCallParseStatus

        parsed = self.renderer.parse_response(list(output_ids), tools=tools,
                                              prompt_ids=list(prompt_ids or []))
        calls: list[ToolCall] = []
        broken: list[str] = []
        for tc in parsed.tool_calls:
            if tc.status != ToolCallParseStatus.OK or not tc.name:
                broken.append(tc.raw)
                continue
            args = tc.arguments
            calls.append(
                ToolCall(
                    id=tc.id or f"call_{uuid.uuid4().hex[:24]}",
                    name=tc.name,
                    arguments=args if isinstance(args, str) else json.dumps(args if args is not None else {}),
                )
            )
        finish: Any = "length" if finish_reason == "length" else ("tool_calls" if calls else "stop")
        completion = Completion(
            text=parsed.content or None,
            reasoning=parsed.reasoning_content or None,
            tool_calls=calls,
            finish_reason=finish,
            usage=Usage(input_tokens=len(prompt_ids or ()), output_tokens=len(output_ids)),
        )
        return completion, broken


def _rebuild_renderer(tokenizer: ChatTokenizer, options: dict[str, Any]) -> ChatRenderer:
    """:meth:`ChatRenderer.__reduce__`'s other half."""
    return ChatRenderer(tokenizer, **options)
