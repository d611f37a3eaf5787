"""Optional extras: importing a package that an extra installs, with one clear error when it is missing."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MissingExtraError", "require_extra"]


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""

    def __init__(self, package: str, extra: str, cause: BaseException | None = None) -> None:
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        super().__init__(
            f"{package} is not installed or failed to import{why}: install it with "
            f"python3 -m pip install 'ares-gateway[{extra}]'"
        )
        self.package = package
        self.extra = extra


def require_extra(module: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install's own error
        raise MissingExtraError(module.partition(".")[0], extra, exc) from exc
