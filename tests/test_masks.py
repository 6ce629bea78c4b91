"""Loss masks: ``scan --masks alpha,files`` finds them, embed stores them at the latent grid cut like their
image (crop and flip), the trainer's ``masked_loss`` weights the loss by them, per sample."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from manifests.cache.records import RecordError, SampleRecord, decode_sample, encode_sample
from manifests.errors import UsageError
from pipeline.embed.imaging import ImageFailure, prepare_views
from pipeline.embed.masks import mask_views, to_latent_grid, variant_masks
from pipeline.sources.masks import parse_masks
from tests.embed_data import SPEC, jpeg
from tests.shards import tar_bytes
from train.masks import MaskedLoss, mask_weights, masked_mse, stack_masks


def _png(array: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, "PNG")
    return buf.getvalue()


def _blocks(mask: np.ndarray, f: int) -> np.ndarray:
    """The hand computation: the mean of each f x f block, rounded (loops, not a reshape)."""
    h, w = mask.shape[0] // f, mask.shape[1] // f
    out = np.zeros((h, w), np.uint8)
    for y in range(h):
        for x in range(w):
            out[y, x] = int(np.floor(mask[y * f : (y + 1) * f, x * f : (x + 1) * f].astype(np.float64).mean() + 0.5))
    return out


# ---------------------------------------------------------------- embed: the mask cut like its image


def _alpha_image(w: int, h: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 255, (h, w, 4), dtype=np.uint8)
    rgba[..., 3] = rng.integers(0, 255, (h, w))  # every pixel its own alpha: a crop or flip off by one shows
    return _png(rgba, "RGBA"), rgba[..., 3]


def test_alpha_masks_are_cut_and_flipped_like_the_image_then_area_averaged():
    data, alpha = _alpha_image(96, 64)  # (w, h): covers the 64x64 bucket at 64x96, center crop left 16
    views = prepare_views(data, (64, 64))
    assert views[0].resized_size == (64, 96) and views[0].crop_top_left == (0, 16)
    cut = mask_views(data, "alpha", views, (64, 64), 1 << 30)  # (1, 64, 64)
    np.testing.assert_array_equal(cut[0], alpha[:, 16:80])  # no resize at this size: the crop itself
    grid = variant_masks(cut[None], 2, (8, 8))  # variant 0, then its mirror
    np.testing.assert_array_equal(grid[0], _blocks(alpha[:, 16:80], 8))
    np.testing.assert_array_equal(grid[1], _blocks(alpha[:, 16:80][:, ::-1], 8))
    # random crops (embed --crops 2): each mask crop is its view's box
    views = prepare_views(data, (64, 64), crops=2, seed=5, sample_id=9)
    cut = mask_views(data, "alpha", views, (64, 64), 1 << 30)
    for k, v in enumerate(views):
        top, left = v.crop_top_left
        np.testing.assert_array_equal(cut[k], alpha[top : top + 64, left : left + 64])


def test_a_mask_file_is_resized_like_its_image_and_must_be_its_size():
    image = jpeg(128, 96, 0)  # covers the 64x64 bucket at 64x85 -> resized, center crop
    mask = np.zeros((96, 128), np.uint8)
    mask[16:64, 40:100] = 255
    views = prepare_views(image, (64, 64))
    (rh, rw), (top, left) = views[0].resized_size, views[0].crop_top_left
    cut = mask_views(_png(mask, "L"), "a.mask.png", views, (64, 64), 1 << 30)[0]
    # by hand: Pillow's BOX resize of the mask to the resized size, then the crop box
    by_hand = np.asarray(Image.fromarray(mask).resize((rw, rh), Image.Resampling.BOX))[top : top + 64, left : left + 64]
    assert np.abs(cut.astype(int) - by_hand.astype(int)).max() <= 1  # one resampling pass vs two
    assert to_latent_grid(cut[None], (8, 8)).shape == (1, 8, 8)
    with pytest.raises(ImageFailure) as e:  # another size than its image: an error row, never a guess
        mask_views(_png(mask[:, :100], "L"), "a.mask.png", views, (64, 64), 1 << 30)
    assert e.value.kind == "mask_mismatch" and "100x96" in e.value.message
    with pytest.raises(ImageFailure) as e:
        mask_views(jpeg(128, 96, 1), "alpha", views, (64, 64), 1 << 30)
    assert e.value.kind == "mask_unusable"


def test_masks_round_trip_in_the_record_and_follow_the_variant():
    latent = np.zeros((4, 2, 3), np.float32)
    masks = np.arange(3 * 2 * 3, dtype=np.uint8).reshape(3, 2, 3)
    record = SampleRecord(sample_id=7, bucket="24x16", latent=latent, dtype="F32", original_size=(16, 24),
                          resized_size=(16, 24), crop_top_left=(0, 0), target_size=(16, 24), caption_key=1,
                          variant_latents=np.stack([latent, latent]), variant_crops=np.zeros((3, 2), np.int32),
                          variant_flips=np.array([0, 1, 0], np.uint8), mask=masks[0], variant_masks=masks[1:])
    back = decode_sample(encode_sample(record))
    for v in range(3):
        np.testing.assert_array_equal(back.variant(v).mask, masks[v])
    plain = decode_sample(encode_sample(SampleRecord(**{**record.__dict__, "mask": None, "variant_masks": None})))
    assert plain.mask is None and plain.variant(2).mask is None  # a sample without a mask
    with pytest.raises(RecordError):  # a mask that is not at the latent grid
        decode_sample(encode_sample(SampleRecord(**{**record.__dict__, "mask": masks[0][:, :2]})))


def test_large_masks_go_last_in_their_own_lz_member_and_read_back():
    from manifests.cache import codec

    y, x = np.mgrid[0:128, 0:128]
    mask = np.where((y - 64) ** 2 + (x - 60) ** 2 < 40**2, 255, 0).astype(np.uint8)  # an object mask
    latent = np.random.default_rng(0).standard_normal((4, 128, 128)).astype(np.float16)
    tensors = {"latent": (latent, "F16"), "mask": (mask, "U8"), "flips": (np.zeros(2, np.uint8), "U8")}
    data = codec.encode_record(tensors, {"kind": "x"})
    head, low = codec.encode_planar(tensors, {"kind": "x"})
    assert gzip.decompress(data) == head + low and low.endswith(mask.tobytes())  # the mask's bytes come last
    back, _ = codec.decode_record(data)
    assert np.array_equal(back["mask"][0], mask) and np.array_equal(back["latent"][0], latent)
    two_members = len(codec.encode_record({"latent": (latent, "F16")}, {"kind": "x"}))
    assert len(data) - two_members < 0.05 * mask.nbytes  # LZ finds the runs: ~400 bytes of 16 KiB


def test_a_parquet_mask_column_is_scanned_and_cut_like_its_image(tmp_path):
    """scan_parquet_file and prepare_batch, the functions the Ray tasks run, on a parquet file of 3 rows: a
    mask, no mask (null), an RGBA image with ``alpha`` asked for too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from manifests.schema import SAMPLES_SCHEMA
    from manifests.storage import open_url
    from pipeline.embed.prepare import prepare_batch
    from pipeline.sources.listing import FileEntry
    from pipeline.sources.parquet import scan_parquet_file

    mask = np.zeros((96, 64), np.uint8)
    mask[10:50, 20:60] = 200
    images = [jpeg(64, 96, 1), jpeg(64, 64, 2), _alpha_image(64, 64)[0]]
    pq.write_table(pa.table({"image": images, "mask": [_png(mask, "L"), None, None]}), tmp_path / "d.parquet")
    entry = FileEntry("d.parquet", (tmp_path / "d.parquet").stat().st_size, None, None)
    fs, root = open_url(str(tmp_path))
    rows = scan_parquet_file(fs, root, entry, image_column="image", masks=parse_masks("alpha,column:mask")).rows
    assert [(r.get("mask"), r.get("mask_size")) for r in rows] == [("column:mask", len(_png(mask, "L"))), (None, None),
                                                              ("alpha", None)]  # fmt: skip
    with pytest.raises(UsageError, match="no column 'masks'"):
        scan_parquet_file(fs, root, entry, image_column="image", masks="column:masks")
    keys = [f.name for f in SAMPLES_SCHEMA]
    rows = [{**{k: None for k in keys}, **r, "sample_id": i, "caption_key": 0} for i, r in enumerate(rows)]
    out = prepare_batch(str(tmp_path), None, "64x64", rows, "center", 0, 1 << 30, image_column="image")
    assert [r["has_mask"] for r in out["rows"]] == [True, False, True] and not out["errors"]
    np.testing.assert_array_equal(out["mask_pixels"][0], mask[16:80])  # 64x96 -> the 64x64 crop at top 16
    assert (out["mask_pixels"][1] == 255).all()  # no mask: all inside, not stored (has_mask False)
    np.testing.assert_array_equal(out["mask_pixels"][2], _alpha_image(64, 64)[1])


# ---------------------------------------------------------------- trainer: the masked loss


def test_masked_loss_equals_the_hand_computation_with_and_without_masks():
    rng = np.random.default_rng(0)
    pred, target = (torch.from_numpy(rng.normal(size=(3, 2, 2, 2)).astype(np.float32)) for _ in range(2))
    m0 = np.array([[255, 0], [0, 0]], np.uint8)  # sample 0: one pixel inside
    m2 = np.array([[255, 255], [128, 0]], np.uint8)
    stacked = stack_masks([m0, None, m2], (2, 2))  # sample 1 has none: weight 1 everywhere
    assert stacked.shape == (3, 1, 2, 2) and torch.equal(stacked[1], torch.ones(1, 2, 2))

    class Batch:
        mask = stacked

    se = ((pred - target) ** 2).numpy()  # (3, 2, 2, 2)
    for outside in (0.0, 0.25):
        got = masked_mse(pred, target, mask_weights(Batch, MaskedLoss(outside)))
        per = []
        for b, m in enumerate([m0, None, m2]):
            w = np.ones((2, 2)) if m is None else m / 255.0 + outside * (1 - m / 255.0)
            per.append(sum(w[y, x] * se[b, c, y, x] for c in range(2) for y in range(2) for x in range(2))
                       / (2 * w.sum()))  # fmt: skip
        assert got.item() == pytest.approx(np.mean(per), rel=1e-6)
    assert got.item() != pytest.approx(float(se.mean()))  # the small mask of sample 0 counts as much as the rest
    # no masks in the batch, or no masked_loss: the plain mean squared error
    Batch.mask = stack_masks([None, None, None], (2, 2))
    assert Batch.mask is None
    assert masked_mse(pred, target, mask_weights(Batch, MaskedLoss())).item() == pytest.approx(float(se.mean()))
    Batch.mask = stacked
    assert masked_mse(pred, target, mask_weights(Batch, None)).item() == pytest.approx(float(se.mean()))


def test_the_flux_recipes_packed_mask_weighs_the_same_pixels():
    from diffusers import FluxPipeline

    b, c, h, w = 2, 3, 4, 6
    gen = torch.Generator().manual_seed(0)
    pred, target, mask = torch.randn(b, c, h, w, generator=gen), torch.randn(b, c, h, w, generator=gen), \
        torch.rand(b, 1, h, w, generator=gen)  # fmt: skip
    pack = FluxPipeline._pack_latents  # (B, h/2 * w/2, 4C): what flux.py does to the latents and the mask
    packed = masked_mse(pack(pred, b, c, h, w), pack(target, b, c, h, w), pack(mask.expand(b, c, h, w), b, c, h, w))
    assert packed.item() == pytest.approx(masked_mse(pred, target, mask).item(), rel=1e-6)


def test_bad_masked_loss_and_masks_options_are_one_line_errors():
    with pytest.raises(UsageError, match="weight_outside"):
        MaskedLoss.from_config({"weight_outside": 2})
    with pytest.raises(UsageError, match="unknown keys"):
        MaskedLoss.from_config({"outside": 0.0})
    assert parse_masks("files, alpha") == "alpha,files"
    with pytest.raises(UsageError, match="--masks"):
        parse_masks("alpha,member")


# ---------------------------------------------------------------- scan -> embed -> train, on Ray


@pytest.fixture(scope="module")
def masked(tmp_path_factory, ray_local, bucketeer_home):
    """8 loose images: an RGBA png, 3 jpgs with a mask file (one of another size), 4 plain; and a tar shard of
    3 keys: a jpg with its mask member, an RGBA png, a plain jpg. Scanned with --masks (one manifest),
    embedded with --flip (default tiny encoders), planned."""
    from pipeline import PlanJob, ScanJob, run
    from tests.embed_data import embed_cache

    base = tmp_path_factory.mktemp("masks")
    root = base / "data"
    root.mkdir()
    rgba, alpha = _alpha_image(96, 64)
    (root / "rgba.png").write_bytes(rgba)
    masks = {}
    for i in range(3):
        (root / f"m{i}.jpg").write_bytes(jpeg(64, 64, i))
        m = np.zeros((64, 64 if i < 2 else 48), np.uint8)
        m[8 * i : 8 * i + 24, 16:40] = 255
        (root / f"m{i}.mask.png").write_bytes(_png(m, "L"))
        masks[f"m{i}.jpg"] = m
    for i in range(4):
        (root / f"p{i}.jpg").write_bytes(jpeg(64, 64, 10 + i))
        (root / f"p{i}.txt").write_text("a plain photo")
    member = np.zeros((96, 64), np.uint8)  # (h, w) of the member image below
    member[40:90, 8:30] = 255
    masks["shard.tar/k0.jpg"] = member
    (root / "shard.tar").write_bytes(tar_bytes([
        ("k0.jpg", jpeg(64, 96, 20)), ("k0.mask.png", _png(member, "L")), ("k0.txt", b"a shard photo"),
        ("k1.png", _alpha_image(64, 64)[0]), ("k2.jpg", jpeg(64, 64, 21))]))  # fmt: skip
    manifest, cache, plan = str(base / "manifest"), str(base / "cache"), str(base / "plan")
    scanned = run(ScanJob(source=str(root), out=manifest, spec=SPEC, masks="alpha,files"))
    embedded = embed_cache(manifest, cache, flip=True)
    run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=2, epochs=1, seed=0, cache=(cache,)))
    return {"base": base, "scanned": scanned, "embedded": embedded, "manifest": manifest, "cache": cache,
            "plan": plan, "alpha": alpha, "masks": masks}


@pytest.mark.ray
@pytest.mark.slow
def test_scan_records_masks_and_never_lists_mask_files_as_samples(masked):
    from manifests.manifest import read_manifest

    scanned = masked["scanned"]
    rows = {r["filename"]: r["mask"] for r in read_manifest(masked["manifest"]).samples.to_pylist()}
    assert rows == {"rgba.png": "alpha", "m0.jpg": "m0.mask.png", "m1.jpg": "m1.mask.png", "m2.jpg": "m2.mask.png",
                    **{f"p{i}.jpg": None for i in range(4)}, "shard.tar/k0.jpg": "shard.tar/k0.mask.png",
                    "shard.tar/k1.png": "alpha", "shard.tar/k2.jpg": None}  # fmt: skip
    s = scanned.meta.summary
    assert scanned.meta.masks == "alpha,files" and (s.masks_alpha, s.masks_files, s.mask_files) == (2, 4, 4)
    assert scanned.listed == 11 and scanned.errors == 0  # mask files and members are not images of their own
    from pipeline.report import plots
    from pipeline.report.job import manifest_section

    rows = dict(manifest_section(read_manifest(masked["manifest"]), plots).rows)  # the report counts them
    assert rows["loss masks"] == "6 of 11 samples have one (2 alpha channels, 4 mask files), 5 without"


@pytest.mark.ray
def test_embed_stores_masks_at_the_latent_grid_and_verify_checks_them(masked):
    from manifests.cache import read_cache_meta, read_index
    from manifests.schema import sample_id
    from pipeline.verify import VerifyJob, run as verify
    from tests.embed_data import records_by_id

    records = records_by_id(masked["cache"])
    rgba = records[sample_id("rgba.png")]
    crop = masked["alpha"][:, 16:80]  # 96x64 into the 64x64 bucket: center crop at left 16, no resize
    np.testing.assert_array_equal(rgba.mask, _blocks(crop, 8))
    np.testing.assert_array_equal(rgba.variant(1).mask, _blocks(crop[:, ::-1], 8))  # the flipped variant
    for name in ("m0.jpg", "m1.jpg"):
        np.testing.assert_array_equal(records[sample_id(name)].mask, _blocks(masked["masks"][name], 8))
    member = records[sample_id("shard.tar/k0.jpg")]  # 64x96 into the 64x64 bucket: center crop at top 16
    assert (member.bucket, member.resized_size, member.crop_top_left) == ("64x64", (96, 64), (16, 0))
    views = prepare_views(jpeg(64, 96, 20), (64, 64))
    cut = mask_views(_png(masked["masks"]["shard.tar/k0.jpg"], "L"), "m", views, (64, 64), 1 << 30)
    np.testing.assert_array_equal(cut[0], masked["masks"]["shard.tar/k0.jpg"][16:80])  # no resize: the crop
    np.testing.assert_array_equal(member.mask, _blocks(cut[0], 8))
    np.testing.assert_array_equal(member.variant(1).mask, _blocks(cut[0][:, ::-1], 8))
    assert records[sample_id("shard.tar/k1.png")].mask is not None
    assert all(records[sample_id(f"p{i}.jpg")].mask is None for i in range(4))
    errors = read_index(masked["cache"])["errors"].to_pylist()  # the mask of another size: an error row
    assert [(e["filename"], e["error"]) for e in errors] == [("m2.jpg", "mask_mismatch")]
    assert read_cache_meta(masked["cache"]).settings.masks
    assert verify(VerifyJob(cache=masked["cache"])).ok


@pytest.mark.ray
def test_training_with_masked_loss_runs_and_batches_carry_the_masks(masked, tmp_path):
    from manifests.cache import CacheReader
    from train.config import DEFAULT_CONFIG, load_config
    from train.data import BatchLoader, rank_steps
    from train.model import step_generator
    from train.recipes import recipe_for

    reader = CacheReader(masked["cache"])
    batches = list(BatchLoader(reader, list(rank_steps(masked["plan"], 0)), reader.meta.latent))
    with_mask = [b for b in batches if b.mask is not None]
    assert with_mask and any(b.mask is None for b in batches)  # 4 masked of 7 samples in batches of 2
    for b in with_mask:
        assert b.mask.shape == (len(b.sample_ids), 1, *b.latents.shape[-2:]) and b.mask.max() <= 1.0
    config = tmp_path / "masked.yaml"  # the config key as a user writes it
    config.write_text(Path(DEFAULT_CONFIG).read_text() + "\nmasked_loss:\n  weight_outside: 0.1\n")
    losses = []
    for cfg in (load_config(config), load_config(DEFAULT_CONFIG)):  # the family's recipe, masked and not
        torch.manual_seed(0)
        denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
        loss = denoiser.loss(denoiser.model, with_mask[0], step_generator(0, 0, with_mask[0].step, 0))
        loss.backward()
        assert loss.ndim == 0 and torch.isfinite(loss)
        losses.append(loss.item())
    assert losses[0] != pytest.approx(losses[1])  # the masks weigh the loss
