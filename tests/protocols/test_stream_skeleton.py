"""The skeleton the three stream encoders share (protocols/_stream.py): its guarantees, per protocol."""

from __future__ import annotations

import pytest

from ares_gateway.core.canonical import Completion, CompletionDelta, WireProtocol
from ares_gateway.protocols import get_adapter
from ares_gateway.protocols._stream import StreamEncoderBase

PROTOCOLS = list(WireProtocol)


def _encoder(protocol: WireProtocol) -> StreamEncoderBase:  # type: ignore[type-arg]
    body = {"model": "m", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "input": "x"}
    if protocol is WireProtocol.OPENAI_RESPONSES:
        del body["messages"]
    else:
        del body["input"]
    request = get_adapter(protocol).parse_request(body)
    enc = get_adapter(protocol).stream_encoder(request, "req_1")
    assert isinstance(enc, StreamEncoderBase)
    return enc


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nothing_is_written_after_the_end(protocol: WireProtocol) -> None:
    done = _encoder(protocol)
    done.start()
    assert done.finish(Completion(text="hi"))
    assert done.feed(CompletionDelta(text="more")) == b""
    assert done.finish(Completion(text="again")) == b""
    assert done.error(500, "late") == b""
    failed = _encoder(protocol)
    failed.start()
    assert b"broke" in failed.error(502, "broke")
    assert failed.feed(CompletionDelta(text="more")) == b"" and failed.finish(Completion(text="x")) == b""


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_finish_says_only_what_the_deltas_did_not(protocol: WireProtocol) -> None:
    streamed = _encoder(protocol)
    out = streamed.start() + streamed.feed(CompletionDelta(reasoning="think ", text="hel"))
    out += streamed.feed(
        CompletionDelta(tool_index=0, tool_call_id="call_a", tool_name="run", arguments='{"a"'))
    out += streamed.finish(Completion(reasoning="think more", text="hello", finish_reason="tool_calls",
                                      tool_calls=[{"id": "call_a", "name": "run", "arguments": '{"a": 1}'}]))
    text = out.decode()
    assert text.index("think ") < text.index('"hel"')  # reasoning is fed before text
    assert '"more"' in text and '"lo"' in text and '": 1}"' in text  # finish sent only the rest
