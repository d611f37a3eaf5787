"""The Kubernetes backend, driven by the real ``kubernetes_asyncio`` client against a stand-in API server
(bench/support/kube_fake.py) whose pods are bwrap namespaces with no network.

* the backend contract of tests/sandbox/test_contract.py (its tests, imported);
* what the client sends at the wire: the pod (labels, owner annotations, resources, no token) and an
  egress-deny NetworkPolicy that selects exactly that pod, created before it and deleted with it;
* kill_processes, gc of a dead owner's pod, the v4 fallback, clear errors that never show the token;
* the exec tunnel: the shared transport suite of tests/sandbox/test_tunnel.py over the exec WebSocket
  (v5 and v4), the fake cutting the WebSocket mid-response (the agent's retry succeeds), the tunnel's
  pings keeping the stream alive against an idle timeout, and reaching nothing but its own session;
* a live test behind ``ARES_K8S_LIVE=1`` and a kubeconfig.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sandbox
from ares_gateway import EpisodeConfig, RunConfig
from bench.support.kube_fake import PROTOCOLS, TOKEN, KubeFake, unavailable
from sandbox import SandboxSpec, janitor
from sandbox import kubernetes as kube
from sandbox.kubernetes import KubernetesSandbox
from sandbox.tunnel import Channel, Tunnel

from . import test_tunnel as _tunnel_tests
from .test_contract import (  # noqa: F401  (the contract, run here on this backend)
    test_async_with_removes_on_exception,
    test_background_process_outlives_its_exec_until_stop,
    test_cwd,
    test_detached_launch_returns_promptly_on_every_loop,
    test_directory_round_trip,
    test_env_from_spec_and_call,
    test_exit_code_stdout_stderr,
    test_large_binary_file_round_trip,
    test_list_command_is_quoted,
    test_missing_remote_file_is_a_clear_error,
    test_timeout_kills_the_process_group,
    test_use_before_start,
    test_user,
)
from .test_tunnel import (  # noqa: F401  (the shared transport suite, run over the exec WebSocket)
    CLIENT,
    HOSTILE,
    N_CONCURRENT,
    Harness,
    Session,
    _count_relays,
    test_hostile_relay_is_torn_down_with_bounded_memory,
    test_traffic_sse_big_body_all_bytes_and_64_concurrent_streams,
    test_transport_drop_mid_response_and_the_agents_retry_succeeds,
)

NAMESPACE = "ares-test"
IMAGE = "ares-gateway/agent-base:latest"  # the fake runs the host's system; the name is only sent
V4 = ("v4.channel.k8s.io",)
session = _tunnel_tests.session  # the shared suite's session fixture


@pytest.fixture(scope="module")
def kube_fake() -> Iterator[KubeFake]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    fake = KubeFake().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(kube_fake: KubeFake) -> Iterator[KubeFake]:
    yield kube_fake
    kube_fake.protocols, kube_fake.idle_timeout = PROTOCOLS, None


@pytest.fixture
def kubeconfig(kube_fake: KubeFake, tmp_path: Path) -> str:
    return kube_fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)


def _new(kubeconfig: str, **spec: Any) -> KubernetesSandbox:
    options = {k: spec.pop(k) for k in ("tunnel_ping_interval",) if k in spec}
    return KubernetesSandbox(SandboxSpec(**spec), kubeconfig=kubeconfig, namespace=NAMESPACE,
                             default_image=IMAGE, **options)


# -- the contract (tests imported from test_contract) ----------------------------------------------------

@pytest.fixture
def backend() -> str:
    return "kubernetes"


@pytest.fixture
async def make_sandbox(fake: KubeFake,
                       kubeconfig: str) -> AsyncIterator[Callable[..., Awaitable[KubernetesSandbox]]]:
    made: list[KubernetesSandbox] = []

    async def factory(start: bool = True, **kwargs: Any) -> KubernetesSandbox:
        sb = _new(kubeconfig, **kwargs)
        made.append(sb)
        if start:
            await sb.start()
        return sb

    yield factory
    for sb in made:
        await sb.stop()


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


async def test_pod_and_its_egress_deny_policy_at_the_wire(fake: KubeFake, kubeconfig: str) -> None:
    spec = {"network": "none", "env": {"A": "1"}, "labels": {"task": "t1", "bad": "a/b c"},
            "resources": sandbox.Resources(cpus=2, memory="3g", disk="10g", gpus=1)}
    before = len(fake.requests)
    a, b = _new(kubeconfig, **spec), _new(kubeconfig, **spec)
    await a.start()
    await b.start()
    try:
        pod = next(p for p in fake.created_pods if p["metadata"]["name"] == a.pod_name)
        meta, pspec = pod["metadata"], pod["spec"]
        [container] = pspec["containers"]
        assert container["image"] == IMAGE and {"name": "A", "value": "1"} in container["env"]
        assert container["resources"]["requests"] == {"cpu": "2", "memory": str(3 << 30),
                                                      "ephemeral-storage": str(10 << 30)}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pspec["automountServiceAccountToken"] is False and pspec["enableServiceLinks"] is False
        assert pspec["restartPolicy"] == "Never"
        assert meta["labels"][janitor.SANDBOX_LABEL] == a.id and meta["labels"]["task"] == "t1"
        assert "bad" not in meta["labels"]  # not a valid label value: an annotation only
        ann = meta["annotations"]
        assert ann[janitor.OWNER_LABEL] == janitor.owner_id() and ann["bad"] == "a/b c"
        assert ann[janitor.SESSION_LABEL] == janitor.session_id() and janitor.CREATED_LABEL in ann
        # The policy: all egress (and ingress) denied, selecting this pod and no other.
        policy = fake.policies[(NAMESPACE, kube.policy_name(a.pod_name))]["spec"]
        assert set(policy["policyTypes"]) == {"Egress", "Ingress"}
        assert not policy.get("egress") and not policy.get("ingress")
        selector = policy["podSelector"]["matchLabels"]
        pod_b = next(p for p in fake.created_pods if p["metadata"]["name"] == b.pod_name)
        assert _labels_match(selector, meta["labels"]) and not _labels_match(selector,
                                                                             pod_b["metadata"]["labels"])
        # Created before the pod.
        mine = [r for r in fake.requests[before:] if r.startswith("POST")]
        assert mine[0].endswith("/networkpolicies") and mine[1].endswith("/pods")
        assert "egress denied" in a.description
        # No interface but loopback inside (the fake's stand-in for the policy).
        r = await a.exec("tail -n +3 /proc/net/dev | cut -d: -f1", timeout=30)
        assert r.stdout.split() == ["lo"], r
    finally:
        await a.stop()
        await b.stop()
    assert fake.pod(a.pod_name) is None and fake.pod(b.pod_name) is None
    assert kube.policy_name(a.pod_name) in fake.deleted_policies
    assert (NAMESPACE, kube.policy_name(a.pod_name)) not in fake.policies
    assert not fake.unknown_routes, fake.unknown_routes


async def test_network_host_makes_no_policy(fake: KubeFake, kubeconfig: str) -> None:
    async with _new(kubeconfig) as sb:
        assert (NAMESPACE, kube.policy_name(sb.pod_name)) not in fake.policies
        assert fake.pod(sb.pod_name) is not None


async def test_stop_removes_the_pod_and_is_idempotent(fake: KubeFake, kubeconfig: str) -> None:
    sb = _new(kubeconfig, network="none")
    await sb.start()
    assert sb in janitor.live_sandboxes()
    await sb.stop()
    assert fake.pod(sb.pod_name) is None and (NAMESPACE, kube.policy_name(sb.pod_name)) not in fake.policies
    await sb.stop()
    # The synchronous path the janitor takes from atexit and signal handlers.
    sb2 = _new(kubeconfig, network="none")
    await sb2.start()
    sb2.stop_and_remove()
    assert fake.pod(sb2.pod_name) is None and (NAMESPACE, kube.policy_name(sb2.pod_name)) not in fake.policies
    assert sb2 not in janitor.live_sandboxes()
    with pytest.raises(sandbox.SandboxStateError, match="cannot be started again"):
        await sb2.start()


async def test_a_pod_that_cannot_start_is_a_clear_error_and_leaves_nothing(fake: KubeFake,
                                                                           kubeconfig: str) -> None:
    sb = KubernetesSandbox(SandboxSpec(image="registry.invalid/missing:1", network="none"),
                           kubeconfig=kubeconfig, namespace=NAMESPACE, start_timeout=20)
    with pytest.raises(sandbox.SandboxStartError, match="ErrImagePull"):
        await sb.start()
    assert sb.state == "stopped" and fake.pod(sb.pod_name) is None
    assert (NAMESPACE, kube.policy_name(sb.pod_name)) not in fake.policies


async def test_bad_input_and_missing_configuration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs an image"):
        KubernetesSandbox(SandboxSpec())
    with pytest.raises(ValueError, match="build and push"):
        KubernetesSandbox(SandboxSpec(dockerfile=tmp_path / "Dockerfile"))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nothing-here"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    sb = KubernetesSandbox(SandboxSpec(image="x"))
    with pytest.raises(sandbox.BackendUnavailableError, match="set KUBECONFIG"):
        await sb.start()


async def test_the_token_never_shows_in_errors_or_logs(fake: KubeFake, kubeconfig: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-secret-token-4d1e9a7c"
    bad = fake.write_kubeconfig(tmp_path / "bad", namespace=NAMESPACE, token=wrong)
    sb = _new(bad, network="none")
    with pytest.raises(sandbox.SandboxStartError) as info:
        await sb.start()
    assert "401" in str(info.value)
    async with _new(kubeconfig) as good:
        assert (await good.exec("echo $CALL_SECRET", env={"CALL_SECRET": "s3cr3t"},
                                timeout=30)).stdout == "s3cr3t\n"
        fake.call(_remove_pod(fake, good.pod_name))  # the pod goes away under the sandbox: exec fails clearly
        with pytest.raises(sandbox.ExecError, match="HTTP 404") as gone:
            await good.exec("echo hi", env={"CALL_SECRET": "s3cr3t"}, timeout=30)
    for text in (str(info.value), repr(info.value), str(gone.value), caplog.text):
        assert wrong not in text and TOKEN not in text
        # The command, and a call's env with it, travel in the exec URL: never shown.  (The spec's env
        # is in the pod's manifest, which the SDK logs at DEBUG like any API object.)
        assert "s3cr3t" not in text


async def _remove_pod(fake: KubeFake, name: str) -> None:
    pod = fake.pod(name)
    assert pod is not None
    await fake._remove(pod)


async def test_v4_fallback_runs_commands_and_moves_files(fake: KubeFake, kubeconfig: str,
                                                         tmp_path: Path) -> None:
    fake.protocols = V4
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(300_000) + bytes(range(256)))
    async with _new(kubeconfig) as sb:
        stream = await sb.open_exec(["cat"], stdin=True)
        assert not stream.can_close_stdin  # v4 has no half-close: only closing the stream ends stdin
        await stream.aclose()
        r = await sb.exec("echo out; echo err >&2; exit 4", timeout=30)
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 4)
        await sb.upload_file(src, "in.bin")
        await sb.download_file("in.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert fake.execs[-1][2] == "v4.channel.k8s.io"


async def test_v5_half_closes_stdin(fake: KubeFake, kubeconfig: str) -> None:
    """``cat`` ends only when its stdin does: the v5 close signal ([255, 0]) reached it."""
    data = os.urandom(500_000) + bytes(range(256))
    async with _new(kubeconfig) as sb:
        stream = await sb.open_exec(["cat"], stdin=True)
        try:
            assert stream.protocol == "v5.channel.k8s.io" and stream.can_close_stdin
            stream.write(data)
            stream.close_stdin()
            out, err, status = await asyncio.wait_for(stream.collect(), 30)
        finally:
            await stream.aclose()
        assert out == data and err == b"" and kube.exit_code(status) == 0


async def test_kill_processes_spares_pid_1_and_the_relays(fake: KubeFake, kubeconfig: str,
                                                          session: Session) -> None:
    async with _new(kubeconfig, network="none", forwards={18080: session.path}) as sb:
        for user in ("nobody", None):
            r = await sb.exec("setsid sh -c 'sleep 300' >/dev/null 2>&1 </dev/null & echo $!", user=user,
                              timeout=30)
            assert r.ok, r
        count = ("ps_count() { n=0; for d in /proc/[0-9]*; do case $(cat $d/comm 2>/dev/null) in sleep) "
                 "n=$((n+1));; esac; done; echo $n; }; ps_count")
        before = int((await sb.exec(count, timeout=30)).stdout)
        assert await sb.kill_processes(user="nobody") >= 1  # its sleep (and the sh above it)
        assert int((await sb.exec(count, timeout=30)).stdout) == before - 1
        assert await sb.kill_processes() >= 1
        # Left: the keeper's sleep only; the relay serves the port still.
        assert int((await sb.exec(count, timeout=30)).stdout) == 1
        r = await sb.exec(["python3", "-c", CLIENT, "18080", "traffic"], user="nobody", cwd="/", timeout=120)
        assert json.loads(r.stdout)["bytes"] == [200, True], r
        tunnel = sb.tunnel_for(18080)
        assert tunnel is not None and tunnel.channels_opened == 1
        with pytest.raises(sandbox.ExecError, match="no user"):
            await sb.kill_processes(user="no-such-user")


async def test_gc_removes_a_dead_owners_pod_and_keeps_a_live_ones(fake: KubeFake, kubeconfig: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import gc

    child = await asyncio.create_subprocess_exec("true")
    await child.wait()
    dead = {janitor.OWNER_LABEL: f"{socket.gethostname()}:{child.pid}:12345", janitor.SESSION_LABEL: "0" * 16}
    with monkeypatch.context() as m:
        m.setattr(janitor, "owner_labels", lambda: dict(dead))
        orphan = _new(kubeconfig, network="none")
        await orphan.start()
        # A policy whose pod was never created (its owner died in between) is garbage too.
        lonely = _new(kubeconfig, network="none")
        api = kube._sdk().client.ApiClient(await kube.load_configuration(kubeconfig))
        try:
            await kube._sdk().client.NetworkingV1Api(api).create_namespaced_network_policy(
                NAMESPACE, lonely.policy_manifest())
        finally:
            await api.close()
    janitor.unregister(orphan)  # as if its process had died
    live = _new(kubeconfig, network="none")
    await live.start()
    try:
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        monkeypatch.setenv("ARES_K8S_NAMESPACE", NAMESPACE)
        report = await asyncio.to_thread(gc.collect_garbage, ["kubernetes"])
        assert f"kubernetes:{NAMESPACE}/{orphan.pod_name}" in report.removed, report
        assert f"kubernetes:{NAMESPACE}/{lonely.pod_name}" in report.removed, report
        assert (NAMESPACE, kube.policy_name(lonely.pod_name)) not in fake.policies
        assert f"kubernetes:{NAMESPACE}/{live.pod_name}" in report.kept, report
        assert not report.errors, report.errors
        assert fake.pod(orphan.pod_name) is None
        assert (NAMESPACE, kube.policy_name(orphan.pod_name)) not in fake.policies
        assert fake.pod(live.pod_name) is not None
    finally:
        await live.stop()
        await orphan.stop()  # already gone: harmless


# -- the exec tunnel ----------------------------------------------------------------------------------

class KubeHarness(Harness):
    """A ``network="none"`` pod of the fake; clients run in it as ``nobody``."""

    kind = "kubernetes"

    def __init__(self, kubeconfig: str, **options: Any) -> None:
        self.kubeconfig, self.options = kubeconfig, options
        self.port = 18080
        self.sb: KubernetesSandbox | None = None

    async def _started(self, forwards: dict[int, str]) -> KubernetesSandbox:
        self.sb = _new(self.kubeconfig, network="none", forwards=forwards, **self.options)
        await self.sb.start()
        return self.sb

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        sb = await self._started({self.port: session.path})
        tunnel = sb.tunnel_for(self.port)
        assert tunnel is not None
        return tunnel

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        async def opener() -> Channel:
            sb = self.sb or await self._started({})
            return await sb.open_exec_channel(["python3", "-c", HOSTILE, mode, "binary"])

        return opener

    async def client(self, what: str) -> dict[str, Any]:
        assert self.sb is not None
        r = await self.sb.exec(["python3", "-c", CLIENT, str(self.port), what], user="nobody", cwd="/",
                               timeout=180)
        assert r.ok, r
        return dict(json.loads(r.stdout))

    async def close(self) -> None:
        if self.sb is not None:
            await self.sb.stop()


@pytest.fixture(params=["v5", "v4"])
async def harness(request: pytest.FixtureRequest, fake: KubeFake,
                  kubeconfig: str) -> AsyncIterator[KubeHarness]:
    fake.protocols = PROTOCOLS if request.param == "v5" else V4
    # The SDK's first import (some 30 MB of API models) happens here, not inside the hostile test's
    # memory window (whose pod starts only with its first channel): a cost per process, not per channel.
    kube._ws_client_class()
    h = KubeHarness(kubeconfig)
    yield h
    await h.close()


async def test_the_fake_cutting_the_websocket_mid_response_and_the_agents_retry_succeeds(
    fake: KubeFake, kubeconfig: str, session: Session
) -> None:
    h = KubeHarness(kubeconfig)
    try:
        tunnel = await h.open_tunnel(session)
        assert h.sb is not None
        call = asyncio.ensure_future(h.client("retry"))
        await asyncio.wait_for(session.first_chat_started.wait(), 60)
        # the tunnel's WebSocket goes, no close frame
        assert fake.drop_execs(h.sb.pod_name, running="relay.py") == 1
        result = await asyncio.wait_for(call, 120)
        assert result["answer"] == "hello after retry" and result["attempts"] >= 2, result
        assert session.chat_calls >= 2
        assert tunnel.channels_opened >= 2 and tunnel.running and tunnel.violation is None
        r = await h.sb.exec(_count_relays(h.port), user="root", cwd="/", timeout=30)
        assert r.stdout.strip() == "1", r  # the dropped channel's relay ended (its stdin did)
    finally:
        await h.close()


async def test_the_tunnels_pings_keep_the_stream_alive_against_an_idle_timeout(
    fake: KubeFake, kubeconfig: str, session: Session
) -> None:
    """The apiserver's exec stream deadline is reset only by what the client sends; the tunnel's pings
    are such messages.  With pings well inside the timeout the channel stays; without, it is cut."""
    pinging = KubeHarness(kubeconfig, tunnel_ping_interval=0.25)
    quiet = KubeHarness(kubeconfig, tunnel_ping_interval=60)
    try:
        kept, cut = await pinging.open_tunnel(session), await quiet.open_tunnel(session)
        fake.idle_timeout = 1.0
        await asyncio.sleep(3.5)
        assert kept.channels_opened == 1 and kept.running, kept.last_reason
        assert cut.channels_opened >= 2 or (cut.last_reason and "ended" in cut.last_reason), cut.last_reason
        assert fake.idle_cuts >= 1
        fake.idle_timeout = None
        got = await pinging.client("traffic")
        assert got["bytes"] == [200, True] and got["concurrent"] == N_CONCURRENT
        assert kept.channels_opened == 1
    finally:
        fake.idle_timeout = None
        await pinging.close()
        await quiet.close()


async def test_a_pod_reaches_only_its_own_session(fake: KubeFake, kubeconfig: str, session: Session) -> None:
    probe = ("import socket,sys\ns=socket.socket(); s.settimeout(3)\n"
             "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
             "except OSError as e: print('failed', type(e).__name__)\n")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    h = KubeHarness(kubeconfig)
    try:
        await h.open_tunnel(session)
        sb = h.sb
        assert sb is not None
        for addr, port in (("127.0.0.1", host.getsockname()[1]), ("127.0.0.1", fake.port), ("10.0.0.1", 80)):
            r = await sb.exec(["python3", "-c", probe, addr, str(port)], user="nobody", timeout=30)
            assert r.stdout.startswith("failed"), (addr, port, r)
        r = await sb.exec(["python3", "-c", probe, "127.0.0.1", str(h.port)], user="nobody", timeout=30)
        assert r.stdout.strip() == "connected", r
        # Nothing of the host's socket directory inside; the agent cannot kill the root relay.
        r = await sb.exec(f"ls {session.dir}", user="nobody", timeout=30)
        assert not r.ok
        r = await sb.exec(f"kill -9 $(cat /.ares/relay-{h.port}.pid)", user="nobody", timeout=30)
        assert not r.ok
        # Another port after start reaches another session, and only that one.
        other = Session()
        await other.start()
        try:
            await sb.forward(h.port + 1, other.path)
            r = await sb.exec(["python3", "-c", CLIENT, str(h.port + 1), "traffic"], user="nobody", cwd="/",
                              timeout=120)
            assert json.loads(r.stdout)["concurrent"] == N_CONCURRENT, r
            assert other.together.is_set() and not session.together.is_set()
            assert "exec tunnel" in sb.description
        finally:
            await other.stop()
        # Closing ends the relays (their stdin ends).
        await sb.stop()
        assert fake.pod(sb.pod_name) is None
    finally:
        host.close()
        await h.close()


# -- live ------------------------------------------------------------------------------------------------

def _live_missing() -> str | None:
    if os.environ.get("ARES_K8S_LIVE") != "1":
        return "live Kubernetes test: set ARES_K8S_LIVE=1 (and KUBECONFIG) to run it"
    path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not os.path.exists(path.split(os.pathsep)[0]):
        return f"live Kubernetes test: no kubeconfig at {path}: set KUBECONFIG to one"
    return None


@pytest.mark.skipif(_live_missing() is not None, reason=str(_live_missing()))
async def test_live_kubernetes(tmp_path: Path, session: Session) -> None:
    """A pod of ``$ARES_K8S_IMAGE`` (python:3.12-slim) in ``$ARES_K8S_NAMESPACE`` (default)."""
    spec = SandboxSpec(image=os.environ.get("ARES_K8S_IMAGE", "python:3.12-slim"), network="none",
                       workdir="/tmp/ares-live", forwards={18080: session.path})
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(100_000))
    async with KubernetesSandbox(spec, namespace=os.environ.get("ARES_K8S_NAMESPACE", "default")) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 3", timeout=60)
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
        assert (await sb.exec("sleep 120", timeout=2)).timed_out
        await sb.upload_file(src, "in.bin")
        await sb.download_file("in.bin", tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
        r = await sb.exec(["python3", "-c", CLIENT, "18080", "traffic"], user="nobody", cwd="/", timeout=300)
        got = json.loads(r.stdout)
        assert got["concurrent"] == N_CONCURRENT and got["bytes"] == [200, True], r


# -- an episode --------------------------------------------------------------------------------------------


async def test_an_episode_runs_in_a_pod_behind_its_egress_deny_policy_over_the_tunnel(
        fake: KubeFake, kubeconfig: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_rollouts(..., sandbox="kubernetes")` with a real harness (tiny-agent) and the oracle, through the
    real client and the stand-in: the pod is created behind its egress-deny policy, every LLM call of the
    agent goes over the exec tunnel, reward 1.0, results.json says the sandbox reached only its session, and
    nothing is left behind."""
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.episodes.tasks import Task
    from ares_gateway.policies import make_policy
    from sandbox import tunnel as tunnel_mod

    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.setenv("ARES_K8S_NAMESPACE", NAMESPACE)
    started: list[Tunnel] = []
    real_start = tunnel_mod.Tunnel.start

    async def counting_start(self: Tunnel) -> None:  # the real start, counted: proof the tunnel carried it
        started.append(self)
        await real_start(self)

    monkeypatch.setattr(tunnel_mod.Tunnel, "start", counting_start)
    d = tmp_path / "greet"
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n')
    (d / "instruction.md").write_text("Write hello to greeting.txt\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/sh\necho hello > greeting.txt\n")
    (d / "tests" / "test.sh").write_text(
        '#!/bin/sh\nv="${ARES_VERIFIER_DIR:-/logs/verifier}"; mkdir -p "$v"\n'
        'if grep -q hello /workspace/greeting.txt; then echo 1 > "$v/reward.txt"; '
        'else echo 0 > "$v/reward.txt"; fi\n')
    pods_before = len(fake.created_pods)
    summary = await run_rollouts(
        [Task.load(d)], policy=make_policy("oracle"),
        episode=EpisodeConfig("tiny-agent", sandbox="kubernetes", image=IMAGE, time_limit=120),
        run=RunConfig(out=tmp_path / "out", stats="null"),
    )
    [e] = summary.episodes
    assert e.exit_reason == "completed" and e.reward == 1.0, e
    assert e.network == "relay" and e.turns >= 2
    assert len(started) == 1 and started[0].mux is not None and started[0].mux.opened >= 1
    assert started[0].violation is None
    # Two pods: the agent's and the fresh one the tests ran in (labelled as grading), each behind its
    # own egress-deny policy, both gone at the end.
    pods = fake.created_pods[pods_before:]
    roles = sorted((p["metadata"].get("labels") or {}).get("ares-gateway.role", "agent") for p in pods)
    assert roles == ["agent", "grading"], roles
    assert e.to_dict()["grading"] == "fresh"
    for pod in pods:
        name = pod["metadata"]["name"]
        assert f"{name}-deny" in fake.deleted_policies and name in fake.deleted_pods
        assert not any(n == name for _, n in fake.pods) and not any(n == f"{name}-deny" for _,
                                                                    n in fake.policies)


@pytest.mark.parametrize("how", ["start time", "owner"])
async def test_a_relay_record_naming_another_process_spares_nothing(fake: KubeFake, kubeconfig: str,
                                                                    session: Session,
                                                                   how: str) -> None:
    """The pid a dead relay's files still name, taken by another user's process (as pid reuse would
    have it): kill_processes() kills it.  The record differs from it by start time, or by owner."""
    async with _new(kubeconfig, network="none", forwards={18080: session.path}) as sb:
        r = await sb.exec("setsid sleep 4321 >/dev/null 2>&1 </dev/null & echo $!", user="nobody", timeout=30)
        other = int(r.stdout.strip())
        relay = int((await sb.exec("cat /.ares/relay-18080.pid", timeout=30)).stdout.strip())
        stat = await sb.exec(f"cat /proc/{other}/stat /proc/{relay}/stat", timeout=30)
        other_start, relay_start = (line.rsplit(")", 1)[1].split()[19] for line in stat.stdout.splitlines())
        start = relay_start if how == "start time" else other_start
        forged = await sb.exec(
            f"echo {other} >/.ares/relay-18080.pid; echo '{other} {start}' >/.ares/relay-18080.id",
            timeout=30)
        assert forged.ok, forged
        await sb.kill_processes(timeout=20)
        left = await sb.exec(f"s=$(cut -d')' -f2 /proc/{other}/stat 2>/dev/null | cut -d' ' -f2); "
                             "case $s in ''|Z|X) echo gone;; *) echo alive;; esac", timeout=30)
        assert left.stdout.strip() == "gone", left


async def test_a_timed_out_command_is_killed_by_roots_record(fake: KubeFake, kubeconfig: str) -> None:
    """The record of the command's session leader is root's (the agent cannot read or write it), and
    the timeout kills the command's group by it."""
    async with _new(kubeconfig, network="none") as sb:
        r = await sb.exec("ls /.ares/exec 2>&1; sleep 4322", user="nobody", timeout=2)
        assert r.timed_out and "Permission denied" in r.stdout, r
        left = await sb.exec(
            "for d in /proc/[0-9]*; do cat $d/cmdline 2>/dev/null | tr '\\0' ' '; echo; done "
            "| grep -c '^sleep 4322' || true", timeout=30)
        assert left.stdout.strip() == "0", left
