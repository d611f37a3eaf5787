"""The sandbox exception hierarchy.

Every error raised by this package is a :class:`SandboxError`; each message says what went wrong and
what to do about it.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by ``sandbox``."""


class BackendUnavailableError(SandboxError):
    """The requested backend cannot be used here (engine not running, package not installed, ...)."""


class ImageBuildError(SandboxError):
    """Building the sandbox image from a Dockerfile failed."""


class SandboxStartError(SandboxError):
    """The sandbox could not be created or started."""


class SandboxStateError(SandboxError):
    """The sandbox is not in a state that allows this call (not started yet, or already stopped)."""


class ExecError(SandboxError):
    """A command could not be run at all (this is not raised for a non-zero exit code)."""


class FileTransferError(SandboxError):
    """Copying a file or directory into or out of the sandbox failed."""


class ArchiveTooLargeError(FileTransferError):
    """An archive (``protocol.filter_tar``, ``BaseSandbox.archive_dir``) would pass its size limit."""


class ForwardError(SandboxError):
    """A port could not be forwarded into the sandbox (see ``BaseSandbox.forward``)."""


class NotSupportedError(SandboxError):
    """This backend cannot do this (yet); the message says which backends can."""
