"""REPA from cached DINOv2 features vs DINOv2 run live in the training step; cache bytes per sample with features.

    python benchmarks/repa.py                      # tiny and mid-size configs, CPU, 1 torch thread
    python benchmarks/repa.py --configs tiny --steps 8,24 --rounds 2

Each config is a denoiser (the trainer's from-scratch PixArt transformer, ``train.model.build_model``) with the
trainer's REPA term (``train.repa.Repa``: hook, projector, loss) and a DINOv2 (``transformers.Dinov2Model``, random
weights of the named size), the same batch for both arms:

- **cached**: the step reads the features from the batch (what ``embed --features dinov2`` stores);
- **live**: the step first runs DINOv2 on the batch's pixels (``pipeline.embed.features.preprocess``, inference
  mode), as a trainer without a feature cache must, then the same loss.

Step cost is the **marginal CPU time per step** (``time.process_time`` over two run lengths, the difference divided
by the difference in steps, so set-up and warm-up drop out), arms interleaved round by round. ``--threads 1``
keeps the figure meaningful on a shared machine; wall-clock figures would be noise at the load here. Bytes:
``encode_sample`` (the writers' planar gzip records) of one sample with and without its features, latents and
features of random values (neither compresses much; real DINOv2 features are layer-normed like these).

No GPU on the machine this was written on: the CUDA row is for a GPU run (``--device cuda``; the code moves the
models and batch there and uses bf16 autocast for both arms). Every round's figures go to
``benchmarks/results/repa.json`` (``benchmarks/results.py``; ``--save NAME`` for another name, e.g. a CUDA run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from manifests.cache.records import SampleRecord, encode_sample  # noqa: E402
from pipeline.embed.features import IMAGENET_MEAN, IMAGENET_STD, preprocess  # noqa: E402
from train.model import build_model, flow_matching_loss, step_generator  # noqa: E402
from train.repa import Repa, RepaConfig  # noqa: E402

from benchmarks.results import Run  # noqa: E402

# name: (image side px, batch, denoiser model config, DINOv2 config, DINOv2 input side)
CONFIGS = {
    "tiny": (64, 4, {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 24, "sample_size": 8},
             {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8, "mlp_ratio": 2,
              "image_size": 32}, 32),
    # ViT-S/14 (dinov2-small's shape) at 224 beside a 12-layer, 384-wide PixArt on 256 px (32x32 latents), batch 2
    "mid": (256, 2, {"num_layers": 12, "num_attention_heads": 6, "attention_head_dim": 64, "sample_size": 32},
            {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6, "patch_size": 14,
             "image_size": 224}, 224),
}  # fmt: skip


class Arm:
    """One arm's model, projector, optimizer and step on one fixed batch."""

    def __init__(self, name: str, live: bool, device: str):
        from transformers import Dinov2Config, Dinov2Model

        side, b, model_cfg, dino_cfg, dino_side = CONFIGS[name]
        torch.manual_seed(0)
        self.device, self.live, self.side = device, live, dino_side
        self.dino = Dinov2Model(Dinov2Config(**dino_cfg)).eval().to(device)
        self.model = build_model(model_cfg, latent_channels=4, caption_channels=32).to(device)
        dim = dino_cfg["hidden_size"]
        self.repa = Repa(RepaConfig(depth=model_cfg["num_layers"] // 3, projector_dim=2048 if name == "mid" else 64),
                         self.model, dim, device)  # fmt: skip
        self.optimizer = torch.optim.AdamW([*self.model.parameters(), *self.repa.parameters()], lr=1e-4)
        rng = np.random.default_rng(0)
        self.pixels = torch.from_numpy(rng.integers(0, 255, (b, side, side, 3), dtype=np.uint8)).to(device)
        self.latents = torch.randn(b, 4, side // 8, side // 8, device=device)
        self.text, self.mask = torch.randn(b, 8, 32, device=device), torch.ones(b, 8, device=device)
        self.cond = {"resolution": torch.full((b, 2), float(side), device=device),
                     "aspect_ratio": torch.ones(b, 1, device=device)}  # fmt: skip
        self.cached = self.features() if not live else None  # (B, g, g, D) float16, as the loader hands them
        self.step_index = 0

    def features(self) -> torch.Tensor:
        with torch.inference_mode():
            x = preprocess(self.pixels, (self.side, self.side), IMAGENET_MEAN, IMAGENET_STD)
            tokens = self.dino(pixel_values=x).last_hidden_state[:, 1:]
            g = int(round(tokens.shape[1] ** 0.5))
            return tokens.reshape(len(x), g, g, -1).to(torch.float16)

    def step(self) -> None:
        self.step_index += 1
        features = self.features() if self.live else self.cached
        batch = type("Batch", (), {"latents": self.latents, "features": features})()
        with torch.autocast(self.device, torch.bfloat16, enabled=self.device == "cuda"):
            loss = flow_matching_loss(self.model, self.latents, self.text, self.mask, self.cond,
                                      step_generator(0, 0, self.step_index, 0))  # fmt: skip
            loss = loss + self.repa.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()


def timed(arm: Arm, steps: int) -> float:
    t0 = time.process_time()
    for _ in range(steps):
        arm.step()
    return time.process_time() - t0


def record_bytes(name: str) -> tuple[int, int]:
    """Compressed bytes of one sample record without and with its features (random values)."""
    side, _, _, dino_cfg, dino_side = CONFIGS[name]
    rng = np.random.default_rng(1)
    latent = (rng.standard_normal((4, side // 8, side // 8), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    g = dino_side // dino_cfg["patch_size"]
    features = rng.standard_normal((g, g, dino_cfg["hidden_size"])).astype(np.float16)
    plain = SampleRecord(sample_id=1, bucket=f"{side}x{side}", latent=latent, dtype="BF16", original_size=(side, side),
                         resized_size=(side, side), crop_top_left=(0, 0), target_size=(side, side), caption_key=1)
    with_features = SampleRecord(**{**plain.__dict__, "features": features})
    return len(encode_sample(plain)), len(encode_sample(with_features))


def real_sizes() -> list[tuple[str, list[int]]]:
    """Record bytes at real sizes (random values; encode only): latents of three models beside the 16 x 16 patch
    features of dinov2-small / base / large at 224 px."""
    rng = np.random.default_rng(2)
    print("\n| latent (bf16) | record w/o features | + dinov2-small 16x16x384 | + base 16x16x768 | + large 16x16x1024 |"
          "\n|---|---|---|---|---|")
    shapes = (("256 px, 4x32x32 (SiT/DiT)", (4, 32, 32)), ("1024 px, 4x128x128 (SDXL, PixArt)", (4, 128, 128)),
              ("1024 px, 16x128x128 (SD3, Flux)", (16, 128, 128)))
    rows = []
    for label, shape in shapes:
        latent = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        side = shape[1] * 8
        plain = SampleRecord(sample_id=1, bucket=f"{side}x{side}", latent=latent, dtype="BF16",
                             original_size=(side, side), resized_size=(side, side), crop_top_left=(0, 0),
                             target_size=(side, side), caption_key=1)  # fmt: skip
        sizes = [len(encode_sample(plain))]
        for dim in (384, 768, 1024):
            features = rng.standard_normal((16, 16, dim)).astype(np.float16)
            sizes.append(len(encode_sample(SampleRecord(**{**plain.__dict__, "features": features}))))
        print(f"| {label} | {sizes[0]:,} | " + " | ".join(f"{n:,} (x{n / sizes[0]:.2f})" for n in sizes[1:]) + " |")
        rows.append((label, sizes))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,mid")
    parser.add_argument("--steps", default=None, help="two run lengths, e.g. 8,24 (default: tiny 10,40; mid 1,3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, every config in each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--save", default="repa", help="results/NAME.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = Run(args.save, "python benchmarks/repa.py" + "".join(f" {a}" for a in sys.argv[1:]), ["transformers"])
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}, load {os.getloadavg()[0]:.1f}")
    configs = {}
    for name in args.configs.split(","):
        steps = tuple(int(x) for x in (args.steps or ("10,40" if name == "tiny" else "1,3")).split(","))
        arms = {"cached": Arm(name, False, args.device), "live": Arm(name, True, args.device)}
        for arm in arms.values():
            arm.step()  # warm-up
        configs[name] = (steps, arms)
    for r in range(args.rounds):
        with run.round():  # interleaved: both arms of every config see the same machine
            print(f"round {r + 1}\n| config | cached: CPU s/step | live DINOv2: CPU s/step | saved by the cache | "
                  "record bytes w/o -> with features |\n|---|---|---|---|---|")
            for name, ((short, long), arms) in configs.items():
                rate = {}
                for key, arm in arms.items():
                    a, b = timed(arm, short), timed(arm, long)
                    rate[key] = (b - a) / (long - short)
                cached, live = rate["cached"], rate["live"]
                plain, featured = record_bytes(name)
                print(f"| {name} | {cached:.4f} | {live:.4f} | {1 - cached / live:.0%} of the live step "
                      f"({live / cached:.2f}x) | {plain:,} -> {featured:,} (x{featured / plain:.1f}) |", flush=True)
                run.add(f"{name}: cached features, CPU per step", cached, "s")
                run.add(f"{name}: DINOv2 live, CPU per step", live, "s")
                run.add(f"{name}: live / cached", live / cached, "x")
                run.add(f"{name}: record bytes without features", plain, "B")
                run.add(f"{name}: record bytes with features", featured, "B")
            for label, sizes in real_sizes():
                run.add(f"record bytes, {label}, without features", sizes[0], "B")
                for model, n in zip(("dinov2-small", "dinov2-base", "dinov2-large"), sizes[1:]):
                    run.add(f"record bytes, {label}, + {model} features", n, "B")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    run.save()


if __name__ == "__main__":
    main()
