"""``python -m aerie.sglang_capture``: the same tool as the ``aerie-sglang-capture`` console script."""

import sys

from aerie.sglang_capture.cli import main

sys.exit(main())
