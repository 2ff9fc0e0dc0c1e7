"""``python -m medha_runtime``: the ``medha-runtime`` command."""

import sys

from medha_runtime.cli import main

sys.exit(main())
