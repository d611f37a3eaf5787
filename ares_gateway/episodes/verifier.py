"""Running a task's scripts in a sandbox and reading the reward its verifier wrote.

After the agent, :func:`run_tests` uploads the task's ``tests/``, runs ``tests/test.sh`` in the
workdir with ``$ARES_VERIFIER_DIR`` (default ``/logs/verifier``) naming where it must write
``reward.json`` (a JSON object of named floats; the reward is their mean) or ``reward.txt`` (one
float), and reads that reward (:func:`read_reward`, :func:`parse_reward`). :func:`run_solution`
runs the task's reference ``solution/solve.sh`` (the oracle, without an agent). :func:`task_paths`
says where a task's files go in each backend.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ares_gateway.episodes.failures import AGENT_SANDBOX, GRADING_SANDBOX
from ares_gateway.episodes.tasks import (
    DEFAULT_VERIFIER_DIR,
    VERIFIER_DIR_ENV,
    MissingTaskFileError,
    RewardError,
    Task,
    _empty,
)
from sandbox import Sandbox, SandboxError
from sandbox.errors import ArchiveTooLargeError

_EMPTY: Mapping[str, Any] = MappingProxyType({})


# ============================================================================ rewards


@dataclass(frozen=True)
class Reward:
    """A verifier's verdict: ``value`` (the mean of ``parts`` for reward.json) and the named parts."""

    value: float
    parts: Mapping[str, float] = field(default_factory=_empty, hash=False)
    #: "reward.json" or "reward.txt" (or "" when built by hand).
    source: str = ""


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"{where} must be a number, got {value!r}: make tests/test.sh write numbers only")
    f = float(value)
    if not math.isfinite(f):
        raise RewardError(f"{where} must be finite, got {value!r}: make tests/test.sh write a finite number")
    return f


def check_range(reward: Reward, reward_range: tuple[float, float]) -> Reward:
    """``reward`` when each of its parts and its value lie in ``reward_range`` (``[lo, hi]``, ends
    included); else :class:`RewardError` naming the first value outside it."""
    lo, hi = reward_range
    named = [(f"{reward.source or 'the reward'}[{k!r}]", v) for k, v in reward.parts.items()]
    for where, value in [*named, (reward.source or "the reward", reward.value)]:
        if not lo <= value <= hi:
            raise RewardError(
                f"reward {value!r} is outside the task's range [{lo:g}, {hi:g}]: {where} is {value!r}; make "
                "tests/test.sh write values in that range, or declare the task's range in task.toml "
                "([verifier] reward_range = [lo, hi])")
    return reward


def parse_reward(reward_json: str | bytes | None = None, reward_txt: str | bytes | None = None, *,
                 reward_range: tuple[float, float] | None = None) -> Reward:
    """The reward from the contents of ``reward.json`` and/or ``reward.txt`` (reward.json preferred).

    reward.json is a JSON object of named numbers (the reward is their mean, the parts are kept) or a
    bare number; reward.txt is one number. With ``reward_range``, each part and the reward must lie in
    it (:func:`check_range`). Raises :class:`RewardError` saying what is wrong.
    """
    reward = _parse_reward(reward_json, reward_txt)
    return check_range(reward, reward_range) if reward_range is not None else reward


def _parse_reward(reward_json: str | bytes | None, reward_txt: str | bytes | None) -> Reward:
    if reward_json is not None:
        text = reward_json.decode("utf-8", "replace") if isinstance(reward_json, bytes) else reward_json
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RewardError(
                f"reward.json is not JSON ({exc}): make tests/test.sh write an object such as "
                "{\"tests\": 1.0}"
            ) from None
        if isinstance(data, dict):
            if not data:
                raise RewardError("reward.json is an empty object: give at least one named number, e.g. "
                                  "{\"tests\": 1.0}")
            parts = {str(k): _finite(v, f"reward.json[{k!r}]") for k, v in data.items()}
            return Reward(sum(parts.values()) / len(parts), MappingProxyType(parts), "reward.json")
        return Reward(_finite(data, "reward.json"), _EMPTY, "reward.json")
    if reward_txt is not None:
        text = reward_txt.decode("utf-8", "replace") if isinstance(reward_txt, bytes) else reward_txt
        try:
            value = float(text.strip())
        except ValueError:
            raise RewardError(
                f"reward.txt must hold one number, got {text.strip()[:80]!r}: make tests/test.sh write e.g. "
                "1 or 0.5"
            ) from None
        return Reward(_finite(value, "reward.txt"), _EMPTY, "reward.txt")
    raise RewardError(
        "the verifier wrote neither reward.json nor reward.txt: make tests/test.sh write one of them to "
        f"${VERIFIER_DIR_ENV} (default {DEFAULT_VERIFIER_DIR})"
    )


_READ_MARK = "@@ares-reward@@"


async def read_reward(
    sb: Sandbox, verifier_dir: str = DEFAULT_VERIFIER_DIR, *, timeout: float = 30.0, user: str | None = None,
    reward_range: tuple[float, float] | None = None,
) -> Reward:
    """Read the reward a verifier left in ``verifier_dir`` of a sandbox (reward.json preferred).

    One ``exec`` reads both files (they are tiny), so this costs one round trip on remote backends.
    Raises :class:`RewardError` when neither file is there, it is unreadable, or (with
    ``reward_range``) a value lies outside that range.
    """
    d = shlex.quote(verifier_dir.rstrip("/") or "/")
    # A marker line tells which file followed; the reward files themselves are never shell-parsed.
    cmd = (
        f"if [ -f {d}/reward.json ]; then echo json{_READ_MARK}; cat {d}/reward.json; "
        f"elif [ -f {d}/reward.txt ]; then echo txt{_READ_MARK}; cat {d}/reward.txt; "
        f"else echo none{_READ_MARK}; fi"
    )
    result = await sb.exec(cmd, cwd="/", user=user, timeout=timeout)
    if not result.ok:
        raise RewardError(
            f"could not read the reward in {verifier_dir} (exit {result.exit_code}, timed out: "
            f"{result.timed_out}): "
            f"{result.stderr.strip()[-300:]}"
        )
    kind, _, body = result.stdout.partition(f"{_READ_MARK}\n")
    if kind == "json":
        return parse_reward(reward_json=body, reward_range=reward_range)
    if kind == "txt":
        return parse_reward(reward_txt=body, reward_range=reward_range)
    return parse_reward()


# ============================================================================ running a task's scripts


@dataclass(frozen=True)
class TaskPaths:
    """Where a task's files live inside one sandbox."""

    tests_dir: str
    solution_dir: str
    verifier_dir: str


def task_paths(sb: Sandbox) -> TaskPaths:
    """Harbor's ``/tests``, ``/solution`` and ``/logs/verifier`` in containers and hardened local
    sandboxes (a private root where only root can create them); per-sandbox directories under ``/tmp``
    in a local backend that is not hardened, whose host filesystem is read-only (bubblewrap) or shared
    (no isolation), so fixed root paths would be unwritable or collide between sandboxes."""
    if sb.backend == "local" and not getattr(sb.spec, "hardened", False):
        root = getattr(sb, "root", None)
        if getattr(sb, "isolated", True) is False and root is not None:
            # Without isolation sandbox paths are host paths: stay inside the sandbox's own directory,
            # which stop() removes.
            base = str(Path(root) / "task")
        else:
            base = f"/tmp/ares-task-{sb.id}"
        return TaskPaths(f"{base}/tests", f"{base}/solution", f"{base}/logs/verifier")
    return TaskPaths("/tests", "/solution", DEFAULT_VERIFIER_DIR)


@dataclass(frozen=True)
class ScriptResult:
    """What running ``solve.sh`` or ``test.sh`` did (outputs cut to their last 4000 characters)."""

    exit_code: int
    timed_out: bool
    duration: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class VerifierResult:
    """The outcome of :func:`run_tests`: always a reward (0.0 on any failure, with ``error`` saying why)."""

    reward: Reward
    script: ScriptResult | None
    error: str | None = None
    #: The verifier's own machinery failed (its directories, the upload of the tests, the copy of the
    #: workdir, the sandbox), not the tests: whose failure that is depends on ``failure_site``
    #: (:mod:`ares_gateway.episodes.failures`).
    crashed: bool = False
    #: Where a crash's cause lies (set by the episode, which knows the sandboxes):
    #: :data:`~ares_gateway.episodes.failures.AGENT_SANDBOX` (the agent's own sandbox, or the copy of
    #: its workdir: the agent's once the policy answered a call),
    #: :data:`~ares_gateway.episodes.failures.GRADING_SANDBOX`
    #: (the fresh grading sandbox before anything of the agent's was in it: the infrastructure's), or
    #: ``""`` (no crash).
    failure_site: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


_TAIL = 4000


def _script_result(r: Any) -> ScriptResult:
    return ScriptResult(r.exit_code, r.timed_out, r.duration, r.stdout[-_TAIL:], r.stderr[-_TAIL:])


def _run_script_cmd(script: str) -> str:
    # Harbor runs its scripts with bash; POSIX sh is the fallback for minimal images.
    s = shlex.quote(script)
    return f"if command -v bash >/dev/null 2>&1; then exec bash {s}; else exec sh {s}; fi"


async def run_solution(
    sb: Sandbox, task: Task, *, paths: TaskPaths | None = None, timeout: float | None = None,
    user: str | None = None,
) -> ScriptResult:
    """Upload ``solution/`` and run ``solve.sh`` in the workdir (the oracle, without an agent)."""
    if task.solution_dir is None:
        raise MissingTaskFileError(
            f"{task.path / 'solution' / 'solve.sh'} is missing: task {task.name!r} has no reference solution",
            path=task.path / "solution" / "solve.sh",
        )
    paths = paths or task_paths(sb)
    await sb.upload_dir(task.solution_dir, paths.solution_dir)
    r = await sb.exec(
        _run_script_cmd(posixpath.join(paths.solution_dir, "solve.sh")),
        cwd=task.workdir,
        env=dict(task.config.solution_env),
        user=user,
        timeout=timeout if timeout is not None else task.config.agent_timeout,
    )
    return _script_result(r)


def _fresh_dirs_cmd(paths: TaskPaths, verifier_user: str | None) -> str:
    """Remove and re-create the tests and verifier directories, 0755 and root's (the verifier's own
    directory its user's when ``[verifier] user`` is another), their parents not writable by others."""
    t, v = shlex.quote(paths.tests_dir), shlex.quote(paths.verifier_dir)
    parents = sorted(
        {posixpath.dirname(p.rstrip("/")) for p in (paths.tests_dir, paths.verifier_dir)} - {"/", "/tmp"}
    )
    qp = " ".join(shlex.quote(p) for p in parents)
    cmd = (f"rm -rf {t} {v} && mkdir -p {t} {v} && chown 0:0 {t} {v} {qp} 2>/dev/null; "
           f"chmod 0755 {t} {v} && {{ [ -z {shlex.quote(qp)} ] || chmod go-w {qp}; }}")
    if verifier_user and verifier_user not in ("root", "0"):
        cmd += f" && chown {shlex.quote(verifier_user)} {v}"
    return cmd


async def prepare_tests(sb: Sandbox, task: Task, *, paths: TaskPaths | None = None) -> VerifierResult | None:
    """The verifier's setup in ``sb``: fresh, root-owned tests and verifier directories, the task's
    ``tests/`` uploaded into them and sealed. ``None`` when done; else a crashed :class:`VerifierResult`
    (reward 0.0) saying what failed. Never raises for what the sandbox did."""
    paths = paths or task_paths(sb)
    zero = Reward(0.0)
    root = None if sb.backend == "local" else "root"
    try:
        # Fresh, root-owned directories made after the agent's processes are gone (the episode kills
        # them first; a fresh grading sandbox never had any): a reward file or a test.sh the agent
        # left is removed, and no one but root (and the verifier's own user) can write what is read back.
        prep = await sb.exec(_fresh_dirs_cmd(paths, task.config.verifier_user), cwd="/", user=root,
                             timeout=60)
        if not prep.ok:
            return VerifierResult(zero, None,
                                  f"cannot create {paths.verifier_dir}: {prep.stderr.strip()[-300:]}",
                                  crashed=True)
        await sb.upload_dir(task.tests_dir, paths.tests_dir)
        sealed = await sb.exec(f"chown -R 0:0 {shlex.quote(paths.tests_dir)} 2>/dev/null; "
                               f"chmod -R go-w {shlex.quote(paths.tests_dir)}", cwd="/", user=root,
                               timeout=60)
        if not sealed.ok:
            return VerifierResult(zero, None,
                                  f"cannot protect {paths.tests_dir}: {sealed.stderr.strip()[-300:]}",
                                  crashed=True)
    except SandboxError as exc:
        return VerifierResult(zero, None, f"sandbox failure while verifying: {exc}", crashed=True)
    return None


async def run_tests(
    sb: Sandbox,
    task: Task,
    *,
    paths: TaskPaths | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    prepared: bool = False,
) -> VerifierResult:
    """Upload ``tests/`` (:func:`prepare_tests`; not when ``prepared`` says that was done), run
    ``test.sh`` in the workdir with its own timeout, and read the reward.

    Never raises for what the verifier or sandbox did: a timeout, a missing or bad reward file or a
    sandbox error gives reward 0.0 with ``error`` set (a non-zero exit of test.sh with a reward file
    is not an error: many verifiers exit 1 when tests fail), and so does a reward outside the task's
    ``[verifier] reward_range`` (default ``[0, 1]``). ``ARES_VERIFIER_DIR`` is set for the script.
    """
    paths = paths or task_paths(sb)
    zero = Reward(0.0)
    root = None if sb.backend == "local" else "root"
    if not prepared:
        failed = await prepare_tests(sb, task, paths=paths)
        if failed is not None:
            return failed
    try:
        r = await sb.exec(
            _run_script_cmd(posixpath.join(paths.tests_dir, "test.sh")),
            cwd=task.workdir,
            env={**task.config.verifier_env, **(env or {}), VERIFIER_DIR_ENV: paths.verifier_dir},
            user=task.config.verifier_user,
            timeout=timeout if timeout is not None else task.config.verifier_timeout,
        )
        script = _script_result(r)
        if r.timed_out:
            return VerifierResult(zero, script, f"tests/test.sh timed out after {r.duration:.0f}s")
        try:
            reward = await read_reward(sb, paths.verifier_dir, user=root,
                                       reward_range=task.config.reward_range)
        except RewardError as exc:
            return VerifierResult(zero, script, f"{exc} (test.sh exit code {r.exit_code})")
        return VerifierResult(reward, script)
    except SandboxError as exc:
        return VerifierResult(zero, None, f"sandbox failure while verifying: {exc}", crashed=True)


# ============================================================================ grading in a fresh sandbox

#: The largest archive of an agent's workdir copied into a grading sandbox when the task declares no
#: ``[environment] storage_mb`` (with one, that size is the bound).
MAX_WORKSPACE_BYTES = 2 * 1024**3
class WorkspaceCopyError(Exception):
    """The agent's workdir could not be copied into the grading sandbox; the message says why.

    ``site`` says where the cause lies (:data:`~ares_gateway.episodes.failures.AGENT_SANDBOX`: the
    agent's sandbox or what came out of it, its archive;
    :data:`~ares_gateway.episodes.failures.GRADING_SANDBOX`: the grading sandbox's own preparation);
    ``crashed`` that the copy's machinery failed (a workdir over the bound did not: that is a verdict on
    what the agent left, reward 0.0).
    """

    def __init__(self, message: str, *, site: str = AGENT_SANDBOX, crashed: bool = True) -> None:
        super().__init__(message)
        self.site = site
        self.crashed = crashed


def workspace_limit(task: Task) -> int:
    """The most bytes an archive of ``task``'s workdir may hold: its ``storage_mb``, else
    :data:`MAX_WORKSPACE_BYTES`."""
    mb = task.config.storage_mb
    return mb * 1024 * 1024 if mb is not None else MAX_WORKSPACE_BYTES


def _scratch(sb: Sandbox) -> tuple[str, str | None]:
    """Where a sandbox's temporary directories for the copy go (a host-side directory of the sandbox's
    own for a local backend without isolation, whose /tmp is the host's), and who runs root's steps."""
    root = getattr(sb, "root", None)
    if sb.backend == "local" and getattr(sb, "isolated", True) is False and root is not None:
        return str(Path(root) / "grade"), None
    return "/tmp", None if sb.backend == "local" else "root"


def _tail(text: str, n: int = 300) -> str:
    return " ".join(text.strip().split())[-n:]


async def copy_workspace(
    src: Sandbox,
    dst: Sandbox,
    *,
    src_workdir: str,
    dst_workdir: str,
    user: str | None,
    limit: int = MAX_WORKSPACE_BYTES,
    timeout: float = 600.0,
    keep: str | os.PathLike[str] | None = None,
) -> int:
    """Replace ``dst_workdir`` of the grading sandbox ``dst`` with a copy of ``src_workdir`` of the
    agent's sandbox ``src``; returns the archive's size in bytes.

    The archive is made inside ``src`` (after the agent's processes are gone) and streamed out by
    :meth:`~sandbox.BaseSandbox.archive_dir`: symbolic links stored as links, none followed, FIFOs,
    sockets and device nodes left out, set-id bits and owners cleared. It travels as one opaque file
    (never unpacked on this host) and is unpacked inside ``dst`` as ``user`` (the agent's uid: the
    files end up its own, and nothing in the archive can land where that user could not write;
    ``None``: the sandbox's default user), before anything of the task's is put there. An archive over
    ``limit`` bytes, or one that cannot be made or unpacked, raises :class:`WorkspaceCopyError`.
    ``keep``: write the archive to this file, and leave it there (also when the copy fails: what was
    archived so far), instead of a temporary one: the run's saved workspace
    (:mod:`~ares_gateway.episodes.workspaces`).
    """
    base, root = _scratch(dst)
    qw = shlex.quote(dst_workdir)
    owner = f"chown {shlex.quote(user)} {qw} \"$d\" && " if user is not None else ""
    make_room = (
        f"mkdir -p {shlex.quote(base)} && d=$(mktemp -d {shlex.quote(base)}/ares-grade.XXXXXXXX) || exit 3\n"
        f"mkdir -p {qw} && find {qw} -mindepth 1 -maxdepth 1 -exec rm -rf -- {{}} + && {owner}"
        f'chmod 0755 "$d" && printf "%s\\n" "$d"\n'
    )
    with tempfile.TemporaryDirectory(prefix="ares-grade-") as tmp:
        local = Path(keep) if keep is not None else Path(tmp) / "ws.tar"
        # The archive first, then the grading side's room: where the two sandboxes' workdirs are one
        # directory (a volume both mount; a stand-in on one disk), emptying it first would lose the work.
        try:
            packed = await src.archive_dir(src_workdir, local, limit=limit)
        except ArchiveTooLargeError:
            raise WorkspaceCopyError(
                f"the workdir {src_workdir} is too large to grade: its archive passes {limit} bytes (the "
                f"task's storage_mb, else {MAX_WORKSPACE_BYTES} bytes); the agent left too much in it",
                crashed=False) from None
        except SandboxError as exc:
            raise WorkspaceCopyError(f"archiving the workdir {src_workdir} failed: {exc}") from exc
        room = await dst.exec(make_room, cwd="/", user=root, timeout=timeout)
        if not room.ok:
            raise WorkspaceCopyError(f"preparing {dst_workdir} in the grading sandbox failed: "
                                     f"{_tail(room.stderr)}", site=GRADING_SANDBOX)
        dst_dir = room.stdout.strip()
        os.chmod(local, 0o644)  # the unpacking user reads it; the directory it lands in is its own
        await dst.upload_file(local, posixpath.join(dst_dir, "ws.tar"))
    qd = shlex.quote(dst_dir)
    unpack = (
        f"cd {qw} || exit 4\n"
        f"tar -x --no-same-owner --no-same-permissions -f {qd}/ws.tar; rc=$?\n"
        f"rm -rf {qd} 2>/dev/null; exit $rc\n"  # the directory is the unpacking user's
    )
    unpacked = await dst.exec(unpack, cwd="/", user=user if user is not None else root, timeout=timeout)
    if not unpacked.ok:
        # tar's own failure (exit 2: a member it could not write, no room) or its timeout comes from what
        # the archive holds, which is the agent's; anything else (no workdir) from the grading sandbox.
        site = AGENT_SANDBOX if unpacked.timed_out or unpacked.exit_code == 2 else GRADING_SANDBOX
        raise WorkspaceCopyError(f"unpacking the workdir in the grading sandbox failed (exit "
                                 f"{unpacked.exit_code}, timed out: {unpacked.timed_out}): "
                                 f"{_tail(unpacked.stderr or unpacked.stdout)}",
                                 site=site)
    return int(packed)
