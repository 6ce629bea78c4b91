"""The families of mid-2026, declared (:class:`manifests.families.spec.FamilySpec`); docs/families-mid-2026.md
explains them."""

from __future__ import annotations

from manifests.families.images import FLUX1_VAE, QWEN_IMAGE_VAE
from manifests.families.spec import Encoder, FamilySpec, Objective, Sizes, Text, Vae

__all__ = ["SPECS"]

# Kandinsky 5 (both): Qwen2.5-VL-7B + CLIP-L; one transformer call per sample (it takes no text mask)
K5_ENCODERS = (Encoder("text_encoder", "Qwen2_5_VLModel"), Encoder("text_encoder_2", "CLIPTextModel"))
K5_CUT = "prompt_clean, then a caption past 512 tokens cut by its decoded text"
K5_POOLED = "CLIP-L pooler_output (77, run with its mask, on the cleaned caption)"
K5_OBJECTIVE = Objective("Kandinsky5Transformer3DModel", "flow", "1000 sigma", "scheduler", patch=2, config=True)

SPECS = (
    FamilySpec(
        "ernie-image", "ERNIE-Image: Ministral 3 second-to-last hidden states of the raw caption (1024 cap, masked; "
        "real tokens)", ("ErnieImagePipeline",),
        Text((Encoder("text_encoder", "Mistral3Model"),), "the caption as it is, one at a time (empty: [bos])",
             "second-to-last", "lengths", "real", {"": 1024}, limit=16384),
        Vae("AutoencoderKLFlux2", "bn_patch2", factor=16, channels=128, stored="normalised", bn_eps=1e-5),
        Objective("ErnieImageTransformer2DModel", "flow", "1000 sigma", "scheduler", config=True),
        53, "families-mid-2026.md", "Apache-2.0",
        embed="ernie_image:FAMILY", recipe="ernie_image:RECIPE", tiny="tiny_ernie:ernie_image", diffusers="0.42",
        sizes=Sizes("Ministral 3 3B (the caption alone, second-to-last, real tokens)", 32,
                    ("MINISTRAL3_3B_TEXT", "ERNIE_IMAGE"))),
    FamilySpec(
        "qwen-image-2.1", "Qwen-Image 2.1: Qwen3-VL last layer before its final norm, of the caption in its template "
        "(system message dropped; masked; up to 1024 rows, the pipeline has no limit)", ("QwenImage21Pipeline",),
        Text((Encoder("text_encoder", "Qwen3VLModel"),), "Qwen-Image 2.1's system message + user turn + assistant "
             "opening, left-padded; its system tokens dropped (empty: one space)", "last, before the final norm",
             "mask", "real", {"": 1024}, limit=1024, tokenizer="processor"),
        Vae("AutoencoderKLQwenImage21", "per_channel", factor=16, channels=64, stored="normalised"),
        Objective("QwenImage21Transformer2DModel", "flow", "sigma", "dynamic"),
        56, "families-mid-2026.md", "Qwen Research License Agreement (QwenLM/Qwen-Image-2.1; model card not seen)",
        embed="qwen_image21:FAMILY", recipe="qwen_image21:RECIPE", tiny="tiny_qwen21:qwen_image21", diffusers="0.42",
        sizes=Sizes("Qwen3-VL-8B (template + caption, real tokens)", 32,
                    ("QWEN3_VL_8B", "QWEN_IMAGE21_VAE", "QWEN_IMAGE21_TRANSFORMER"))),
    FamilySpec(
        "longcat-image", "LongCat-Image: Qwen2.5-VL last hidden states of the caption (quoted text per character) "
        "padded to 512, run masked in its template; all 512 rows stored", ("LongCatImagePipeline",),
        Text((Encoder("text_encoder", "Qwen2_5_VLModel"),), "LongCat's system message + user turn, the caption's ids "
             "(quoted text a character at a time) cut and padded to 512, the closing turn; prefix and suffix rows "
             "dropped", "last", "none", "all", {"": 512}),
        FLUX1_VAE, Objective("LongCatImageTransformer2DModel", "flow", "sigma", "dynamic", patch=2, config=True),
        52, "families-mid-2026.md", "Apache-2.0",
        embed="longcat_image:FAMILY", recipe="longcat_image:RECIPE", tiny="tiny_longcat:longcat_image",
        diffusers="0.42",
        sizes=Sizes("Qwen2.5-VL-7B (template + caption padded to 512, all rows)", 32,
                    ("QWEN_VL_7B", "FLUX1_VAE", "LONGCAT_IMAGE"))),
    FamilySpec(
        "krea-2", "Krea 2: Qwen3-VL-4B hidden states 2, 5, ..., 35 stacked per token (12 x 2560) of the caption in "
        "Qwen-Image's template (512; masked: caption + suffix rows)", ("Krea2Pipeline",),
        Text((Encoder("text_encoder", "Qwen3VLModel"),), "Qwen-Image's system prefix + caption padded to 512 + 34 - 5, "
             "then the 5-token assistant suffix after the padding; positions cumsum(mask) - 1; 34 prefix tokens "
             "dropped", "hidden states 2, 5, ..., 35 stacked per token", "mask", "real", {"": 512}),
        QWEN_IMAGE_VAE,
        Objective("Krea2Transformer2DModel", "flow", "sigma", "dynamic", patch=2, config=True),  # mu 1.15: distilled
        51, "families-mid-2026.md", "Krea 2 Community License (Krea-2-Raw released for fine-tuning; terms not seen)",
        embed="krea2:FAMILY", recipe="krea2:RECIPE", tiny="tiny_krea2:krea2", diffusers="0.42",
        sizes=Sizes("Qwen3-VL-4B (template + caption padded to 512, 12 hidden states)", 16,
                    ("QWEN3_VL_4B", "KREA2_TRANSFORMER"))),
    FamilySpec(
        "anima", "Anima (AnimaModularPipeline): Qwen3 last hidden states + T5 ids through the frozen LLM adapter "
        "(512, masked; the adapter's real rows, zero-padded to 512 by the trainer)", ("AnimaModularPipeline",),
        Text((Encoder("text_encoder", "Qwen3Model"),), "the caption as it is (no template), one at a time, and its "
             "T5 token ids (no T5 model)", "last, through the frozen AnimaTextConditioner (LLM adapter)", "none",
             "real", {"": 512}),
        QWEN_IMAGE_VAE, Objective("CosmosTransformer3DModel", "flow", "sigma", "scheduler", patch=2),
        57, "families-mid-2026.md", "CircleStone Labs Non-Commercial License v1.2 (+ NVIDIA Open Model License): "
        "non-commercial", embed="anima:FAMILY", recipe="anima:RECIPE", tiny="tiny_anima:anima", diffusers="0.42",
        sizes=Sizes("Qwen3-0.6B + LLM adapter (the caption alone, real T5 rows)", 32,
                    ("QWEN3_06B", "ANIMA_TEXT_CONDITIONER", "ANIMA_TRANSFORMER"))),
    FamilySpec(
        "kandinsky-5", "Kandinsky 5 T2I: Qwen2.5-VL last hidden states of the caption in its template (512, up to "
        "1024; real rows, the transformer unmasked), pooled CLIP-L; FLUX.1 VAE scaled without shift",
        ("Kandinsky5T2IPipeline",),
        Text(K5_ENCODERS, f"Kandinsky 5's image system message + user turn (no assistant turn), its 40 prefix tokens "
             f"dropped; {K5_CUT}", "last", "list", "real", {"": 512}, limit=1024, pooled=K5_POOLED),
        Vae("AutoencoderKL", "scale_no_shift", channels=16), K5_OBJECTIVE, 54, "families-mid-2026.md", "MIT",
        embed="kandinsky5:FAMILY", recipe="kandinsky5:RECIPE", tiny="tiny_kandinsky:kandinsky5", diffusers="0.42",
        sizes=Sizes("Qwen2.5-VL-7B + CLIP-L (template + caption, real tokens; pooled CLIP-L)", 32,
                    ("QWEN_VL_7B", "FLUX1_VAE", "KANDINSKY5_T2I"))),  # fmt: skip
    FamilySpec(
        "kandinsky-5-video", "Kandinsky 5 T2V (video): Qwen2.5-VL last hidden states of the caption in its video "
        "template (512, up to 1024; real rows, the transformer unmasked), pooled CLIP-L; HunyuanVideo's VAE",
        ("Kandinsky5T2VPipeline",),
        Text(K5_ENCODERS, f"Kandinsky 5's 7-line video system message + user turn (no assistant turn), its 128 "
             f"prefix tokens dropped; {K5_CUT}", "last", "list", "real", {"": 512}, limit=1024, pooled=K5_POOLED),
        Vae("AutoencoderKLHunyuanVideo", "scale", channels=16, temporal=4), K5_OBJECTIVE, 55, "families-mid-2026.md",
        "MIT", video=True, embed="kandinsky5:VIDEO", recipe="kandinsky5:VIDEO_RECIPE",
        tiny="tiny_kandinsky:kandinsky5_video", diffusers="0.42"),  # fmt: skip
)
