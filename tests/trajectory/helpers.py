"""A readable token scheme for golden tests.

A toy chat template renders each message as ``<role> body </role>`` with exactly one
token per message body (plus one per tool call); the assistant opener is ``<gen>``, which
is also the generation prompt, so a clean replay of a generation re-renders the exact
tokens the model produced.  Ids come in per-role bands so a decoded id always shows
where it came from:

======  ====================================
1-99    markers (<sys>, </sys>, <usr>, ...)
1000+   system bodies (strings starting "S")
2000+   user bodies ("u...")
3000+   assistant bodies ("r..." and "call:...")
4000+   tool bodies ("t...")
5000+   anything else
======  ====================================

:func:`show` renders a sample as ``prompt | response`` with trained tokens (loss 1) in
brackets, e.g. ``<sys> S </sys> <usr> u </usr> <gen> | [r:ok] [</ast>]``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from trajectory import Sample, TrajectoryManager, TurnRecord

MARKERS = ["<sys>", "</sys>", "<usr>", "</usr>", "<gen>", "</ast>", "<tool>", "</tool>"]
_MARKER_IDS = {m: i + 1 for i, m in enumerate(MARKERS)}
_BANDS = {"S": 1000, "u": 2000, "r": 3000, "c": 3000, "t": 4000}
_ids: dict[str, int] = dict(_MARKER_IDS)
_names: dict[int, str] = {i: m for m, i in _MARKER_IDS.items()}
_next: dict[int, int] = {}


def tok(s: str) -> int:
    """Token id of one token string (assigned on first use, in the string's role band)."""
    if s not in _ids:
        band = _BANDS.get(s[0], 5000)
        n = _next.get(band, 0)
        _next[band] = n + 1
        _ids[s] = band + n
        _names[band + n] = s
    return _ids[s]


def toks(text: str) -> list[int]:
    """Token ids of a whitespace-separated token string."""
    return [tok(s) for s in text.split()]


def untok(ids: Any) -> list[str]:
    return [_names[int(i)] for i in ids]


# ------------------------------------------------------------------ messages
def sys(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "system", "content": text, **extra}


def usr(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **extra}


def ast(
    text: str = "", calls: list[tuple[str, dict[str, Any]]] | None = None, **extra: Any
) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    msg.update(extra)
    return msg


def tool(text: str, call_id: str = "call_0") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def alternating(*texts: str) -> list[dict[str, Any]]:
    """A conversation of plain texts, user first, then assistant and user in turn."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


def _call_token(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = json.dumps(json.loads(fn["arguments"]), sort_keys=True, separators=(",", ":"))
    return f"call:{fn['name']}({args})"


def body_tokens(msg: dict[str, Any]) -> str:
    parts: list[str] = []
    content = msg.get("content")
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
    if content:
        parts.append(str(content))
    parts.extend(_call_token(c) for c in msg.get("tool_calls") or ())
    return " ".join(parts)


_OPEN = {"system": "<sys>", "user": "<usr>", "assistant": "<gen>", "tool": "<tool>"}
_CLOSE = {"system": "</sys>", "user": "</usr>", "assistant": "</ast>", "tool": "</tool>"}


def render(messages: list[dict[str, Any]], generation_prompt: bool = True) -> str:
    """The toy chat template: the prompt's token string."""
    out = []
    for m in messages:
        body = body_tokens(m)
        out.append(
            f"{_OPEN[m['role']]} {body} {_CLOSE[m['role']]}"
            if body
            else f"{_OPEN[m['role']]} {_CLOSE[m['role']]}"
        )
    if generation_prompt:
        out.append("<gen>")
    return " ".join(out)


def output_of(reply: dict[str, Any]) -> str:
    """What the model generated for ``reply``: its body tokens and the closing marker."""
    body = body_tokens(reply)
    return f"{body} </ast>" if body else "</ast>"


class Episode:
    """Drives a TrajectoryManager the way the gateway does, with token strings for drift."""

    def __init__(self, tm: TrajectoryManager | None = None, session_id: str = "s") -> None:
        self.tm = tm if tm is not None else TrajectoryManager(fork_threshold_tokens=1024)
        self.sid = session_id

    def turn(
        self,
        prompt: list[dict[str, Any]],
        reply: dict[str, Any] | None,
        *,
        prompt_tokens: str | None = None,
        output_tokens: str | None = None,
        logprobs: Any = None,
        finish_reason: str = "stop",
        ill_formed: bool = False,
        metadata: dict[str, Any] | None = None,
        as_array: bool = False,
    ) -> dict[str, Any] | None:
        p = toks(prompt_tokens if prompt_tokens is not None else render(prompt))
        if output_tokens is not None:
            o = toks(output_tokens)
        else:
            o = toks(output_of(reply)) if reply is not None else []
        if logprobs is None:
            # Distinct, exactly representable values so pass-through is checkable.
            lps: Any = [-(k + 1) / 8 for k in range(len(o))]
        else:
            lps = logprobs
        rec = TurnRecord(
            np.asarray(p, dtype=np.int32) if as_array else p,
            np.asarray(o, dtype=np.int32) if as_array else o,
            lps,
            finish_reason=finish_reason,
            ill_formed=ill_formed,
        )
        # Fresh copies each call, as the gateway delivers them.
        self.tm.record_turn(
            self.sid,
            prompt_messages=json.loads(json.dumps(prompt)),
            response_message=None if reply is None else json.loads(json.dumps(reply)),
            turn=rec,
            metadata=metadata,
        )
        return reply

    def samples(self, **kw: Any) -> list[Sample]:
        out = self.tm.get_trajectory(self.sid, **kw)
        for s in out:
            check_sample(s)
        return out

    def shown(self, **kw: Any) -> list[str]:
        return [show(s) for s in self.samples(**kw)]


def check_sample(s: Sample) -> None:
    """Invariants every sample must satisfy."""
    s.check()
    n = len(s.tokens)
    assert s.tokens.dtype == np.int32
    assert 0 < s.response_length <= n
    assert set(np.unique(s.loss_mask).tolist()) <= {0, 1}
    assert int(s.loss_mask.sum()) > 0, "sample without trained tokens must be dropped"
    d = s.to_dict()
    assert len(d["tokens"]) == n and d["response_length"] == s.response_length
    assert all(type(x) is int for x in d["tokens"][:5] + d["loss_mask"][:5])
    assert all(type(x) is float for x in d["logprobs"][:5])
    json.dumps(d)


def show(s: Sample) -> str:
    """``prompt | response`` with trained tokens in brackets."""
    names = untok(s.tokens)
    p = s.prompt_length
    out = [*names[:p], "|"]
    for i, name in enumerate(names[p:]):
        out.append(f"[{name}]" if s.loss_mask[i] else name)
    return " ".join(out)
