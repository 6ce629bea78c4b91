"""Write per-rank shard plans: bucketed batches, disjoint ranks, equal steps, deterministic, resumable.

    bucketeer plan MANIFEST --out PLAN --world-size 8 --batch-size 4 --seed 0 --epochs 10
    bucketeer plan MANIFEST --out PLAN --world-size 8 --max-tokens 16384 --cache CACHE   # packing mode
    bucketeer plan MANIFEST --out PLAN --world-size 1024 --batch-size 4 --epochs 100 --window 10  # 10 now
    bucketeer plan MANIFEST --extend PLAN --epochs 20         # write epochs 10..19 of that plan
    bucketeer plan --check PLAN MANIFEST                      # re-check every invariant (exit 1 if violated)
    bucketeer plan --resume PLAN --at 3:1200 --world-size 4 --out PLAN2   # elastic resume
    bucketeer plan M1 M2 M3 --out PLAN --weights 0.6,0.3,0.1 --cache C1,C2,C3 --world-size 8 --batch-size 4
    bucketeer plan M1 M2 --out PLAN --repeats 1,2.5 ...       # a mixture: see manifests/plan/mix.py
    bucketeer plan MANIFEST --out PLAN --annotations SCORES,DUPS --where "aesthetic > 5.5 AND NOT duplicate"
    bucketeer plan MANIFEST --out PLAN --annotations SCORES --weight-by aesthetic ...  # see manifests/select.py

A mixture (several manifests, or ``--weights``/``--repeats``, or a manifest with caption lists)
counts samples per epoch by this rule: ``--repeats r``: ``round(r * n)`` samples of a dataset of
``n`` (halves up); ``--weights w`` (normalised): an epoch holds as many samples as all datasets
together, split by largest remainder. Each dataset's count is spread over its buckets by largest
remainder; within an epoch a sample repeats only once every sample of its dataset and bucket has
been drawn as often (fresh draw per epoch). Bucket leftovers are then dropped or padded as usual.
``--cache C1,C2,...`` gives one cache per manifest, in the same order.

``python -m pipeline.plan`` takes the same options. The planning is pure numpy
(:mod:`manifests.plan.schedule`); :mod:`pipeline.plan.job` is the job (``run(PlanJob(...))``, the Python
API), :mod:`pipeline.plan.options` the command line, :mod:`pipeline.plan.inputs` reads the manifests and
caches, :mod:`pipeline.plan.summary` prints the summary.
"""

from pipeline.plan.job import PlanJob, PlanResult, run
from pipeline.plan.options import add_arguments, job_from_args

__all__ = ["PlanJob", "PlanResult", "add_arguments", "job_from_args", "run"]
