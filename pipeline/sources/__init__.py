"""Sources that hold images inside containers: WebDataset tar shards and parquet files of image bytes.

Loose image files are the scan's own (:mod:`pipeline.scan`); this package adds containers:
:mod:`~pipeline.sources.tar` walks a shard's member headers from byte ranges (pure),
:mod:`~pipeline.sources.shards` scans shards (grouping members into samples, probing each image
where it lies, reading captions), :mod:`~pipeline.sources.parquet` scans parquet files (the image
and caption columns only, row group by row group, each header probed from the bytes in hand),
:mod:`~pipeline.sources.containers` is the job part of both (refusals, per-container reuse, the
manifest). Embed reads each image of a shard with one ranged read
(:func:`manifests.schema.image_range`, the manifest contract), and the images of a parquet file by
row group (:mod:`pipeline.embed.parquet_images`).
"""
