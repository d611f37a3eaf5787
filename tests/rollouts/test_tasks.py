"""Task and dataset loading (with errors that name the file and the fix) and reward parsing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import sandbox
from ares_gateway.episodes.tasks import (
    DEFAULT_VERIFIER_DIR,
    Dataset,
    DatasetError,
    MissingTaskFileError,
    RewardError,
    Task,
    TaskConfigError,
    TaskError,
    TaskNotFoundError,
    examples_dir,
    load_dataset,
    parse_task_config,
    register_dataset,
    registered_datasets,
)
from ares_gateway.episodes.verifier import Reward, parse_reward, read_reward, run_tests, task_paths


def make_task(root: Path, name: str = "t1", *, toml: str = 'version = "1.0"\n',
              test: str = "echo 1 > \"$ARES_VERIFIER_DIR/reward.txt\"\n") -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "task.toml").write_text(toml)
    (d / "tests" / "test.sh").write_text(test)
    return d


# ---------------------------------------------------------------- loading


def test_examples_dataset() -> None:
    ds = load_dataset("examples")
    assert ds.name == "examples" and ds.path == examples_dir().resolve()
    assert ds.names == sorted(ds.names) and len(ds) == 4
    assert set(ds.names) == {"fix-median-bug", "make-slug-tests-pass", "summarize-sales-csv",
                             "write-greeting-file"}
    for task in ds:
        assert task.instruction.strip() and task.has_solution and not task.needs_image
        assert task.workdir == "/workspace"
        assert task.config.verifier_timeout <= 60 and task.config.agent_timeout >= 120
        assert task.config.metadata["author_name"] == "ares-gateway"
    fix = ds.task("fix-median-bug")
    assert fix.workspace_dir is not None and (fix.workspace_dir / "stats.py").is_file()
    assert fix.config.cpus == 1.0 and fix.config.memory_mb == 1024
    spec = fix.sandbox_spec(default_image="img:1")
    assert spec.image == "img:1" and spec.workdir == "/workspace" and spec.resources.memory_bytes == 1024**3
    assert spec.labels["ares-gateway.task"] == "fix-median-bug"
    assert hash(fix) == hash(Task.load(fix.path)) and fix == Task.load(fix.path)
    assert "examples" in registered_datasets()
    with pytest.raises(DatasetError, match="has no task 'nope'; it has: fix-median-bug"):
        ds.task("nope")


def test_full_harbor_config(tmp_path: Path) -> None:
    cfg = parse_task_config(
        """
version = "1.0"
[metadata]
difficulty = "hard"
tags = ["a"]
[agent]
timeout_sec = 900.0
user = "agent"
[verifier]
timeout_sec = 120
env = { API_KEY = "k" }
[environment]
build_timeout_sec = 300.0
cpus = 2
memory = "4G"
storage_mb = 10240
gpus = 1
allow_internet = false
docker_image = "python:3.12-slim"
workdir = "/app"
[solution]
env = { X = "1" }
"""
    )
    assert cfg.agent_timeout == 900.0 and cfg.agent_user == "agent" and cfg.verifier_timeout == 120.0
    assert dict(cfg.verifier_env) == {"API_KEY": "k"} and dict(cfg.solution_env) == {"X": "1"}
    assert (cfg.cpus, cfg.memory_mb, cfg.storage_mb, cfg.gpus) == (2.0, 4096, 10240, 1)
    assert cfg.allow_internet is False and cfg.docker_image == "python:3.12-slim" and cfg.workdir == "/app"
    assert cfg.metadata["difficulty"] == "hard" and cfg.raw["environment"]["cpus"] == 2
    defaults = parse_task_config("")
    assert defaults.agent_timeout == 600.0 and defaults.verifier_timeout == 600.0 and defaults.workdir is None


def test_workdir_from_dockerfile(tmp_path: Path) -> None:
    d = make_task(tmp_path)
    (d / "environment").mkdir()
    (d / "environment" / "Dockerfile").write_text("FROM debian\nWORKDIR /src\nRUN true\nWORKDIR /app\n")
    task = Task.load(d)
    assert task.workdir == "/app" and task.needs_image
    spec = task.sandbox_spec(default_image="ignored")
    assert spec.image is None and spec.dockerfile == d.resolve() / "environment" / "Dockerfile"
    assert spec.build_context == d.resolve() / "environment"


@pytest.mark.parametrize(
    ("remove", "cls", "message"),
    [
        ("instruction.md", MissingTaskFileError, r"instruction.md is missing: write the task's prompt"),
        ("task.toml", MissingTaskFileError, r"task.toml is missing: add one"),
        ("tests/test.sh", MissingTaskFileError,
         r"tests/test.sh is missing: the verifier must be tests/test.sh"),
    ],
)
def test_missing_files_name_the_file_and_the_fix(tmp_path: Path, remove: str, cls: type[TaskError],
                                                 message: str) -> None:
    d = make_task(tmp_path)
    (d / remove).unlink()
    with pytest.raises(cls, match=message) as err:
        Task.load(d)
    assert err.value.path == d.resolve() / remove
    # The same error surfaces when the task is part of a dataset.
    with pytest.raises(cls, match=message):
        Dataset.from_dir(tmp_path)


def test_empty_instruction(tmp_path: Path) -> None:
    d = make_task(tmp_path)
    (d / "instruction.md").write_text("  \n")
    with pytest.raises(MissingTaskFileError, match=r"instruction\.md is empty"):
        Task.load(d)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("version = \n", r"task.toml is not valid TOML: .*line 1.*fix the syntax"),
        ("[agent\ntimeout_sec = 1\n", r"is not valid TOML"),
        ("[agent]\ntimeout_sec = \"ten\"\n", r"\[agent\] timeout_sec must be a positive number, got 'ten'"),
        ("[agent]\ntimeout_sec = -1\n", r"\[agent\] timeout_sec must be a positive number, got -1"),
        ("[verifier]\nenv = { A = 1 }\n", r"\[verifier\] env must be a table of strings"),
        ("[environment]\nmemory = \"lots\"\n", r"\[environment\] memory must be a size like \"512M\""),
        ("[environment]\ncpus = true\n", r"\[environment\] cpus must be a positive number"),
        ("[environment]\nworkdir = \"app\"\n", r"\[environment\] workdir must be an absolute path"),
        ("[environment]\nallow_internet = \"no\"\n", r"allow_internet must be true or false"),
        ("agent = 3\n", r"\[agent\] must be a table"),
        ("version = 1\n", r"version must be a string"),
    ],
)
def test_bad_toml_names_the_file_and_key(tmp_path: Path, toml: str, message: str) -> None:
    d = make_task(tmp_path, toml=toml)
    with pytest.raises(TaskConfigError, match=message) as err:
        Task.load(d)
    assert str(d.resolve() / "task.toml") in str(err.value)


def test_dataset_directory_rules(tmp_path: Path) -> None:
    with pytest.raises(TaskNotFoundError, match="does not exist"):
        Dataset.from_dir(tmp_path / "nope")
    with pytest.raises(DatasetError, match="no tasks in"):
        Dataset.from_dir(tmp_path)
    make_task(tmp_path, "b")
    make_task(tmp_path, "a")
    (tmp_path / "notes").mkdir()  # not a task: skipped
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("x")
    ds = Dataset.from_dir(tmp_path, name="mine")
    assert ds.name == "mine" and ds.names == ["a", "b"] and ds[0].name == "a" and [t.name
                                                                                   for t in ds[0:1]] == ["a"]
    # A single task directory is a one-task dataset.
    assert Dataset.from_dir(tmp_path / "b").names == ["b"]
    # Registry entries and plain paths.
    register_dataset("rollouts-test-ds", tmp_path, replace=True)
    assert load_dataset("rollouts-test-ds").names == ["a", "b"]
    assert load_dataset(str(tmp_path)).names == ["a", "b"]
    with pytest.raises(DatasetError, match="unknown dataset 'nope-ds': use a registered name"):
        load_dataset("nope-ds")
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("examples", tmp_path)
    with pytest.raises(TaskNotFoundError, match="is not a task directory"):
        Task.load(tmp_path / "missing")


# ---------------------------------------------------------------- rewards


def test_parse_reward() -> None:
    r = parse_reward(reward_json='{"tests": 1, "lint": 0.5, "style": 0}')
    assert r.value == pytest.approx(0.5) and dict(r.parts) == {"tests": 1.0, "lint": 0.5, "style": 0.0}
    assert r.source == "reward.json"
    assert parse_reward(reward_txt="1\n") == Reward(1.0, {}, "reward.txt")
    assert parse_reward(reward_txt=b" 0.25 ").value == 0.25
    assert parse_reward(reward_json="0.75").value == 0.75
    # reward.json wins over reward.txt.
    assert parse_reward(reward_json='{"a": 0}', reward_txt="1").value == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "neither reward.json nor reward.txt"),
        ({"reward_json": "{"}, "reward.json is not JSON"),
        ({"reward_json": "{}"}, "empty object"),
        ({"reward_json": '{"a": "high"}'}, r"reward.json\['a'\] must be a number"),
        ({"reward_json": '{"a": true}'}, r"must be a number"),
        ({"reward_json": '{"a": NaN}'}, r"must be finite"),
        ({"reward_json": "[1]"}, r"must be a number"),
        ({"reward_txt": "pass"}, r"reward.txt must hold one number, got 'pass'"),
        ({"reward_txt": ""}, r"reward.txt must hold one number"),
        ({"reward_txt": "inf"}, r"must be finite"),
    ],
)
def test_bad_rewards(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(RewardError, match=message):
        parse_reward(**kwargs)


async def test_read_reward_from_a_sandbox(tmp_path: Path) -> None:
    async with sandbox.LocalSandbox(sandbox.SandboxSpec()) as sb:
        d = task_paths(sb).verifier_dir
        with pytest.raises(RewardError, match=r"neither reward\.json nor reward\.txt"):
            await read_reward(sb, d)
        await sb.exec(f"mkdir -p {d} && echo 0.5 > {d}/reward.txt")
        assert await read_reward(sb, d) == Reward(0.5, {}, "reward.txt")
        await sb.exec(f"""printf '{{"a": 1, "b": 0}}' > {d}/reward.json""")
        assert (await read_reward(sb, d)).parts == {"a": 1.0, "b": 0.0}
    assert task_paths(sb).verifier_dir != DEFAULT_VERIFIER_DIR  # local: never the host's /logs


async def test_run_tests_never_raises(tmp_path: Path) -> None:
    """A verifier that writes nothing, writes garbage, or hangs gives 0.0 with the reason."""
    cases = {
        "silent": ("true\n", "neither reward.json nor reward.txt"),
        "garbage": ('echo nope > "$ARES_VERIFIER_DIR/reward.txt"; exit 1\n',
                    "must hold one number.*exit code 1"),
        "hangs": ("sleep 30\n", "timed out"),
        "fails-with-reward": ('echo 0 > "$ARES_VERIFIER_DIR/reward.txt"; exit 1\n', None),
    }
    for name, (script, error) in cases.items():
        task = Task.load(make_task(tmp_path, name, toml="[verifier]\ntimeout_sec = 2\n", test=script))
        async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
            result = await run_tests(sb, task)
        assert result.reward.value == 0.0
        if error is None:
            assert (result.ok and result.reward.source == "reward.txt" and result.script
                    and result.script.exit_code == 1)
        else:
            assert result.error is not None and not result.ok
            import re

            assert re.search(error, result.error), result.error


def test_examples_dir_is_bundled() -> None:
    # The examples must stay self-contained: POSIX sh + python3, no network tools.
    for script in examples_dir().glob("*/*/*.sh"):
        text = script.read_text()
        assert not any(tool in text for tool in ("curl ", "wget ", "pip install", "apt-get")), script
    assert shutil.which("python3")
