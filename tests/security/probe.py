"""Run by the agent inside the sandbox (tests/security): every way out it can think of, one line each.

Usage: python3 probe.py CONTROL_PORT OTHER_PORT OTHER_SESSION MARKER
Each line is ``KIND what -> result``; the test reads them from the verifier's log.
"""

import glob
import json
import os
import socket
import sys
import urllib.error
import urllib.request

control_port, other_port, other_session, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
relay = (os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
         or os.environ.get("ANTHROPIC_BASE_URL") or "")
own_token = next((v for v in os.environ.values() if v.startswith("ags-")), "")
print("INFO relay", relay, "token", "yes" if own_token else "no")


def http(method, url, body=None, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                    timeout=5) as r:
            return str(r.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except Exception as exc:
        return "refused " + type(exc).__name__


roots = [f"http://127.0.0.1:{control_port}"]
if relay.startswith("http://127.0.0.1:"):
    roots.append(relay.split("/s/")[0].rstrip("/").removesuffix("/v1"))
guesses = [None, own_token, "admin", "ares", "changeme", "ags-" + "A" * 32]
for root in dict.fromkeys(roots):
    for token in guesses:
        who = "none" if token is None else ("own" if token == own_token else "guess")
        for method, path, body in (
            ("GET", "/poll?wait=0", None),
            ("GET", "/sessions", None),
            ("POST", "/respond", {"id": "req_1", "completion": {"text": "x"}}),
            ("POST", f"/sessions/{other_session}/end", {"reward": 1.0}),
            ("POST", "/sessions", {"token": own_token or "ags-" + "B" * 32}),
            ("GET", "/metrics", None),
            ("GET", f"/s/{other_session}/v1/models", None),
        ):
            print(f"CONTROL {root} {method} {path} {who} -> {http(method, root + path, body, token)}")

for port in (other_port, control_port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        print(f"CONNECT 127.0.0.1:{port} -> connected")
    except OSError as exc:
        print(f"CONNECT 127.0.0.1:{port} -> refused {type(exc).__name__}")

found = []
for top in ("/",):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in ("/proc", "/sys", "/dev")]
        for name in filenames:
            if name in ("solve.sh", "test.sh"):
                path = os.path.join(dirpath, name)
                try:
                    with open(path, errors="replace") as f:
                        if marker in f.read():
                            found.append(path)
                except OSError:
                    pass
print("FILES with the task's marker:", found or "none")
for path in ("/var/run/docker.sock", "/run/docker.sock", "/work", "/root/.bashrc", "/tests", "/solution"):
    print(f"EXISTS {path} -> {os.path.exists(path)}")
print("EXISTS /tmp/ares-task-* ->", glob.glob("/tmp/ares-task-*"))

# The relay carrying the agent's HTTP (root): killing it, or writing into or reading its channel's
# pipes/sockets (the exec tunnel's stdin/stdout), would cut or forge the session's traffic.
for p in glob.glob("/proc/[0-9]*"):
    try:
        with open(p + "/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        continue
    if "relay.py" not in cmd or int(p[6:]) == os.getpid():
        continue
    for fd, mode in (("0", "wb"), ("1", "rb"), ("1", "wb")):
        try:
            with open(f"{p}/fd/{fd}", mode, buffering=0) as f:
                f.write(b"\0" * 16) if "w" in mode else f.read(1)
            print(f"RELAY {p} fd{fd} {mode} -> opened")
        except OSError as exc:
            print(f"RELAY {p} fd{fd} {mode} -> refused {type(exc).__name__}")
    try:
        os.kill(int(p[6:]), 9)
        print(f"RELAY {p} kill -> killed")
    except OSError as exc:
        print(f"RELAY {p} kill -> refused {type(exc).__name__}")

print("ENV", json.dumps(dict(os.environ)))
for p in glob.glob("/proc/[0-9]*"):
    for what in ("environ", "cmdline"):
        try:
            with open(p + "/" + what, "rb") as f:
                print("PROC", p, what, f.read().replace(b"\0", b" ").decode("utf-8", "replace"))
        except OSError:
            pass
print("PROBE DONE")
