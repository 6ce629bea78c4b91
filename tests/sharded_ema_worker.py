"""One rank of tests/test_train_ema_sharded.py: ``torchrun --nproc_per_node 2 -m tests.sharded_ema_worker OUT``.

A small model sharded by torch's ``fully_shard`` (FSDP2, gloo on the CPU; one parameter has a single row, so
one rank's shard of it is empty) trains 5 steps on this rank's half of a global batch; beside it an unsharded
replica trains on the whole batch. Checked here, on every rank: the :class:`ShardedEMA` equals, exactly, diffusers'
``EMAModel`` fed the gathered weights, and, to float tolerance, the project's unsharded :class:`EMA` of the
replica; the one saved after step 3 (torch.distributed.checkpoint) and read back into a fresh ShardedEMA
continues to the same shards and counters; swapped into the model, a full state dict gathered from it is the
average, and the model's own weights come back after. Rank 0 writes ``OUT/exact-3.safetensors`` (the average
after step 3) for the test to compare a one-process read of the checkpoint with (a re-shard from 2 ranks to 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

DECAY, STEPS, SAVED_AT = 0.9, 5, 3


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.GELU(), torch.nn.Linear(6, 1))


def main(out: Path) -> None:
    from diffusers.training_utils import EMAModel
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from train.ema import EMA, ShardedEMA

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, replica = build_model(), build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica_optimizer = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    ema, reference = ShardedEMA(model, DECAY), EMA(replica, DECAY)
    exact = EMAModel([p.full_tensor() for p in model.parameters()], decay=DECAY)
    resumed = None
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 1, generator=g)  # the global batch
        mine = slice(2 * rank, 2 * rank + 2)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()  # FSDP2 averages the ranks' gradients
        torch.nn.functional.mse_loss(replica(x), y).backward()
        for opt in (optimizer, replica_optimizer):
            opt.step()
            opt.zero_grad()
        for average in (ema, resumed):
            if average is not None:
                average.step(model)
        reference.step(replica)
        exact.step([p.full_tensor() for p in model.parameters()])
        if step == SAVED_AT:
            ema.save(out / "checkpoint")
            dist.barrier()
            resumed = ShardedEMA(model, DECAY)  # a fresh run's EMA (the current weights, no steps) ...
            resumed.load(out / "checkpoint")  # ... reads the checkpoint's
            if rank == 0:
                save_file({n: t.contiguous() for n, t in zip(ema.names, exact.shadow_params)},
                          str(out / f"exact-{SAVED_AT}.safetensors"))  # fmt: skip
    full = ema.full_state()
    for (name, tensor), shadow in zip(full.items(), exact.shadow_params):
        assert torch.equal(tensor, shadow), name  # the same arithmetic on each shard: bit for bit
    for name, tensor in reference.state().items():
        torch.testing.assert_close(full[name], tensor, rtol=1e-5, atol=1e-6)  # FSDP2 vs one replica: float sums
    for a, b in zip(ema.shadow, resumed.shadow):
        assert torch.equal(a.to_local(), b.to_local())
    assert resumed.counters.state_dict() | {"shadow_params": 0} == ema.counters.state_dict() | {"shadow_params": 0}
    own = {n: p.full_tensor() for n, p in model.named_parameters()}
    with ema.swapped_into(model):  # what the trainer's final model_ema/ gathers
        gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert sorted(gathered) == sorted(full) and all(torch.equal(gathered[n], full[n]) for n in full)
    assert all(torch.equal(p.full_tensor(), own[n]) for n, p in model.named_parameters())
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: sharded EMA ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
