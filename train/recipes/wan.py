"""Wan 2.x text-to-video: fine-tune the pretrained ``WanTransformer3DModel`` with rectified flow on video latents.

As ``WanPipeline`` feeds it: latents ``(B, C, F, h, w)`` (``F`` latent frames; one ``WxHxF`` bucket per batch
makes every clip's shape the same), normalised per channel by the loader, ``(z - latents_mean) / latents_std``
from ``_cache.json``'s ``latent`` (what the pipeline inverts before decoding); the UMT5 states of the caption,
stored as their real tokens only, zero-padded to the layout's length (512, ``max_sequence_length``) as
``WanPipeline._get_t5_prompt_embeds`` pads them, as ``encoder_hidden_states`` ``(B, 512, D)`` with no text
mask. ``x_t = (1 - s) x0 + s eps``, the target ``eps - x0`` at timestep ``1000 s``; ``s`` drawn by the
config's density and shifted as the base scheduler samples (``timestep_shift: auto``: the Wan 2.1 folders'
``UniPCMultistepScheduler`` ``flow_shift``, or a ``FlowMatchEulerDiscreteScheduler``'s ``shift``).

Wan 2.2 (the pipeline folder's ``model_index.json`` says which): ``wan2.2-a14b`` has two experts, ``transformer``
for timesteps ``t >= boundary_ratio * num_train_timesteps`` (high noise) and ``transformer_2`` below; the config's
``expert: high | low`` picks the one a run trains, and its ``s`` are drawn as above and mapped linearly into that
expert's range (``[boundary, 1]`` or ``[0, boundary)``), so it never trains on the other's noise levels. The
low-noise expert's LoRA export loads with ``load_lora_weights(..., load_into_transformer_2=True)``; validation
clips run both experts (the other one as the base model has it). ``expert: both`` trains LoRA adapters on both
experts in one run (:class:`WanExperts`, :func:`pick_expert`): each optimizer step trains one of them, the same on
every rank, on ``s`` drawn as its one-expert run draws them; ``OUTPUT/lora`` and ``OUTPUT/lora_2`` are the two
exports. ``wan2.2-ti2v-5b``'s pipeline
(``expand_timesteps``) gives its transformer one timestep per latent token, ``(B, F h w / 4)``: so does the loss.

Not yet for video: ``masked_loss`` and ``repa`` are refused in one line.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from train.config import TrainConfig
from train.model import flow_sample, to_weight_dtype
from train.recipes.memory import check_fits
from train.shift import timestep_shift
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip

__all__ = ["RECIPE", "A14B_RECIPE", "TI2V_RECIPE", "setup", "pad_text", "load_flow_scheduler", "WanExperts",
           "high_share", "pick_expert"]

SAMPLER_STEPS = 50  # WanPipeline's default num_inference_steps: what high_share counts the sampler's calls over


def pad_text(text: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, L, D)`` prompt embeddings zero-padded to ``(B, length, D)`` (``L <= length``): what ``WanPipeline``
    gives its transformer, which takes no text mask (so the pad rows are inputs it was trained with)."""
    return torch.nn.functional.pad(text, (0, 0, 0, length - text.shape[1]))


def load_flow_scheduler(source: str) -> Any:
    """The base model's ``scheduler/`` as its own class (``UniPCMultistepScheduler`` for the Wan 2.1 folders).

    Raises UsageError when it does not sample rectified flow (neither flow matching nor flow sigmas with
    ``prediction_type: flow_prediction``): its shift would not be the noise levels this recipe trains.
    """
    import diffusers

    try:  # any scheduler class reads scheduler/scheduler_config.json; its _class_name says which it is
        config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(source, subfolder="scheduler")
    except (OSError, EnvironmentError) as e:
        raise UsageError(f"pretrained {source!r}: cannot read its scheduler/ ({e}); pass the Wan diffusers pipeline "
                         "folder or hub id") from None  # fmt: skip
    name = config.get("_class_name", "")
    cls = getattr(diffusers, name, None)
    flow = name.startswith("FlowMatch") or (config.get("use_flow_sigmas") and
                                            config.get("prediction_type") == "flow_prediction")  # fmt: skip
    if cls is None or not flow:
        raise UsageError(f"pretrained {source!r}: its scheduler/ is {name or 'unknown'} without flow sigmas; the wan "
                         "recipe trains rectified flow: pass a Wan pipeline folder (UniPC with use_flow_sigmas, or "
                         "FlowMatchEulerDiscreteScheduler)")  # fmt: skip
    return cls.from_config(config)


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as one module, for ``expert: both``: ``transformer`` (high noise) and
    ``transformer_2`` (low noise), state-dict keys under those names; ``forward(expert=NAME, **inputs)`` runs one.

    One module, so the loop's one model, optimizer, DDP wrapper and checkpoint hold both: a step runs one
    expert, and DDP (``find_unused_parameters``, set by the launch for ``expert: both``) leaves the other's
    gradients None, so AdamW leaves its weights and moments as they were.
    """

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """The experts by their names in ``WanPipeline``, high-noise first (the order of the LoRA exports)."""
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    def forward(self, expert: str, **inputs: Any) -> Any:
        return self.experts[expert](**inputs)

    def add_adapter(self, config: Any) -> None:
        """The same LoRA configuration on each expert (:func:`train.lora.add_lora`)."""
        for model in self.experts.values():
            model.add_adapter(config)

    @property
    def peft_config(self) -> dict[str, Any]:
        """The adapters' configuration (the same on both): what :func:`train.lora.lora_record` reads."""
        return self.transformer.peft_config


def high_share(scheduler: Any, boundary_timestep: float) -> float:
    """The share of ``WanPipeline``'s denoiser calls that go to ``transformer`` (``t >= boundary_timestep``) at its
    default :data:`SAMPLER_STEPS` steps with the base model's ``scheduler`` (a copy is set; 0.32 for flow_shift 3
    and boundary 875, 0.64 for shift 12)."""
    import copy

    sampler = copy.deepcopy(scheduler)
    sampler.set_timesteps(SAMPLER_STEPS)
    return float((sampler.timesteps.double() >= boundary_timestep).double().mean())


def pick_expert(seed: int, epoch: int, update: int, share: float) -> str:
    """The expert that optimizer step ``update`` of ``epoch`` trains under ``expert: both``: ``transformer`` with
    probability ``share`` (:func:`high_share`), else ``transformer_2``; a pure function of its arguments.

    Why the sampler's share, drawn per step: an expert's quality matters in proportion to the denoising steps it
    runs at inference, so the run gives it that share of its optimizer steps (not the share of the training
    density, which depends on the config's weighting, nor a strict alternation, which would give the low expert,
    about twice the sampler calls at flow_shift 3, half the updates). A seeded draw rather than a fixed pattern: no
    aliasing with the plan's bucket order or with ``checkpoint_every``. Positions, not an RNG stream, so every
    rank and a resumed run pick the same expert without any state.
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{update}:expert".encode(), digest_size=8).digest()
    return "transformer" if int.from_bytes(digest, "little") / 2.0**64 < share else "transformer_2"


def _refuse(cfg: TrainConfig, meta: CacheMeta) -> None:
    """One line for what the recipe does not train yet, and for a cache of image latents."""
    family = meta.family or meta.text_layout.family
    if cfg.masked_loss is not None:
        raise UsageError(f"config masked_loss: the {family} recipe does not weight video latents by loss masks yet; "
                         "remove masked_loss:")  # fmt: skip
    if cfg.repa is not None:
        raise UsageError(f"config repa: the {family} recipe has no REPA for video latents yet; remove repa:")
    latent = meta.latent
    if latent is None or latent.temporal_factor is None or latent.latents_mean is None:
        raise UsageError(f"the cache holds no video latents (_cache.json latent.temporal_factor, latents_mean and "
                         f"latents_std): the {family} recipe trains clips embedded with `bucketeer embed --family "
                         f"{family}` from a video manifest")  # fmt: skip
    if cfg.expert is not None and family != "wan2.2-a14b":
        raise UsageError(f"config expert: {cfg.expert}: family {family} has one transformer; expert is for "
                         "wan2.2-a14b: remove expert:")  # fmt: skip
    if cfg.expert is None and family == "wan2.2-a14b":
        raise UsageError("config: family wan2.2-a14b trains its experts by timestep: set expert: high "
                         "(transformer, the noisy timesteps), expert: low (transformer_2) or expert: both (LoRA on "
                         "each, one run)")  # fmt: skip
    if cfg.expert == "both" and not cfg.lora_rank:
        raise UsageError("config expert: both trains LoRA adapters on both experts; set lora_rank (e.g. 32), or "
                         "fine-tune each expert fully in its own run (expert: high, then expert: low)")  # fmt: skip


def _wan22(source: str, family: str) -> tuple[float | None, bool]:
    """``(boundary_ratio, expand_timesteps)`` of the pipeline folder ``source`` (its ``model_index.json``).

    Raises UsageError when they are not the family's: a boundary (and ``transformer_2``) for wan2.2-a14b only,
    ``expand_timesteps`` for wan2.2-ti2v-5b only."""
    from diffusers import DiffusionPipeline

    try:
        index = DiffusionPipeline.load_config(source)
    except (OSError, EnvironmentError) as e:
        if family == "wan":  # Wan 2.1 needs only transformer/ and scheduler/
            return None, False
        raise UsageError(f"pretrained {source!r}: cannot read its model_index.json ({e}); pass the {family} diffusers "
                         "pipeline folder or hub id") from None  # fmt: skip
    ratio, expand = index.get("boundary_ratio"), bool(index.get("expand_timesteps"))
    two = ratio is not None and (index.get("transformer_2") or [None])[0] is not None
    is_a14b, is_ti2v = family == "wan2.2-a14b", family == "wan2.2-ti2v-5b"
    if two != is_a14b or expand != is_ti2v:
        kind = "wan2.2-a14b" if two else "wan2.2-ti2v-5b" if expand else "wan"
        raise UsageError(f"pretrained {source!r} is a {kind} pipeline (boundary_ratio {ratio}, expand_timesteps "
                         f"{expand}), the cache's family is {family}: embed with --family {kind}, or train the "
                         f"{family} model")  # fmt: skip
    return (float(ratio) if two else None), expand


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import WanPipeline, WanTransformer3DModel

    _refuse(cfg, meta)
    family = meta.family or meta.text_layout.family
    source = pretrained_source(cfg, meta)
    boundary, expand = _wan22(source, family)
    low, both = cfg.expert == "low", cfg.expert == "both"
    component = "transformer_2" if low else "transformer"
    # before any weight is read: both experts' frozen float32 weights are twice one expert's (docs/families-video.md)
    check_fits(family, WanTransformer3DModel, source, cfg, ("transformer", "transformer_2") if both else component)
    transformer = load_pretrained(WanTransformer3DModel, source, component)
    model: torch.nn.Module = transformer
    if both:  # the low-noise expert beside it: one module, one optimizer, one DDP wrapper
        model = WanExperts(transformer, load_pretrained(WanTransformer3DModel, source, "transformer_2"))
    layout = meta.text_layout
    channels = int(meta.latent.channels)
    check_matches("text width (text_dim)", transformer.config.text_dim, layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, channels, source)
    check_matches("latent channels (out_channels)", transformer.config.out_channels, channels, source)
    scheduler = load_flow_scheduler(source)
    pt, ph, pw = (int(p) for p in transformer.config.patch_size)
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=ph)  # auto: the scheduler's flow_shift
    length = layout.length  # what WanPipeline pads every caption to (max_sequence_length)
    factor = int(meta.latent.factor or 8)  # pixels per latent pixel
    # the experts' noise levels: the pipeline runs transformer for t >= boundary_ratio * num_train_timesteps, and
    # this recipe's t is 1000 sigma
    edge = None if boundary is None else boundary * scheduler.config.num_train_timesteps / 1000.0
    spans = {"transformer": (0.0, 1.0) if edge is None else (edge, 1.0), "transformer_2": (0.0, edge)}
    share = high_share(scheduler, boundary * scheduler.config.num_train_timesteps) if both else None
    accum = cfg.grad_accum or 1  # the launch resolves it from the plan: every plan step of an update, one expert
    drawn: dict[str, Any] = {}  # the last draw's expert and sigmas, for --record-samples

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, _, f, h, w = batch.latents.shape  # (B, C, F, h, w)
        if f % pt or h % ph or w % pw:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} (frames x h x w) do not divide into the "
                             f"transformer's {pt}x{ph}x{pw} patches; scan with a --bucket-step that is a multiple "
                             f"of {factor * max(ph, pw)} pixels")  # fmt: skip
        expert = pick_expert(cfg.seed, batch.epoch, batch.step // accum, share) if both else component
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w, f // pt),
                           sigma_range=spans[expert], **flow_options(cfg))  # fmt: skip
        noisy, text = to_weight_dtype(model, draw.noisy, pad_text(batch.text, length))  # DeepSpeed bf16
        timestep = draw.sigma.flatten() * 1000.0  # (B,)
        if expand:  # TI2V: one timestep per latent token, as WanPipeline(expand_timesteps=True) gives it
            timestep = timestep[:, None].expand(b, (f // pt) * (h // ph) * (w // pw))
        inputs = {"expert": expert} if both else {}
        pred = model(**inputs, hidden_states=noisy, timestep=timestep, encoder_hidden_states=text,
                     return_dict=False)[0]  # (B, C, F, h, w)  # fmt: skip
        if both:
            drawn.update(expert=expert, sigma=draw.sigma.flatten().tolist())
        return flow_loss(pred, draw.target, draw.weight)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        experts = model.experts if both else {component: model}
        if boundary is not None and not both:  # the other expert as the base model has it; loaded per validation
            other = "transformer" if low else "transformer_2"  # in the trained one's dtype (no fp32 copy of 14B)
            experts[other] = WanTransformer3DModel.from_pretrained(source, subfolder=other,
                                                                   torch_dtype=model.dtype).to(model.device)
        return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, boundary_ratio=boundary,
                           expand_timesteps=expand, **experts)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": pad_text(prompts.embeds, length),
                "negative_prompt_embeds": pad_text(negative.embeds, length)}  # fmt: skip

    return Denoiser(model, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * ph * pw), source=source,
                    pipeline_class="WanPipeline", component=component,
                    lora_load={"load_into_transformer_2": True} if low else {},
                    lora_component="transformer" if low else None,
                    more_lora_loads=({"load_into_transformer_2": True},) if both else (),
                    step_record=drawn)  # fmt: skip


RECIPE = Recipe("wan", setup)
A14B_RECIPE = Recipe("wan2.2-a14b", setup)
TI2V_RECIPE = Recipe("wan2.2-ti2v-5b", setup)
