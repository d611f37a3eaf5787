"""Tasks and datasets in Harbor's layout (``task.toml``), and setting a task's workdir up.

A task is a directory::

    my-task/
      instruction.md          the prompt given to the agent (required, not empty)
      task.toml               timeouts, resources, workdir, metadata (required)
      environment/Dockerfile  the image to build (optional; else ``[environment] docker_image`` or a default)
      environment/workspace/  files copied into the workdir before the agent starts (optional, ares extension)
      tests/test.sh           the verifier: writes reward.json or reward.txt (required)
      solution/solve.sh       a reference solution (optional)

``tests/test.sh`` runs after the agent, with the task's workdir as its current directory and
``$ARES_VERIFIER_DIR`` (default ``/logs/verifier``) naming where it must write ``reward.json`` (a JSON
object of named floats; the reward is their mean) or ``reward.txt`` (one float).

A dataset is a directory of tasks (sorted by name) or a registry entry naming one
(:func:`register_dataset`; the bundled ``examples`` are registered by default).

:func:`prepare_workdir` sets a task's workdir up in any :class:`sandbox.Sandbox`; running its tests and
reading the reward is :mod:`ares_gateway.episodes.verifier`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, overload

from ares_gateway.episodes.oracle import oracle_command
from sandbox import Sandbox, SandboxError, SandboxSpec
from sandbox.local import AGENT_UID, AGENT_USER
from sandbox.spec import Resources

#: Where Harbor tasks write their reward; ``tests/test.sh`` reads ``$ARES_VERIFIER_DIR`` with this default.
DEFAULT_VERIFIER_DIR = "/logs/verifier"
VERIFIER_DIR_ENV = "ARES_VERIFIER_DIR"
#: The workdir of a task that names none (and whose Dockerfile has no WORKDIR).
DEFAULT_WORKDIR = "/workspace"
#: Harbor's defaults for the agent and verifier time budgets (seconds).
DEFAULT_AGENT_TIMEOUT = 600.0
DEFAULT_VERIFIER_TIMEOUT = 600.0
DEFAULT_BUILD_TIMEOUT = 600.0
#: Where a task's tests run (``[verifier] sandbox``): ``fresh``, a new sandbox from the task's image
#: holding a copy of the agent's final workdir and nothing else of the agent's (the default), or
#: ``agent``, the agent's own sandbox with the processes it left still running (for tests that need
#: a service the agent started; those processes can act while the tests run).
GRADING_MODES = ("fresh", "agent")
#: The range a reward must lie in when ``[verifier] reward_range`` names none.
DEFAULT_REWARD_RANGE = (0.0, 1.0)
#: The user every harness runs the agent as by default (``harnesses.BaseHarness(user=...)``): the
#: tests never run as it.
DEFAULT_AGENT_USER = AGENT_USER

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return _EMPTY


# ============================================================================ errors


class TaskError(Exception):
    """A task or dataset cannot be used; the message names the file and says what to fix."""

    def __init__(self, message: str, *, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class TaskNotFoundError(TaskError):
    """A task directory (or a dataset name / directory) does not exist."""


class MissingTaskFileError(TaskError):
    """A required file of a task (instruction.md, task.toml, tests/test.sh) is missing or empty."""


class TaskConfigError(TaskError):
    """``task.toml`` is not valid TOML, or a field has the wrong type or value."""


class DatasetError(TaskError):
    """A dataset is empty, unknown, or holds broken tasks."""


class RewardError(TaskError):
    """The verifier's reward file is missing or unreadable."""


# ============================================================================ task.toml


@dataclass(frozen=True)
class TaskConfig:
    """The parts of ``task.toml`` that ares-gateway uses; the whole file is kept in :attr:`raw`.

    Harbor's fields are read where they are: ``[agent] timeout_sec``, ``[verifier] timeout_sec / env /
    user``, ``[environment] build_timeout_sec / cpus / memory_mb (or memory = "4G") / storage_mb (or
    storage) / gpus / allow_internet / docker_image``, ``[solution] env``, ``[metadata]``. ares-gateway
    adds ``[environment] workdir`` (else the Dockerfile's last ``WORKDIR``, else ``/workspace``).
    """

    version: str = "1.0"
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT
    agent_user: str | None = None
    setup_timeout: float | None = None
    verifier_timeout: float = DEFAULT_VERIFIER_TIMEOUT
    verifier_user: str | None = None
    #: Where the tests run: one of :data:`GRADING_MODES`.
    grading: str = "fresh"
    #: ``(lo, hi)``: every part of the reward and the reward itself must lie in it, else the
    #: verifier failed (reward 0.0 with ``verifier_error``).
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    verifier_env: Mapping[str, str] = field(default_factory=_empty, hash=False)
    solution_env: Mapping[str, str] = field(default_factory=_empty, hash=False)
    build_timeout: float = DEFAULT_BUILD_TIMEOUT
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    #: Harbor's ``[environment] allow_internet``; ares-gateway gives the network only when it is set to
    #: ``true`` (by default an episode's sandbox reaches nothing but its own session's LLM endpoint).
    allow_internet: bool = False
    docker_image: str | None = None
    workdir: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=_empty, hash=False)
    raw: Mapping[str, Any] = field(default_factory=_empty, hash=False, repr=False)

    @property
    def resources(self) -> Resources:
        """The task's resources in :mod:`sandbox`'s terms."""
        return Resources(
            cpus=self.cpus,
            memory=f"{self.memory_mb}m" if self.memory_mb is not None else None,
            disk=f"{self.storage_mb}m" if self.storage_mb is not None else None,
            gpus=self.gpus,
        )


class _Reader:
    """Typed access to a parsed TOML table with errors naming the file and the key."""

    def __init__(self, path: Path, data: Mapping[str, Any]) -> None:
        self.path = path
        self.data = data

    def table(self, name: str) -> Mapping[str, Any]:
        value = self.data.get(name, {})
        if not isinstance(value, dict):
            raise TaskConfigError(
                f"{self.path}: [{name}] must be a table, got {type(value).__name__}; write it as a "
                f"[{name}] section", path=self.path,
            )
        return value

    def _fail(self, key: str, want: str, got: Any) -> TaskConfigError:
        return TaskConfigError(
            f"{self.path}: {key} must be {want}, got {got!r}; fix that line of task.toml", path=self.path
        )

    def number(self, table: Mapping[str, Any], section: str, key: str, *,
               positive: bool = True) -> float | None:
        if key not in table:
            return None
        v = table[key]
        if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
            or (positive and v <= 0)):
            raise self._fail(f"[{section}] {key}", "a positive number" if positive else "a number", v)
        return float(v)

    def integer(self, table: Mapping[str, Any], section: str, key: str) -> int | None:
        if key not in table:
            return None
        v = table[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self._fail(f"[{section}] {key}", "a non-negative integer", v)
        return v

    def string(self, table: Mapping[str, Any], section: str, key: str) -> str | None:
        if key not in table:
            return None
        v = table[key]
        if not isinstance(v, str) or not v:
            raise self._fail(f"[{section}] {key}", "a non-empty string", v)
        return v

    def boolean(self, table: Mapping[str, Any], section: str, key: str) -> bool | None:
        if key not in table:
            return None
        v = table[key]
        if not isinstance(v, bool):
            raise self._fail(f"[{section}] {key}", "true or false", v)
        return v

    def env(self, table: Mapping[str, Any], section: str) -> Mapping[str, str]:
        v = table.get("env", {})
        if (not isinstance(v, dict)
            or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())):
            raise self._fail(f"[{section}] env", 'a table of strings (env = { NAME = "value" })', v)
        return MappingProxyType(dict(v))

    def choice(self, table: Mapping[str, Any], section: str, key: str,
               choices: tuple[str, ...]) -> str | None:
        if key not in table:
            return None
        v = table[key]
        if v not in choices:
            raise self._fail(f"[{section}] {key}", " or ".join(repr(c).replace("'", '"') for c in choices), v)
        return str(v)

    def number_range(self, table: Mapping[str, Any], section: str, key: str) -> tuple[float, float] | None:
        if key not in table:
            return None
        v = table[key]
        ok = (isinstance(v, list) and len(v) == 2
              and all(not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) for x in v)
              and v[0] < v[1])
        if not ok:
            raise self._fail(f"[{section}] {key}", "two finite numbers [lo, hi] with lo < hi, such as [0, 1]",
                             v)
        return float(v[0]), float(v[1])

    def size_mb(self, table: Mapping[str, Any], section: str, mb_key: str, size_key: str) -> int | None:
        """``memory_mb = 2048`` (Harbor) or ``memory = "2G"`` (older Harbor / Terminal-Bench)."""
        mb = self.integer(table, section, mb_key)
        if mb is not None:
            return mb
        if size_key not in table:
            return None
        v = table[size_key]
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", v) if isinstance(v, str) else None
        if m is None:
            raise self._fail(f"[{section}] {size_key}", 'a size like "512M" or "4G"', v)
        factor = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024,
                  "t": 1024 * 1024}[m.group(2).lower()]
        return max(1, round(float(m.group(1)) * factor))


def parse_task_config(text: str, *, path: Path | str = "task.toml") -> TaskConfig:
    """Parse the text of a ``task.toml``. Raises :class:`TaskConfigError` naming ``path`` and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskConfigError(f"{path} is not valid TOML: {exc}; fix the syntax at that line",
                              path=path) from None
    r = _Reader(path, data)
    agent, verifier, env_t, solution = r.table("agent"), r.table("verifier"), r.table("environment"), r.table(
        "solution")
    metadata = r.table("metadata")
    version = data.get("version", data.get("schema_version", "1.0"))
    if not isinstance(version, str):
        raise r._fail("version", 'a string such as "1.0"', version)
    workdir = r.string(env_t, "environment", "workdir")
    if workdir is not None and not workdir.startswith("/"):
        raise r._fail("[environment] workdir", "an absolute path such as /workspace", workdir)
    gpus = r.integer(env_t, "environment", "gpus")
    agent_user = r.string(agent, "agent", "user")
    verifier_user = r.string(verifier, "verifier", "user")
    if verifier_user is not None and verifier_user in {DEFAULT_AGENT_USER, str(AGENT_UID), agent_user}:
        raise TaskConfigError(
            f"{path}: [verifier] user = {verifier_user!r} is the agent's user: the tests must "
            "never run as the user whose files and processes they judge; drop the line (root runs them) or "
            "name another user", path=path)
    return TaskConfig(
        version=version,
        agent_timeout=r.number(agent, "agent", "timeout_sec") or DEFAULT_AGENT_TIMEOUT,
        agent_user=agent_user,
        setup_timeout=r.number(agent, "agent", "setup_timeout_sec"),
        verifier_timeout=r.number(verifier, "verifier", "timeout_sec") or DEFAULT_VERIFIER_TIMEOUT,
        verifier_user=verifier_user,
        grading=r.choice(verifier, "verifier", "sandbox", GRADING_MODES) or "fresh",
        reward_range=r.number_range(verifier, "verifier", "reward_range") or DEFAULT_REWARD_RANGE,
        verifier_env=r.env(verifier, "verifier"),
        solution_env=r.env(solution, "solution"),
        build_timeout=r.number(env_t, "environment", "build_timeout_sec") or DEFAULT_BUILD_TIMEOUT,
        cpus=r.number(env_t, "environment", "cpus"),
        memory_mb=r.size_mb(env_t, "environment", "memory_mb", "memory"),
        storage_mb=r.size_mb(env_t, "environment", "storage_mb", "storage"),
        gpus=gpus or None,
        allow_internet=r.boolean(env_t, "environment", "allow_internet") is True,
        docker_image=r.string(env_t, "environment", "docker_image"),
        workdir=workdir,
        metadata=MappingProxyType(dict(metadata)),
        raw=MappingProxyType(data),
    )


def _dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last absolute ``WORKDIR`` of a Dockerfile (relative ones and variables are not resolved)."""
    workdir = None
    for line in dockerfile.read_text(errors="replace").splitlines():
        parts = line.strip().split(None, 1)
        if (len(parts) == 2 and parts[0].upper() == "WORKDIR" and parts[1].startswith("/")
            and "$" not in parts[1]):
            workdir = parts[1].strip().strip("\"'")
    return workdir


# ============================================================================ Task


@dataclass(frozen=True)
class Task:
    """One task, loaded from its directory by :meth:`Task.load`. Immutable; hashable by name and path."""

    name: str
    path: Path
    instruction: str
    config: TaskConfig
    #: ``tests/``: uploaded to the sandbox after the agent finishes; ``test.sh`` is its entry point.
    tests_dir: Path
    #: ``solution/`` when ``solution/solve.sh`` exists.
    solution_dir: Path | None = None
    #: ``environment/Dockerfile`` when it exists.
    dockerfile: Path | None = None
    #: ``environment/workspace/`` when it exists: copied into the workdir before the agent starts.
    workspace_dir: Path | None = None

    def __hash__(self) -> int:
        return hash((self.name, self.path))

    def moved(self, old_root: str | os.PathLike[str], new_root: str | os.PathLike[str]) -> Task:
        """This task with its paths under ``old_root`` moved under ``new_root`` (the same folders at
        another place: a Ray node's copy of a ``working_dir``); paths outside ``old_root`` stay."""
        old, new = Path(old_root), Path(new_root)

        def move(p: Path | None) -> Path | None:
            if p is None or not p.is_relative_to(old):
                return p
            return new / p.relative_to(old)

        return dataclasses.replace(self, path=move(self.path) or self.path,
                                   tests_dir=move(self.tests_dir) or self.tests_dir,
                                   solution_dir=move(self.solution_dir), dockerfile=move(self.dockerfile),
                                   workspace_dir=move(self.workspace_dir))

    @property
    def workdir(self) -> str:
        """Where the agent works: ``[environment] workdir``, else the Dockerfile's WORKDIR, else
        /workspace."""
        if self.config.workdir:
            return self.config.workdir
        if self.dockerfile is not None:
            found = _dockerfile_workdir(self.dockerfile)
            if found:
                return found
        return DEFAULT_WORKDIR

    def oracle_command(self) -> str:
        """One shell command that plays ``solution/solve.sh`` from the agent's working directory (what
        the oracle policy sends through the agent's shell tool; see :mod:`ares_gateway.episodes.oracle`)."""
        return oracle_command(self.name, self.solution_dir, self.config.solution_env)

    @property
    def has_solution(self) -> bool:
        return self.solution_dir is not None

    @property
    def needs_image(self) -> bool:
        """Whether the task defines its own image (a Dockerfile or docker_image): the local sandbox cannot
        honour it."""
        return self.dockerfile is not None or self.config.docker_image is not None

    def sandbox_spec(
        self,
        *,
        default_image: str | None = None,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        user: str | None = None,
        name: str | None = None,
    ) -> SandboxSpec:
        """A :class:`SandboxSpec` for this task: its Dockerfile or image (else ``default_image``),
        workdir, resources, and ``network="none"`` unless ``allow_internet = true``."""
        dockerfile = self.dockerfile
        return SandboxSpec(
            image=None if dockerfile is not None else (self.config.docker_image or default_image),
            dockerfile=dockerfile,
            build_context=dockerfile.parent if dockerfile is not None else None,
            workdir=self.workdir,
            env=dict(env or {}),
            resources=self.config.resources,
            network="host" if self.config.allow_internet else "none",
            labels={"ares-gateway.task": self.name, **(labels or {})},
            user=user,
            name=name,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Task:
        """Read a task directory. Raises :class:`TaskNotFoundError`, :class:`MissingTaskFileError` or
        :class:`TaskConfigError`, each naming the file and saying what to fix."""
        p = Path(path).expanduser()
        if not p.is_dir():
            raise TaskNotFoundError(
                f"{p} is not a task directory: a task is a directory with instruction.md, task.toml and "
                "tests/test.sh",
                path=p,
            )
        p = p.resolve()
        instruction_path = p / "instruction.md"
        if not instruction_path.is_file():
            raise MissingTaskFileError(
                f"{instruction_path} is missing: write the task's prompt for the agent in it",
                path=instruction_path
            )
        instruction = instruction_path.read_text(encoding="utf-8")
        if not instruction.strip():
            raise MissingTaskFileError(
                f"{instruction_path} is empty: write the task's prompt for the agent in it",
                path=instruction_path
            )
        toml_path = p / "task.toml"
        if not toml_path.is_file():
            raise MissingTaskFileError(
                f"{toml_path} is missing: add one (at least `version = \"1.0\"`; see docs/rollouts.md for "
                "timeouts, resources and workdir)",
                path=toml_path,
            )
        config = parse_task_config(toml_path.read_text(encoding="utf-8"), path=toml_path)
        test_sh = p / "tests" / "test.sh"
        if not test_sh.is_file():
            raise MissingTaskFileError(
                f"{test_sh} is missing: the verifier must be tests/test.sh and write reward.json "
                "or reward.txt "
                f"to ${VERIFIER_DIR_ENV} (default {DEFAULT_VERIFIER_DIR})",
                path=test_sh,
            )
        solve_sh = p / "solution" / "solve.sh"
        dockerfile = p / "environment" / "Dockerfile"
        workspace = p / "environment" / "workspace"
        return cls(
            name=p.name,
            path=p,
            instruction=instruction,
            config=config,
            tests_dir=test_sh.parent,
            solution_dir=solve_sh.parent if solve_sh.is_file() else None,
            dockerfile=dockerfile if dockerfile.is_file() else None,
            workspace_dir=workspace if workspace.is_dir() else None,
        )


def _looks_like_task(p: Path) -> bool:
    return (p / "task.toml").is_file() or (p / "instruction.md").is_file() or (p / "tests").is_dir()


# ============================================================================ Dataset


@dataclass(frozen=True)
class Dataset:
    """An ordered, immutable collection of tasks (sorted by name)."""

    name: str
    path: Path
    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    @overload
    def __getitem__(self, index: int) -> Task: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Task, ...]: ...

    def __getitem__(self, index: int | slice) -> Task | tuple[Task, ...]:
        return self.tasks[index]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def task(self, name: str) -> Task:
        """The task called ``name``."""
        for t in self.tasks:
            if t.name == name:
                return t
        raise DatasetError(f"dataset {self.name!r} has no task {name!r}; it has: {', '.join(self.names)}")

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, name: str | None = None) -> Dataset:
        """Every task directory under ``path``, sorted by name; ``path`` may also be one task.

        Hidden directories and directories with none of instruction.md / task.toml / tests/ are
        skipped; a directory with some of them must be a complete task (else its :class:`TaskError`).
        """
        p = Path(path).expanduser()
        if not p.is_dir():
            raise TaskNotFoundError(
                f"dataset directory {p} does not exist: pass a directory of task directories", path=p)
        p = p.resolve()
        if (p / "task.toml").is_file():
            task = Task.load(p)
            return cls(name or task.name, p, (task,))
        tasks = tuple(
            Task.load(child)
            for child in sorted(p.iterdir(), key=lambda c: c.name)
            if child.is_dir() and not child.name.startswith((".", "_")) and _looks_like_task(child)
        )
        if not tasks:
            raise DatasetError(
                f"no tasks in {p}: each task is a subdirectory with instruction.md, task.toml and "
                "tests/test.sh", path=p,
            )
        return cls(name or p.name, p, tasks)


def examples_dir() -> Path:
    """The bundled example tasks (``examples/tasks`` of the source tree)."""
    return Path(__file__).resolve().parents[2] / "examples" / "tasks"


_REGISTRY: dict[str, Path] = {"examples": examples_dir()}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def register_dataset(name: str, path: str | os.PathLike[str], *, replace: bool = False) -> None:
    """Register ``name`` for the dataset directory ``path`` (checked when the dataset is loaded)."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"dataset name {name!r} must be letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit")
    if name in _REGISTRY and not replace and _REGISTRY[name] != Path(path):
        raise ValueError(
            f"dataset {name!r} is already registered for {_REGISTRY[name]}; pass replace=True to change it")
    _REGISTRY[name] = Path(path)


def registered_datasets() -> dict[str, Path]:
    """A copy of the registry: dataset name -> directory."""
    return dict(_REGISTRY)


def load_dataset(name_or_path: str | os.PathLike[str]) -> Dataset:
    """A registered dataset by name, or a dataset directory by path."""
    key = os.fspath(name_or_path)
    if key in _REGISTRY:
        return Dataset.from_dir(_REGISTRY[key], name=key)
    p = Path(key).expanduser()
    if p.is_dir():
        return Dataset.from_dir(p)
    raise DatasetError(
        f"unknown dataset {key!r}: use a registered name ({', '.join(sorted(_REGISTRY))}) or a "
        "directory of tasks"
    )


# ============================================================================ setting a task up in a sandbox


async def prepare_workdir(sb: Sandbox, task: Task, *, user: str | None = None) -> None:
    """Create the task's workdir in a started sandbox and copy ``environment/workspace/`` into it."""
    wd = task.workdir
    if wd != sb.spec.workdir:
        # Every backend creates its spec's workdir when it starts; only another one needs creating (and a
        # local sandbox without isolation would create it on the host, so give it the task's spec).
        r = await sb.exec(f"mkdir -p {shlex.quote(wd)}", cwd="/", timeout=60)
        if not r.ok:
            raise SandboxError(f"cannot create the workdir {wd}: {r.stderr.strip()[-300:]}")
    if task.workspace_dir is not None:
        await sb.upload_dir(task.workspace_dir, wd)
    if user is not None:
        await sb.exec(f"chown -R {shlex.quote(user)} {shlex.quote(wd)}", cwd="/", timeout=120)
