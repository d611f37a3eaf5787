"""A disk quota for a local sandbox: its own ext4 filesystem in a sparse file, loop-mounted.

Everything the sandbox can write (its workdir, ``/tmp`` and ``/home``) lives on it, so a write past
``spec.resources.disk`` fails with ENOSPC inside the sandbox, and the host's disk holds at most that
much for it.  Needs root, ``mkfs.ext4`` (e2fsprogs), ``mount``/``umount`` (util-linux) and loop
devices.  No journal (nothing survives the sandbox, and it would take space from the quota), no
reserved blocks (root and the agent see the same space), ``nosuid,nodev``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

_MKFS = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
         "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0"]
# Free space at or under this (or no inode left) counts as full: a write found the quota reached.
_FULL_BYTES = 1024 * 1024


def unavailable_reason() -> str | None:
    """Why a loop-mounted quota cannot be made here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [tool for tool in ("mkfs.ext4", "mount", "umount") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install e2fsprogs util-linux)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control)"
    return None


def is_mounted(path: str | Path) -> bool:
    """Whether ``path`` is a mount point (in this process's mount namespace)."""
    target = str(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return os.path.ismount(target)
    return any(len(fields := line.split()) > 4 and fields[4] == target for line in lines)


class LoopDisk:
    """``size`` bytes of ext4 in ``image``, mounted at ``mountpoint`` (which must exist)."""

    def __init__(self, image: Path, mountpoint: Path, size: int) -> None:
        self.image = image
        self.mountpoint = mountpoint
        self.size = size
        self._full = False

    def create(self) -> None:
        """Make and mount the filesystem; raises OSError (with mkfs's or mount's words) and undoes itself."""
        self.image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.image, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, self.size)  # sparse: the host holds only what is written
        finally:
            os.close(fd)
        try:
            for argv in ([*_MKFS, str(self.image)],
                         ["mount", "-o", "loop,nosuid,nodev,noatime", str(self.image), str(self.mountpoint)]):
                proc = subprocess.run(argv, capture_output=True, check=False, env={"PATH": os.environ.get(
                    "PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}, timeout=60)
                if proc.returncode != 0:
                    raise OSError(f"{argv[0]} failed: {proc.stderr.decode(errors='replace').strip()[-300:]}")
        except BaseException:
            self.remove()
            raise

    def full(self) -> bool:
        """Whether the filesystem is (or once was, when looked at) full. Sticky."""
        if not self._full and is_mounted(self.mountpoint):
            with contextlib.suppress(OSError):
                st = os.statvfs(self.mountpoint)
                free = st.f_bavail * st.f_frsize
                if free <= min(_FULL_BYTES, self.size // 50) or (st.f_files and st.f_favail == 0):
                    self._full = True
        return self._full

    def usage(self) -> int:
        """Bytes in use on the filesystem now."""
        st = os.statvfs(self.mountpoint)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def remove(self, timeout: float = 10.0) -> None:
        """Unmount (lazily if still busy after ``timeout``) and delete the image. Never raises."""
        remove(self.image, self.mountpoint, timeout)


def remove(image: Path, mountpoint: Path, timeout: float = 10.0) -> None:
    """Unmount ``mountpoint`` if mounted (lazily once ``timeout`` is spent) and delete ``image``."""
    deadline = time.monotonic() + timeout
    while is_mounted(mountpoint):
        lazy = time.monotonic() > deadline
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["umount", *(["-l"] if lazy else []), str(mountpoint)], capture_output=True,
                           check=False, timeout=30)
        if lazy:
            break
        if is_mounted(mountpoint):
            time.sleep(0.05)
    # The loop device was set up with autoclear: it goes when the last mount does.
    with contextlib.suppress(OSError):
        image.unlink()
