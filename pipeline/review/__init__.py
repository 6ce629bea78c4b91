"""``bucketeer review``: a local page to look at a manifest with its annotations, filter, sort and decide;
the decisions are an annotations folder (task ``review``) that ``plan``, ``scan --captions``, ``stats`` and
``report`` read like any other.

The job is :mod:`pipeline.review.job`; :mod:`~pipeline.review.decisions` writes the decisions,
:mod:`~pipeline.review.data` answers the page's queries, :mod:`~pipeline.review.thumbs` reads and caches
images, :mod:`~pipeline.review.server` serves it all; the page is ``static/`` (no build step).
"""

from pipeline.review.job import ReviewJob, add_arguments, job_from_args, run, session

__all__ = ["ReviewJob", "add_arguments", "job_from_args", "run", "session"]
