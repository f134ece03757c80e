"""``python -m batchgraph``: the same as the ``batchgraph`` command."""

from __future__ import annotations

import sys

from batchgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
