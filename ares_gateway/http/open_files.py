"""The process's open-file limit, which bounds how many connections the gateway can hold.

Every client connection is one file descriptor. A soft ``RLIMIT_NOFILE`` of 1024 is common on Linux
while the hard limit is far higher; :func:`raise_open_file_limit` lifts the soft limit to the hard one
(what an unprivileged process may do), and :func:`connection_cap` derives the default connection
cap from the result, keeping a reserve for everything else the process opens (the data dir's
files, sandboxes' pipes, per-session sockets, upstream connections).
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

#: Most descriptors kept back from connections for the rest of the process.
FD_RESERVE = 1024


def _kernel_max() -> int:
    """The most descriptors one process can have (``fs.nr_open``), for an unlimited hard limit."""
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def open_file_limits() -> tuple[int, int]:
    """The soft and hard open-file limits, an unlimited one given as the kernel's maximum."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = _kernel_max()
    return (top if soft == resource.RLIM_INFINITY else soft), (top if hard == resource.RLIM_INFINITY
                                                               else hard)


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _kernel_max() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return open_file_limits()[0]


def reserve_for(limit: int) -> int:
    """Descriptors kept back from connections under an open-file limit of ``limit``."""
    return min(FD_RESERVE, max(limit // 4, 1))


def connection_cap(limit: int | None = None) -> int:
    """The default connection cap under an open-file limit (default: the current soft limit):
    the limit less :func:`reserve_for` it."""
    if limit is None:
        limit = open_file_limits()[0]
    return max(limit - reserve_for(limit), 1)


def check_connections(max_connections: int, limit: int | None = None) -> str | None:
    """A warning when ``max_connections`` connections would not fit the open-file limit (default:
    the current soft limit, which :func:`raise_open_file_limit` has made the hard one), else ``None``."""
    if limit is None:
        limit = open_file_limits()[0]
    needed = max_connections + reserve_for(limit)
    if needed <= limit:
        return None
    return (f"max_connections={max_connections} needs about {needed} open files but this process may open "
            f"{limit} (its hard limit): connections past about {connection_cap(limit)} will fail to "
            "be accepted. "
            f"Raise the hard limit (`ulimit -n {needed}` as root before starting, LimitNOFILE= in a systemd "
            f"unit, `docker run --ulimit nofile={needed}`) or lower --max-connections")


__all__ = ["FD_RESERVE", "check_connections", "connection_cap", "open_file_limits", "raise_open_file_limit",
           "reserve_for"]
