"""The previews of a run (money, disk, GPU fit, time) and the host check against them; they read the plan."""
