"""python -m aerie.sources fetch --configfile CONFIG: fill the offline datasets cache with the config's Hub datasets."""

from aerie.sources.tables import main

raise SystemExit(main())
