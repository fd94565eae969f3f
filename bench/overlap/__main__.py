"""``python -m bench.overlap`` (see :mod:`bench.overlap._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.overlap._main import main

if __name__ == "__main__":
    sys.exit(main())
