"""EMA under sharding: :class:`train.ema.ShardedEMA` on torch's ``fully_shard`` (FSDP2) in 2 gloo processes.

One ``torchrun`` run of :mod:`tests.sharded_ema_worker` (its checks are on the ranks: the sharded average equals
the unsharded one, saves and resumes); here, the checkpoint those 2 ranks wrote is read by one process without
FSDP (torch.distributed.checkpoint re-shards it) and equals the average at that step. Then the backends an EMA is
refused on, in one line each. The trainer's own FSDP2 run with an EMA needs CUDA (accelerate runs FSDP on GPUs
only): ``test_fsdp2_trains_checkpoints_resumes_and_saves_a_loadable_model`` (marker ``gpu``) has ``ema_decay``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from manifests.errors import UsageError
from tests.conftest import free_port
from tests.sharded_ema_worker import DECAY, SAVED_AT, build_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
@pytest.mark.slow
def test_a_sharded_ema_equals_the_unsharded_one_and_resumes_on_any_world_size(tmp_path):
    from safetensors.torch import load_file

    from train.ema import ShardedEMA

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "tests.sharded_ema_worker", str(tmp_path)]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("sharded EMA ok") == 2
    files = sorted(p.name for p in (tmp_path / "checkpoint" / "ema").iterdir())
    assert files == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    # one process, no FSDP: the 2 ranks' shards read back whole, the average after the step they were saved at
    whole = ShardedEMA(build_model(), DECAY)
    whole.load(tmp_path / "checkpoint")
    expected = load_file(str(tmp_path / f"exact-{SAVED_AT}.safetensors"))
    assert sorted(expected) == sorted(whole.names)
    for name, tensor in zip(whole.names, whole.shadow):
        assert torch.equal(tensor, expected[name]), name
    assert whole.counters.optimization_step == SAVED_AT


def test_an_ema_is_refused_where_the_weights_are_not_dtensor_shards(tmp_path):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from train.ema import EMA, EMA_FILE, ShardedEMA, sharded_ema

    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=SimpleNamespace())
    assert sharded_ema(ddp) is False
    fsdp2 = SimpleNamespace(distributed_type=DistributedType.FSDP,
                            state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))
    assert sharded_ema(fsdp2) is True
    fsdp1 = SimpleNamespace(distributed_type=DistributedType.FSDP,
                            state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)))
    with pytest.raises(UsageError, match="set fsdp_version: 2"):
        sharded_ema(fsdp1)
    zero3 = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}})))
    with pytest.raises(UsageError, match="ZeRO-3 partitions the weights its own way"):
        sharded_ema(zero3)
    # a checkpoint of an unsharded EMA, resumed under FSDP: one line saying so
    (tmp_path / EMA_FILE).write_bytes(b"")
    with pytest.raises(UsageError, match="unsharded ema.safetensors: resume it without FSDP"):
        ShardedEMA(build_model(), DECAY).load(tmp_path)
    # and the other way round
    sharded = tmp_path / "sharded"
    ShardedEMA(build_model(), DECAY).save(sharded)
    with pytest.raises(UsageError, match=r"holds a sharded EMA \(ema/, FSDP2\): resume it under FSDP2"):
        EMA(build_model(), DECAY).load(sharded)


def test_the_fsdp2_flux_config_reads():
    from train.config import load_config

    config = load_config(ROOT / "train" / "configs" / "flux-fsdp2.yaml")
    assert (config.family, config.ema_decay, config.timestep_shift, config.lora_rank) == ("flux", 0.9999, "auto", 0)
