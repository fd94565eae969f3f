"""``python -m bench.tuner_load`` (see :mod:`bench.tuner_load._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.tuner_load._main import main

if __name__ == "__main__":
    sys.exit(main())
