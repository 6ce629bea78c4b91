"""The image families of 2024-2025, declared (:class:`manifests.families.spec.FamilySpec`); docs/embed.md explains
them, docs/families-flux2-chroma.md and docs/families-qwen-zimage.md the newer ones."""

from __future__ import annotations

from manifests.families.spec import Encoder, FamilySpec, Objective, Sizes, Text, Vae

__all__ = ["SPECS", "FLUX1_VAE", "QWEN_IMAGE_VAE", "FLUX2_VAE"]

SD_VAE = Vae("AutoencoderKL", "scale", channels=4)  # SD 1.x / SDXL / PixArt: z * scaling_factor
FLUX1_VAE = Vae("AutoencoderKL", "scale_shift", channels=16)  # SD3, Flux.1 and those on its VAE: (z - shift) * scale
FLUX2_VAE = Vae("AutoencoderKLFlux2", "bn_patch2", factor=16, channels=128, stored="normalised")  # 2x2, batch norm
QWEN_IMAGE_VAE = Vae("AutoencoderKLQwenImage", "per_channel", channels=16, stored="normalised")  # (z - mean) / std
T5 = Encoder("text_encoder", "T5EncoderModel")
CLIP_L = Encoder("text_encoder", "CLIPTextModel")
QWEN25_VL = Encoder("text_encoder", "Qwen2_5_VLModel")
QWEN_TEMPLATE = "Qwen-Image's system message + user turn around the caption, its 34 prefix tokens dropped"

SPECS = (
    FamilySpec(
        "sdxl", "Stable Diffusion XL: CLIP-L + CLIP-G penultimate states (77 x 2048), pooled CLIP-G projection",
        ("StableDiffusionXLPipeline",),
        Text((CLIP_L, Encoder("text_encoder_2", "CLIPTextModelWithProjection")), "the caption (77 tokens, fixed)",
             "penultimate of each, side by side", "none", "all", pooled="CLIP-G text_embeds"),
        SD_VAE, Objective("UNet2DConditionModel", "ddpm", "t in [0, 1000), DDPM", "none", ("unet",), config=True),
        1, "embed.md", "CreativeML Open RAIL++-M", sizes=Sizes("CLIP-L + CLIP-bigG (77 tokens)", 128, ("SDXL_VAE",)),
        embed="sdxl:FAMILY", recipe="sdxl:RECIPE"),  # fmt: skip
    FamilySpec(
        "sd3", "Stable Diffusion 3 / 3.5: CLIP-L | CLIP-G (77) then T5 (256) on the sequence, pooled both CLIPs",
        ("StableDiffusion3Pipeline",),
        Text((Encoder("text_encoder", "CLIPTextModelWithProjection"),
              Encoder("text_encoder_2", "CLIPTextModelWithProjection"), Encoder("text_encoder_3", "T5EncoderModel")),
             "the caption", "penultimate CLIPs zero-padded to T5's width, then T5's last", "none", "all",
             {"": 256}, pooled="both CLIPs' projections"),
        FLUX1_VAE, Objective("SD3Transformer2DModel", "flow", "1000 sigma", "scheduler", patch=2, config=True),
        3, "embed.md", "Stability AI Community License",
        embed="sd3:FAMILY", recipe="sd3:RECIPE"),  # fmt: skip
    FamilySpec(
        "flux", "Flux.1: T5 (512, unmasked), pooled CLIP-L", ("FluxPipeline",),
        Text((CLIP_L, Encoder("text_encoder_2", "T5EncoderModel")), "the caption", "T5's last", "none", "all",
             {"": 512}, pooled="CLIP-L pooler_output"),
        FLUX1_VAE, Objective("FluxTransformer2DModel", "flow", "sigma", "dynamic", patch=2, config=True),
        4, "embed.md", "FLUX.1 [dev] Non-Commercial License (dev); Apache-2.0 (schnell)",
        sizes=Sizes("CLIP-L + T5-XXL (512 tokens)", 32, ("T5_XXL", "FLUX1_VAE")),
        embed="flux:FAMILY", recipe="flux:RECIPE"),  # fmt: skip
    FamilySpec(
        "pixart", "PixArt-alpha/-sigma: T5 (120/300, masked; real tokens stored)",
        ("PixArtAlphaPipeline", "PixArtSigmaPipeline"),
        Text((T5,), "the caption (cleaned)", "last", "mask", "real",
             {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300}),
        SD_VAE, Objective("PixArtTransformer2DModel", "flow_from_scratch", "1000 sigma", "none", patch=2),
        5, "embed.md", "CreativeML Open RAIL++-M",
        embed="pixart:FAMILY", recipe="pixart:RECIPE"),  # fmt: skip
    FamilySpec(
        "generic", "any --text-encoder(s): real tokens of each (masked), side by side; for bucketeer's own trainer",
        (), Text((), "the caption", "last of each", "mask", "real"), SD_VAE,
        Objective("PixArtTransformer2DModel", "flow_from_scratch", "1000 sigma", "none", patch=2),
        0, "embed.md", demo=False,
        embed="generic:FAMILY", recipe="pixart:RECIPE"),  # fmt: skip
    FamilySpec(
        "flux2", "FLUX.2-dev: Mistral Small 3.1 chat, hidden states 10/20/30 side by side (512, unmasked)",
        ("Flux2Pipeline",),
        Text((Encoder("text_encoder", "Mistral3ForConditionalGeneration"),), "chat template with FLUX.2's system "
             "message", "hidden states 10, 20, 30 side by side", "none", "all", {"": 512}),
        FLUX2_VAE, Objective("Flux2Transformer2DModel", "flow", "sigma", "flux2_empirical"),
        21, "families-flux2-chroma.md", "FLUX.2 [dev] Non-Commercial License",
        sizes=Sizes("Mistral Small 3.1 24B (chat, 512 tokens, hidden states 10/20/30)", 8,
                    ("MISTRAL_SMALL_31", "FLUX2_TRANSFORMER")),
        embed="flux2:FAMILY", recipe="flux2:RECIPE"),  # fmt: skip
    FamilySpec(
        "flux2-klein", "FLUX.2 [klein]: Qwen3 chat, hidden states 9/18/27 side by side (512, unmasked)",
        ("Flux2KleinPipeline",),
        Text((Encoder("text_encoder", "Qwen3ForCausalLM"),), "chat template (thinking off)",
             "hidden states 9, 18, 27 side by side", "none", "all", {"": 512}),
        FLUX2_VAE, Objective("Flux2Transformer2DModel", "flow", "sigma", "flux2_empirical"),
        22, "families-flux2-chroma.md", "Apache-2.0 (4B); FLUX Non-Commercial (9B)",
        sizes=Sizes("Qwen3-4B (chat, 512 tokens, hidden states 9/18/27)", 16, ("QWEN3_4B",)),
        embed="flux2:KLEIN", recipe="flux2:KLEIN_RECIPE"),
    FamilySpec(
        "chroma", "Chroma: T5 (512, run masked; all rows stored) and the transformer's mask (real tokens + 1)",
        ("ChromaPipeline",), Text((T5,), "the caption", "last", "mask", "all", {"": 512},
                                  pooled="the mask the transformer reads (real tokens + 1)"),
        FLUX1_VAE, Objective("ChromaTransformer2DModel", "flow", "sigma", "dynamic", patch=2),
        23, "families-flux2-chroma.md", "Apache-2.0",
        sizes=Sizes("T5-XXL (512 tokens, run masked)", 32, ("T5_XXL", "FLUX1_VAE")),
        embed="chroma:FAMILY", recipe="chroma:RECIPE"),  # fmt: skip
    FamilySpec(
        "qwen-image", "Qwen-Image: Qwen2.5-VL last hidden states of the caption in its template (512 as __call__ "
        "cuts, up to 1024; masked; prefix dropped)", ("QwenImagePipeline",),
        Text((QWEN25_VL,), QWEN_TEMPLATE, "last", "mask", "real", {"": 512}, limit=1024),
        QWEN_IMAGE_VAE, Objective("QwenImageTransformer2DModel", "flow", "sigma", "dynamic", patch=2),
        7, "families-qwen-zimage.md", "Apache-2.0",
        sizes=Sizes("Qwen2.5-VL-7B (template + caption, real tokens)", 32, ("QWEN_VL_7B", "QWEN_IMAGE")),
        embed="qwen_image:FAMILY", recipe="qwen_image:RECIPE"),
    FamilySpec(
        "qwen-image-edit", "Qwen-Image-Edit: Qwen2.5-VL last hidden states of the instruction with its reference "
        "image (scan --conditioning; per sample, inline; prefix dropped)", ("QwenImageEditPipeline",),
        Text((QWEN25_VL,), "Qwen-Image-Edit's template around the reference image and the instruction, its 64 "
             "prefix tokens dropped", "last", "mask", "real", processor="processor"),
        QWEN_IMAGE_VAE, Objective("QwenImageTransformer2DModel", "flow", "sigma", "dynamic", patch=2),
        8, "families-qwen-zimage.md", "Apache-2.0", reference=True,
        sizes=Sizes("Qwen2.5-VL-7B (template + instruction + reference image)", 8,
                    ("QWEN_VL_7B", "QWEN_IMAGE")),
        embed="qwen_image_edit:FAMILY", recipe="qwen_image:EDIT_RECIPE"),  # fmt: skip
    FamilySpec(
        "z-image", "Z-Image: Qwen3 second-to-last hidden states of the chat-templated caption (512, masked; real "
        "tokens)", ("ZImagePipeline",),
        Text((Encoder("text_encoder", "Qwen3Model"),), "chat template (thinking on)", "second-to-last", "list",
             "real", {"": 512}),
        FLUX1_VAE, Objective("ZImageTransformer2DModel", "flow", "1 - sigma (output negated)", "scheduler", patch=2),
        9, "families-qwen-zimage.md", "Apache-2.0",
        sizes=Sizes("Qwen3-4B (chat template, real tokens)", 32, ("QWEN3_4B", "FLUX1_VAE", "Z_IMAGE")),
        embed="z_image:FAMILY", recipe="z_image:RECIPE"),  # fmt: skip
)
