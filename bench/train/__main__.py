"""``python -m bench.train`` (see :mod:`bench.train._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.train._main import main

if __name__ == "__main__":
    sys.exit(main())
