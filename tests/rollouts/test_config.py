"""EpisodeConfig and RunConfig: every entry point's settings, declared and checked in one place."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RolloutSource, RunConfig
from ares_gateway.episodes.config import configs_from
from ares_gateway.episodes.executor import LocalExecutor, start_executor
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.helpers import cli, left_behind
from tests.rollouts.e2e import REPO

TASKS = load_dataset("examples").tasks


@pytest.mark.parametrize(("make", "says"), [
    (lambda: EpisodeConfig(""), "harness must be a harness name"),
    (lambda: EpisodeConfig("tiny-agent", sandbox=""), "sandbox must be a backend name"),
    (lambda: EpisodeConfig("tiny-agent", step_limit=0), "step_limit must be a whole number"),
    (lambda: EpisodeConfig("tiny-agent", step_limit=True), "step_limit must be a whole number"),
    (lambda: EpisodeConfig("tiny-agent", time_limit=0), "time_limit must be positive seconds"),
    (lambda: RunConfig(concurrency=0), "concurrency must be an integer of at least 1"),
    (lambda: RunConfig(attempts=1.5), "attempts must be an integer of at least 1"),
    (lambda: RunConfig(retries=-1), "retries must be 0 or more"),
    (lambda: RunConfig(retry_backoff=-1.0), "retry_backoff must be 0 or more"),
    (lambda: RunConfig(warm=-1), "warm must be a whole number"),
    (lambda: RunConfig(warm=2, executor=LocalExecutor()), "pass warm= to the executor"),
    (lambda: RunConfig(stats_period=-1.0), "stats_period must be 0 or more seconds"),
])
def test_a_bad_setting_is_refused_when_the_config_is_made(make: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        make()


def test_configs_are_frozen_and_keep_their_own_copy_of_the_harness_options() -> None:
    options = {"command_timeout": 5}
    ep = EpisodeConfig("tiny-agent", options)
    options["command_timeout"] = 99
    assert ep.harness_options == {"command_timeout": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ep.sandbox = "docker"  # type: ignore[misc]
    assert dataclasses.replace(ep, sandbox="docker").sandbox == "docker" and ep.sandbox == "auto"
    run = RunConfig()
    assert run.resolved(save_workspaces=False, stats="null") == dataclasses.replace(
        run, save_workspaces=False, stats="null")
    assert RunConfig(save_workspaces=True, stats="logging").resolved(save_workspaces=False, stats="null") == \
        RunConfig(save_workspaces=True, stats="logging")


def test_flat_keywords_map_onto_the_configs_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"run_rollouts\(harness=, concurrency=\) is deprecated"):
        ep, run = configs_from("run_rollouts", None, None, {"harness": "tiny-agent", "concurrency": 3})
    assert ep == EpisodeConfig("tiny-agent") and run == RunConfig(concurrency=3)
    # Over given configs, and over the entry point's own defaults.
    with pytest.warns(DeprecationWarning):
        ep, run = configs_from("x", EpisodeConfig("tiny-agent", step_limit=4), RunConfig(attempts=2),
                               {"sandbox": "local", "retries": 0})
    assert ep == EpisodeConfig("tiny-agent", sandbox="local", step_limit=4)
    assert run == RunConfig(attempts=2, retries=0)
    ep, _ = configs_from("rollout_func", None, None, {},
                         episode_default={"harness": "mini-swe-agent", "sandbox": "local", "step_limit": 20})
    assert ep == EpisodeConfig("mini-swe-agent", sandbox="local", step_limit=20)
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) 'concurency'"):
        configs_from("run_rollouts", None, None, {"harness": "tiny-agent", "concurency": 2})
    with pytest.raises(TypeError, match=r"needs episode=EpisodeConfig\(harness=\.\.\.\)"):
        configs_from("run_rollouts", None, None, {})


async def test_flat_keywords_and_configs_run_the_same_episodes(tmp_path: Path, sandbox_root: Path) -> None:
    tasks = TASKS[:2]
    runs: list[dict[str, Any]] = []
    for how in ("configs", "flat"):
        out = tmp_path / how
        if how == "configs":
            summary = await run_rollouts(tasks, policy=make_policy("oracle"),
                                         episode=EpisodeConfig("tiny-agent", sandbox="local", step_limit=10),
                                         run=RunConfig(concurrency=2, attempts=2, out=out, stats="null"))
        else:
            with pytest.warns(DeprecationWarning, match="is deprecated"):
                summary = await run_rollouts(tasks, harness="tiny-agent", policy=make_policy("oracle"),
                                             sandbox="local", step_limit=10, concurrency=2, attempts=2,
                                             out=out, stats="null")
        assert [e.reward for e in summary.episodes] == [1.0] * 4, [e.error for e in summary.episodes]
        runs.append(json.loads((out / "results.json").read_text())["run"])
    keys = ("harness", "sandbox", "concurrency", "attempts", "step_limit", "time_limit", "tasks", "retries",
            "save_workspaces", "image", "warm")
    assert {k: runs[0][k] for k in keys} == {k: runs[1][k] for k in keys}
    assert runs[0]["sandbox"] == "local" and runs[0]["attempts"] == 2 and runs[0]["save_workspaces"] is True
    assert left_behind(sandbox_root) == []


def test_a_rollout_source_refuses_a_warm_pool() -> None:
    with pytest.raises(ValueError, match="RolloutSource does not set episodes up ahead"):
        RolloutSource(TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent"),
                      run=RunConfig(warm=2))


async def test_an_executor_whose_start_takes_the_settings_one_by_one_still_starts_with_a_warning() -> None:
    calls: list[Any] = []

    class OldStart:
        async def start(self, *, harness: str, tasks: Any, policy: Any, time_limit: float | None,
                        sandbox: str = "auto", image: str | None = None) -> None:
            calls.append((harness, time_limit, sandbox, image))

    class NewStart:
        async def start(self, *, tasks: Any, policy: Any, episode: EpisodeConfig) -> None:
            calls.append(episode)

    ep = EpisodeConfig("tiny-agent", sandbox="local", time_limit=30)
    with pytest.warns(DeprecationWarning, match=r"OldStart.start\(harness=.*\) is deprecated"):
        await start_executor(OldStart(), tasks=TASKS, policy=make_policy("oracle"),  # type: ignore[arg-type]
                             episode=ep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await start_executor(NewStart(), tasks=TASKS, policy=make_policy("oracle"),  # type: ignore[arg-type]
                             episode=ep)
    assert calls == [("tiny-agent", 30, "local", None), ep]


@pytest.mark.parametrize(("flags", "says"), [
    (("-n", "0"), "-n and --attempts must be at least 1"),
    (("--attempts", "0"), "-n and --attempts must be at least 1"),
    (("--step-limit", "0"), "--step-limit must be at least 1"),
    (("--time-limit", "-5"), "--time-limit must be a positive number of seconds"),
    (("--time-limit", "nan"), "--time-limit must be a positive number of seconds"),
    (("--retries", "-1"), "--retries must be at least 0"),
])
def test_run_refuses_a_bad_setting_by_its_flag_before_anything_starts(flags: tuple[str, ...], says: str,
                                                                       tmp_path: Path) -> None:
    bad = subprocess.run(cli("run", "examples-tiny", "--policy", "oracle", "--sandbox", "local", *flags,
                             "--out", str(tmp_path / "o")),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and says in bad.stderr, (bad.returncode, bad.stderr[-500:])
    assert not (tmp_path / "o").exists()  # refused before the run wrote anything
