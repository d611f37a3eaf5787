"""`ares-gateway serve` as a real process: serves, keeps secrets out of its output, stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from tests.helpers import free_port


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.time() + 20
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("gateway did not become healthy")


def test_serve_process_round_trip_and_clean_shutdown() -> None:
    port = free_port()
    admin = "cli-admin-secret-abcdef0123"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", str(port), "--access-log"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ARES_GATEWAY_ADMIN_TOKEN": admin},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        req = urllib.request.Request(url + "/sessions", data=b"{}", method="POST",
                                     headers={"authorization": f"Bearer {admin}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            info = json.load(r)
        assert info["base_url"] == f"{url}/s/{info['session_id']}"
        # An agent request with the session token (it will be cancelled at shutdown).
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        chat = urllib.request.Request(
            info["base_url"] + "/v1/chat/completions", data=body,
            headers={"authorization": f"Bearer {info['token']}", "content-type": "application/json"}
        )
        import threading

        outcome: dict[str, int] = {}

        def agent() -> None:
            try:
                urllib.request.urlopen(chat, timeout=10)
            except urllib.error.HTTPError as e:
                outcome["status"] = e.code

        t = threading.Thread(target=agent)
        t.start()
        poll = urllib.request.Request(url + "/poll?wait=5", headers={"authorization": f"Bearer {admin}"})
        with urllib.request.urlopen(poll, timeout=10) as r:
            items = json.load(r)
        assert len(items) == 1 and items[0]["request"]["messages"][0]["content"] == "hi"
        proc.send_signal(signal.SIGTERM)
        t.join(10)
        assert outcome.get("status") == 503  # failed cleanly at shutdown, not left hanging
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert "listening on" in out
    assert admin not in out and info["token"] not in out


def test_serve_help_lists_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--help"], capture_output=True, text=True,
        check=True, env={**os.environ}
    ).stdout
    for flag in ("--host", "--port", "--admin-token-file", "ARES_GATEWAY_ADMIN_TOKEN", "--request-timeout",
                 "--auto-sessions"):
        assert flag in out
    assert "--admin-token " not in out and "--admin-token TOKEN" not in out  # no flag takes the token itself


SECRET = "on-the-command-line-0123456789"


def test_a_token_on_the_command_line_is_refused_in_one_line() -> None:
    """``--admin-token TOKEN`` would show the token to every user of the host (ps): every command that
    takes an admin token refuses the flag, exit 2, one line saying where the token goes instead."""
    cases = [
        (["serve", "--port", "0", "--in-memory", "--admin-token", SECRET], "--admin-token-file PATH"),
        (["serve", "--port", "0", "--in-memory", f"--admin-token={SECRET}"], "$ARES_GATEWAY_ADMIN_TOKEN"),
        (["serve", "--admin-token"], "--admin-token-file PATH"),
        (["run", "no-such-preset", "--admin-token", SECRET], "--admin-token-env VAR"),
    ]
    for argv, instead in cases:
        try:
            r = subprocess.run([sys.executable, "-m", "ares_gateway.cli", *argv], capture_output=True,
                               text=True, timeout=30, env={**os.environ, "ARES_GATEWAY_ADMIN_TOKEN": ""})
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{argv}: still running after 30 s (the token was taken)") from exc
        lines = r.stderr.splitlines()
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("ares-gateway: --admin-token is not accepted"), (
            argv, r.stderr)
        assert "ps" in lines[0] and instead in lines[0], (argv, lines)
        assert SECRET not in r.stderr + r.stdout, argv


def test_serve_limit_flags_reach_the_server() -> None:
    """The limits are serve flags: a lower --max-headers answers 431, a lower --header-timeout closes a slow
    head."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", str(port), "--in-memory",
         "--max-headers", "16", "--header-timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            head = ("GET /healthz HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-H{i}: v\r\n" for i in range(20))
                    + "\r\n")
            s.sendall(head.encode())
            status_line = s.recv(200).split(b"\r\n", 1)[0]
            assert status_line.split()[1:2] == [b"431"], (status_line, "20 headers against --max-headers 16")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            started = time.monotonic()
            while s.recv(4096):  # until the server closes it
                pass
            waited = time.monotonic() - started
        assert waited < 5, f"a slow head was closed after {waited:.1f} s with --header-timeout 1 (default 10)"
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_setting_flag_is_declared_once_on_its_field() -> None:
    """serve's limit flags come from the fields' metadata: each with the field's default and help, each
    reaching the field it names; the HTTP limits live in GatewayConfig.http, and the gateway's
    keywords and the config's attributes of the same names read and set them there."""
    import argparse
    import dataclasses

    import pytest

    from ares_gateway import Gateway
    from ares_gateway.cli.serve import add_serve_command, setting_flags
    from ares_gateway.gateway import HTTP_LIMIT_NAMES, GatewayConfig
    from ares_gateway.http.server import HttpLimits

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_command(sub)
    serve_help = " ".join(sub.choices["serve"].format_help().split())
    flags = setting_flags()
    names = {f.name for _, _, f in flags}
    assert {"request_timeout", "lease_seconds", "max_headers", "max_connections", "max_parked_bytes",
            "parse_offload_bytes"} <= names
    assert not {"max_body_bytes", "lingering_time", "read_bufsize"} & names  # --max-body-mb; not flags
    defaults = parser.parse_args(["serve"])
    for flag, where, f in flags:
        owner = GatewayConfig() if where == "config" else HttpLimits()
        assert getattr(defaults, f.name) == getattr(owner, f.name), flag
        assert f.metadata["help"] in serve_help, flag
    assert parser.parse_args(["serve", "--lease", "7"]).lease_seconds == 7.0
    assert "http" not in {f.name for f in dataclasses.fields(HttpLimits)}
    assert set(HTTP_LIMIT_NAMES) == {f.name for f in dataclasses.fields(HttpLimits)}

    cfg = GatewayConfig()
    cfg.max_headers = 16
    assert cfg.http.max_headers == 16 and cfg.max_headers == 16
    with pytest.raises(ValueError, match="max_headers must be at least 1"):
        cfg.max_headers = 0
    gw = Gateway(max_headers=12, header_timeout=2.5, request_timeout=30.0)
    assert gw.limits is gw.config.http
    assert (gw.limits.max_headers, gw.limits.header_timeout, gw.config.request_timeout) == (12, 2.5, 30.0)
    with pytest.raises(TypeError, match="unknown setting 'max_header'"):
        Gateway(max_header=12)


def test_a_limit_flag_out_of_range_is_one_line_naming_the_flag() -> None:
    for flag, value, says in (("--max-headers", "0", "max_headers must be at least 1"),
                              ("--stream-idle-timeout", "0", "must be a positive number of seconds"),
                              ("--max-body-mb", "0", "max_body_bytes must be at least 1")):
        r = subprocess.run([sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0", "--in-memory",
                            flag, value], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (flag, r.stdout, r.stderr)
        assert f"ares-gateway: error: {flag}: " in r.stderr and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
