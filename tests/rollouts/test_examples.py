"""The bundled example tasks in a real LocalSandbox: solve.sh then test.sh gives 1.0; test.sh alone 0.0."""

from __future__ import annotations

import pytest

import sandbox
from ares_gateway.episodes.tasks import Task, load_dataset, prepare_workdir
from ares_gateway.episodes.verifier import run_solution, run_tests

TASKS = load_dataset("examples").tasks


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
async def test_solution_scores_one(task: Task) -> None:
    async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
        await prepare_workdir(sb, task)
        solved = await run_solution(sb, task)
        assert solved.ok, (solved.stdout, solved.stderr)
        result = await run_tests(sb, task)
    assert result.error is None, result
    assert result.reward.value == 1.0, result
    assert all(v == 1.0 for v in result.reward.parts.values())


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
async def test_unsolved_scores_zero(task: Task) -> None:
    async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
        await prepare_workdir(sb, task)
        result = await run_tests(sb, task)
    assert result.error is None, result
    assert result.reward.value == 0.0, result


async def test_partial_credit_is_the_mean_of_parts() -> None:
    """summarize-sales-csv: valid JSON with the right regions but wrong totals -> 2 of 3 parts."""
    task = load_dataset("examples").task("summarize-sales-csv")
    async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
        await prepare_workdir(sb, task)
        await sb.exec("""printf '{"north": 1, "south": 1, "east": 1, "west": 1}' > summary.json""")
        result = await run_tests(sb, task)
    assert dict(result.reward.parts) == {"valid_json": 1.0, "regions": 1.0, "totals": 0.0}
    assert result.reward.value == pytest.approx(2 / 3)


async def test_editing_the_visible_tests_does_not_help() -> None:
    task = load_dataset("examples").task("make-slug-tests-pass")
    async with sandbox.LocalSandbox(task.sandbox_spec()) as sb:
        await prepare_workdir(sb, task)
        await sb.exec("printf 'import unittest\\n' > test_slug.py")
        result = await run_tests(sb, task)
    assert result.reward.value == 0.0


@pytest.mark.parametrize("isolate", [False, True])
async def test_with_and_without_bubblewrap(isolate: bool) -> None:
    if isolate and not sandbox.local.bwrap_available():
        pytest.skip("bubblewrap is not usable here (apt-get install bubblewrap)")
    task = load_dataset("examples").task("write-greeting-file")
    spec = task.sandbox_spec()
    if not isolate:
        spec.network = "host"  # network "none" (the task's default) needs bubblewrap
    async with sandbox.LocalSandbox(spec, isolate=isolate) as sb:
        await prepare_workdir(sb, task)
        assert (await run_solution(sb, task)).ok
        assert (await run_tests(sb, task)).reward.value == 1.0
