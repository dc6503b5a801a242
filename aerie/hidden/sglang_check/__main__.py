"""``python -m aerie.hidden.sglang_check``: the same tool as the ``aerie-sglang-capture`` console script."""

import sys

from aerie.hidden.sglang_check.cli import main

sys.exit(main())
