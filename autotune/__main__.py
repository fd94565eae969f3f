"""``python -m autotune show|export|plot|clear``; see :mod:`autotune.report._cli`."""

from __future__ import annotations

import logging

from autotune.report._cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="python -m autotune: %(levelname)s: %(message)s")
    raise SystemExit(main())
