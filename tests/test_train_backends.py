"""What the plan fixes in accelerate's backends, with accelerate's real plugin objects; FSDP2 and DeepSpeed runs.

The DeepSpeed and FSDP plumbing is checked on accelerate's own ``DeepSpeedPlugin`` and
``FullyShardedDataParallelPlugin`` (no engine). The end-to-end FSDP2 and DeepSpeed ZeRO-2 runs
need CUDA: accelerate 1.x runs neither on a CPU-only machine (see the skip reasons); they run
(``make test-gpu``, marker ``gpu``) on 2 GPUs with a 2-rank plan, on 1 GPU with a 1-rank one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from manifests.errors import UsageError
from train.backends import check_backend, configure_deepspeed, plan_grad_accum, plan_micro_batch

FIXTURE_PLAN = Path(__file__).parent / "fixtures" / "v0_2" / "plan"


def _plan_meta():
    """A plan made with --grad-accum 2 whose buckets hold per-rank batches of 4 and 2 (a fixture's, edited)."""
    from manifests.plan import read_plan_meta
    from manifests.plan.meta import BucketInfo

    meta = read_plan_meta(str(FIXTURE_PLAN))
    buckets = {"64x64": BucketInfo(samples=8, batch_size=4, latent_tokens=64),
               "128x32": BucketInfo(samples=8, batch_size=2, latent_tokens=64)}  # fmt: skip
    return replace(meta, inputs=replace(meta.inputs, grad_accum=2), buckets=buckets)


PLAN = _plan_meta()


def test_the_plan_fills_deepspeeds_auto_batch_accumulation_and_clipping():
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)  # what an accelerate config without batch keys gives: "auto"
    configure_deepspeed(plugin, micro_batch=plan_micro_batch(PLAN), grad_accum=2, world_size=8, max_grad_norm=0.5)
    config = plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 2)
    assert config["train_batch_size"] == 4 * 2 * 8 and config["gradient_clipping"] == 0.5
    assert plugin.gradient_accumulation_steps == 2


@pytest.mark.parametrize(
    "settings,key",
    [
        ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu: 8"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps: 1"),
        ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
         "train_batch_size: 48"),
    ],
)  # fmt: skip
def test_a_deepspeed_config_that_contradicts_the_plan_is_an_error_naming_both(tmp_path, settings, key):
    from accelerate.utils import DeepSpeedPlugin

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**settings, "zero_optimization": {"stage": 2}}))
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    with pytest.raises(UsageError, match=f"the DeepSpeed config sets {key}, which contradicts the plan") as e:
        configure_deepspeed(plugin, micro_batch=4, grad_accum=2, world_size=8, max_grad_norm=1.0)
    assert '"auto"' in str(e.value)


def test_the_accelerate_configs_accumulation_may_not_override_the_plans(monkeypatch):
    assert plan_grad_accum(PLAN, None, "P") == 2 and plan_grad_accum(PLAN, 2, "P") == 2
    with pytest.raises(UsageError, match="config says grad_accum: 3"):
        plan_grad_accum(PLAN, 3, "P")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")  # what `accelerate launch` exports
    with pytest.raises(UsageError, match=r"gradient_accumulation_steps: 1 .* made with --grad-accum 2"):
        plan_grad_accum(PLAN, None, "P")


def test_backends_that_cannot_run_or_would_pickle_are_refused(monkeypatch):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    cpu = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=SimpleNamespace())
    check_backend(cpu)
    for env, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        monkeypatch.setenv(env, "true")
        with pytest.raises(UsageError, match=f"asks for {name}, but accelerate runs MULTI_CPU"):
            check_backend(cpu)
        monkeypatch.delenv(env)
    for kind, refused in (("SHARDED_STATE_DICT", True), ("FULL_STATE_DICT", False)):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
        fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
        if refused:
            with pytest.raises(UsageError, match="read back with pickle.*FULL_STATE_DICT"):
                check_backend(fsdp)
        else:
            check_backend(fsdp)


GPUS = torch.cuda.device_count()
WORLD = min(GPUS, 2)  # ranks of the FSDP2 / DeepSpeed runs: 2 where there are 2 GPUs, else 1
FSDP_ON_CPU = ("FSDP2 needs CUDA: accelerate 1.x enables FSDP only for accelerator process groups; with "
               "ACCELERATE_USE_CPU (gloo) it runs MULTI_CPU and ignores the FSDP plugin (accelerate/state.py), "
               "which the trainer refuses (test_backends_that_cannot_run_or_would_pickle_are_refused)")  # fmt: skip
DEEPSPEED_ON_CPU = ("DeepSpeed ZeRO-2 needs deepspeed and CUDA: on a CPU-only machine accelerate 1.x sets up no "
                    "process group for DEEPSPEED (distributed_type NO, 1 process) while DeepSpeed's engine sees "
                    "the whole world (tried with deepspeed 0.19.8, DS_ACCELERATOR=cpu: its batch assertion fails)")


def _run_backend(train_data, tmp_path, *launch_flags: str, **settings) -> Path:
    """Train plan2a on 2 GPUs (plan1a on 1) with the given accelerate flags (and config ``settings``): to a
    checkpoint, resume, final model loads. Returns the output folder."""
    from diffusers import PixArtTransformer2DModel

    from tests.test_train import records, write_config
    from tests.test_train_dist import ROOT, rows

    config = write_config(tmp_path / "c.yaml", checkpoint_every=4, log_every=5, **settings)
    out = tmp_path / "out"
    plan = train_data.plan2a if WORLD == 2 else train_data.plan1a  # both: --grad-accum 2
    base = ["accelerate", "launch", *launch_flags, "--num_processes", str(WORLD), "--main_process_port", "0", "-m",
            "train", "--plan", plan, "--cache", train_data.cache, "--config", str(config), "--output-dir", str(out),
            "--record-samples", str(out / "rec")]  # fmt: skip
    accelerate = shutil.which("accelerate")
    first = subprocess.run([accelerate, *base[1:], "--max-steps", "8"], cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-4000:]
    second = subprocess.run([accelerate, *base[1:], "--resume"], cwd=ROOT, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-4000:]
    for rank in range(WORLD):
        assert [(r["epoch"], r["step"], r["sample_ids"]) for r in records(out / "rec", rank)] == rows(plan, rank)
    assert PixArtTransformer2DModel.from_pretrained(out / "model").config.in_channels == 4
    return out


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(GPUS < 1, reason=FSDP_ON_CPU)
def test_fsdp2_trains_checkpoints_resumes_and_saves_a_loadable_model(train_data, tmp_path):
    from diffusers import PixArtTransformer2DModel

    # with an EMA: sharded beside the model (train.ema.ShardedEMA), in the checkpoint as ema/, resumed, gathered
    out = _run_backend(train_data, tmp_path, "--config_file", "infra/accelerate/fsdp2-1x8.yaml", "--mixed_precision",
                       "no", ema_decay=0.9)  # fmt: skip
    model, ema = (PixArtTransformer2DModel.from_pretrained(out / name) for name in ("model", "model_ema"))
    ema_weights = dict(ema.named_parameters())
    assert any(not torch.equal(p, ema_weights[n]) for n, p in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(GPUS < 1 or shutil.which("deepspeed") is None, reason=DEEPSPEED_ON_CPU)
def test_deepspeed_zero2_trains_checkpoints_resumes_and_saves_a_loadable_model(train_data, tmp_path):
    _run_backend(train_data, tmp_path, "--config_file", "infra/accelerate/deepspeed-zero1-1x8.yaml", "--zero_stage",
                 "2", "--mixed_precision", "no")  # fmt: skip


def _fsdp_accelerator(**plugin_options):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_options)
    return SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))


def test_an_fsdp2_policy_that_selects_a_modulelist_is_refused_in_one_line():
    """Size-based wrapping selects an attention's ``to_out`` ModuleList on a diffusers model, which fully_shard
    refuses deep inside prepare (seen on an H100, torch 2.11): refused before, naming the module and the fix."""
    from train.backends import prepare_fsdp_wrap

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ModuleList([torch.nn.Linear(64, 64)]))
    with pytest.raises(UsageError, match=r"selects 1 \(ModuleList\).*TRANSFORMER_BASED_WRAP"):
        prepare_fsdp_wrap(_fsdp_accelerator(auto_wrap_policy="size_based_wrap", min_num_params=1000), model)
    prepare_fsdp_wrap(_fsdp_accelerator(auto_wrap_policy="transformer_based_wrap"), model)  # no blocks: root only
    named = _fsdp_accelerator(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Linear"])
    prepare_fsdp_wrap(named, model)  # the config's own block names are kept
    assert named.state.fsdp_plugin.transformer_cls_names_to_wrap == ["Linear"]


@pytest.fixture
def gloo_world_of_one():
    import torch.distributed as dist

    from tests.conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux", "pixart", "wan"])
def test_the_fsdp2_config_shards_every_familys_denoiser(tmp_path, family, gloo_world_of_one):
    """infra/accelerate/fsdp2-1x8.yaml's wrap policy on each family's denoiser (tiny, the real classes): it selects
    the model's blocks (named into the plugin by the trainer: accelerate before 1.14 wraps nothing otherwise), the
    trainer's check passes, and torch's fully_shard takes every selected module (on a CPU mesh of one rank: what
    accelerate's fsdp2_prepare_model does on GPUs)."""
    import yaml
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from diffusers import DiffusionPipeline
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipeline.embed.families.tiny import build_tiny
    from train.backends import prepare_fsdp_wrap

    config = yaml.safe_load((Path(__file__).parent.parent / "infra/accelerate/fsdp2-1x8.yaml").read_text())
    options = {"auto_wrap_policy": config["fsdp_config"]["fsdp_auto_wrap_policy"].lower()}
    pipe = DiffusionPipeline.from_pretrained(build_tiny(family, tmp_path / family))
    model = pipe.unet if family == "sdxl" else pipe.transformer
    accelerator = _fsdp_accelerator(**options)
    prepare_fsdp_wrap(accelerator, model)
    policy = fsdp2_prepare_auto_wrap_policy(accelerator.state.fsdp_plugin, model)
    chosen = [m for m in model.modules() if policy(m)]
    assert chosen and {type(m).__name__ for m in chosen} <= set(model._no_split_modules)
    mesh = init_device_mesh("cpu", (1,))
    for module in reversed(chosen):  # innermost first, as accelerate does
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
