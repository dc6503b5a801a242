"""``python -m aerie.emulator``: the same tool as the ``aerie-emulator`` console script."""

import sys

from aerie.emulator.cli import main

sys.exit(main())
