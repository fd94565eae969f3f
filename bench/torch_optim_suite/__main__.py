"""``python -m bench.torch_optim_suite`` (see :mod:`bench.torch_optim_suite._main`; ``--help`` lists the options)."""

from __future__ import annotations

import sys

from bench.torch_optim_suite._main import main

if __name__ == "__main__":
    sys.exit(main())
