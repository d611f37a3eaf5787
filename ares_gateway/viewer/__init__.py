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

__all__ = ["RunSource", "Viewer", "serve_viewer"]
