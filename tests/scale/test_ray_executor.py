"""RayExecutor and ``ares-gateway run --ray`` on a real Ray cluster of simulated nodes on this machine.

Ray stays on loopback: tests/conftest.py sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is
imported, every node is started with ``node_ip_address="127.0.0.1"``, and each cluster asserts it held.
Each node carries a custom resource of its own name, so where episodes ran can be asserted.

* the oracle with the real mini-swe-agent on the 4 bundled tasks x 2 attempts: every node ran
  episodes, every reward 1.0, the same OUT files and sample shapes as a :class:`LocalExecutor` run;
* warm pools: each node runs the episodes it set up ahead;
* faults: a node's actor killed, and a whole node removed, mid-run: every planned episode finishes
  exactly once and no sandbox is left; a cluster where no node can run the sandboxes: an error before
  any episode;
* the CLI: ``run --ray ADDRESS`` against the running cluster, Ctrl-C during it, SIGKILL of the driver
  followed by ``gc --ray``, and ``--ray`` without Ray installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.helpers import cli, left_behind, wait_while_running
from tests.prereq import require
from tests.rollouts.e2e import REPO, require_mini

pytestmark = pytest.mark.slow

TASKS = load_dataset("examples").tasks


def _start_cluster(sandbox_root: Path) -> Any:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except Exception as exc:
        require(False, f"ray is not installed ({exc}): python3 -m pip install -e '.[ray]'")
    # The workers inherit this process's environment: their sandboxes go under sandbox_root.
    os.environ["ARES_SANDBOX_LOCAL_ROOT"] = str(sandbox_root)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node-a": 1},
                                                      "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"node-b": 1}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback held
    return c


def _stop_cluster(c: Any) -> None:
    import ray

    ray.shutdown()
    c.shutdown()


@pytest.fixture
def sandbox_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "sandboxes"
    before = os.environ.get("ARES_SANDBOX_LOCAL_ROOT")
    yield root
    if before is None:
        os.environ.pop("ARES_SANDBOX_LOCAL_ROOT", None)
    else:
        os.environ["ARES_SANDBOX_LOCAL_ROOT"] = before


@pytest.fixture
def cluster(sandbox_root: Path) -> Iterator[Any]:
    c = _start_cluster(sandbox_root)
    try:
        yield c
    finally:
        _stop_cluster(c)


def _files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "tb" not in p.parts}


def _node_names() -> dict[str, str]:
    """Node id -> the custom resource naming it (node-a, node-b)."""
    import ray

    return {n["NodeID"]: next(r for r in n["Resources"] if r.startswith("node-")) for n in ray.nodes()
            if n["Alive"]}


def _sample_shape(line: str) -> tuple[Any, ...]:
    s = json.loads(line)
    return (sorted(s), len(s.get("tokens") or []), sum(s.get("loss_mask") or []))


async def test_oracle_with_mini_swe_agent_on_two_nodes_gives_a_local_runs_outputs(
        cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    from ares_gateway.episodes.ray import RayExecutor

    require_mini()
    names = _node_names()
    ex = RayExecutor(per_node=2)
    summary = await run_rollouts(
        TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("mini-swe-agent", sandbox="local"),
        run=RunConfig(attempts=2, out=tmp_path / "ray", executor=ex, stats="null"),
    )
    assert len(summary.episodes) == 8 and all(e.reward == 1.0 for e in summary.episodes), summary.episodes
    assert len({e.key for e in summary.episodes}) == 8
    nodes = {e.node for e in summary.episodes}
    assert {names[n] for n in nodes if n} == {"node-a", "node-b"}  # both nodes ran episodes
    doc = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert doc["run"]["executor"] == "ray" and {e["node"] for e in doc["episodes"]} == nodes
    lines = [json.loads(x) for x in (tmp_path / "ray" / "episodes.jsonl").read_text().splitlines()]
    assert {x["node"] for x in lines} == nodes

    local = await run_rollouts(
        TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("mini-swe-agent", sandbox="local"),
        run=RunConfig(attempts=2, out=tmp_path / "local", concurrency=4, stats="null"),
    )
    assert all(e.reward == 1.0 for e in local.episodes)
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")
    for e in local.episodes:
        key = f"{e.task}.{e.attempt}"
        ours = (tmp_path / "ray" / "trajectories" / f"{key}.jsonl").read_text().splitlines()
        theirs = (tmp_path / "local" / "trajectories" / f"{key}.jsonl").read_text().splitlines()
        assert [_sample_shape(x) for x in ours] == [_sample_shape(x) for x in theirs]
    assert left_behind(sandbox_root) == []


async def test_warm_pools_on_each_node_set_up_the_episodes_they_run(
        cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    """``RayExecutor(warm=2)``: the driver hands each node the next planned episodes, the node sets them
    up while it runs others and runs them itself: every episode warm, every reward 1.0, nothing left."""
    from ares_gateway.episodes.ray import RayExecutor

    names = _node_names()
    ex = RayExecutor(per_node=1, warm=2)
    summary = await run_rollouts(
        TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(attempts=2, executor=ex, stats="null", out=tmp_path / "ray"),
    )
    assert sorted(e.key for e in summary.episodes) == sorted(f"{t.name}.{a}" for t in TASKS for a in (0, 1))
    assert all(e.reward == 1.0 and e.warm for e in summary.episodes), summary.episodes
    assert {names[e.node] for e in summary.episodes if e.node} == {"node-a", "node-b"}
    assert json.loads((tmp_path / "ray" / "results.json").read_text())["run"]["warm"] == 2
    assert left_behind(sandbox_root) == []


async def test_a_dead_node_actor_reruns_its_episodes_elsewhere_once(cluster: Any, tmp_path: Path,
                                                                     sandbox_root: Path) -> None:
    import ray

    from ares_gateway.episodes.ray import RayExecutor

    ex = RayExecutor(per_node=2)
    killed: list[str] = []

    def on_episode(result: Any) -> None:
        if not killed:  # after the first finished episode, the other node's actor dies mid-run
            victim = next(n for n in ex.nodes if n != result.node)
            killed.append(victim)
            ray.kill(ex._actors[victim], no_restart=True)

    policy = make_policy("scripted", commands=["sleep 2"])
    summary = await run_rollouts(
        TASKS, policy=policy, on_episode=on_episode, episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(attempts=2, out=tmp_path / "run", executor=ex, stats="null"),
    )
    keys = [e.key for e in summary.episodes]
    assert sorted(keys) == sorted(f"{t.name}.{a}" for t in TASKS for a in (0, 1))  # each exactly once
    assert not summary.cancelled and all(e.exit_reason == "completed" for e in summary.episodes)
    # The episodes the dead actor was running ran again on the live node. (One it had finished just
    # before it died can still be recorded as its own: its result was in Ray's object store.)
    assert killed and ex.reruns
    assert all(e.node != killed[0] for e in summary.episodes if e.key in ex.reruns)
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert len(doc["episodes"]) == 8 and sorted(e["attempt"] for e in doc["episodes"]) == [0] * 4 + [1] * 4
    # The killed actor's sandboxes were removed at close (the sandbox janitor's own gc, on the live nodes):
    # at most two a rerun episode, the agent's and its grading sandbox (one killed while still setting up
    # had fewer), and none left.
    assert ex.lost == killed and len(ex.collected) <= 2 * len(ex.reruns)
    assert left_behind(sandbox_root) == []


async def test_a_removed_node_reruns_its_episodes_elsewhere_once(cluster: Any, tmp_path: Path,
                                                                  sandbox_root: Path) -> None:
    from ares_gateway.episodes.ray import RayExecutor

    names = _node_names()
    worker = next(n for n in cluster.worker_nodes)  # node-b (the head carries the driver's connection)
    ex = RayExecutor(per_node=2)
    removed: list[str] = []

    def on_episode(result: Any) -> None:
        if not removed and len(left_behind(sandbox_root)) >= 2:  # node-b is running episodes now
            removed.append(next(n for n, name in names.items() if name == "node-b"))
            cluster.remove_node(worker, allow_graceful=False)

    policy = make_policy("scripted", commands=["sleep 3"])
    summary = await run_rollouts(
        TASKS, policy=policy, on_episode=on_episode, episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(attempts=2, out=tmp_path / "run", executor=ex, stats="null"),
    )
    assert removed, "node-b was never removed mid-run"
    keys = sorted(e.key for e in summary.episodes)
    assert keys == sorted(f"{t.name}.{a}" for t in TASKS for a in (0, 1))  # each exactly once
    assert all(e.exit_reason == "completed" for e in summary.episodes)
    assert ex.lost == removed and ex.reruns
    # Whatever finished after the loss ran on the head; nothing is recorded twice.
    lines = (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 8
    # The removed node's sandboxes (same disk here) were collected by the node still alive.
    assert left_behind(sandbox_root) == []


async def test_no_node_able_to_run_the_sandboxes_is_an_error_before_any_episode(
        cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    from ares_gateway.episodes.ray import NoNodesError, RayExecutor

    ex = RayExecutor(per_node=1)
    started: list[Any] = []
    with pytest.raises(NoNodesError) as err:
        await run_rollouts(
            TASKS, policy=make_policy("oracle"), on_episode=started.append,
            episode=EpisodeConfig("tiny-agent", sandbox="docker", image="ares-gateway/no-such-image:none"),
            run=RunConfig(out=tmp_path / "run", executor=ex, stats="null"),
        )
    message = str(err.value)
    assert "no node of the Ray cluster can run docker sandboxes" in message
    assert message.count("node ") >= 2 and ("no-such-image" in message or "Docker engine" in message), message
    assert started == [] and left_behind(sandbox_root) == []


async def test_task_folders_shipped_with_rays_working_dir(cluster: Any, tmp_path: Path,
                                                          sandbox_root: Path) -> None:
    """Tasks that exist only on the driver reach the nodes in Ray's runtime environment: the driver's
    folder is removed once the actors started, and every episode still finds its tests on its node."""
    import shutil

    from ares_gateway.episodes.ray import RayExecutor

    src = tmp_path / "tasks"
    shutil.copytree(TASKS[0].path.parent, src)
    tasks = load_dataset(str(src)).tasks

    class _Gone(RayExecutor):
        async def start(self, **kw: Any) -> None:
            await super().start(**kw)
            shutil.rmtree(src)  # from here on, only the nodes' copies exist

    import ray

    ray.shutdown()  # Ray ships a local working_dir with a job: the executor connects with it
    ex = _Gone(cluster.address, per_node=2, runtime_env={"working_dir": str(src)})
    summary = await run_rollouts(
        tasks, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(out=tmp_path / "run", executor=ex, stats="null"),
    )
    assert not src.exists()
    assert [e.reward for e in summary.episodes] == [1.0] * len(tasks), [(e.key, e.error)
                                                                        for e in summary.episodes]
    assert left_behind(sandbox_root) == []


async def test_an_external_policy_polls_each_nodes_gateway(cluster: Any, tmp_path: Path,
                                                           sandbox_root: Path) -> None:
    """The http policy on Ray: requests wait on each node's gateway, whose control URLs the executor lists;
    a trainer polling them all (with the admin token it gave) answers every episode."""
    import asyncio

    import aiohttp

    from ares_gateway.episodes.ray import RayExecutor
    from ares_gateway.policies import HttpPolicy

    token = "t0k3n-for-the-test-" + os.urandom(8).hex()
    ex = RayExecutor(per_node=2, admin_token=token)
    oracle = make_policy("oracle")
    by_name = {t.name: t for t in TASKS}
    answered: dict[str, int] = {}
    lines: list[str] = []

    async def poll(url: str) -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            while True:
                async with http.get(f"{url}/poll", params={"wait": "1", "max": "4"}) as r:
                    assert r.status == 200, await r.text()
                    items = await r.json()
                for item in items:
                    sid = item["session_id"]
                    if oracle.session_policy(sid) is None:
                        async with http.get(f"{url}/sessions/{sid}") as r:
                            meta = (await r.json()).get("metadata") or {}
                        oracle.bind(sid, agent="mini-swe-agent", task=by_name[meta["task"]])
                    answer = oracle.session_policy(sid)(item["request"], {})  # type: ignore[misc]
                    async with http.post(f"{url}/respond",
                                         json={"id": item["id"], "completion": answer}) as r:
                        assert r.status == 200, await r.text()
                    answered[url] = answered.get(url, 0) + 1

    async def trainer() -> None:
        while not ex.urls:  # noqa: ASYNC110 (the executor publishes them; a trainer polls, as here)
            await asyncio.sleep(0.1)
        lines.extend(ex.describe())
        await asyncio.gather(*(poll(u) for u in ex.urls.values()))

    poller = asyncio.create_task(trainer())
    try:
        summary = await run_rollouts(
            TASKS, policy=HttpPolicy(), episode=EpisodeConfig("tiny-agent", sandbox="local", time_limit=120),
            run=RunConfig(executor=ex, out=tmp_path / "run", stats="null"),
        )
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    assert [e.reward for e in summary.episodes] == [1.0] * len(TASKS), [
        (e.key, e.exit_reason, e.error) for e in summary.episodes]
    assert len(answered) == 2 and all(n >= 2 for n in answered.values())  # both nodes' gateways served turns
    assert sum(1 for line in lines if "requests wait on http://127.0.0.1:" in line) == 2
    assert not any(token in line for line in lines)
    assert left_behind(sandbox_root) == []


async def test_tito_on_in_process_llama_cpp_loads_one_model_per_node(cluster: Any, tmp_path: Path,
                                                                     sandbox_root: Path) -> None:
    """The tito policy on llama.cpp travels by value: each node's actor loads its own copy of the model and
    its episodes write token-faithful samples (ids, logprobs, loss mask) back to the driver's OUT."""
    require_mini()
    try:
        from ares_gateway.policies.tito import TitoPolicy
    except Exception as exc:  # the model extra
        require(False, f"the model extra is not installed ({exc})")
    from ares_gateway.episodes.ray import RayExecutor

    policy = TitoPolicy("llama-cpp", max_tokens=32, engine_options={"n_ctx": 4096, "n_threads": 1})
    ex = RayExecutor(per_node=1)
    tasks = TASKS[:2]
    summary = await run_rollouts(
        tasks, policy=policy,
        episode=EpisodeConfig(
            "mini-swe-agent", sandbox="local", step_limit=2,
            harness_options={"action_format": "text", "action_regex": r"\A(.+)\Z"},
        ),
        run=RunConfig(attempts=1, out=tmp_path / "run", executor=ex, stats="null"),
    )
    names = _node_names()
    assert [e.exit_reason for e in summary.episodes] == ["step_limit"] * 2, [(e.key, e.error)
                                                                             for e in summary.episodes]
    assert {names[e.node] for e in summary.episodes if e.node} == {"node-a", "node-b"}
    assert policy.engine._llm is None  # the driver's own copy never loaded a model: the nodes did
    for e in summary.episodes:
        assert e.fidelity and e.fidelity["turns"] == 2 and e.fidelity["trained_tokens"] > 0, e.fidelity
        samples = [json.loads(x)
                   for x in (tmp_path / "run" / "trajectories" / f"{e.key}.jsonl").read_text().splitlines()]
        trained = sum(sum(s["loss_mask"]) for s in samples)
        assert trained == e.fidelity["trained_tokens"]
        for s in samples:
            assert len(s["loss_mask"]) == len(s["logprobs"]) == s["response_length"] < len(s["tokens"])
            assert all(lp < 0 or m == 0 for lp, m in zip(s["logprobs"], s["loss_mask"], strict=True) if m)
    assert left_behind(sandbox_root) == []


# --- the CLI ------------------------------------------------------------------------------------------------


def _cli_env(sandbox_root: Path) -> dict[str, str]:
    return {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(sandbox_root), "PYTHONUNBUFFERED": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_cli_run_on_ray(cluster: Any, tmp_path: Path, sandbox_root: Path) -> None:
    require_mini()
    out = tmp_path / "out"
    proc = subprocess.run(cli("run", "examples-mswea", "--policy", "oracle", "--sandbox", "local", "-n", "4",
                              "--ray", cluster.address, "--ray-per-node", "2", "--stats", "null", "--out",
                              str(out)),
                          cwd=REPO, env=_cli_env(sandbox_root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on Ray" in proc.stdout and "ray: 2 node(s), 2 episode(s) each" in proc.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["run"]["executor"] == "ray" and doc["run"]["ray"] == cluster.address
    assert len(doc["episodes"]) == len(TASKS) and all(e["reward"] == 1.0 for e in doc["episodes"])
    assert len({e["node"] for e in doc["episodes"]}) == 2
    assert left_behind(sandbox_root) == []


def _wait_for_sandboxes(proc: subprocess.Popen[str], root: Path, n: int, timeout: float = 240) -> None:
    wait_while_running(proc, lambda: len(left_behind(root)) >= n, timeout=timeout,
                       what="the run's sandboxes did not come up")


def test_cli_ctrl_c_on_ray_stops_the_episodes_and_removes_their_sandboxes(cluster: Any, tmp_path: Path,
                                                                          sandbox_root: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(cli("run", "examples-tiny", "--policy", "scripted", "--command", "sleep 120",
                                "--sandbox", "local", "-n", "4", "--ray", cluster.address, "--ray-per-node",
                                "2", "--stats", "null", "--out", str(out)),
                            cwd=REPO, env=_cli_env(sandbox_root), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_sandboxes(proc, sandbox_root, 4)
        time.sleep(2)  # the agents are running their sleep
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=150)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert "SIGINT: stopping" in output and stopped_in < 60, (stopped_in, output[-2000:])
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["interrupted"] is True
    assert len(doc["episodes"]) + len(doc["summary"]["cancelled"]) == len(TASKS)
    assert left_behind(sandbox_root) == []  # each node's actor removed its sandboxes before the driver exited


def test_gc_on_ray_removes_what_a_killed_driver_left_on_the_nodes(cluster: Any, tmp_path: Path,
                                                                  sandbox_root: Path) -> None:
    proc = subprocess.Popen(cli("run", "examples-tiny", "--policy", "scripted", "--command", "sleep 120",
                                "--sandbox", "local", "-n", "4", "--ray", cluster.address, "--ray-per-node",
                                "2", "--stats", "null", "--out", str(tmp_path / "out")),
                            cwd=REPO, env=_cli_env(sandbox_root), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_sandboxes(proc, sandbox_root, 4)
        proc.send_signal(signal.SIGKILL)  # no chance to clean: Ray then kills the driver's actors
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The actors die with their driver, a moment later.
    deadline = time.monotonic() + 60
    while True:
        gc = subprocess.run(cli("gc", "--ray", cluster.address, "--backend", "local"), cwd=REPO,
                            env=_cli_env(sandbox_root), capture_output=True, text=True, timeout=180)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        if not left_behind(sandbox_root) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "removed" in gc.stdout and "on node" in gc.stdout, gc.stdout
    assert left_behind(sandbox_root) == [], gc.stdout


def test_cli_ray_without_ray_installed_names_the_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['ray'] = None\n"
            "from ares_gateway.cli import main\n"
            f"sys.exit(main(['run', 'examples-tiny', '--policy', 'oracle', '--sandbox', 'local', '--ray', "
            f"'--out', {str(tmp_path / 'out')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ares-gateway[ray]" in lines[0] and "--ray" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
