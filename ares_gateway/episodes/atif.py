"""A run's episodes as ATIF trajectories (Harbor's Agent Trajectory Interchange Format).

:func:`export_atif` reads what ``ares-gateway run`` wrote (``episodes.jsonl``, else ``results.json``'s
``episodes``; ``turns/<task>.<attempt>.jsonl``) and writes one ATIF JSON document per episode, named as
its turn log (``<task>.<attempt>.json``). Nothing here imports Harbor: the documents follow
``harbor.models.trajectories`` (``ATIF_SCHEMA_VERSION``), and the tests validate them with Harbor's own
models.

* **Steps.** Each request's messages are read with the protocol's own parser (any of the three wire
  APIs). ``system`` / ``developer`` messages are ``system`` steps, ``user`` messages ``user`` steps, each
  answered turn an ``agent`` step (text, ``reasoning_content``, ``tool_calls`` with their arguments as an
  object; ``llm_call_count`` 1), and each tool result an observation result on the agent step that made
  the call (``source_call_id``). Only the messages a request adds to the conversation so far become
  steps; an assistant message in a request that no recorded turn answered (history the agent made up,
  few-shot examples) is an agent step with ``llm_call_count`` 0.
* **Metrics per step.** Where the turn has a token record: ``prompt_tokens`` / ``completion_tokens``
  (its counts), ``prompt_token_ids``, ``completion_token_ids`` and ``logprobs``. Else the completion's
  ``usage`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``), else the turn log's ``usage``
  counts; the turn log's other ``usage`` fields (prefix reuse, timing) go to ``metrics.extra``.
  ``final_metrics`` sums the counts.
* **Branches.** A main-line request whose messages do not extend a conversation of the episode so far
  (a compaction, a retry from an earlier point) starts a branch; the side calls (title generation,
  summaries) are their own conversations. The root trajectory is the episode's first main-line
  conversation; every other conversation is an embedded subagent trajectory
  (``subagent_trajectories``, ``trajectory_id`` ``<task>.<attempt>/branch-N`` or ``/side-N``), linked
  from the root's last agent step before it began by an observation result with a
  ``subagent_trajectory_ref``. A branch's steps that repeat the conversation it forked from are
  marked ``is_copied_context``.
* **The episode's outcome** is the root's ``extra``: ``task``, ``attempt``, ``reward``,
  ``reward_parts``, ``exit_reason``, ``truncated``, ``error``, ``session_id``, ``policy``, ``harness``.

The reverse, :func:`import_atif`: ATIF trajectories (these, or a Harbor job's
``TRIAL/agent/trajectory.json``) into a run directory that ``ares-gateway view`` serves: each agent step
that was an LLM call an ``openai.chat`` turn whose request is the conversation before it.

Bad input never stops the export: an episode whose turn log is missing or has no readable turn is
reported (:class:`AtifExport` ``problems``, one line each) and the others are written; a line that is
not JSON (a run killed while writing) or a request that cannot be parsed is skipped and reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ares_gateway.core.canonical import Completion, Message
from ares_gateway.episodes.output import _safe  # the run's own file names: a row finds its turn log
from ares_gateway.protocols import get_adapter

#: The ATIF version the documents declare: the first with embedded subagent trajectories
#: (``trajectory_id``, ``llm_call_count``), which they use.
ATIF_SCHEMA_VERSION = "ATIF-v1.7"

_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass
class AtifExport:
    """What :func:`export_atif` did: the files it wrote and one line per problem it met."""

    written: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every episode was written whole."""
        return not self.problems


def _iso(ts: Any) -> str | None:
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        try:
            return datetime.fromtimestamp(float(ts), UTC).isoformat()
        except (OverflowError, OSError, ValueError):
            return None
    return None


def _text(m: Message) -> str:
    """The message's content as text; a non-text part is named in brackets, never dropped silently."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    out: list[str] = []
    for p in m.content:
        if p.type in ("text", "input_text", "output_text") and p.text is not None:
            out.append(p.text)
        elif p.type in ("thinking", "redacted_thinking"):
            continue
        else:
            out.append(f"[{p.type}]")
    return "".join(out)


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": value}


def _key(m: Message) -> tuple[Any, ...]:
    """What two copies of one message share however an agent re-sends it (whitespace, arguments
    re-serialized, reasoning dropped): role, text and the tool calls' ids and names."""
    return (m.role, _text(m).strip(), tuple((tc.id, tc.name) for tc in m.tool_calls), m.tool_call_id)


@dataclass
class _Turn:
    index: int
    entry: dict[str, Any]
    messages: list[Message]
    completion: Completion


@dataclass
class _Conversation:
    """One conversation (a branch or a side call's) as it grows: its steps and the messages so far."""

    kind: str  # "root", "branch", "side"
    number: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    first_turn: int = 0
    #: Agent steps by tool call id, to attach results to the step that made the call.
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: str | None = None

    def add_messages(self, messages: list[Message], *, copied: int = 0) -> None:
        for i, m in enumerate(messages):
            self._add(m, copied=i < copied)
            self.keys.append(_key(m))

    def _step(self, source: str, message: str, **fields: Any) -> dict[str, Any]:
        step: dict[str, Any] = {"step_id": len(self.steps) + 1, "source": source, "message": message}
        step.update({k: v for k, v in fields.items() if v is not None})
        self.steps.append(step)
        return step

    def _add(self, m: Message, *, copied: bool) -> None:
        flag = True if copied else None
        if m.role == "tool":
            target = self.calls.get(m.tool_call_id or "")
            result: dict[str, Any] = {"content": _text(m)}
            if target is not None:
                result["source_call_id"] = m.tool_call_id
            else:  # a result for no call of this conversation: kept, on a step of its own
                result["extra"] = {"tool_call_id": m.tool_call_id}
                target = self._step("system", "", is_copied_context=flag)
            if m.is_error:
                result.setdefault("extra", {})["is_error"] = True
            target.setdefault("observation", {"results": []})["results"].append(result)
        elif m.role == "assistant":
            # History no recorded turn answered: an agent step that stands for no LLM call.
            step = self._step("agent", _text(m), tool_calls=self._tool_calls(m) or None, llm_call_count=0,
                              is_copied_context=flag)
            for tc in m.tool_calls:
                self.calls[tc.id] = step
        else:
            source = "system" if m.role in _SYSTEM_ROLES else "user"
            extra = None if m.role in ("system", "user") else {"role": m.role}
            self._step(source, _text(m), is_copied_context=flag, extra=extra)

    @staticmethod
    def _tool_calls(m: Message | Completion) -> list[dict[str, Any]]:
        out = []
        for tc in m.tool_calls:
            call: dict[str, Any] = {"tool_call_id": tc.id, "function_name": tc.name,
                                    "arguments": _arguments(tc.arguments)}
            if tc.type != "function":
                call["extra"] = {"type": tc.type}
            out.append(call)
        return out

    def add_turn(self, turn: _Turn, *, token_ids: bool = True) -> None:
        c, e = turn.completion, turn.entry
        metrics: dict[str, Any] = {}
        if c.tokens is not None:  # the counts the engine saw, whatever the usage says
            metrics["prompt_tokens"] = int(c.tokens.prompt_ids.shape[0])
            metrics["completion_tokens"] = int(c.tokens.output_ids.shape[0])
            if token_ids:
                metrics["prompt_token_ids"] = c.tokens.prompt_ids.tolist()
                metrics["completion_token_ids"] = c.tokens.output_ids.tolist()
                if c.tokens.output_logprobs.shape[0]:
                    metrics["logprobs"] = [float(x) for x in c.tokens.output_logprobs.tolist()]
        elif c.usage is not None:
            metrics["prompt_tokens"] = c.usage.input_tokens
            metrics["completion_tokens"] = c.usage.output_tokens
            metrics["cached_tokens"] = c.usage.cached_input_tokens
        # The turn log's per-call usage and timing, where the run recorded them.
        got = e.get("usage")
        use: dict[str, Any] = got if isinstance(got, dict) else {}
        for name in ("prompt_tokens", "completion_tokens"):
            if name not in metrics and isinstance(use.get(name), int):
                metrics[name] = use[name]
        timing = {k: v for k,
                  v in use.items() if k not in ("prompt_tokens", "completion_tokens") and v is not None}
        if timing:
            metrics["extra"] = timing
        extra: dict[str, Any] = {"request_id": e.get("request_id"), "finish_reason": c.finish_reason,
                                 "protocol": e.get("protocol"), "turn_index": turn.index}
        for name in ("latency", "policy_version"):
            if e.get(name) is not None:
                extra[name] = e[name]
        model = c.model or e.get("model")
        step = self._step("agent", c.text or "", timestamp=_iso(e.get("timestamp")), model_name=model,
                          reasoning_content=c.reasoning or None, tool_calls=self._tool_calls(c) or None,
                          metrics=metrics or None, llm_call_count=1, extra=extra)
        for tc in c.tool_calls:
            self.calls[tc.id] = step
        self.keys.append(_key(c.to_message()))
        self.model = self.model or model

    def extends(self, keys: list[tuple[Any, ...]]) -> bool:
        return len(keys) >= len(self.keys) and keys[:len(self.keys)] == self.keys


def _read_jsonl(path: Path, what: str, problems: list[str]) -> list[dict[str, Any]]:
    return list(_iter_jsonl(path, what, problems))


def _iter_jsonl(path: Path, what: str, problems: list[str]) -> Iterator[dict[str, Any]]:
    # One line at a time: a long episode's turn log repeats its history every line (tens of MB).
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                problems.append(f"{what}: line {n} is not JSON (a run killed while writing it?): skipped")
                continue
            if isinstance(row, dict):
                yield row
            else:
                problems.append(f"{what}: line {n} is not a JSON object: skipped")


def _episode_rows(run_dir: Path, problems: list[str]) -> list[dict[str, Any]]:
    if (run_dir / "episodes.jsonl").is_file():
        return _read_jsonl(run_dir / "episodes.jsonl", "episodes.jsonl", problems)
    try:
        results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
        episodes = results.get("episodes") if isinstance(results, dict) else None
    except (OSError, ValueError):
        return []
    return [e for e in episodes or [] if isinstance(e, dict)]


def _run_info(run_dir: Path) -> dict[str, Any]:
    try:
        results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    run = results.get("run") if isinstance(results, dict) else None
    return run if isinstance(run, dict) else {}


def _turns(entries: Iterable[dict[str, Any]], what: str, problems: list[str],
           counts: dict[str, int]) -> Iterator[_Turn]:
    """The readable answered turns; ``counts`` gets ``entries`` and ``failed`` (failed policy calls)."""
    for i, e in enumerate(entries):
        counts["entries"] = i + 1
        if "completion" not in e and "error" in e:
            counts["failed"] = counts.get("failed", 0) + 1
            continue  # a failed policy call: no answer, so no step (counted in the root's extra)
        try:
            if "completion" not in e or "request" not in e:
                raise ValueError("it has no request or completion (a turn log of another layout?)")
            messages = list(
                get_adapter(e.get("protocol") or "openai.chat").parse_request(e["request"]).messages)
            completion = Completion.model_validate(e["completion"])
        except (ValueError, TypeError, KeyError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            problems.append(f"{what}: turn {i + 1} skipped: {reason}")
            continue
        # The request body is what the messages were read from; the rest of the entry is kept.
        request = e["request"]
        e = {k: v for k, v in e.items() if k != "request"}
        e["model"] = request.get("model") if isinstance(request, dict) else None
        yield _Turn(i, e, messages, completion)


def _conversations(turns: Iterable[_Turn], *, token_ids: bool = True) -> list[_Conversation]:
    """The turns sorted into conversations: the main line's first is the root (index 0)."""
    convs: list[_Conversation] = []
    numbers = {"branch": 0, "side": 0}
    for turn in turns:
        side = bool(turn.entry.get("side_call"))
        keys = [_key(m) for m in turn.messages]
        line = [c for c in convs if (c.kind == "side") == side]
        conv = next((c for c in reversed(line) if c.extends(keys)), None)
        if conv is None:
            kind = "side" if side else ("branch" if line else "root")
            numbers[kind] = numbers.get(kind, 0) + 1
            conv = _Conversation(kind, numbers[kind], first_turn=turn.index)
            # What the new conversation shares with the one it forked from is copied context.
            copied = max((_common(c.keys, keys) for c in line), default=0)
            conv.add_messages(turn.messages, copied=copied)
            convs.append(conv)
        else:
            conv.add_messages(turn.messages[len(conv.keys):])
        conv.add_turn(turn, token_ids=token_ids)
    return convs


def _common(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _final_metrics(steps: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {"total_steps": len(steps)}
    for name, total in (("prompt_tokens", "total_prompt_tokens"),
                        ("completion_tokens", "total_completion_tokens"),
                        ("cached_tokens", "total_cached_tokens")):
        values = [s["metrics"][name] for s in steps if name in s.get("metrics", {})]
        if values:
            totals[total] = sum(values)
    return totals


def _document(conv: _Conversation, *, agent: dict[str, Any], session_id: str | None, trajectory_id: str,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"schema_version": ATIF_SCHEMA_VERSION, "trajectory_id": trajectory_id}
    if session_id:
        doc["session_id"] = session_id
    doc["agent"] = dict(agent, **({"model_name": conv.model} if conv.model else {}))
    doc["steps"] = conv.steps
    doc["final_metrics"] = _final_metrics(conv.steps)
    if extra is not None:
        doc["extra"] = extra
    return doc


def episode_trajectory(row: Mapping[str, Any], entries: Iterable[dict[str, Any]], *,
                       run: Mapping[str, Any] | None = None, problems: list[str] | None = None,
                       token_ids: bool = True) -> dict[str, Any] | None:
    """One episode's ATIF document (a plain dict) from its ``episodes.jsonl`` row and turn log entries,
    or ``None`` when no turn could be read (the reason is appended to ``problems``). ``token_ids=False``
    leaves the ids and logprobs out (the counts stay): every step's prompt ids repeat the history."""
    problems = problems if problems is not None else []
    run = run or {}
    key = f"{row.get('task', '?')}.{row.get('attempt', 0)}"
    counts: dict[str, int] = {}
    convs = _conversations(_turns(entries, key, problems, counts), token_ids=token_ids)
    root = next((c for c in convs if c.kind == "root"), None)
    if root is None:
        problems.append(
            f"{key}: no main-line turn could be read ({counts.get('entries', 0)} turn log entries): "
            "not exported")
        return None
    others = [c for c in convs if c is not root]
    name = str(row.get("harness") or run.get("harness") or "agent")
    agent = {"name": name, "version": _harness_version(name),
             "extra": {"recorded_by": "ares-gateway", "policy": run.get("policy")}}
    session_id = row.get("session_id") or None
    subs = []
    for conv in others:
        tid = f"{key}/{conv.kind}-{conv.number}"
        subs.append(_document(conv, agent=agent, session_id=session_id, trajectory_id=tid,
                              extra={"kind": "side_call" if conv.kind == "side" else "branch",
                                     "first_turn": conv.first_turn + 1}))
        # Linked from the root's last step answered before the conversation began.
        anchor = None
        for step in root.steps:
            index = step.get("extra", {}).get("turn_index")
            if (step["source"] == "agent" and step.get("llm_call_count") == 1 and index is not None
                and index < conv.first_turn):
                anchor = step
        anchor = anchor or root.steps[-1]
        ref = {"trajectory_id": tid, "extra": {"kind": "side_call" if conv.kind == "side" else "branch"}}
        anchor.setdefault("observation", {"results": []})["results"].append(
            {"content": f"{'side call' if conv.kind == 'side' else 'branch'} {tid}",
             "subagent_trajectory_ref": [ref]})
    outcome = {name: row.get(name)
               for name in ("task", "attempt", "reward", "reward_parts", "exit_reason", "truncated",
                                                "error", "session_id")}
    outcome["policy"] = run.get("policy")
    outcome["failed_calls"] = counts.get("failed", 0)
    outcome["harness"] = agent["name"]
    doc = _document(root, agent=agent, session_id=session_id, trajectory_id=key, extra=outcome)
    if subs:
        doc["subagent_trajectories"] = subs
    for conv in convs:
        for step in conv.steps:
            step.get("extra", {}).pop("turn_index", None)
    return doc


def _harness_version(name: str) -> str:
    """The version this checkout installs of harness ``name`` (a run does not record it): "unknown"
    for a name no harness registers."""
    from harnesses import registry

    try:
        return str(registry.create(name).version or "unknown")
    except Exception:  # an unknown or renamed harness: the trajectory is still valid without it
        return "unknown"


def _episodes(run_dir: Path, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file key, row) for each episode: every row, then every turn log no row names (a run stopped
    between writing an episode's turns and its row)."""
    seen: set[str] = set()
    for row in _episode_rows(run_dir, problems):
        key = _safe(str(row.get("task", "?"))) + f".{row.get('attempt', 0)}"
        if key in seen:
            continue
        seen.add(key)
        yield key, row
    turns_dir = run_dir / "turns"
    for path in sorted(turns_dir.glob("*.jsonl")) if turns_dir.is_dir() else []:
        if path.stem not in seen:
            task, _, attempt = path.stem.rpartition(".")
            problems.append(f"{path.stem}: no line in episodes.jsonl (the run stopped before it finished?): "
                            "exported without its reward")
            yield path.stem, {"task": task or path.stem, "attempt": int(attempt) if attempt.isdigit() else 0}


def export_atif(run_dir: str | Path, out_dir: str | Path, *, token_ids: bool = True) -> AtifExport:
    """Write one ATIF trajectory JSON per episode of the run in ``run_dir`` to ``out_dir``
    (``<task>.<attempt>.json``); ``token_ids=False`` leaves each step's token ids and logprobs out.
    Raises ``FileNotFoundError`` when ``run_dir`` is not a run's output directory (no ``episodes.jsonl``,
    ``results.json`` or ``turns/``); a bad episode is reported in the returned :class:`AtifExport`'s
    ``problems`` and the others are written."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not any((run_dir / name).exists() for name in ("episodes.jsonl", "results.json", "turns")):
        raise FileNotFoundError(
            f"{run_dir} is not a run's output directory (no episodes.jsonl, results.json or turns/): "
            "name the --out directory of an `ares-gateway run`")
    report = AtifExport()
    run = _run_info(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, row in _episodes(run_dir, report.problems):
        path = run_dir / "turns" / f"{key}.jsonl"
        if not path.is_file():
            report.problems.append(f"{key}: no turns/{key}.jsonl: not exported")
            continue
        entries = _iter_jsonl(path, f"turns/{key}.jsonl", report.problems)
        doc = episode_trajectory(row, entries, run=run, problems=report.problems, token_ids=token_ids)
        if doc is None:
            continue
        target = out_dir / f"{key}.json"
        target.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        report.written.append(target)
    return report


# ---------------------------------------------------------------- the reverse: ATIF into a run directory


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # ATIF content parts: text kept, the others named
        return "".join(p.get("text") or "" if p.get("type") == "text" else f"[{p.get('type')}]"
                       for p in content if isinstance(p, dict))
    return ""


def _epoch(ts: Any) -> float:
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return 0.0


def trajectory_turns(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An ATIF trajectory's LLM calls as turn log entries (``openai.chat`` requests rebuilt from the
    steps before each call; token records from the steps' token ids): the root's, then each embedded
    subagent's (``side_call`` unless its ``extra.kind`` says ``branch``)."""
    entries: list[dict[str, Any]] = []
    for sub, side in [(doc, False)] + [(s, (s.get("extra") or {}).get("kind") != "branch")
                                       for s in doc.get("subagent_trajectories") or []]:
        messages: list[dict[str, Any]] = []
        model = (sub.get("agent") or {}).get("model_name") or "atif"
        for step in sub.get("steps") or []:
            source, text = step.get("source"), _content_text(step.get("message"))
            if source in ("system", "user"):
                if text or not step.get("observation"):
                    messages.append({"role": source, "content": text})
            else:
                calls = [{"id": tc.get("tool_call_id", ""), "name": tc.get("function_name", ""),
                          "arguments": json.dumps(tc.get("arguments") or {})} for tc in step.get("tool_calls")
                         or []]
                if step.get("llm_call_count") != 0:
                    completion: dict[str, Any] = {"text": text or None,
                                                  "reasoning": step.get("reasoning_content"),
                                                  "tool_calls": calls,
                                                  "finish_reason": "tool_calls" if calls else "stop"}
                    m = step.get("metrics") or {}
                    if m.get("prompt_token_ids") is not None and m.get("completion_token_ids") is not None:
                        completion["tokens"] = {"prompt_ids": m["prompt_token_ids"],
                                                "output_ids": m["completion_token_ids"],
                                                "output_logprobs": m.get("logprobs") or []}
                    entries.append({"request_id": f"atif_{len(entries) + 1}", "protocol": "openai.chat",
                                    "side_call": side, "timestamp": _epoch(step.get("timestamp")),
                                    "latency": 0.0, "request": {"model": step.get("model_name") or model,
                                                "messages": list(messages)},
                                    "completion": completion})
                assistant: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    assistant["tool_calls"] = [{"id": c["id"], "type": "function",
                                                "function": {"name": c["name"], "arguments": c["arguments"]}}
                                               for c in calls]
                messages.append(assistant)
            for result in (step.get("observation") or {}).get("results") or []:
                if result.get("subagent_trajectory_ref"):
                    continue  # a link, not a message
                body = _content_text(result.get("content"))
                if result.get("source_call_id"):
                    messages.append(
                        {"role": "tool", "tool_call_id": result["source_call_id"], "content": body})
                else:
                    messages.append({"role": "user", "content": body})
    return entries


def _harbor_reward(path: Path) -> float | None:
    # Harbor's job layout: TRIAL/agent/trajectory.json beside TRIAL/result.json (verifier_result.rewards).
    # (Harbor's code writes result.json; its trial-layout docstring says results.json: both are read.)
    for result in (path.parent.parent / "result.json", path.parent.parent / "results.json",
                   path.parent / "result.json"):
        try:
            rewards = json.loads(result.read_text(encoding="utf-8"))["verifier_result"]["rewards"]
            value = rewards.get("reward") if isinstance(rewards, dict) else None
            if isinstance(value, (int, float)):
                return float(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def import_atif(atif_dir: str | Path, run_dir: str | Path) -> AtifExport:
    """Write a run directory (``episodes.jsonl``, ``results.json``, ``turns/``) holding the ATIF
    trajectories found under ``atif_dir`` (this export's files, or a Harbor job's
    ``*/agent/trajectory.json``), one episode each, for ``ares-gateway view``. The reward is the
    trajectory's ``extra.reward``, else Harbor's ``result.json`` beside it. A JSON file that is not an
    ATIF trajectory is skipped quietly; one that cannot be read is a problem line. Two trajectories of
    one task and attempt (from two runs) become that task's next attempts."""
    from ares_gateway.episodes.output import RunOutputs, RunSummary
    from ares_gateway.episodes.result import EpisodeResult

    atif_dir, run_dir = Path(atif_dir), Path(run_dir)
    report = AtifExport()
    outputs = RunOutputs(run_dir)
    results: list[EpisodeResult] = []
    used: set[str] = set()
    for path in sorted(atif_dir.rglob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            report.problems.append(f"{path}: not readable JSON ({exc}): skipped")
            continue
        if not (isinstance(doc, dict) and str(doc.get("schema_version", "")).startswith("ATIF-")):
            continue
        got = doc.get("extra")
        extra: dict[str, Any] = got if isinstance(got, dict) else {}
        name = str(path.relative_to(atif_dir).with_suffix(""))
        if name.endswith("/agent/trajectory"):
            name = name[: -len("/agent/trajectory")]
        task = str(extra.get("task") or name)
        attempt = extra["attempt"] if isinstance(extra.get("attempt"), int) else 0
        while f"{_safe(task)}.{attempt}" in used:  # two runs' files of one task: the next free attempt
            attempt += 1
        used.add(f"{_safe(task)}.{attempt}")
        try:
            entries = trajectory_turns(doc)
        except (AttributeError, TypeError, ValueError) as exc:
            report.problems.append(f"{path}: not a trajectory this can read ({exc}): skipped")
            continue
        reward = (extra.get("reward") if isinstance(extra.get("reward"), (int, float))
                  else _harbor_reward(path))
        result = EpisodeResult(task=task, attempt=attempt, reward=float(reward or 0.0), turns=len(entries),
                               duration=0.0, exit_reason=str(extra.get("exit_reason") or "completed"),
                               truncated=bool(extra.get("truncated")), error=extra.get("error"),
                               session_id=str(doc.get("session_id") or ""))
        outputs.episode(result, [], entries, {})
        results.append(result)
        report.written.append(run_dir / "turns" / f"{_safe(task)}.{attempt}.jsonl")
    outputs.results({"preset": f"atif:{atif_dir}", "policy": "atif", "harness": "atif", "attempts": 1},
                    RunSummary(results, planned=len(results), attempts=1, duration=0.0))
    return report
