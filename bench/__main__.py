"""``python -m bench``: the benchmark suite (see :mod:`bench.suite`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
