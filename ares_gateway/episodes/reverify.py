"""Grading a finished run's saved workspaces again: ``ares-gateway reverify DIR``.

For each episode of a run directory (``results.json``, or ``episodes.jsonl`` of a run that was
stopped before it wrote one), :func:`reverify_run` starts a fresh sandbox from the task's image, copies
in only the episode's saved workspace (``workspaces/<task>.<attempt>.tar``,
:mod:`~ares_gateway.episodes.workspaces`) by the code that copies it for grading
(:func:`~ares_gateway.episodes.verifier.copy_workspace`), runs the task's tests there
(:func:`~ares_gateway.episodes.verifier.run_tests`), and sets the reward beside the one recorded:

* ``agree``: the same reward and the same named parts;
* ``differ``: not; ``differences`` says which (the reward, each part, the verifier's error) and
  ``output_tail`` is the end of what the verifier printed now (``recorded_output_tail``: then);
* ``error``: this episode could not be graded again (no saved workspace, a damaged archive, the task is
  gone, the sandbox failed): ``note`` says why, in one line; the other episodes still are;
* ``skipped``: the tests never ran in the run (the agent crashed, a limit, a sandbox failure): there
  is no reward to reproduce.

A reward that does not reproduce means the verdict depended on something that is not in the workdir:
a process the agent left running (``[verifier] sandbox = "agent"``), a random or time-dependent
check, the network, or a workspace cut at the cap (``workspace_truncated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sandbox as sandbox_mod
from ares_gateway.episodes.episode import (
    DEFAULT_IMAGE,
    last_lines,
    one_line,
    remove_sandbox,
    resolve_backend,
    unrelayed_isolation,
    with_default_resources,
)
from ares_gateway.episodes.output import episode_key
from ares_gateway.episodes.tasks import Dataset, Task, TaskError, load_dataset
from ares_gateway.episodes.verifier import (
    VerifierResult,
    WorkspaceCopyError,
    copy_workspace,
    prepare_tests,
    run_tests,
    workspace_limit,
)
from ares_gateway.episodes.workspaces import check_archive, part_path
from sandbox.errors import ArchiveTooLargeError, FileTransferError

if TYPE_CHECKING:
    from rich.table import Table  # imported where a table is made (start-up time)

log = logging.getLogger(__name__)

__all__ = ["REPORT_FILE", "EpisodeCheck", "ReverifyReport", "RunDirError", "read_run", "reverify_run"]

#: The report ``reverify`` writes into the run directory.
REPORT_FILE = "reverify.json"
#: The label of a re-verification sandbox (``ares-gateway gc`` removes one a killed reverify left).
ROLE_LABEL = "ares-gateway.role"
_EPS = 1e-9


class RunDirError(Exception):
    """The directory is no run directory (nothing to re-verify); the message says what is missing."""


@dataclass
class EpisodeCheck:
    """One episode re-verified (see the module docstring for ``status``)."""

    task: str
    attempt: int
    status: str
    recorded_reward: float | None = None
    reward: float | None = None
    recorded_parts: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)
    #: What differs, one line each (``differ``), or what to know about a verdict (a workspace cut at the cap).
    differences: list[str] = field(default_factory=list)
    #: One line: why it could not be re-verified (``error``), why it was skipped, or what differs.
    note: str | None = None
    recorded_verifier_error: str | None = None
    verifier_error: str | None = None
    #: The end of what the verifier printed now (stdout then stderr), and then (the run's verifier.log).
    output_tail: str | None = None
    recorded_output_tail: str | None = None
    workspace: str | None = None
    workspace_truncated: bool = False
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.task}.{self.attempt}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReverifyReport:
    """Every episode's :class:`EpisodeCheck`, and what was noticed about the run directory itself."""

    run_dir: str
    sandbox: str
    episodes: list[EpisodeCheck] = field(default_factory=list)
    #: Lines about the directory (no results.json: the run was stopped; a line of episodes.jsonl cut short).
    notes: list[str] = field(default_factory=list)
    duration: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for e in self.episodes if e.status == status)

    @property
    def exit_code(self) -> int:
        """0 when every episode that could be graded again agreed and none failed to be; 1 otherwise."""
        return 0 if not any(e.status in ("differ", "error") for e in self.episodes) else 1

    def to_dict(self) -> dict[str, Any]:
        graded = self.count("agree") + self.count("differ")
        return {
            "run_dir": self.run_dir,
            "sandbox": self.sandbox,
            "summary": {
                "episodes": len(self.episodes),
                **{s: self.count(s) for s in ("agree", "differ", "error", "skipped")},
                "exit_code": self.exit_code,
                "duration_seconds": round(self.duration, 3),
                "episodes_per_minute": (round(graded / self.duration * 60, 3)
                                        if self.duration > 0 and graded else None),
            },
            "notes": list(self.notes),
            "episodes": [e.to_dict() for e in self.episodes],
        }


# ============================================================================ reading the run


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """The run's settings, its episode entries (the last entry of each ``task.attempt``), and notes.

    ``results.json`` when it is whole; else ``episodes.jsonl`` (a run stopped before its end), skipping
    a line that is not JSON (cut short) with a note. Raises :class:`RunDirError` when the directory
    holds neither."""
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory")
    notes: list[str] = []
    run: dict[str, Any] = {}
    entries: list[Any] | None = None
    results = run_dir / "results.json"
    if results.is_file():
        try:
            doc = json.loads(results.read_text(encoding="utf-8"))
            if not isinstance(doc, dict) or not isinstance(doc.get("episodes"), list):
                raise ValueError("it has no list of episodes")
            settings = doc.get("run")
            run = settings if isinstance(settings, dict) else {}
            entries = doc["episodes"]
            if doc.get("error"):
                notes.append(f"the run stopped before its episodes: {doc['error']}")
        except (OSError, ValueError) as exc:
            notes.append(f"results.json cannot be read ({exc}): reading episodes.jsonl instead")
    jsonl = run_dir / "episodes.jsonl"
    if entries is None:
        if not jsonl.is_file():
            raise RunDirError(f"{run_dir} holds neither results.json nor episodes.jsonl: it is no run "
                              "directory (ares-gateway run --out DIR writes one)")
        if not results.exists():
            notes.append("no results.json: the run was stopped before its end; reading episodes.jsonl")
        entries = []
        for n, line in enumerate(jsonl.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except ValueError:
                notes.append(f"episodes.jsonl line {n} is not JSON (cut short when the run was stopped?): "
                             "skipped")
    by_key: dict[str, dict[str, Any]] = {}
    for n, e in enumerate(entries, 1):
        if not (isinstance(e, dict) and isinstance(e.get("task"), str) and isinstance(e.get("attempt"), int)):
            notes.append(f"episode entry {n} names no task and attempt: skipped")
            continue
        by_key[f"{e['task']}.{e['attempt']}"] = e
    return run, list(by_key.values()), notes


class _TaskFinder:
    """An episode's task: its recorded directory, else by name in ``--tasks`` or the run's preset's
    dataset."""

    def __init__(self, run: Mapping[str, Any], tasks: str | os.PathLike[str] | Dataset | None) -> None:
        self._given = tasks
        self._run = run
        self._datasets: list[Dataset] | None = None
        self._problems: list[str] = []

    def _candidates(self) -> list[Dataset]:
        if self._datasets is not None:
            return self._datasets
        found: list[Dataset] = []
        sources: list[Any] = []
        if self._given is not None:
            sources.append(self._given)
        preset = self._run.get("preset")
        if isinstance(preset, str):
            from ares_gateway.episodes.selectors import parse_preset

            with contextlib.suppress(Exception):
                sources.append(parse_preset(preset.split(":", 1)[0].split("@", 1)[0]).dataset)
        for src in sources:
            try:
                found.append(src if isinstance(src, Dataset) else load_dataset(src))
            except (TaskError, OSError, ValueError) as exc:
                self._problems.append(f"dataset {src}: {exc}")
        self._datasets = found
        return found

    def find(self, name: str, recorded: Any) -> Task:
        where = ""
        if isinstance(recorded, str) and recorded:
            try:
                return Task.load(recorded)
            except (TaskError, OSError) as exc:
                where = f"its recorded directory {recorded} is gone or broken ({one_line(str(exc), 200)})"
        for ds in self._candidates():
            with contextlib.suppress(TaskError):
                return ds.task(name)
        looked = ", ".join(ds.name for ds in self._candidates()) or "no dataset"
        problems = "".join(f"; {p}" for p in self._problems)
        raise LookupError(f"task {name!r} is not found: {where or 'the run recorded no task directory'}; "
                          f"looked in {looked}{problems} (pass --tasks DATASET_OR_DIR)")


# ============================================================================ grading one episode again


class _SavedArchive:
    """A saved workspace standing in for the agent's sandbox in :func:`copy_workspace`: its
    ``archive_dir`` hands over the saved tar as it is."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def archive_dir(self, remote_dir: str, local_path: str | os.PathLike[str], *, limit: int) -> int:
        size = self.path.stat().st_size
        if size > limit:
            raise ArchiveTooLargeError(f"the archive passes {limit} bytes")
        try:
            await asyncio.to_thread(shutil.copyfile, self.path, local_path)
        except OSError as exc:
            raise FileTransferError(f"reading {self.path} failed: {exc}") from exc
        return size


def _spec(task: Task, backend: str, image: str | None) -> sandbox_mod.SandboxSpec:
    """The grading sandbox's spec, as an episode's: the task's image and resources, no network (the
    host's where the local backend cannot isolate, or the task opts into it), no relay."""
    spec = task.sandbox_spec(default_image=image, labels={ROLE_LABEL: "reverify"})
    spec = dataclasses.replace(spec, resources=with_default_resources(spec.resources, backend))
    network, hardened = unrelayed_isolation(task, backend)
    return dataclasses.replace(spec, network=network, hardened=hardened)


async def _grade(task: Task, archive: Path, backend: str, image: str | None,
                 uid: str | None) -> VerifierResult:
    """Grade ``archive`` in a fresh sandbox of ``task``'s; raises what the sandbox or the copy raised."""
    sb = sandbox_mod.create(_spec(task, backend, image), backend=backend)
    try:
        await sb.start()
        workdir = sb.workdir if task.workdir == sb.spec.workdir else task.workdir
        if uid is not None and backend == "local" and not getattr(sb.spec, "hardened", False):
            uid = None  # a local sandbox without isolation runs as this user only
        # As an episode grades: the tests prepared first, then the workdir copied in, then the tests run.
        failed = await prepare_tests(sb, task)
        if failed is not None:
            return failed
        src: Any = _SavedArchive(archive)
        await copy_workspace(src, sb, src_workdir=str(archive), dst_workdir=workdir, user=uid,
                             limit=workspace_limit(task), timeout=max(60.0, task.config.verifier_timeout))
        return await run_tests(sb, task, prepared=True)
    finally:
        await remove_sandbox(sb)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _parts(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in ((k, _number(v)) for k, v in value.items()) if v is not None}


def _tail(text: str, n: int = 600) -> str:
    return last_lines(text, n)


def _recorded_tail(run_dir: Path, task: str, attempt: int) -> str | None:
    p = run_dir / "logs" / episode_key(task, attempt) / "verifier.log"
    try:
        return _tail(p.read_text(encoding="utf-8", errors="replace")) or None
    except OSError:
        return None


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _f3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _compare(check: EpisodeCheck) -> None:
    """Set ``status``, ``differences`` and ``note`` from the two verdicts."""
    diffs: list[str] = []
    r0, r1 = check.recorded_reward, check.reward
    if r0 is None or r1 is None or abs(r0 - r1) > _EPS:
        diffs.append(f"reward {_g(r0)} recorded, {_g(r1)} now")
    for name in sorted(set(check.recorded_parts) | set(check.parts)):
        a, b = check.recorded_parts.get(name), check.parts.get(name)
        if a is None or b is None or abs(a - b) > _EPS:
            diffs.append(f"part {name!r}: {_g(a)} recorded, {_g(b)} now")
    if diffs and (check.verifier_error or check.recorded_verifier_error) \
            and check.verifier_error != check.recorded_verifier_error:
        diffs.append(f"verifier error now: {check.verifier_error or 'none'}; recorded: "
                     f"{check.recorded_verifier_error or 'none'}")
    check.status = "differ" if diffs else "agree"
    if check.workspace_truncated:
        diffs.append("the saved workspace was cut at the cap (workspace_truncated): it is not all the agent "
                     "left")
    check.differences = diffs
    if check.status == "differ":
        check.note = "; ".join(diffs)
    elif check.workspace_truncated:
        check.note = diffs[-1]


def _locate(run_dir: Path, workspace: str) -> tuple[Path | None, str | None]:
    """The saved workspace's file when it is there and whole; else ``None`` and why not."""
    archive = (run_dir / workspace).resolve()
    if not archive.is_relative_to(run_dir.resolve()):
        return None, f"the saved workspace {workspace} is outside the run directory: refused"
    if not archive.is_file():
        part = part_path(archive)
        stopped = f"; {part.name} is there: the run was stopped while saving it" if part.exists() else ""
        return None, f"the saved workspace {workspace} is missing{stopped}"
    damage = check_archive(archive)
    if damage is not None:
        return None, f"the saved workspace {workspace} is damaged: {damage}"
    return archive, None


def _half_written(run_dir: Path) -> int:
    folder = run_dir / "workspaces"
    return len(list(folder.glob("*.part"))) if folder.is_dir() else 0


async def _check(entry: Mapping[str, Any], run_dir: Path, finder: _TaskFinder, backend: str,
                 image: str | None, gate: asyncio.Semaphore) -> EpisodeCheck:
    task_name, attempt = str(entry["task"]), int(entry["attempt"])
    check = EpisodeCheck(
        task_name, attempt, "error", recorded_reward=_number(entry.get("reward")),
        recorded_parts=_parts(entry.get("reward_parts")),
        workspace=entry.get("workspace") if isinstance(entry.get("workspace"), str) else None,
        workspace_truncated=bool(entry.get("workspace_truncated")),
        recorded_output_tail=_recorded_tail(run_dir, task_name, attempt))
    err = entry.get("error")
    check.recorded_verifier_error = err if isinstance(err, str) and entry.get("grading") else None
    started = time.monotonic()
    try:
        if check.workspace is None:
            if not entry.get("grading"):
                check.status = "skipped"
                reason = entry.get("exit_reason", "?")
                check.note = (f"the tests did not run in the run (exit reason {reason}): no reward to "
                              "reproduce")
            elif entry.get("workspace_error"):
                check.note = f"no saved workspace: {entry['workspace_error']}"
            elif "workspace" not in entry:
                check.note = ("no saved workspace: the run predates saved workspaces (its results name "
                              "none); runs save them unless --no-save-workspaces")
            else:
                check.note = "no saved workspace: the run ran with --no-save-workspaces"
            return check
        archive, why = await asyncio.to_thread(_locate, run_dir, check.workspace)
        if archive is None:
            check.note = why
            return check
        try:
            task = finder.find(task_name, entry.get("task_dir"))
        except LookupError as exc:
            check.note = str(exc)
            return check
        uid = entry.get("workspace_uid") if isinstance(entry.get("workspace_uid"), str) else None
        async with gate:
            started = time.monotonic()
            try:
                verdict = await _grade(task, archive, backend, image, uid)
            except WorkspaceCopyError as exc:
                check.note = f"copying the saved workspace into the sandbox failed: {one_line(str(exc), 300)}"
                return check
            except sandbox_mod.SandboxError as exc:
                check.note = f"the {backend} sandbox failed: {one_line(str(exc), 400)}"
                return check
        if verdict.crashed:
            check.note = f"the verifier's machinery failed: {one_line(verdict.error, 400)}"
            return check
        check.reward = verdict.reward.value
        check.parts = dict(verdict.reward.parts)
        check.verifier_error = one_line(verdict.error)
        if verdict.script is not None:
            sc = verdict.script  # the shape of the run's verifier.log, so that the two tails compare
            head = f"exit code {sc.exit_code} (timed out: {sc.timed_out}, {sc.duration:.1f} s)"
            check.output_tail = _tail(f"{head}\n--- stdout\n{sc.stdout}\n--- stderr\n{sc.stderr}\n") or None
        _compare(check)
        return check
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # anything unforeseen is this episode's line, never the command's traceback
        log.debug("re-verifying %s.%s failed", task_name, attempt, exc_info=True)
        check.status = "error"
        check.note = f"{type(exc).__name__}: {one_line(str(exc), 400) or '(no message)'}"
        return check
    finally:
        check.seconds = round(time.monotonic() - started, 3)


async def reverify_run(
    run_dir: str | os.PathLike[str],
    *,
    sandbox: str | None = None,
    concurrency: int = 4,
    image: str | None = None,
    tasks: str | os.PathLike[str] | Dataset | None = None,
    write: bool = True,
) -> ReverifyReport:
    """Grade every episode of ``run_dir`` again from its saved workspace (see the module docstring).

    ``sandbox``: ``local``, ``docker`` or ``auto`` (default: the backend the run used, else ``auto``);
    ``image``: for tasks that bring none (default: the run's ``--image``, else the backend's default);
    ``tasks``: a dataset name or directory to find tasks by name where the recorded directory is gone.
    At most ``concurrency`` sandboxes at once. Writes ``run_dir/reverify.json`` unless ``write=False``.
    Raises :class:`RunDirError` when ``run_dir`` is no run directory; never for one episode.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    root = Path(run_dir)
    started = time.monotonic()
    run, entries, notes = read_run(root)
    recorded_backend = run.get("sandbox") if isinstance(run.get("sandbox"), str) else None
    if recorded_backend not in ("local", "docker"):
        recorded_backend = "auto"
    backend = resolve_backend(sandbox or recorded_backend or "auto")
    if image is None and isinstance(run.get("image"), str):
        image = run["image"]
    if image is None and backend == "docker":
        image = DEFAULT_IMAGE
    finder = _TaskFinder(run, tasks)
    gate = asyncio.Semaphore(concurrency)
    checks = await asyncio.gather(*(_check(e, root, finder, backend, image, gate) for e in entries))
    report = ReverifyReport(str(root), backend, sorted(checks, key=lambda c: (c.task, c.attempt)), notes,
                            time.monotonic() - started)
    parts = _half_written(root)
    if parts:
        report.notes.append(f"{parts} workspace archive(s) were left half-written (*.part): the run was "
                            "stopped while saving them")
    if write:
        tmp = root / f"{REPORT_FILE}.tmp"
        tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, root / REPORT_FILE)
    return report


def report_table(report: ReverifyReport) -> Table:
    """A rich Table: task, attempt, recorded reward, reward now, status and what differs."""
    from rich.table import Table

    table = Table(title=f"reverify {report.run_dir} ({report.sandbox})", show_lines=False)
    for name, justify in (("task", "left"), ("attempt", "right"), ("recorded", "right"), ("now", "right"),
                          ("status", "left"), ("why", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in report.episodes:
        table.add_row(c.task, str(c.attempt), _f3(c.recorded_reward), _f3(c.reward), c.status,
                      (c.note or "")[:400])
    return table


def summary_line(report: ReverifyReport) -> str:
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("agree", "differ", "error", "skipped"))
    return f"{len(report.episodes)} episode(s): {counts} in {report.duration:.1f}s"


def differing_details(report: ReverifyReport) -> Sequence[str]:
    """For each episode that differs: its differences and the verifier's output tail, now and then."""
    out: list[str] = []
    for c in report.episodes:
        if c.status != "differ":
            continue
        out.append(f"{c.key}: " + "; ".join(c.differences))
        if c.output_tail:
            out.append(f"  verifier output now: {c.output_tail}")
        if c.recorded_output_tail:
            out.append(f"  verifier output then: {c.recorded_output_tail}")
    return out
