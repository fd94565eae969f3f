"""``python -m bench.simulate`` (see :mod:`bench.simulate._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.simulate._main import main

if __name__ == "__main__":
    sys.exit(main())
