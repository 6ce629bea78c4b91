"""How to read a source: listing it, probing image headers, reading captions, and containers.

The scan job (:mod:`pipeline.scan`) sits on top of this package and nothing here imports it.
The parts every kind of source shares: :mod:`~pipeline.sources.listing` (one listing of a root:
images, sidecars, ignored files), :mod:`~pipeline.sources.headers` with
:mod:`~pipeline.sources.parsers` and :mod:`~pipeline.sources.results` (one checked header per
image), :mod:`~pipeline.sources.reading` (many ranged reads in flight), :mod:`~pipeline.sources.captions`
(sidecars and caption tables) and :mod:`~pipeline.sources.tasks` (batches as Ray tasks).
Containers, WebDataset tar shards and parquet files of image bytes:
:mod:`~pipeline.sources.tar` walks a shard's member headers from byte ranges (pure),
:mod:`~pipeline.sources.shards` scans shards (grouping members into samples, probing each image
where it lies, reading captions), :mod:`~pipeline.sources.parquet` scans parquet files (the image
and caption columns only, row group by row group, each header probed from the bytes in hand),
:mod:`~pipeline.sources.containers` is the job part of both (compressed shards refused, per-container
reuse, the rows and summary of the part). Embed reads each image of a shard with one ranged read
(:func:`manifests.schema.image_range`, the manifest contract), and the images of a parquet file by
row group (:mod:`pipeline.embed.parquet_images`).
"""
