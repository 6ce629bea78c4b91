"""The families of mid-2026, declared (:class:`manifests.families.spec.FamilySpec`); docs/families-mid-2026.md
explains them."""

from __future__ import annotations

from manifests.families.images import FLUX1_VAE, QWEN_IMAGE_VAE
from manifests.families.spec import Encoder, FamilySpec, Objective, Text, Vae

__all__ = ["SPECS"]

SPECS = (
    FamilySpec(
        "ernie-image", "ERNIE-Image: Ministral 3 second-to-last hidden states of the raw caption (1024 cap, masked; "
        "real tokens)", ("ErnieImagePipeline",),
        Text((Encoder("text_encoder", "Mistral3Model"),), "the caption as it is, one at a time (empty: [bos])",
             "second-to-last", "lengths", "real", {"": 1024}, limit=16384),
        Vae("AutoencoderKLFlux2", "bn_patch2", factor=16, channels=128, stored="normalised", bn_eps=1e-5),
        Objective("ErnieImageTransformer2DModel", "flow", "1000 sigma", "scheduler", config=True),
        53, "families-mid-2026.md", "Apache-2.0",
        embed="ernie_image:FAMILY", recipe="ernie_image:RECIPE", tiny="tiny_ernie:ernie_image"),
    FamilySpec(
        "qwen-image-2.1", "Qwen-Image 2.1: Qwen3-VL last layer before its final norm, of the caption in its template "
        "(system message dropped; masked; up to 1024 rows, the pipeline has no limit)", ("QwenImage21Pipeline",),
        Text((Encoder("text_encoder", "Qwen3VLModel"),), "Qwen-Image 2.1's system message + user turn + assistant "
             "opening, left-padded; its system tokens dropped (empty: one space)", "last, before the final norm",
             "mask", "real", {"": 1024}, limit=1024, tokenizer="processor"),
        Vae("AutoencoderKLQwenImage21", "per_channel", factor=16, channels=64, stored="normalised"),
        Objective("QwenImage21Transformer2DModel", "flow", "sigma", "dynamic"),
        56, "families-mid-2026.md", "Qwen Research License Agreement (QwenLM/Qwen-Image-2.1; model card not seen)",
        embed="qwen_image21:FAMILY", recipe="qwen_image21:RECIPE", tiny="tiny_qwen21:qwen_image21"),
    FamilySpec(
        "longcat-image", "LongCat-Image: Qwen2.5-VL last hidden states of the caption (quoted text per character) "
        "padded to 512, run masked in its template; all 512 rows stored", ("LongCatImagePipeline",),
        Text((Encoder("text_encoder", "Qwen2_5_VLModel"),), "LongCat's system message + user turn, the caption's ids "
             "(quoted text a character at a time) cut and padded to 512, the closing turn; prefix and suffix rows "
             "dropped", "last", "none", "all", {"": 512}),
        FLUX1_VAE, Objective("LongCatImageTransformer2DModel", "flow", "sigma", "dynamic", patch=2, config=True),
        52, "families-mid-2026.md", "Apache-2.0",
        embed="longcat_image:FAMILY", recipe="longcat_image:RECIPE", tiny="tiny_longcat:longcat_image"),
    FamilySpec(
        "krea-2", "Krea 2: Qwen3-VL-4B hidden states 2, 5, ..., 35 stacked per token (12 x 2560) of the caption in "
        "Qwen-Image's template (512; masked: caption + suffix rows)", ("Krea2Pipeline",),
        Text((Encoder("text_encoder", "Qwen3VLModel"),), "Qwen-Image's system prefix + caption padded to 512 + 34 - 5, "
             "then the 5-token assistant suffix after the padding; positions cumsum(mask) - 1; 34 prefix tokens "
             "dropped", "hidden states 2, 5, ..., 35 stacked per token", "mask", "real", {"": 512}),
        QWEN_IMAGE_VAE,
        Objective("Krea2Transformer2DModel", "flow", "sigma", "dynamic", patch=2, config=True),  # mu 1.15: distilled
        51, "families-mid-2026.md", "Krea 2 Community License (Krea-2-Raw released for fine-tuning; terms not seen)",
        embed="krea2:FAMILY", recipe="krea2:RECIPE", tiny="tiny_krea2:krea2"),
    FamilySpec(
        "anima", "Anima (AnimaModularPipeline): Qwen3 last hidden states + T5 ids through the frozen LLM adapter "
        "(512, masked; the adapter's real rows, zero-padded to 512 by the trainer)", ("AnimaModularPipeline",),
        Text((Encoder("text_encoder", "Qwen3Model"),), "the caption as it is (no template), one at a time, and its "
             "T5 token ids (no T5 model)", "last, through the frozen AnimaTextConditioner (LLM adapter)", "none",
             "real", {"": 512}),
        QWEN_IMAGE_VAE, Objective("CosmosTransformer3DModel", "flow", "sigma", "scheduler", patch=2),
        57, "families-mid-2026.md", "CircleStone Labs Non-Commercial License v1.2 (+ NVIDIA Open Model License): "
        "non-commercial", embed="anima:FAMILY", recipe="anima:RECIPE", tiny="tiny_anima:anima"),
)
