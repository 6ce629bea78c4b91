"""The video families, declared (:class:`manifests.families.spec.FamilySpec`); docs/families-video.md explains
them."""

from __future__ import annotations

from manifests.families.spec import Encoder, FamilySpec, Objective, Text, Vae

__all__ = ["SPECS"]

UMT5 = Text((Encoder("text_encoder", "UMT5EncoderModel"),), "the caption (Wan's prompt_clean)", "last", "none",
            "real", {"": 512})  # real rows stored; the trainer zero-pads them to 512 as the pipeline does
WAN21_VAE = Vae("AutoencoderKLWan", "per_channel", channels=16, temporal=4)
WAN = Objective("WanTransformer3DModel", "flow", "1000 sigma", "scheduler", patch=2, config=True)

SPECS = (
    FamilySpec("wan", "Wan 2.x (video): UMT5 (512, masked; real tokens stored, zero-padded by the trainer)",
               ("WanPipeline",), UMT5, WAN21_VAE, WAN, 6, "families-video.md", "Apache-2.0", video=True,
               embed="wan:FAMILY", recipe="wan:RECIPE"),
    FamilySpec("wan2.2-a14b", "Wan 2.2 A14B (video, two experts by timestep): UMT5 as wan, Wan 2.1's VAE",
               ("WanPipeline",), UMT5, WAN21_VAE,
               Objective("WanTransformer3DModel", "flow", "1000 sigma", "scheduler", ("transformer", "transformer_2"),
                         patch=2, config=True),
               31, "families-video.md", "Apache-2.0", video=True,
               embed="wan:A14B", recipe="wan:A14B_RECIPE"),  # fmt: skip
    FamilySpec("wan2.2-ti2v-5b", "Wan 2.2 TI2V-5B (video): UMT5 as wan, Wan 2.2's VAE (48 channels, 16x)",
               ("WanPipeline",), UMT5, Vae("AutoencoderKLWan", "per_channel", factor=16, channels=48, temporal=4),
               Objective("WanTransformer3DModel", "flow", "1000 sigma per token", "scheduler", patch=2, config=True),
               32, "families-video.md", "Apache-2.0", bucket_step=32, video=True,
               embed="wan:TI2V", recipe="wan:TI2V_RECIPE"),  # fmt: skip
    FamilySpec(
        "ltx-2", "LTX-2 (video, no audio training): Gemma 3, every layer's states (1024, masked, left-padded; real "
        "tokens stored), clip latents stored normalised", ("LTX2Pipeline",),
        Text((Encoder("text_encoder", "Gemma3ForConditionalGeneration"),), "the caption (left-padded)",
             "every layer's states, stacked (the connectors run in the recipe)", "mask", "real", {"": 1024}),
        Vae("AutoencoderKLLTX2Video", "ltx", factor=32, channels=128, stored="normalised", temporal=8),
        Objective("LTX2VideoTransformer3DModel", "flow", "1000 sigma (audio fed as noise at 1000)", "dynamic",
                  config=True),
        41, "families-video.md", "LTX-2 Community License (LTX-2.3 folders load as ltx-2)", bucket_step=32,
        video=True,
        embed="ltx2:FAMILY", recipe="ltx2:RECIPE"),  # fmt: skip
    FamilySpec(
        "hunyuanvideo-1.5", "HunyuanVideo 1.5 (video): Qwen2.5-VL hidden_states[-3] (1000, masked) and glyph ByT5 "
        "(256, masked), two streams", ("HunyuanVideo15Pipeline",),
        Text((Encoder("text_encoder", "Qwen2_5_VLTextModel"), Encoder("text_encoder_2", "T5EncoderModel")),
             "HunyuanVideo's system message + caption; the quoted text through ByT5", "third-to-last; ByT5's last",
             "mask", "real", {"": 1000}),
        Vae("AutoencoderKLHunyuanVideo15", "scale", factor=16, channels=32, temporal=4),
        Objective("HunyuanVideo15Transformer3DModel", "flow", "1000 sigma", "scheduler", config=True),
        33, "families-video.md", "Tencent Hunyuan Community License", bucket_step=32, video=True,
        embed="hunyuan_video15:FAMILY", recipe="hunyuan_video15:RECIPE"),  # fmt: skip
)
