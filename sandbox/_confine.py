"""Load a seccomp filter, then exec a command: the launcher in front of every hardened local command.

Stdlib only (ctypes), run with the host's interpreter as ``python3 -I -S _confine.py FILTER -- ARGV...``
before ``nsenter``: it sets ``no_new_privs``, installs the classic-BPF program in ``FILTER`` (built
once per process by :func:`sandbox.local.seccomp_filter` with libseccomp) with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``, and execs ``ARGV``.  The filter is inherited across
fork and exec, so everything the command starts inside the sandbox, root or not, runs under it.
Exits 126 (with a message on stderr) when the filter cannot be installed: a command never runs
unconfined.
"""

import ctypes
import os
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_FAILED = 126


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _fail(what: str, err: int) -> None:
    sys.stderr.write(f"ares-confine: {what}: {os.strerror(err)}\n")
    sys.exit(_FAILED)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: _confine.py FILTER -- COMMAND [ARGS...]\n")
        sys.exit(_FAILED)
    try:
        with open(args[0], "rb") as fh:
            program = fh.read()
    except OSError as exc:
        _fail(f"reading {args[0]}", exc.errno or 0)
    if not program or len(program) % 8:
        sys.stderr.write(f"ares-confine: {args[0]} is not a BPF program\n")
        sys.exit(_FAILED)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        _fail("prctl(PR_SET_NO_NEW_PRIVS)", ctypes.get_errno())
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        _fail("prctl(PR_SET_SECCOMP)", ctypes.get_errno())
    try:
        os.execvp(args[2], args[2:])
    except OSError as exc:
        _fail(f"exec {args[2]}", exc.errno or 0)


if __name__ == "__main__":
    main()
