"""``python3 -m ares_gateway.cli``: the ``ares-gateway`` command."""

import sys

from ares_gateway.cli import main

sys.exit(main())
