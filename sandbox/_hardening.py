"""What a local sandbox's isolation is made of: bubblewrap's probe, the host paths a hardened sandbox
sees, the privileges each kind of user keeps, the environment root never takes, and the seccomp filter
every hardened command runs under (:mod:`sandbox.local` applies them; docs/sandbox.md says why each).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from .errors import SandboxStartError

# What a hardened sandbox sees of the host (read-only), when it exists.
HARDENED_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                         "/opt/ares-agents")
# A non-root user in a hardened sandbox: no capabilities now or ever (setuid binaries included).
DROP_PRIVS = ["--clear-groups", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
# Root in a hardened sandbox (installs, the verifier, file transfers): Docker's default capabilities
# less MKNOD, NET_RAW and SETFCAP; CAP_DAC_READ_SEARCH (open_by_handle_at), CAP_SYS_ADMIN,
# CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_SYS_RAWIO... are out of the bounding set, so no program it
# runs, setuid or not, gets them back.
ROOT_CAPS = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
             "net_bind_service", "sys_chroot", "audit_write")
ROOT_PRIVS = [f"--bounding-set=-all,{','.join('+' + c for c in ROOT_CAPS)}", "--inh-caps=-all",
               "--ambient-caps=-all", "--no-new-privs"]
# The environment a root command of a hardened sandbox never takes from its caller: what makes a
# program load code from elsewhere (an agent-writable directory).  HOME and PATH are set anew.
ROOT_ENV_DROP_PREFIXES = ("PYTHON", "LD_")
ROOT_ENV_DROP = frozenset({"BASH_ENV", "ENV", "PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB", "RUBYOPT",
                            "NODE_OPTIONS", "NODE_PATH", "GCONV_PATH", "HOSTALIASES", "LOCALDOMAIN"})
CONFINE_SCRIPT = Path(__file__).with_name("_confine.py")
FILTER_FILE = "seccomp.bpf"
# System calls every command of a hardened sandbox (agent and root) is refused, with EPERM: new
# mounts and filesystem handles (open_by_handle_at read the host's filesystem through a bind mount),
# the kernel keyring (shared by every sandbox of one uid), tracing other processes, modules, kexec,
# BPF, perf, swap, reboot, userfaultfd.  Docker's default profile refuses the same.
SECCOMP_DENIED = (
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "name_to_handle_at", "open_by_handle_at",
    "add_key", "request_key", "keyctl",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "swapon", "swapoff", "reboot", "acct", "quotactl",
    "lookup_dcookie", "iopl", "ioperm",
)
# Refused with ENOSYS, so that libraries fall back: clone3 (its flags sit in a struct the filter
# cannot read; glibc then uses clone, whose flags it can) and io_uring (whose operations bypass
# seccomp; libuv/node fall back to threads).
SECCOMP_NOSYS = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
CLONE_NEWUSER = 0x10000000



@cache
def bwrap_available() -> bool:
    """Whether bubblewrap is installed *and* can create the namespaces it needs here."""
    exe = shutil.which("bwrap")
    if not exe:
        return False
    try:
        probe = subprocess.run(
            [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
             "--die-with-parent", "true"],
            capture_output=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@cache
def seccomp_filter() -> bytes:
    """The classic-BPF seccomp program of hardened local commands (built once per process with
    libseccomp through ``pyseccomp``): :data:`SECCOMP_DENIED` and new user namespaces (``unshare`` or
    ``clone`` with ``CLONE_NEWUSER``) get EPERM, :data:`SECCOMP_NOSYS` ENOSYS, a foreign ABI (32-bit
    ``int 0x80``) kills the process; everything else is allowed."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:
        raise SandboxStartError(
            "SandboxSpec(hardened=True) needs libseccomp and its binding: pip install pyseccomp, "
            "apt-get install "
            f"libseccomp2 ({exc})"
        ) from exc
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in SECCOMP_DENIED:
        filt.add_rule(sc.ERRNO(errno.EPERM), name)
    for name in SECCOMP_NOSYS:
        filt.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for name in ("unshare", "clone"):  # the flags are the first argument on x86-64 and arm64
        filt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def host_etc_secrets() -> list[str]:
    """The host's password hashes and private keys under /etc, hidden from a hardened sandbox."""
    found = [p for p in ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/ssl/private")
             if os.path.exists(p) and not os.path.islink(p)]
    with contextlib.suppress(OSError):
        found += sorted(os.path.join("/etc/ssh", n) for n in os.listdir("/etc/ssh")
                        if n.startswith("ssh_host_") and n.endswith("_key"))
    return found


def root_binds(workdir: str) -> list[str]:
    """Read-only binds of the host's top-level directories onto bwrap's fresh root (a tmpfs), so
    that the workdir can be created as a new mount point there."""
    top = workdir.strip("/").split("/", 1)[0]
    args: list[str] = []
    for name in sorted(os.listdir("/")):
        if name in ("proc", "dev", "tmp", top):
            continue
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args
