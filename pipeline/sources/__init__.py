"""Sources that hold images inside containers, scanned without reading the containers whole.

Loose image files are the scan's own (:mod:`pipeline.scan`); this package adds WebDataset tar
shards: :mod:`~pipeline.sources.tar` walks a shard's member headers from byte ranges (pure),
:mod:`~pipeline.sources.shards` scans shards (grouping members into samples, probing each image
where it lies, reading captions), :mod:`~pipeline.sources.containers` is the job part (refusals,
per-shard reuse, the manifest). Embed reads each image of a shard with one ranged read
(:func:`manifests.schema.image_range`, the manifest contract).
"""
