"""ChatRenderer on the real SmolLM2 tokenizer: renders, parses, and the checked incremental bridge."""

from __future__ import annotations

import random

import pytest

from ares_gateway.core.canonical import ContentPart, Message, Tool

CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


def _answer_ids(renderer, text: str, *, stopped: bool = True) -> list[int]:  # type: ignore[no-untyped-def]
    """What a sampler emitting ``text`` produces: its tokens, then the end-of-turn token."""
    ids = renderer.tokenizer.encode(text)
    return [*ids, renderer.tokenizer.eos_token_id] if stopped else ids


def _in_context(renderer, prompt_ids: list[int], prompt_text: str, answer: str, stopped: bool) -> list[int]:  # type: ignore[no-untyped-def]
    """The answer as the tokenizer would tokenize it after the prompt (what a full re-render assumes)."""
    whole = renderer.tokenizer.encode(prompt_text + answer + ("<|im_end|>" if stopped else ""))
    assert whole[: len(prompt_ids)] == prompt_ids
    return whole[len(prompt_ids) :]


def test_full_render_is_the_models_template(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    r = smol_renderer
    msgs = r.template_messages([Message(role="user", content="hi")])
    out = r.render(msgs)
    assert out.text == CHATML + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_ids == r.tokenizer.encode(out.text)
    # developer -> system; content parts joined; a tool result keeps its role.
    msgs = r.template_messages(
        [
            Message(role="developer", content=[ContentPart(text="be "), ContentPart(text="brief")]),
            Message(role="tool", content="ok", tool_call_id="c1"),
        ]
    )
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["role"] == "tool" and msgs[1]["tool_call_id"] == "c1"


def test_parse_round_trip(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    r = smol_renderer
    for text in ["Sure! Run `ls -la`.\n\n```bash\nls -la\n```", "ünï 日本 🎉", "  spaced  "]:
        c, broken = r.parse(_answer_ids(r, text), finish_reason="stop")
        assert (c.text, c.finish_reason, broken) == (text, "stop", [])
        c, _ = r.parse(_answer_ids(r, text, stopped=False), finish_reason="length")
        assert (c.text, c.finish_reason) == (text, "length")


def test_images_are_refused_with_a_reason(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import RenderError

    msg = Message(role="user", content=[ContentPart(type="image", url="data:image/png;base64,AAAA")])
    with pytest.raises(RenderError, match="image content"):
        smol_renderer.template_messages([msg])


def _conversation(seed: int, turns: int) -> list[tuple[list[Message], str, bool]]:
    """(new messages, the answer text, whether the answer ended by a stop token) per turn."""
    rng = random.Random(seed)
    words = ["ls", "cat file.py", "pytest -q", "ü日🎉", "  x  ", "\n", "1234", "{\"a\": 1}", "tail\n\n",
             "```"]

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))

    out = []
    for i in range(turns):
        new = [Message(role="user" if i == 0 or rng.random() < 0.5 else "tool", content=text(),
                       tool_call_id=None)]
        if rng.random() < 0.3:
            new.append(Message(role="user", content=text()))
        # An answer opening with whitespace would merge with the prompt's last "\n" when re-tokenized
        # (see test_sampled_tokens_are_kept_where_a_re_render_would_drift); here answers open with a word.
        out.append((new, "ok " + text(), rng.random() > 0.2))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_equals_full_render_on_an_append_only_template(smol_renderer, seed: int) -> None:  # type: ignore[no-untyped-def]
    r = smol_renderer
    history: list[Message] = [Message(role="system", content="You solve tasks.")]
    prompt = None
    for new, answer, stopped in _conversation(seed, 25):
        if prompt is None:
            history += new
            rendered = r.render(r.template_messages(history))
            prompt_ids, prompt_text = rendered.prompt_ids, rendered.text
        else:
            b = r.bridge(prompt[0], prompt[1], r.template_messages(history), r.template_messages(new),
                         prev_prompt_text=prompt[2])
            history += new
            full = r.render(r.template_messages(history))
            assert b.reason is None
            assert b.prompt_ids == full.prompt_ids  # byte-for-byte what a full re-render gives
            assert b.text == full.text
            prompt_ids, prompt_text = b.prompt_ids, b.text
        out = _in_context(r, prompt_ids, prompt_text, answer, stopped)
        c, _ = r.parse(out, finish_reason="stop" if stopped else "length")
        history.append(c.to_message())
        prompt = (prompt_ids, out, prompt_text)


def test_sampled_tokens_are_kept_where_a_re_render_would_drift(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    # The model opened its answer with "\n" as its own token; re-tokenizing "assistant\n\n..." merges
    # the two newlines into one token, so a full re-render of the history no longer holds what was
    # sampled. The bridge keeps the sampled ids: the next prompt starts with prompt + output exactly.
    r = smol_renderer
    hist = [{"role": "user", "content": "hi"}]
    first = r.render(hist)
    out = [*r.tokenizer.encode("\n"), *r.tokenizer.encode(" {\"a\": 1}"), r.tokenizer.eos_token_id]
    c, _ = r.parse(out)
    history = [*hist, *r.template_messages([c.to_message()])]
    new = [{"role": "user", "content": "next"}]
    b = r.bridge(first.prompt_ids, out, history, new, prev_prompt_text=first.text)
    assert b.prompt_ids is not None
    assert b.prompt_ids[: len(first.prompt_ids) + len(out)] == first.prompt_ids + out
    full = r.render([*history, *new]).prompt_ids
    assert full[: len(first.prompt_ids) + len(out)] != first.prompt_ids + out  # the drift the bridge avoids
    assert r.tokenizer.decode(full) == r.tokenizer.decode(b.prompt_ids)  # same text, other tokens


def _tokenizer_with_template(smol_tokenizer, template: str):  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import ChatTokenizer

    return ChatTokenizer(
        smol_tokenizer._tok, template, name_or_path="test/not-append-only", eos_token="<|im_end|>",
        special_tokens=smol_tokenizer.all_special_tokens,
    )


# Drops the reasoning of every assistant turn but the last one: history changes once a turn follows.
DROPS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last and m.reasoning_content %}<think>{{ m.reasoning_content "
    "}}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt "
    "%}<|im_start|>assistant\n{% endif %}"
)
# Puts the number of messages in the system prompt: every earlier token after it moves.
COUNTS_MESSAGES = (
    "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "reason"),
    [(DROPS_THINKING, "not append-only"), (COUNTS_MESSAGES, "not append-only")],
)
def test_a_template_that_is_not_append_only_is_detected(smol_tokenizer, template: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import ChatRenderer

    r = ChatRenderer(_tokenizer_with_template(smol_tokenizer, template), renderer="default")
    hist = [{"role": "user", "content": "fix the bug"}]
    first = r.render(hist)
    sampled = r.tokenizer.encode("<think>look at it</think>done<|im_end|>")
    answer = {"role": "assistant", "content": "done", "reasoning_content": "look at it"}
    b = r.bridge(first.prompt_ids, sampled, [*hist, answer], [{"role": "user", "content": "thanks"}],
                 prev_prompt_text=first.text)
    assert b.prompt_ids is None and b.reason is not None and reason in b.reason
    # ... while the same template bridges fine where it happens to be append-only for the turn.
    if template is DROPS_THINKING:
        plain = r.tokenizer.encode("done<|im_end|>")
        b = r.bridge(first.prompt_ids, plain, [*hist, {"role": "assistant", "content": "done"}],
                     [{"role": "user", "content": "thanks"}], prev_prompt_text=first.text)
        assert b.prompt_ids is not None


def test_bridge_refuses_what_it_cannot_prove(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    r = smol_renderer
    hist = [{"role": "user", "content": "hi"}]
    first = r.render(hist)
    out = _answer_ids(r, "Hello!")
    # The agent edited the answer it sends back: the sampled tokens are not what the history says.
    edited = [*hist, {"role": "assistant", "content": "Hello! (edited)"}]
    b = r.bridge(first.prompt_ids, out, edited, [{"role": "user", "content": "next"}],
                 prev_prompt_text=first.text)
    assert b.prompt_ids is None and "renders differently from the sampled tokens" in (b.reason or "")
    # An assistant message the engine never sampled among the new ones.
    same = [*hist, {"role": "assistant", "content": "Hello!"}]
    b = r.bridge(first.prompt_ids, out, same, [{"role": "assistant", "content": "prefill"}])
    assert b.prompt_ids is None and "did not sample" in (b.reason or "")
    b = r.bridge(first.prompt_ids, out, same, [])
    assert b.prompt_ids is None


def test_tools_are_passed_to_the_template(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    tools = smol_renderer.template_tools(
        [Tool(name="bash", description="run", parameters={"type": "object"}), Tool(type="web_search")]
    )
    assert tools == [{"type": "function", "function": {"name": "bash", "description": "run",
                                                       "parameters": {"type": "object"}}}]
    assert smol_renderer.template_tools([]) is None
