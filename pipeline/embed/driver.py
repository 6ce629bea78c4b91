"""The driver's side of an embed run (:mod:`pipeline.embed.job`): it opens the cache's committer once
the settings are known, runs the captions phase and then the images phase on the Ray Data pipelines
(:mod:`pipeline.embed.dataflow`), checks that every worker loaded the same weights, commits the
index rows the workers send back, and counts what the run wrote for its summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests.cache import CacheCommitter, CacheMeta, ComputeInfo, settings_diff
from manifests.errors import BucketeerError
from manifests.progress import Progress
from manifests.throttles import ThrottleTally, job_throttles
from manifests.storage import call_storage, is_local, join, open_url
from pipeline.embed.dataflow import Placement
from pipeline.embed.reuse import ReuseTable
from pipeline.embed.settings import cache_info, committed_text, compact_mode, full_settings, refuse
from pipeline.embed.work import EmbedWork

__all__ = ["EmbedDriver"]


class EmbedDriver:
    """The driver's side of a run: the committer (opened once the settings are known: the VAE's
    description, and the text encoders' from their first result or the committed cache), the
    workers' descriptions it checks, and the counts it reports."""

    def __init__(self, manifest: str, out: str, so: dict, request: dict, committed: CacheMeta | None, vae: dict,
                 placement: Placement, validation: list[dict], commit_seconds: float, reuse: ReuseTable | None = None):
        self.manifest, self.out, self.so, self.request, self.committed, self.vae, self.placement = (
            manifest, out, so, request, committed, vae, placement)  # fmt: skip
        self.reuse = reuse  # embed --reuse: the records other caches hold, taken instead of encoded
        self.taken = {"samples": 0, "texts": 0, "refused": 0}  # records taken from --reuse caches (refused: not)
        self.commit_seconds = commit_seconds
        self.validation = validation  # listed in _cache.json: the prompts of this run, else the committed ones
        self.committer: CacheCommitter | None = None
        self.seen: dict[str, dict] = {}  # phase -> the first worker's encoder description
        self.nodes: set[str] = set()  # Ray nodes whose VAE workers returned results
        self.notices: set[str] = set()
        self.throttles = job_throttles() or ThrottleTally()  # the workers' throttled storage answers go here
        self.embedded = self.errors = self.shards = 0
        self.steady_images, self.steady_seconds = 0, 0.0  # images after the first result, and their seconds
        self.written = {"texts": [0, 0], "samples": [0, 0]}  # kind -> [records, compressed bytes] of this run
        if committed is not None:  # refuse other VAE weights now, before any caption is encoded
            old = committed.settings.hashed
            full = full_settings(self.request, vae, old["text"])
            # other VAE weights, or other --features (or none, for a cache that has them): refused now
            new = {**{k: v for k, v in old.items() if k != "features"}, "vae": full["vae"],
                   **({"features": full["features"]} if "features" in full else {})}  # fmt: skip
            refuse(out, settings_diff(old, new))

    def _open(self, text: dict) -> None:
        settings = full_settings(self.request, self.vae, text)
        info = cache_info(self.so, settings, self.vae, text, self.validation)
        self.committer = CacheCommitter(self.out, settings, info, self.so, meta=self.committed,
                                        commit_seconds=self.commit_seconds)  # fmt: skip

    def _count(self, kind: str, rows: pa.Table) -> None:
        """Count the records of ``rows`` (index rows of this run's shards) and their compressed bytes."""
        self.written[kind][0] += rows.num_rows
        self.written[kind][1] += int(pc.sum(rows.column("length")).as_py() or 0)

    def bytes_per(self, kind: str) -> int | None:
        """Mean compressed bytes of a record of ``kind`` written by this run (None when none was)."""
        records, size = self.written[kind]
        return round(size / records) if records else None

    def _worker(self, phase: str, text: str) -> dict:
        """Check a result's worker description against the first of its phase (and the VAE probe)."""
        worker = json.loads(text)
        first = self.seen.setdefault(phase, worker)
        expected = self.vae if phase == "images" else first["encoder"]
        digests = (lambda d: [e["weights_sha256"] for e in d.get("encoders", [d])])  # noqa: E731
        text = (lambda w: digests(w["text"]) if w.get("text") else None)  # noqa: E731  # image workers' text encoders
        if digests(worker["encoder"]) != digests(expected) or text(worker) != text(first):
            raise BucketeerError(f"encoder workers on {first['host']} and {worker['host']} loaded different "
                                 "weights (nodes disagree on the model files): fix the nodes' model cache and rerun")
        if worker["notice"] and worker["notice"] not in self.notices:
            self.notices.add(worker["notice"])
            print(f"bucketeer embed: WARNING: {worker['notice']}", file=sys.stderr, flush=True)
        return worker

    def mark_visible(self) -> None:
        """A local --out gets a marker every worker must see: workers write shards there themselves."""
        from pipeline.embed.workers import VISIBLE_MARKER

        fs, root = open_url(self.out, self.so)
        if is_local(fs):
            call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
            with open(join(root, VISIBLE_MARKER), "w") as f:
                f.write(f"{os.getpid()}\n")

    def unmark_visible(self) -> None:
        from pipeline.embed.workers import VISIBLE_MARKER

        fs, root = open_url(self.out, self.so)
        if is_local(fs):
            call_storage(fs, "removing", root, lambda: os.remove(join(root, VISIBLE_MARKER)))

    def captions(self, work: EmbedWork, prompts: dict[int, str], make_text, batch_size: int) -> None:
        """Phase 1: new captions and ``prompts`` (caption key -> text: the empty caption, validation
        prompts) -> text shards, committed as they finish and all before the images."""
        from pipeline.embed.dataflow import caption_pipeline, results
        from pipeline.embed.workers import from_ipc

        if not work.captions and not prompts:  # every text has its record: the text settings are the committed ones
            if self.committed is not None:
                self._open(committed_text(self.committed))
            return  # else a family whose image workers encode every text: their first result describes it
        args = (work, prompts, self.manifest, self.so, make_text, self.request["dtype"], self.out, batch_size,
                self.placement, self.reuse, compact_mode(self.request))  # fmt: skip
        if self.placement.executor == "local":
            from pipeline.embed.local import caption_results

            rows = caption_results(*args)
        else:
            rows = results(caption_pipeline(*args))
        written = 0
        total = work.new_captions + len(prompts)
        with Progress("embed", "captions", total=total, unit="captions") as progress:
            for row in rows:
                self.throttles.add(*row["throttled"])
                worker = self._worker("captions", row["worker"])
                if self.committer is None:
                    self._open(worker["encoder"])
                rows = from_ipc(row["texts"])
                self.taken["texts"] += int(row.get("taken") or 0)
                self.committer.add("texts", rows)
                self._count("texts", rows)
                written += row["shard_bytes"]
                self.shards += 1
                progress.update(rows.num_rows, written=f"{written / 1e6:.1f} MB")
                if self.committer.due():
                    self.committer.commit()
        self.committer.commit()  # text records are committed before any sample that refers to them

    def images(self, work: EmbedWork, source: str, make_vae, options: dict[str, Any], make_text=None) -> None:
        """Phase 2: units of rows -> sample shards and error rows, committed every --commit-seconds.
        ``options``: what the image workers take (batch size, crop, variants, ...;
        :func:`pipeline.embed.dataflow.image_pipeline`); ``make_text``: the text encoders, for the captions
        that only one sample has (encoded into its record; their text rows come with its sample rows)."""
        from pipeline.embed.dataflow import image_pipeline, results
        from pipeline.embed.workers import from_ipc

        make_text = make_text if work.inline_captions else None
        args = (work, self.manifest, source, self.so, make_vae, self.request["dtype"], self.out, options,
                self.placement, make_text)  # fmt: skip
        if self.placement.executor == "local":
            from pipeline.embed.local import image_results

            rows = image_results(*args)
        else:
            rows = results(image_pipeline(*args))
        written, first, start, results_seen, images_seen = 0, None, time.time(), 0, 0
        with Progress("embed", "images", total=work.todo, unit="images") as progress:
            for row in rows:
                self.throttles.add(*row["throttled"])
                worker = self._worker("images", row["worker"])
                if self.committer is None:  # Qwen-Image-Edit: the text encoders are the image workers'
                    self._open(worker["text"])
                elif worker.get("text") and self.committed is not None and results_seen == 0:
                    # a resumed cache: the image workers' text encoders must be the ones it was embedded with
                    old = self.committed.settings.hashed
                    refuse(self.out, settings_diff(old, {**old, "text": full_settings(self.request, self.vae,
                                                                                      worker["text"])["text"]}))
                if self.committer.meta.compute is None:
                    self.committer.set_compute(ComputeInfo(device=worker["device"], gpus=self.placement.gpus_now,
                                                           dtype=worker["encoder"].get("compute_dtype")))  # fmt: skip
                self.nodes.add(worker["node"])
                samples, errors = from_ipc(row["samples"]), from_ipc(row["errors"])
                for kind, column in (("samples", "taken"), ("texts", "texts_taken"), ("refused", "refused")):
                    self.taken[kind] += int(row.get(column) or 0)
                self.embedded += self.committer.add("samples", samples)
                self._count("samples", samples)
                self.errors += self.committer.add("errors", errors)
                written += row["shard_bytes"]
                self.shards += bool(row["shard_bytes"])
                progress.update(samples.num_rows + errors.num_rows, written=f"{written / 1e6:.1f} MB",
                                errors=self.errors)  # fmt: skip
                results_seen, images_seen = results_seen + 1, images_seen + samples.num_rows
                if first is None:
                    first = time.time()
                else:
                    self.steady_images += samples.num_rows
                    self.steady_seconds = time.time() - first
                if self.committer.due():
                    self.committer.commit()
        if results_seen < 3:  # one or two units finish together: their gap says nothing about the rate
            self.steady_images, self.steady_seconds = images_seen, time.time() - start
        self.committer.commit()
