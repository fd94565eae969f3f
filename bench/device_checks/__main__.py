"""``python -m bench.device_checks`` (see :mod:`bench.device_checks._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.device_checks._main import main

if __name__ == "__main__":
    sys.exit(main())
