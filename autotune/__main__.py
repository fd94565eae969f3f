"""``python -m autotune show|export|plot|clear``; see :mod:`autotune._cli`."""

from __future__ import annotations

import logging

from autotune._cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="python -m autotune: %(levelname)s: %(message)s")
    raise SystemExit(main())
