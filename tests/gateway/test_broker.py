"""The broker alone: leases, exactly-once answers, timeouts and withdrawal, without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from ares_gateway import (
    AlreadyAnsweredError,
    CanonicalRequest,
    Completion,
    RequestGoneError,
    UnknownRequestError,
    WireProtocol,
)
from ares_gateway.core.answers import ErrorAnswer
from ares_gateway.core.broker import Broker, RequestClosed
from ares_gateway.core.recorder import RecordedTurn


def _req(text: str = "x") -> CanonicalRequest:
    return CanonicalRequest.model_validate(
        {"protocol": WireProtocol.OPENAI_CHAT, "messages": [{"role": "user", "content": text}],
         "raw": {"m": text}}
    )


async def test_long_poll_wakes_on_park_and_returns_empty_after_wait() -> None:
    b = Broker()
    t0 = asyncio.get_running_loop().time()
    assert await b.poll(wait=0.1) == []
    assert asyncio.get_running_loop().time() - t0 >= 0.09
    poller = asyncio.create_task(b.poll(wait=5))
    await asyncio.sleep(0.01)
    parked = b.park("s1", _req(), "/v1/chat/completions")
    got = await asyncio.wait_for(poller, 1)
    assert got == [parked] and parked.attempt == 1


async def test_poll_filters_by_session_and_batches() -> None:
    b = Broker()
    a = [b.park("a", _req(str(i)), "/e") for i in range(3)]
    c = b.park("c", _req(), "/e")
    assert await b.poll("c", max_items=10) == [c]
    assert await b.poll(max_items=2) == a[:2]
    assert await b.poll(max_items=10) == a[2:]


async def test_lease_expiry_redelivers_with_attempt_count() -> None:
    b = Broker(lease_seconds=0.05)
    p = b.park("s", _req(), "/e")
    assert await b.poll() == [p]
    assert await b.poll() == []
    again = await b.poll(wait=1)
    assert again == [p] and p.attempt == 2
    # No lease: never redelivered.
    b.respond(p.id, Completion(text="ok"))
    q = b.park("s", _req(), "/e")
    assert await b.poll(lease=None) == [q]
    assert await b.poll(wait=0.15) == []


async def test_one_timer_keeps_every_deadline() -> None:
    """Timeouts, leases and long-poll waits share one timer: an earlier deadline re-arms it."""
    loop = asyncio.get_running_loop()
    b = Broker(request_timeout=0.2, lease_seconds=0.1)
    t0 = loop.time()
    idle = asyncio.create_task(b.poll("other", wait=0.6))  # arms the timer for t0 + 0.6
    await asyncio.sleep(0)
    p = b.park("s", _req(), "/e")  # times out at t0 + 0.2: earlier, so the timer moves
    with pytest.raises(RequestClosed) as err:
        await b.wait(p)
    assert err.value.status == 504 and 0.19 <= loop.time() - t0 < 0.45  # not at the poll's t0 + 0.6
    t1 = loop.time()
    q = b.park("s", _req(), "/e")
    assert await b.poll("s") == [q]  # leased until t1 + 0.1
    assert await b.poll("s", wait=1) == [q] and q.attempt == 2  # delivered again when the lease ran out
    assert 0.09 <= loop.time() - t1 < 0.3  # not at the poll's t0 + 0.6
    b.respond(q.id, Completion(text="ok"))
    assert await idle == [] and loop.time() - t0 >= 0.59
    # An answered request leaves nothing behind to fire.
    await asyncio.sleep(0.25)
    assert b.pending_count == 0 and (await q.future).text == "ok"  # type: ignore[union-attr]


async def test_expiring_leases_one_by_one_do_not_rescan_each_time() -> None:
    """A poller that took requests one at a time and died: their leases end one by one, and the
    deadline timer's passes over the pending requests stay few."""
    loop = asyncio.get_running_loop()
    b = Broker(lease_seconds=0.2)
    parked = [b.park("s", _req(str(i)), "/e") for i in range(3000)]
    started = loop.time()
    for i in range(3000):
        assert len(await b.poll()) == 1
        if i % 30 == 0:
            await asyncio.sleep(0.002)  # spreads the leases' ends over about 0.2 s
    spread = loop.time() - started  # the leases end over this long
    passes_before = b.deadline_passes
    again = await b.poll(max_items=5000, wait=2, lease=None)
    while len(again) < 3000:
        more = await b.poll(max_items=5000, wait=1, lease=None)
        assert more, "every request is delivered again"
        again += more
    assert sorted(p.id for p in again) == sorted(p.id for p in parked)
    assert all(p.attempt == 2 for p in again)
    # One pass per 60 ms at most (3,000 pending x 20 us), where a pass per lease end would be
    # one per millisecond of the spread.
    passes = b.deadline_passes - passes_before
    assert passes <= 5 + spread / 0.05, (passes, spread)


async def test_exactly_once_and_outcome_errors() -> None:
    turns: list[RecordedTurn] = []
    b = Broker(on_turn=turns.append)
    p = b.park("s", _req(), "/e")
    b.respond(p.id, Completion(text="a"))
    assert (await p.future).text == "a"  # type: ignore[union-attr]
    with pytest.raises(AlreadyAnsweredError):
        b.respond(p.id, Completion(text="b"))
    with pytest.raises(UnknownRequestError):
        b.respond("nope", Completion(text="b"))
    assert [t.completion.text for t in turns] == ["a"]
    # An error answer is delivered but not recorded as a turn.
    q = b.park("s", _req(), "/e")
    b.respond(q.id, ErrorAnswer(500, "boom"))
    assert isinstance(await q.future, ErrorAnswer) and len(turns) == 1


async def test_timeout_and_withdraw_are_final() -> None:
    b = Broker(request_timeout=0.05)
    p = b.park("s", _req(), "/e")
    with pytest.raises(RequestClosed) as err:
        await b.wait(p)
    assert err.value.status == 504
    with pytest.raises(RequestGoneError):
        b.respond(p.id, Completion(text="late"))
    q = b.park("s", _req(), "/e")
    waiter = asyncio.create_task(b.wait(q))
    await asyncio.sleep(0)
    waiter.cancel()  # the agent's handler is cancelled when its client disconnects
    await asyncio.gather(waiter, return_exceptions=True)
    assert b.pending_count == 0 and await b.poll() == []
    with pytest.raises(RequestGoneError):
        b.respond(q.id, Completion(text="late"))


async def test_close_session_fails_only_that_session() -> None:
    b = Broker()
    a = b.park("a", _req(), "/e")
    c = b.park("c", _req(), "/e")
    assert b.close_session("a") == 1
    with pytest.raises(RequestClosed):
        await a.future
    assert b.pending() == [c]


async def test_many_parked_requests_all_answered_in_order() -> None:
    b = Broker()
    parked = [b.park(f"s{i % 7}", _req(str(i)), "/e") for i in range(500)]
    got = await b.poll(max_items=1000)
    assert got == parked
    for p in got:
        b.respond(p.id, Completion(text=p.request.raw["m"]))
    assert [(await p.future).text for p in parked] == [str(i) for i in range(500)]  # type: ignore[union-attr]
    assert b.pending_count == 0


async def test_poll_json_equals_poll_item() -> None:
    import orjson

    b = Broker()
    req = _req("héllo ✓")
    plain = b.park("s", req, "/v1/chat/completions")
    verbatim = b.park("s", req, "/v1/chat/completions", raw_body=b'{ "m" :  "h\\u00e9llo \xe2\x9c\x93" }')
    await b.poll(max_items=2, lease=0.01)
    for p in (plain, verbatim):
        assert orjson.loads(p.poll_json()) == p.poll_item()
    assert verbatim.poll_json().count(b'{ "m" :  ') == 1  # the agent's bytes, not a re-encoding
    lean = orjson.loads(verbatim.poll_json(canonical=False))
    assert "canonical" not in lean and lean == {k: v for k,
                                                v in verbatim.poll_item().items() if k != "canonical"}
    await asyncio.sleep(0.05)
    again = await b.poll(max_items=2)
    assert [orjson.loads(p.poll_json())["attempt"] for p in again] == [2, 2]


def test_polled_canonical_form_is_pydantics_json() -> None:
    """/poll serializes the canonical form with orjson; it must be byte for byte what pydantic
    writes, for real client bodies of each protocol and for values only pydantic can encode."""
    from ares_gateway.core.broker import _canonical_json
    from ares_gateway.protocols import get_adapter
    from tests.protocols.test_anthropic_messages import claude_code_body
    from tests.protocols.test_openai_chat import mini_swe_agent_body
    from tests.protocols.test_openai_responses import codex_body

    for protocol, body in (
        (WireProtocol.ANTHROPIC_MESSAGES, claude_code_body()),
        (WireProtocol.OPENAI_CHAT, mini_swe_agent_body()),
        (WireProtocol.OPENAI_RESPONSES, codex_body()),
    ):
        req = get_adapter(protocol).parse_request(body)
        assert _canonical_json(req) == req.model_dump_json(exclude={"raw"}).encode()
    huge = _req().model_copy(update={"extra": {"seed": 2**70}})  # orjson refuses integers over 64 bits
    assert _canonical_json(huge) == huge.model_dump_json(exclude={"raw"}).encode()
