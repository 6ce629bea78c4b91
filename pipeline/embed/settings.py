"""What an embed run writes into ``_cache.json`` besides the index: the fingerprinted settings and the
facts that say how to read the records.

The settings are built in two steps, so that a mismatch with an existing cache fails before any
work: :func:`request_settings` (what the options ask for, known before any model is loaded; checked
first by :func:`check_early`), then :func:`full_settings` (with the loaded encoders' classes, weight
hashes and text layout). :func:`cache_info` is the rest of ``_cache.json``: latent scaling, text
layout, the empty caption and validation prompts. The settings dict is exactly what the fingerprint
hashes (:func:`manifests.cache.fingerprint_of`): its keys and values are a format contract.
"""

from __future__ import annotations

from typing import Any

from manifests.cache import CACHE_FORMAT_VERSION, CacheError, CacheMeta, CacheMissingError, read_cache_meta
from manifests.cache import settings_diff
from manifests.cache.records import caption_key
from manifests.storage import public_options, redact
from pipeline.embed.latents import LatentSpec
from pipeline.embed.encoders import TextSpec
from pipeline.embed.families import get_family, qwen_image_edit

# what ``_cache.json`` settings ``masks`` says when the records carry loss masks (SampleRecord.mask)
MASKS_SETTING = "uint8 0..255 at the latent grid: cropped and flipped like the image, area-averaged"

# what ``_cache.json`` settings ``text.compact`` says of ``embed --text-dtype fp8`` (manifests.cache.compact)
COMPACT_TEXT = {"fp8": "float8 e4m3 codes, a float32 scale per row (amax / 448), read back as float32"}

# what ``_cache.json`` settings ``video.clips`` says: which clips of a video its record holds
VIDEO_CLIPS = "up to max_clips of the video's non-overlapping clips, evenly spaced; one variant each (x2 with flip)"

__all__ = ["MASKS_SETTING", "VIDEO_CLIPS", "COMPACT_TEXT", "compact_mode", "request_settings", "check_early",
           "vae_settings", "full_settings", "committed_text",
           "cache_info", "refuse"]

_VAE_KEYS = ("class", "weights_sha256", "factor", "channels", "scaling_factor", "shift_factor")
_VIDEO_VAE_KEYS = ("latents_mean", "latents_std", "temporal_factor")


def request_settings(
    latent: LatentSpec, text: TextSpec, *, dtype: str, bucket_spec: dict, crop: str, seed: int, crops: int,
    flip: bool, conditioning: bool = False, masks: bool = False, max_clips: int | None = None,
    reference: int | None = None, compact: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The settings known before any model is loaded (checked first, so a mismatch fails fast).
    ``dtype``: the stored dtype (``BF16``, ...); ``conditioning``: the manifest pairs its samples with
    conditioning images. ``latent.features`` (``--features``): a ``features`` section, fingerprinted like
    the encoders (a cache is made with or without features, never both: resuming with other ``--features``
    is refused); ``masks``: the manifest has loss masks (``scan --masks``); ``max_clips``: a video manifest's
    ``--max-clips`` (None for images: a ``video`` section only in video caches); ``reference``: the area in pixels
    a ``reference`` family resizes its conditioning images to (``--reference-resolution`` squared), which the
    ``conditioning`` setting names; ``compact``: ``--text-dtype fp8`` (:data:`COMPACT_TEXT` says what it stores), a
    ``text.compact`` setting only then."""
    features = latent.features
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "family": text.family,
        "dtype": dtype,
        "buckets": bucket_spec,
        "crop": crop,
        "seed": seed if crop == "random" or crops > 1 else None,
        "resample": "lanczos",
        "pixels": "rgb, [-1, 1], exif-transposed, alpha on white",
        "latent": "posterior_mean" if latent.latents == "mean" else "posterior_mean_std",
        "model": None if text.model is None else text.model.ident,
        "vae": {"id": latent.source.ident, "subfolder": latent.source.subfolder},
        "text": {"layer": text.layer, "max_text_tokens": text.max_tokens,
                 "encoders": [{"id": t.ident, "subfolder": t.subfolder} for t in text.sources],
                 **({"compact": COMPACT_TEXT[compact]} if compact else {})},
        # only when used, so that caches made before these options keep their settings (and fingerprint)
        **({"variants": {"crops": crops, "flip": flip}} if crops > 1 or flip else {}),
        **({"conditioning": qwen_image_edit.conditioning_setting(reference) if reference else
            "same crop and variants as the image"} if conditioning else {}),
        **({"features": {"kind": features.kind, "id": features.ident}} if features is not None else {}),
        **({"masks": MASKS_SETTING} if masks else {}),
        **({"video": {"max_clips": max_clips, "clips": VIDEO_CLIPS, "decoder": "pyav"}}
           if max_clips is not None else {}),
    }  # fmt: skip


def compact_mode(settings: dict) -> str | None:
    """``--text-dtype``'s compact mode (``"fp8"``) of requested or hashed ``settings``, None for exact text."""
    said = settings.get("text", {}).get("compact")
    return next((mode for mode, text in COMPACT_TEXT.items() if text == said), None) if said else None


def check_early(url: str, storage_options: dict, request: dict) -> CacheMeta | None:
    """Refuse a cache made with other requested settings; its ``_cache.json``, None when there is no cache."""
    try:
        meta = read_cache_meta(url, storage_options)
    except CacheMissingError:
        return None
    refuse(url, settings_diff(meta.settings.hashed, request, only_new_keys=True))
    return meta


def vae_settings(request: dict, vae: dict) -> dict[str, Any]:
    """``request`` with the VAE's ``describe()`` (and the features model's): every setting that makes a latent is
    then as ``_cache.json`` hashes it (what ``embed --reuse`` compares)."""
    settings = {**request}
    settings["vae"] = {**request["vae"], **{k: vae[k] for k in _VAE_KEYS},
                       **{k: vae[k] for k in _VIDEO_VAE_KEYS if vae.get(k) is not None},  # video VAEs only
                       **({"normalised": vae["normalised"]} if vae.get("normalised") else {})}  # Qwen-Image's VAE
    if "features" in request:
        settings["features"] = {**request["features"], **vae["features"]}
    return settings


def full_settings(request: dict, vae: dict, text: dict) -> dict[str, Any]:
    """The fingerprinted settings: ``request`` with the VAE's and text encoders' ``describe()``."""
    settings = vae_settings(request, vae)
    settings["text"] = {**request["text"], "pipeline": text["pipeline"], "pooled_dim": text["pooled_dim"],
                        "layout": text["layout"], "encoders": [
        {**r, **{k: e[k] for k in ("class", "weights_sha256", "max_length", "hidden_size")},
         **({"processor": e["processor"]} if e.get("processor") else {})}  # a multimodal family's resize code
        for r, e in zip(request["text"]["encoders"], text["encoders"])]}  # fmt: skip
    return settings


def committed_text(meta: CacheMeta) -> dict[str, Any]:
    """The text encoders' ``describe()`` as a committed ``_cache.json`` records it (a run with no new
    caption loads no text encoder). The hashed parts come from the settings exactly as hashed."""
    hashed = meta.settings.hashed["text"]
    return {**meta.text.to_json(), **{k: hashed[k] for k in ("pipeline", "pooled_dim", "layout", "encoders")}}


def cache_info(so: dict, settings: dict, vae: dict, text: dict, validation: list[dict]) -> dict[str, Any]:
    """What ``_cache.json`` says besides the fingerprinted settings, as JSON (the committer parses it
    into :class:`~manifests.cache.CacheMeta`): how to read the tensors, the text records besides the
    captions (the empty caption, ``validation`` prompts)."""
    posterior = vae["latents"] == "posterior"
    video = {k: vae[k] for k in _VIDEO_VAE_KEYS if vae.get(k) is not None}  # AutoencoderKLWan: per-channel
    usage = (vae.get("usage") or "clip latents (C, F', h, w), F' = (F - 1) // temporal_factor + 1; "
             "z = (latent - latents_mean) / latents_std per channel" if video else
             ("latent = latent + latent_std * noise; " if posterior else "")
             + (vae.get("usage") or ("z = latent, stored normalised (latent.normalised)" if vae.get("normalised") else
                                     "z = (latent - shift_factor) * scaling_factor (shift 0 when null)")))  # fmt: skip
    return {
        "family": text["family"],
        "latent": {"kind": "posterior_mean_std" if posterior else "posterior_mean", "dtype": settings["dtype"],
                   "channels": vae["channels"], "factor": vae["factor"], "scaling_factor": vae["scaling_factor"],
                   "shift_factor": vae["shift_factor"], "usage": usage, **video,
                   **({"normalised": vae["normalised"]} if vae.get("normalised") else {})},
        "text": {"family": text["family"], "pipeline": text["pipeline"], "dtype": settings["dtype"],
                 "layer": text["layer"], "max_tokens": text["max_tokens"], "pooled_dim": text["pooled_dim"],
                 **({"compact": settings["text"]["compact"]} if settings["text"].get("compact") else {}),
                 "encoders": [{"id": e["id"], "class": e["class"], "hidden_size": e["hidden_size"],
                               "max_length": e["max_length"]} for e in text["encoders"]],
                 "layout": text["layout"],
                 # its text record: caption dropout, a null caption's text (none where text depends on the image)
                 "empty_caption_key": None if get_family(text["family"]).reference else caption_key(""),
                 "validation_prompts": validation},
        **({"features": {**settings["features"], "dtype": "F16",
                         "usage": "record features (gh, gw, dim) = last_hidden_state patch tokens of the variant's "
                                  "crop resized to input_size, normalised with mean/std (pipeline.embed.features)"}}
           if "features" in settings else {}),
        "gzip": "zlib",  # what compresses the records (Huffman-only and stored blocks); `records` says how
        "storage_options": public_options(so),
    }  # fmt: skip


def refuse(url: str, diff: list[str]) -> None:
    """CacheError listing ``diff`` (``settings_diff`` lines) when there is any."""
    if diff:
        raise CacheError(f"{redact(url)} was embedded with other settings:\n  " + "\n  ".join(diff)
                         + "\nUse a new --out for these settings (a cache holds exactly one setting).")  # fmt: skip
