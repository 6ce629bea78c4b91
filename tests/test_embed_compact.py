"""``embed --text-dtype fp8``: compact text records end to end (pipeline.embed, manifests.cache.compact).

Every text record, a shared caption's and one held inline in its sample's record, is stored as float8 codes with a
scale per row, each value within e4m3's bound of the exact float32 text; the setting is in the fingerprint; verify
passes; ``estimate`` gives the bytes the run writes; a compact cache trains; ``--reuse`` takes its latents and
encodes its text.
"""

from __future__ import annotations

import numpy as np
import pytest

from manifests.cache import CacheReader, read_cache_meta, read_index
from manifests.cache.codec import decode_record
from manifests.cache.records import to_float32
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from manifests.storage import join, open_url
from tests.embed_data import embed_args, embed_cache, make_dataset

pytestmark = pytest.mark.usefixtures("bucketeer_home")


def raw_texts(url: str) -> dict[int, dict]:
    """Each caption's stored tensors, undecoded (codes stay codes), by caption key."""
    fs, root = open_url(url)
    out = {}
    for row in read_index(url)["texts"].to_pylist():
        data = fs.cat_file(join(root, row["shard"]), start=row["offset"], end=row["offset"] + row["length"])
        tensors, meta = decode_record(data)
        prefix = "text." if meta.get("kind") == "sample" else ""
        out[row["caption_key"]] = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return out


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("compact")
    root, manifest = str(base / "images"), str(base / "manifest")
    make_dataset(root, manifest, 10, unique_from=7)  # shared captions and 3 of their own (held inline)
    paths = {"manifest": manifest}
    for name, options in (("exact", {"dtype": "fp32"}), ("fp8", {"text_dtype": "fp8"})):
        paths[name] = str(base / name)
        embed_cache(manifest, paths[name], family="flux2", model="default", executor="local", **options)
    return paths


def test_every_text_record_is_float8_within_its_bound_of_the_exact_text(caches):
    exact, compact = CacheReader(caches["exact"]), CacheReader(caches["fp8"])
    raw = raw_texts(caches["fp8"])
    inline = read_index(caches["fp8"])["samples"].column("text_inline").to_pylist()
    assert any(inline) and not all(inline)  # both kinds of text record are checked
    keys = [set(read_index(caches[k])["texts"].column("caption_key").to_pylist()) for k in ("exact", "fp8")]
    assert set(raw) == keys[0] == keys[1]
    for key, tensors in raw.items():
        assert tensors["tokens.0"][1] == "F8_E4M3" and tensors["tokens.0.scale"][1] == "F32"
        a, b = exact.read_texts([key])[0], compact.read_texts([key])[0]
        assert b.dtype == "F32"
        for x, y in zip(a.tokens, b.tokens):
            x = to_float32(x, a.dtype)
            scale = np.abs(x).max(axis=1, keepdims=True) / 448  # (L, 1): per row
            assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-4 + scale * 2.0**-9 + 1e-30)
    assert verify_cache(caches["fp8"]).ok


def test_the_setting_is_in_the_fingerprint_and_a_rerun_with_the_other_is_refused(caches, tmp_path):
    import shutil

    exact, compact = read_cache_meta(caches["exact"]), read_cache_meta(caches["fp8"])
    assert compact.settings.hashed["text"]["compact"].startswith("float8 e4m3")
    assert "compact" not in exact.settings.hashed["text"] and compact.text.compact
    shutil.copytree(caches["fp8"], tmp_path / "fp8")
    make_dataset(str(tmp_path / "images"), str(tmp_path / "manifest"), 11, unique_from=7)  # one image more
    with pytest.raises(UsageError, match="text.compact"):  # exact text never joins a compact cache
        embed_cache(str(tmp_path / "manifest"), str(tmp_path / "fp8"), family="flux2", model="default",
                    executor="local")  # fmt: skip


def test_the_estimate_gives_the_bytes_the_run_writes(caches, tmp_path):
    from pipeline.estimate import EstimateJob, estimate

    job = embed_args(caches["manifest"], str(tmp_path / "new"), "--family", "flux2", "--model", "default",
                     "--text-dtype", "fp8")  # fmt: skip
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    written = sum(a.nbytes for tensors in raw_texts(caches["fp8"]).values() for a, _ in tensors.values())
    assert bill.text_bytes == written


@pytest.mark.slow
@pytest.mark.dist
def test_a_compact_cache_trains(tmp_path):
    from pipeline import PlanJob, run
    from tests.test_train import write_config
    from tests.test_train_dist import consumed, launch, rows

    root, manifest, cache = str(tmp_path / "images"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(root, manifest, 8, unique_from=6)
    embed_cache(manifest, cache, text_dtype="fp8", executor="local")
    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=1, epochs=1, seed=3, cache=(cache,)))
    out = tmp_path / "run"
    launch(1, "--plan", plan, "--cache", cache, "--config", write_config(tmp_path / "c.yaml", log_every=1),
           "--output-dir", out, "--record-samples", out / "rec")  # fmt: skip
    assert consumed(out / "rec", 0) == rows(plan, 0)


def test_reuse_takes_a_compact_caches_latents_and_encodes_its_text(caches, tmp_path, capsys):
    """A compact text record is never copied: read back and quantized again, its scales could differ from a fresh
    encode's. The latents are taken."""
    result = embed_cache(caches["manifest"], str(tmp_path / "again"), family="flux2", model="default",
                         text_dtype="fp8", reuse=(caches["fp8"],), executor="local")  # fmt: skip
    assert (result.reused_samples, result.reused_texts) == (10, 0)
    assert "--text-dtype fp8 records are encoded, not copied" in capsys.readouterr().out
    assert verify_cache(str(tmp_path / "again")).ok
