"""TokenStreams: later turns extend earlier turns' exact tokens; rewritten history is a counted fresh
render."""

from __future__ import annotations

from ares_gateway.core.canonical import Message, Tool


def _answer(streams, prepared, text: str) -> tuple[list[int], Message]:  # type: ignore[no-untyped-def]
    r = streams.renderer
    out = [*r.tokenizer.encode(text), r.tokenizer.eos_token_id]
    c, _ = r.parse(out, prompt_ids=prepared.prompt_ids)
    streams.commit(prepared, out, c.to_message())
    return out, c.to_message()


def test_a_session_extends_its_own_tokens(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import TokenStreams

    st = TokenStreams(smol_renderer)
    msgs = [Message(role="system", content="solve it"), Message(role="user", content="task: 1+1")]
    prompts: list[tuple[list[int], list[int]]] = []
    for k in range(6):
        p = st.prepare("s1", msgs)
        assert p.mode == ("first" if k == 0 else "extend"), p.reason
        if prompts:
            prev_prompt, prev_out = prompts[-1]
            assert p.prompt_ids[: len(prev_prompt) + len(prev_out)] == prev_prompt + prev_out
            assert p.base_prompt_tokens == len(prev_prompt) + len(prev_out)
        out, echo = _answer(st, p, f"ok step {k}: run `echo {k}`")
        prompts.append((p.prompt_ids, out))
        # The agent echoes the answer back (as a fresh object, with an id it made up) and adds a result.
        msgs = [*msgs, Message(role="assistant", content=echo.content, extra={"id": f"m{k}"}),
                Message(role="user", content=f"output: {k}")]
    s = st.stats("s1")
    assert (s.turns, s.first, s.extended, s.fresh, s.streams) == (6, 1, 5, 0, 1)


def test_retry_extends_the_turn_it_repeats(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import TokenStreams

    st = TokenStreams(smol_renderer)
    m1 = [Message(role="user", content="hi")]
    p1 = st.prepare("s", m1)
    _, echo = _answer(st, p1, "hello")
    m2 = [*m1, echo, Message(role="user", content="again")]
    p2 = st.prepare("s", m2)
    _answer(st, p2, "first try")
    p2b = st.prepare("s", m2)  # the agent retried the same request
    assert p2b.mode == "extend" and p2b.prompt_ids == p2.prompt_ids
    assert st.stats("s").fresh == 0


def test_rewritten_history_is_a_counted_fresh_render(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import TokenStreams

    st = TokenStreams(smol_renderer)
    m = [Message(role="system", content="sys"), Message(role="user", content="long task")]
    p = st.prepare("s", m)
    _, echo = _answer(st, p, "step one")
    m = [*m, echo, Message(role="user", content="r1")]
    p = st.prepare("s", m)
    _, echo2 = _answer(st, p, "step two")
    # Compaction: the agent replaces the history by a summary.
    compacted = [m[0], Message(role="user", content="summary of the work so far"),
                 Message(role="user", content="go on")]
    pc = st.prepare("s", compacted)
    assert pc.mode == "fresh" and "continues no recorded turn" in (pc.reason or "")
    assert pc.prompt_ids == smol_renderer.render(smol_renderer.template_messages(compacted)).prompt_ids
    # The agent edited an earlier answer: no recorded turn produced that answer, so nothing is extended.
    edited = [*m[:2], Message(role="assistant", content="step one (edited)"), m[3]]
    assert st.prepare("s", edited).mode == "fresh"
    # New tools change the prompt's preamble: fresh, even though the messages continue.
    cont = [*m, echo2, Message(role="user", content="r2")]
    assert st.prepare("s", cont, [Tool(name="bash", parameters={"type": "object"})]).mode == "fresh"
    assert st.prepare("s", cont).mode == "extend"
    s = st.stats("s")
    assert (s.first, s.fresh, s.streams) == (1, 3, 4)
    assert len(s.fresh_reasons) == 3


def test_bounded_memory(smol_renderer) -> None:  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import TokenStreams

    st = TokenStreams(smol_renderer, max_turns_kept=2, max_sessions=3)
    m = [Message(role="user", content="u0")]
    first = st.prepare("s", m)
    _, e0 = _answer(st, first, "a0")
    for k in range(1, 4):
        m = [*m, Message(role="assistant", content=f"a{k - 1}"), Message(role="user", content=f"u{k}")]
        _answer(st, st.prepare("s", m), f"a{k}")
    # The first turn was forgotten (only 2 kept): continuing it directly is a fresh render.
    assert st.prepare(
        "s", [Message(role="user", content="u0"), e0, Message(role="user", content="x")]).mode == "fresh"
    for sid in ("a", "b", "c"):
        st.prepare(sid, [Message(role="user", content="hi")])
    assert st.stats("s").turns == 0  # "s" was the least recently used of 4 sessions: dropped
