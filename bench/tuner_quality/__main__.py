"""``python -m bench.tuner_quality`` (see :mod:`bench.tuner_quality._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.tuner_quality._main import main

if __name__ == "__main__":
    sys.exit(main())
