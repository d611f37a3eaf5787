"""Played inside a hardened local sandbox (tests/security/test_hostile_local.py): what an agent's code
tries, as the agent (``agent``) or imported as root by a verifier (``root``).  One line each,
``WHO what -> ok ...`` or ``WHO what -> refused ERRNO``.

Usage: python3 hostile_probe.py agent|root [store DESC SECRET | read DESC]
"""

import ctypes
import errno
import os
import stat
import struct
import subprocess
import sys

# x86-64 system call numbers (the test skips other machines).
NR = {"unshare": 272, "add_key": 248, "keyctl": 250, "ptrace": 101, "mount": 165}
CLONE_NEWUSER = 0x10000000
KEY_SPEC_USER_KEYRING = -4
KEYCTL_SETPERM, KEYCTL_SEARCH, KEYCTL_READ = 5, 10, 11
# Possessor and user: everything, so that a later process of the same uid (the next episode) reads it.
KEY_PERM_ALL = 0x3F3F0000

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def syscall(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(NR[name], *args)
    return r, ctypes.get_errno()


def show(who, what, r, err):
    print(f"{who} {what} -> " + (f"ok {r}" if r >= 0 else f"refused {errno.errorcode.get(err, err)}"),
          flush=True)


class FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * 128)]


def common(who):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("CapEff", "CapBnd", "Seccomp:")):
                print(f"{who} STATUS {line.split()[0]} {line.split()[1]}", flush=True)
    cli = subprocess.run(["unshare", "-Urpf", "true"], capture_output=True, text=True)
    print(f"{who} unshare-Urpf -> "
          + ("ok 0" if cli.returncode == 0 else f"refused {cli.stderr.strip()[-80:]}"),
          flush=True)
    # In a child: a user namespace that works would change this process's keyrings.
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write_end, repr(syscall("unshare", CLONE_NEWUSER)).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    r, err = eval(os.read(read_end, 100).decode())
    show(who, "unshare(CLONE_NEWUSER)", r, err)


def root():
    common("ROOT")
    # A handle through a bind mount (/usr), then the host filesystem's root inode forged (ext4: 2).
    fh = FileHandle(handle_bytes=128)
    mount_id = ctypes.c_int()
    ctypes.set_errno(0)
    r = libc.name_to_handle_at(-100, b"/usr", ctypes.byref(fh), ctypes.byref(mount_id), 0)
    show("ROOT", "name_to_handle_at(/usr)", r, ctypes.get_errno())
    mfd = os.open("/usr", os.O_RDONLY | os.O_DIRECTORY)
    for label, handle in (("own", fh), ("forged-root-inode", None)):
        if handle is None:
            handle = FileHandle(handle_bytes=8, handle_type=1)
            struct.pack_into("<II", handle.f_handle, 0, 2, 0)
        ctypes.set_errno(0)
        fd = libc.open_by_handle_at(mfd, ctypes.byref(handle), os.O_RDONLY | os.O_DIRECTORY)
        show("ROOT", f"open_by_handle_at({label})", fd, ctypes.get_errno())
        if fd >= 0:
            print("ROOT LISTED", sorted(os.listdir(fd))[:20], flush=True)
            os.close(fd)
    try:
        os.mknod("/tmp/ares-blk", stat.S_IFBLK | 0o600, os.makedev(8, 0))
        print("ROOT mknod(block) -> ok 0", flush=True)
    except OSError as exc:
        print(f"ROOT mknod(block) -> refused {errno.errorcode.get(exc.errno)}", flush=True)
    os.makedirs("/tmp/ares-mnt", exist_ok=True)
    show("ROOT", "mount(tmpfs)", *syscall("mount", b"none", b"/tmp/ares-mnt", b"tmpfs", 0, None))
    show("ROOT", "add_key(@u)",
         *syscall("add_key", b"user", b"ares-root-probe", b"x", 1, KEY_SPEC_USER_KEYRING))
    show("ROOT", "ptrace(ATTACH, 1)", *syscall("ptrace", 16, 1, 0, 0))
    print("ROOT PROBE DONE", flush=True)


def agent(args):
    common("AGENT")
    if args[:1] == ["store"]:
        desc, secret = args[1].encode(), args[2].encode()
        key, err = syscall("add_key", b"user", desc, secret, len(secret), KEY_SPEC_USER_KEYRING)
        show("AGENT", "add_key(@u)", key, err)
        if key >= 0:
            show("AGENT", "keyctl(SETPERM)", *syscall("keyctl", KEYCTL_SETPERM, key, KEY_PERM_ALL))
    elif args[:1] == ["read"]:
        key, err = syscall("keyctl", KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user", args[1].encode(), 0)
        show("AGENT", "keyctl(SEARCH @u)", key, err)
        if key >= 0:
            buf = ctypes.create_string_buffer(256)
            n, err = syscall("keyctl", KEYCTL_READ, key, buf, 256)
            show("AGENT", "keyctl(READ)", n, err)
            print("AGENT KEY", buf.raw[: max(n, 0)].decode(errors="replace"), flush=True)
    print("AGENT PROBE DONE", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "root":
        root()
    else:
        agent(sys.argv[2:])
