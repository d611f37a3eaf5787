"""Where the viewer's data comes from: a run directory, a gateway data dir, a live gateway, or a live
gateway with the run directory it writes (``run``).

Every read is bounded by what a page shows: the run table is paginated here (sorted and filtered
first), an episode's turns are built once into compact views (:mod:`~ares_gateway.viewer.turns`)
and sent a page at a time, a sample's tokens a window at a time. Nothing here writes.

Episodes are named by a *key*: ``TASK.ATTEMPT`` (the name of its files under ``turns/`` and
``trajectories/``) for an episode of a run directory, ``session:ID`` for a session known only to the
gateway or its data dir (a running episode, or a data dir alone).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ares_gateway.core.errors import DataDirError
from ares_gateway.core.session_recorder import SessionRecorder, TurnLogReader, tree_view_of_turn_log
from ares_gateway.core.store import DB_NAME, StoreReader
from ares_gateway.episodes.output import pass_at_k
from ares_gateway.viewer.samples import SampleSet, TokenPieces
from ares_gateway.viewer.turns import FileTurns, TurnViews, cut

#: Characters of the end of an episode's verifier log shown.
LOG_TAIL = 20_000
#: The columns the run table sorts by.
SORT_KEYS = ("task", "attempt", "reward", "turns", "duration", "exit_reason", "error", "node", "key")

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
SESSION_PREFIX = "session:"


def file_key(task: str, attempt: int) -> str:
    """The name a run gives an episode's files (as :class:`~ares_gateway.episodes.output.RunOutputs`)."""
    return (_SAFE.sub("_", task)[:120] or "task") + f".{attempt}"


class NotFound(LookupError):
    """No such episode or sample (the page shows 404)."""


@dataclass
class _Cached:
    stamp: Any
    value: Any


@dataclass
class _Jsonl:
    """A JSONL file read incrementally: only lines appended since the last read are parsed."""

    path: Path
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        """Every row so far (what was appended since the last call parsed now)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self.rows
        if size < self.offset:  # rewritten: read again
            self.offset, self.rows = 0, []
        if size > self.offset:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(size - self.offset)
            end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
            for line in data[:end].splitlines():
                if line.strip():
                    try:
                        self.rows.append(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        continue
            self.offset += end
        return self.rows


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def _row(e: dict[str, Any], key: str, *, live: bool = False) -> dict[str, Any]:
    return {"key": key, "task": e.get("task"), "attempt": e.get("attempt"), "reward": e.get("reward"),
            "turns": e.get("turns"), "duration": e.get("duration"), "exit_reason": e.get("exit_reason"),
            "error": e.get("error"), "node": e.get("node"), "session_id": e.get("session_id"),
            "truncated": e.get("truncated"), "samples": e.get("samples"), "usage": e.get("usage"),
            "live": live}


class RunSource:
    """The viewer's data: a finished (or growing) run directory, a data dir, a live gateway, or both.

    Args:
        run_dir: a run's ``--out`` directory (``results.json``, ``episodes.jsonl``, ``turns/`` ...).
        data_dir: a gateway data dir (``gateway.sqlite3``); for a run directory its ``gateway-data``
            is found by itself (the message trees are rebuilt from it).
        gateway: a live :class:`~ares_gateway.gateway.Gateway`: its sessions are the running episodes.
        tokenizer: a ``.gguf`` or Hugging Face directory whose tokenizer turns ids into text pieces
            (default: the run's ``model`` / ``tokenizer`` from ``results.json``, when it loads).
        title: what the page calls the run.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *,
                 data_dir: str | os.PathLike[str] | None = None, gateway: Any = None,
                 tokenizer: str | None = None, title: str | None = None) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        if (data_dir is None and self.run_dir is not None
            and (self.run_dir / "gateway-data" / DB_NAME).is_file()):
            data_dir = self.run_dir / "gateway-data"
        self.data_dir = None if data_dir is None else Path(data_dir)
        self.gateway = gateway
        #: When a live view started (``run`` mounts it as the run starts): episodes/min before results.json.
        self.started = time.time() if gateway is not None else None
        self.title = title or str(self.run_dir or self.data_dir or "live gateway")
        self._episodes = None if self.run_dir is None else _Jsonl(self.run_dir / "episodes.jsonl")
        self._results: _Cached | None = None
        self._reader: StoreReader | None = None
        self._recorder: SessionRecorder | None = None
        self._stored: _Cached | None = None
        self._turns: dict[str, _Cached] = {}
        self._samples: dict[str, _Cached] = {}
        self._trees: dict[str, _Cached] = {}
        self._readers: dict[str, TurnLogReader] = {}
        self._pieces = TokenPieces(tokenizer)
        # Offline reads run on threads (one page at a time each); the data dir's reader is one connection.
        self._lock = threading.RLock()

    @property
    def live(self) -> bool:
        """Whether a live gateway is shown (its data is read on its event loop)."""
        return self.gateway is not None

    def close(self) -> None:
        """Close the data dir's reader (opened again if asked for more)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
            self._recorder = None

    # ------------------------------------------------------------------ the data dir

    def _store(self) -> SessionRecorder | None:
        if (self.data_dir is None and self.run_dir is not None
            and (self.run_dir / "gateway-data" / DB_NAME).is_file()):
            self.data_dir = self.run_dir / "gateway-data"  # a live run's gateway creates it as it starts
        if self.data_dir is None:
            return None
        if self._recorder is None:
            try:
                self._reader = StoreReader(self.data_dir)
            except DataDirError:
                self.data_dir = None
                return None
            self._recorder = SessionRecorder(store=self._reader)  # type: ignore[arg-type]
        return self._recorder

    def _stored_sessions(self) -> list[Any]:
        rec = self._store()
        if rec is None or self._reader is None:
            return []
        stamp = _stamp(self._reader.path / (DB_NAME + "-wal")), _stamp(self._reader.path / DB_NAME)
        if self._stored is None or self._stored.stamp != stamp:
            sessions = self._reader.load_sessions()
            rec.known({s.id for s in sessions if s.turns})
            self._stored = _Cached(stamp, sessions)
        return list(self._stored.value)

    # ------------------------------------------------------------------ the run

    def results(self) -> dict[str, Any] | None:
        """``results.json`` (re-read when it changes), or ``None``."""
        if self.run_dir is None:
            return None
        path = self.run_dir / "results.json"
        stamp = _stamp(path)
        if self._results is None or self._results.stamp != stamp:
            doc = None
            if stamp is not None:
                try:
                    doc = orjson.loads(path.read_bytes())
                except (OSError, orjson.JSONDecodeError):
                    doc = None  # being replaced: the next read has it
            self._results = _Cached(stamp, doc)
        return self._results.value  # type: ignore[no-any-return]

    def rows(self) -> list[dict[str, Any]]:
        """Every episode: the run's finished ones, then the sessions no finished episode names."""
        with self._lock:
            return self._rows()

    def _rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        if self._episodes is not None:
            rows = [_row(e, file_key(str(e.get("task")), int(e.get("attempt") or 0)))
                    for e in self._episodes.read()]
            if not rows and (doc := self.results()):
                rows = [_row(e, file_key(str(e.get("task")), int(e.get("attempt") or 0)))
                        for e in doc.get("episodes") or []]
        named = {r["session_id"] for r in rows if r["session_id"]}
        if self.gateway is not None:
            for s in list(self.gateway.sessions):
                if s.id in named:
                    continue
                meta = s.metadata or {}
                rows.append(
                    _row({"task": meta.get("task", s.id), "attempt": meta.get("attempt"), "reward": s.reward,
                          "turns": s.turns, "duration": time.time() - s.created_at,
                          "exit_reason": "ended" if s.ended else "running", "session_id": s.id,
                          "truncated": s.truncated}, SESSION_PREFIX + s.id, live=not s.ended))
                named.add(s.id)
        elif self.run_dir is None:
            for s in self._stored_sessions():
                if s.id in named:
                    continue
                meta = s.metadata or {}
                ended = s.ended_at if s.ended_at else None
                rows.append(
                    _row({"task": meta.get("task", s.id), "attempt": meta.get("attempt"), "reward": s.reward,
                          "turns": s.turns, "duration": None if ended is None else ended - s.created_at,
                          "exit_reason": "ended" if s.ended else "not ended", "session_id": s.id,
                          "truncated": s.truncated}, SESSION_PREFIX + s.id))
        return rows

    def version(self) -> tuple[Any, ...]:
        """Changes whenever the run table would (an episode ended, a session started or took a turn)."""
        parts: list[Any] = []
        if self.run_dir is not None:
            parts.append(_stamp(self.run_dir / "episodes.jsonl"))
        if self.gateway is not None:
            parts.append(tuple((s.id, s.turns, s.ended) for s in list(self.gateway.sessions)))
        return tuple(parts)

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean reward, pass@k, exit reasons, episodes/min: ``results.json``'s when it covers every
        finished episode, else worked out from the rows."""
        doc = self.results() or {}
        finished = [r for r in rows if not r["live"] and r["reward"] is not None]
        saved = doc.get("summary")
        if isinstance(saved, dict) and saved.get("finished") == len(finished):
            out = dict(saved)
        else:
            attempts = int((doc.get("run") or {}).get("attempts")
                           or max([r["attempt"] or 1 for r in finished] or [1]))
            by_task: dict[str, list[float]] = {}
            for r in finished:
                by_task.setdefault(str(r["task"]), []).append(float(r["reward"]))
            complete = [v for v in by_task.values() if len(v) == attempts]
            out = {"finished": len(finished),
                   "mean_reward": sum(float(r["reward"]) for r in finished) / len(finished) if finished
                   else None}
            for k in range(1, attempts + 1):
                if complete:
                    out[f"pass@{k}"] = sum(pass_at_k(len(v), sum(x >= 1.0 for x in v), k)
                                           for v in complete) / len(complete)
            reasons: dict[str, int] = {}
            for r in finished:
                reasons[str(r["exit_reason"])] = reasons.get(str(r["exit_reason"]), 0) + 1
            out["exit_reasons"] = reasons
            # Known while the viewer watches the run from its start (``run``'s mount); else not.
            span = None if self.started is None else time.time() - self.started
            out["episodes_per_minute"] = round(len(finished) / span * 60, 3) if span and finished else None
        out["running"] = sum(1 for r in rows if r["live"])
        return out

    def run_page(self, *, offset: int = 0, limit: int = 50, sort: str = "key", desc: bool = False,
                 query: str = "", exit_reason: str = "") -> dict[str, Any]:
        """One page of the run table (sorted, then filtered) and the run's summary."""
        with self._lock:
            rows = self._rows()
            doc = self.results() or {}
            summary = self.summary(rows)
        picked = rows
        if exit_reason:
            picked = [r for r in picked if r["exit_reason"] == exit_reason]
        if query:
            q = query.lower()
            picked = [r for r in picked
                      if any(q in str(r[k]).lower() for k in ("task", "error", "key", "node"))]
        if sort not in SORT_KEYS:
            sort = "key"

        def order(r: dict[str, Any]) -> tuple[int, Any]:
            v = r[sort]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                return (1, 0)
            return (0, v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (0, str(v))

        try:
            picked = sorted(picked, key=order, reverse=desc)
        except TypeError:  # numbers and text in one column
            picked = sorted(picked, key=lambda r: str(r[sort]), reverse=desc)
        run = doc.get("run") or {}
        keys = ("preset", "policy", "harness", "sandbox", "attempts", "engine", "model", "concurrency")
        return {"title": self.title, "live": self.live, "run": {k: run.get(k) for k in keys if k in run},
                "error": doc.get("error"), "summary": summary, "total": len(rows), "matched": len(picked),
                "offset": offset, "rows": picked[offset: offset + max(1, min(limit, 500))],
                "exit_reasons": sorted({str(r["exit_reason"]) for r in rows})}

    # ------------------------------------------------------------------ one episode

    def row(self, key: str) -> dict[str, Any]:
        """The episode ``key`` names; ``session:ID`` also finds the run's row of that session once its
        episode has ended (its key is then ``TASK.ATTEMPT``), so an open page keeps working."""
        rows = self.rows()
        for r in rows:
            if r["key"] == key:
                return r
        if key.startswith(SESSION_PREFIX):
            sid = key[len(SESSION_PREFIX):]
            for r in rows:
                if r["session_id"] == sid:
                    return r
        raise NotFound(f"no episode {key!r}")

    def _session_of(self, row: dict[str, Any]) -> str | None:
        return row["session_id"] or None

    def episode(self, key: str) -> dict[str, Any]:
        """An episode's row, its verifier's output, its samples (no tokens) and its turn count."""
        row = self.row(key)
        key = row["key"]
        out: dict[str, Any] = {"episode": row}
        if self.run_dir is not None and not key.startswith(SESSION_PREFIX):
            log = self.run_dir / "logs" / key / "verifier.log"
            try:
                with open(log, "rb") as fh:
                    fh.seek(max(0, log.stat().st_size - LOG_TAIL))
                    out["verifier"] = cut(fh.read().decode("utf-8", "replace"))
            except OSError:
                out["verifier"] = None
            reward_parts = next(
                (e.get("reward_parts") for e in (self._episodes.read() if self._episodes else [])
                 if file_key(str(e.get("task")), int(e.get("attempt") or 0)) == key), None)
            out["reward_parts"] = reward_parts
        samples = self.samples(key)
        out["samples"] = samples.summaries()
        turns = self.turn_log(key)
        out["turns"] = turns.count()
        out["side_calls"] = turns.side_count()
        # The tree holds the turns answered with token ids; a live one may get its first any moment.
        out["has_tree"] = bool(out["samples"]) or row["live"]
        return out

    def _entries(self, key: str, row: dict[str, Any], start: int) -> list[dict[str, Any]]:
        """The turn-log entries from ``start`` on of an episode the gateway or the data dir holds."""
        sid = self._session_of(row)
        if sid is not None and self.gateway is not None and self.gateway.sessions.find(sid) is not None:
            # On the gateway's event loop: decode only the records added since the last look.
            reader = self._readers.get(key)
            if reader is None or start == 0:
                reader = self._readers[key] = TurnLogReader(self.gateway.recorder, sid)
            return reader.new()
        rec = self._store()
        if sid is not None and rec is not None:
            self._stored_sessions()
            return rec.turn_log(sid, tokens=False)[start:]
        return []

    def _turn_log_stamp(self, key: str, row: dict[str, Any]) -> Any:
        """Changes when the episode's turn log does."""
        sid = self._session_of(row)
        if self.run_dir is not None and not key.startswith(SESSION_PREFIX):
            stamp = _stamp(self.run_dir / "turns" / f"{key}.jsonl")
            if stamp is not None:
                return stamp
        if sid is not None and self.gateway is not None and self.gateway.sessions.find(sid) is not None:
            return ("live", self.gateway.recorder.turn_count(sid))
        if sid is not None and self._store() is not None:
            return ("stored", sid)
        return None

    def turn_log(self, key: str) -> TurnViews | FileTurns:
        """The episode's turns as views: its ``turns/`` file (indexed once, a view built when a page
        shows it), else the gateway's or the data dir's log (built once; a live log adds its new turns)."""
        with self._lock:
            row = self.row(key)
            key = row["key"]
            stamp = self._turn_log_stamp(key, row)
            cached = self._turns.get(key)
            if cached is not None and cached.stamp == stamp:
                return cached.value  # type: ignore[no-any-return]
            log: TurnViews | FileTurns
            if isinstance(stamp, tuple) and isinstance(stamp[0], int):  # a turns/ file (size, mtime)
                log = FileTurns(self.run_dir / "turns" / f"{key}.jsonl")  # type: ignore[operator]
            else:
                live = isinstance(stamp, tuple) and stamp[0] == "live"
                views: TurnViews = TurnViews()
                if (cached is not None and live and isinstance(cached.stamp, tuple)
                    and cached.stamp[0] == "live"):
                    views = cached.value  # a live session's log only grows
                views.add(self._entries(key, row, views.count()))
                log = views
            self._turns[key] = _Cached(stamp, log)
            return log

    def turn_count(self, key: str) -> int:
        """How many turns the episode has now (cheap: for the live updates)."""
        try:
            row = self.row(key)
            key = row["key"]
        except NotFound:
            return 0
        sid = self._session_of(row)
        if (self.gateway is not None and sid is not None
            and (s := self.gateway.sessions.find(sid)) is not None):
            return int(s.turns)
        stamp = self._turn_log_stamp(key, row)
        cached = self._turns.get(key)
        if cached is not None and cached.stamp == stamp:
            return int(cached.value.count())
        return int(row.get("turns") or 0)

    def turns(self, key: str, *, offset: int = 0, limit: int = 50, line: str = "all") -> dict[str, Any]:
        """One page of the episode's turn views."""
        return self.turn_log(key).page(offset=offset, limit=max(1, min(limit, 200)), line=line)

    def tree(self, key: str, *, side_call: bool = False) -> dict[str, Any]:
        """The episode's message tree (main line or side calls), with which samples come from which leaf."""
        row = self.row(key)
        key = row["key"]
        sid = self._session_of(row)
        view = None
        with self._lock:
            turns_file = None if self.run_dir is None else self.run_dir / "turns" / f"{key}.jsonl"
            if sid is not None and self.gateway is not None and self.gateway.sessions.find(sid) is not None:
                view = self.gateway.recorder.tree_view(sid, side_call=side_call)
            elif turns_file is not None and not key.startswith(SESSION_PREFIX) and turns_file.is_file():
                # A run's turn log has every answered turn with its token record (the run removes its
                # sessions from the gateway's data dir as they end): the tree is rebuilt from it, once.
                stamp = (_stamp(turns_file), side_call)
                cached = self._trees.get(key)
                if cached is None or cached.stamp != stamp:
                    cached = self._trees[key] = _Cached(stamp, tree_view_of_turn_log(
                        _read_lines(turns_file, 0), side_call=side_call))
                view = cached.value
            elif sid is not None and (rec := self._store()) is not None:
                self._stored_sessions()
                view = rec.tree_view(sid, side_call=side_call)
        samples = [s for s in self.samples(key).summaries() if bool(s["side_call"]) == side_call]
        by_leaf: dict[int, list[int]] = {}
        for s in samples:
            if s["branch"] is not None:
                by_leaf.setdefault(int(s["branch"]), []).append(s["index"])
        return {"tree": view, "samples_by_leaf": {str(k): v for k, v in by_leaf.items()},
                "why": None if view is not None
                else "no message tree: the run kept no data dir for it, or no turn "
                                                     "of it had token ids"}

    def samples(self, key: str) -> SampleSet:
        """The episode's training samples (from its ``trajectories/`` file, else rebuilt from the records)."""
        with self._lock:
            row = self.row(key)
            key = row["key"]
            sid = self._session_of(row)
            if self.run_dir is not None and not key.startswith(SESSION_PREFIX):
                path = self.run_dir / "trajectories" / f"{key}.jsonl"
                stamp: Any = _stamp(path)
                if stamp is not None:
                    cached = self._samples.get(key)
                    if cached is None or cached.stamp != stamp:
                        cached = self._samples[key] = _Cached(stamp, SampleSet(_read_lines(path, 0)))
                    return cached.value  # type: ignore[no-any-return]
            reward = float(row["reward"] or 0.0)
            if sid is not None and self.gateway is not None and self.gateway.sessions.find(sid) is not None:
                stamp = ("live", self.gateway.recorder.turn_count(sid))
                cached = self._samples.get(key)
                if cached is None or cached.stamp != stamp:
                    found = self.gateway.recorder.samples(sid, reward=reward)
                    cached = self._samples[key] = _Cached(stamp, SampleSet([s.to_dict() for s in found]))
                return cached.value  # type: ignore[no-any-return]
            rec = self._store()
            if sid is not None and rec is not None:
                cached = self._samples.get(key)
                if cached is None:
                    self._stored_sessions()
                    found = rec.samples(sid, reward=reward)
                    cached = self._samples[key] = _Cached(("stored", sid),
                                                          SampleSet([s.to_dict() for s in found]))
                return cached.value  # type: ignore[no-any-return]
            return SampleSet([])

    def sample(self, key: str, index: int, *, offset: int = 0, limit: int = 2000) -> dict[str, Any]:
        """A window of one sample's tokens: id, text piece, loss mask, logprob."""
        samples = self.samples(key)
        if not 0 <= index < len(samples.rows):
            raise NotFound(f"episode {key!r} has no sample {index}")
        tokenizer = self._tokenizer_path()
        return samples.window(index, offset=offset, limit=max(1, min(limit, 5000)),
                              pieces=self._pieces.for_model(tokenizer))

    def _tokenizer_path(self) -> str | None:
        run = (self.results() or {}).get("run") or {}
        return run.get("tokenizer") or run.get("model")


def _read_lines(path: Path, start: int) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` from line ``start`` on (a torn last line is left out)."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        for i, line in enumerate(fh):
            if i < start or not line.endswith(b"\n"):
                continue
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out
