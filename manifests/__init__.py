"""bucketeer's contracts: manifest schema, buckets, shard plans, cache records, storage.

Pure logic and IO only: this package imports neither Ray nor torch, so every job and the
trainer share one definition of each artifact.
"""

__version__ = "0.1.0"
