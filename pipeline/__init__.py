"""bucketeer's Ray jobs (scan, embed, plan) and the ``bucketeer`` command line."""
