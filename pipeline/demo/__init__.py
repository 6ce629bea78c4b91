"""Run scan -> annotate -> dedup -> embed -> plan -> train -> verify -> report on a generated dataset, here.

    bucketeer demo                        # ./demo-output: 200 images, 2 training processes, under 2 minutes on 2 cores
    bucketeer demo --s3                   # the same flow against a local S3-compatible server (moto, 127.0.0.1)
    bucketeer demo --images 60 --out-dir demo-small
    bucketeer demo --family sdxl          # the same flow with a tiny random-weight SDXL (sd3, flux alike)
    bucketeer demo --family qwen-image    # ... Qwen-Image (Qwen2.5-VL text, normalised latents); z-image alike
    bucketeer demo --family qwen-image-edit  # ... (target, reference) pairs: a grey reference per image
    bucketeer demo --repa                 # DINOv2 features in the cache (embed --features), REPA in training
    bucketeer demo --family wan           # video: generated clips, scan --frames, a tiny random-weight Wan
    bucketeer demo --family wan2.2-ti2v-5b   # ... Wan 2.2 (48-channel VAE); wan2.2-a14b: LoRA on both experts
    bucketeer demo --family flux2         # a tiny random-weight FLUX.2-dev (flux2-klein, chroma alike)

Each stage is the real job, called the way a user calls it: scan, annotate, dedup, embed, plan, verify
and report through their ``bucketeer`` entry points in this process (the Ray drivers among them share one
local Ray started here), the trainer as ``accelerate launch --config_file
infra/accelerate/cpu-2proc.yaml -m train`` in subprocesses (2 ranks, gloo on the CPU). With
``--s3`` the dataset is uploaded to a moto server started on a free 127.0.0.1 port, every
artifact is an ``s3://`` URL passed with ``--storage-options '{"endpoint_url": ...}'``, and the
server is stopped afterwards, also when a stage fails. The same stage functions serve both modes.

What a user decides before training is in the flow: ``annotate --task sha256,phash,stats`` (no model: hashes
and image statistics), ``dedup`` (exact and perceptual duplicates, one keeper per cluster) and a plan made
with ``--where "NOT duplicate AND contrast > 0.02"``. The dataset has cases for them planted
(:func:`pipeline.sample_data.add_curation_cases`: copies of 6 images, 3 blank frames; from 40 images up), and
the report shows the scores, the duplicate clusters and what the selection dropped. A ``--family`` demo
shows that family's embed and training, without these stages.

``--family sdxl|sd3|flux|flux2|flux2-klein|chroma`` builds that family's tiny random-weight diffusers folder once (under
``$BUCKETEER_HOME``, :func:`pipeline.embed.families.tiny.ensure_tiny`), embeds with ``--family F --model
<that folder>`` and two validation prompts, and trains the family's recipe from it (fine-tuning the
tiny pretrained weights, with caption dropout, an EMA and validation images at the end: the
settings are in ``train-config.yaml``). ``--family wan`` does the same on ~24 generated short clips
(H.264 and VP9, one rotated, stills among them, one too short and one broken), scanned with ``--frames
9,17`` into ``WxHxF`` buckets and trained with the wan recipe; ``--family wan2.2-a14b`` trains LoRA on both
experts in one run (``expert: both``) and ``--family wan2.2-ti2v-5b`` scans with sides in steps of 32 (its VAE
is 16x).
``--family qwen-image-edit`` gives every image a reference (its grey version, ``dataset/_references/``), scans
the pairs (``--conditioning``), embeds each (caption, reference) with the references at the demo's 256²
(``--reference-resolution 256``) and fine-tunes without caption dropout or validation images. ``--family
pixart`` (or none) is the default flow: the embedded default encoders and the from-scratch transformer.
"""

from pipeline.demo.job import DemoJob, DemoResult, add_arguments, job_from_args, run

__all__ = ["DemoJob", "DemoResult", "add_arguments", "job_from_args", "run"]
