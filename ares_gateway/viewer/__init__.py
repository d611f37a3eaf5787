"""The trajectory viewer: a run's episodes, turns, message trees and samples in the browser.

* :mod:`~ares_gateway.viewer.source`: what is shown (a run directory, a data dir, a live gateway);
* :mod:`~ares_gateway.viewer.turns`: an episode's turn log as per-turn views of what is new;
* :mod:`~ares_gateway.viewer.samples`: samples without their tokens, and one sample's tokens by window;
* :mod:`~ares_gateway.viewer.app`: the pages, the JSON API, live updates and the login, under ``/ui``;
* ``static/``: the hand-written page (HTML, CSS, JS), shipped in the package.

``ares-gateway view DIR`` serves it on 127.0.0.1; ``serve`` and ``run`` mount it at ``/ui/`` behind the
admin token. See ``docs/viewer.md``.
"""

from ares_gateway.viewer.app import Viewer, serve_viewer
from ares_gateway.viewer.source import RunSource


def mount_viewer(gateway: object, run_dir: object = None) -> Viewer:
    """Serve the viewer of ``gateway`` (and of the run directory it writes, if any) at ``/ui`` on the
    gateway's own port, behind its admin token (``serve`` and ``run`` do this)."""
    from pathlib import Path

    source = RunSource(None if run_dir is None else Path(str(run_dir)), gateway=gateway,
                       title=str(run_dir) if run_dir is not None else "live gateway")
    viewer = Viewer(source, admin_token=gateway.admin_token)  # type: ignore[attr-defined]
    gateway.mount("/ui", viewer)  # type: ignore[attr-defined]
    return viewer


__all__ = ["RunSource", "Viewer", "mount_viewer", "serve_viewer"]
