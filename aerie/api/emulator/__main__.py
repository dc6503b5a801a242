"""``python -m aerie.api.emulator``: the same tool as the ``aerie-emulator`` console script."""

import sys

from aerie.api.emulator.cli import main

sys.exit(main())
