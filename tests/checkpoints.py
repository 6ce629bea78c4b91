"""The real checkpoints' preprocessing files (tokenizers, processors, chat templates, configs), as test fixtures.

``tests/fixtures/checkpoints/<family>/`` mirrors the real checkpoint's folder (``tokenizer/``, ``scheduler/``,
``vae/config.json``, ...) without its weights. Small files lie there verbatim; a large one (a vocabulary, a
``tokenizer.json``, a SentencePiece model) lies there as ``<name>.blob``, one line of JSON naming an xz-compressed
file in ``tests/fixtures/checkpoints/blobs/`` (stored once, whichever families share it) and the sha256 and size of
the file it decompresses to. ``SOURCES.md`` in each family folder says where every file came from and its licence.

:func:`materialize` writes a family's files out as the folder the checkpoint has, checked against the recorded
hashes, so that ``AutoTokenizer`` / ``AutoProcessor`` / ``from_pretrained`` read them exactly as from the hub.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
from pathlib import Path

ROOT = Path(__file__).parent / "fixtures" / "checkpoints"
BLOBS = ROOT / "blobs"
NOT_FILES = {"SOURCES.md"}


def families() -> list[str]:
    """The families that have a fixture folder."""
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "blobs")


def files(family: str) -> dict[str, Path]:
    """``{path in the checkpoint: fixture file}`` of ``family`` (a ``.blob`` pointer under its real name)."""
    base = ROOT / family
    out = {}
    for p in sorted(base.rglob("*")):
        if p.is_file() and p.name not in NOT_FILES:
            rel = p.relative_to(base).as_posix()
            out[rel.removesuffix(".blob")] = p
    return out


def read(pointer: Path) -> bytes:
    """The bytes of a fixture file (a ``.blob`` pointer decompressed and checked against its sha256)."""
    if pointer.suffix != ".blob":
        return pointer.read_bytes()
    ref = json.loads(pointer.read_text())
    data = lzma.decompress((BLOBS / ref["blob"]).read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref["sha256"] or len(data) != ref["bytes"]:
        raise ValueError(f"{pointer}: {ref['blob']} decompresses to sha256 {digest}, not {ref['sha256']}")
    return data


def materialize(family: str, dest: Path) -> Path:
    """Write ``family``'s fixture files under ``dest`` as the checkpoint lays them out; returns ``dest``."""
    for rel, src in files(family).items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".blob":
            target.write_bytes(read(src))
        else:
            shutil.copyfile(src, target)
    return dest


def store(data: bytes, name: str, pointer: Path) -> None:
    """Store ``data`` (a large file called ``name``) as an xz blob and write ``pointer`` (``<name>.blob``) to it:
    what a session adding a fixture runs once."""
    digest = hashlib.sha256(data).hexdigest()
    blob = f"{digest[:16]}.{name}.xz"
    BLOBS.mkdir(parents=True, exist_ok=True)
    if not (BLOBS / blob).exists():
        (BLOBS / blob).write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(json.dumps({"blob": blob, "sha256": digest, "bytes": len(data)}) + "\n")


# the token ids a text encoder's config holds, copied from the real checkpoint's config onto the tiny model
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "video_token_id",
                  "vision_start_token_id", "vision_end_token_id", "image_token_index", "boi_token_index",
                  "eoi_token_index")  # fmt: skip


def _load_component(cls_name: str, folder: Path):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(folder)


def real_files_pipeline(family: str, folder: Path) -> Path:
    """``family``'s tiny random-weight pipeline (:func:`pipeline.embed.families.tiny.tiny_pipeline`) with the real
    checkpoint's tokenizer and processor files in place of the stand-ins, saved to ``folder`` as the checkpoint
    lays it out: each ``tokenizer*`` / ``processor`` subfolder holds the fixture files verbatim and
    ``model_index.json`` names the classes the real one names, so that ``DiffusionPipeline.from_pretrained`` loads
    them as it loads the real checkpoint. Each text encoder's vocabulary is resized to its tokenizer's (new rows
    random) and takes the real config's special token ids. Returns ``folder``."""
    import json as _json

    import torch

    from pipeline.embed.families.tiny import save_pipeline, tiny_pipeline

    src = materialize(family, folder.parent / f".{folder.name}-files")
    index_path = src / "model_index.json"
    index = _json.loads(index_path.read_text()) if index_path.exists() else {}
    pipe = tiny_pipeline(family)
    names = [n for n in pipe.components if (n.startswith("tokenizer") or n == "processor")
             and ((src / n).is_dir() or pipe.components[n] is not None)]  # a component the tiny leaves out: not it
    classes = {}
    torch.manual_seed(0)
    for name in names:
        if not (src / name).is_dir():
            raise FileNotFoundError(f"{family}: the fixtures have no {name}/ folder")
        current = pipe.components[name]
        classes[name] = (index.get(name) or [None, None])[1] or type(current).__name__
        loaded = _load_component(classes[name], src / name)
        setattr(pipe, name, loaded)
        if name == "processor":
            continue
        encoder = pipe.components.get(name.replace("tokenizer", "text_encoder"))
        if encoder is None:
            continue
        tokenizer = getattr(loaded, "tokenizer", loaded)
        encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        config_file = src / name.replace("tokenizer", "text_encoder") / "config.json"
        real = _json.loads(config_file.read_text()) if config_file.exists() else {}
        for key in _TOKEN_ID_KEYS:
            if key in real and hasattr(encoder.config, key):
                setattr(encoder.config, key, real[key])
    save_pipeline(pipe, folder)
    for name in names:  # the real files verbatim, not a re-serialisation of them
        shutil.rmtree(folder / name, ignore_errors=True)
        shutil.copytree(src / name, folder / name)
    saved = _json.loads((folder / "model_index.json").read_text())
    saved.update({name: ["transformers", cls] for name, cls in classes.items()})
    (folder / "model_index.json").write_text(_json.dumps(saved, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(src)
    return folder
