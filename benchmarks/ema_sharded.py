"""The EMA step under FSDP2 (:class:`train.ema.ShardedEMA`, 2 ranks) beside the unsharded EMA (diffusers
``EMAModel`` through :class:`train.ema.EMA`, 1 process), in CPU time per optimizer step.

    python benchmarks/ema_sharded.py [--rounds 3]   # launches itself with torchrun on 2 gloo processes

Two model sizes (stacks of 1024x1024 linear layers, 12.6M and 25.2M parameters) give the marginal cost
per million parameters, so that the per-step fixed cost (Python, DTensor dispatch) drops out. Each rank
of the sharded run averages only its half of every weight; the unsharded EMA averages all of them. CPU
time (``time.process_time``, one thread per process) because the machine is shared. Each of ``--rounds``
rounds measures both sides at both sizes (20 steps each) and rank 0 writes every round's figures to
``benchmarks/results/ema_sharded.json`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SIZES = (12, 24)  # layers of 1024x1024 (+ bias): 12.6M and 25.2M parameters
STEPS = 20


def model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))


def cpu_per_step(ema, m: torch.nn.Module) -> float:
    """CPU seconds per ``ema.step``, the mean over STEPS steps after one warm-up step."""
    ema.step(m)  # warm-up
    spent = 0.0
    for _ in range(STEPS):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1e-3)  # a stand-in for the optimizer's update
        start = time.process_time()
        ema.step(m)
        spent += time.process_time() - start
    return spent / STEPS


def measure(rank: int) -> list[tuple[float, float, float]]:
    """``(M parameters, sharded CPU s per step of this rank, unsharded CPU s per step)`` per size (unsharded: rank
    0 only)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from train.ema import EMA, ShardedEMA

    rows = []
    for layers in SIZES:
        sharded = model(layers)
        for layer in sharded:
            fully_shard(layer)
        fully_shard(sharded)
        t_sharded = cpu_per_step(ShardedEMA(sharded, 0.999), sharded)
        plain = model(layers)
        t_plain = cpu_per_step(EMA(plain, 0.999), plain) if rank == 0 else 0.0
        params = sum(p.numel() for p in plain.parameters()) / 1e6
        rows.append((params, t_sharded, t_plain))
        dist.barrier()
    return rows


def rank_main(rounds: int, command: str) -> None:
    import torch.distributed as dist

    from benchmarks.results import Run

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = Run("ema_sharded", command)
    for r in range(rounds):
        with run.round():
            rows = measure(rank)
            times = torch.tensor([[row[1] for row in rows]])
            gathered = [torch.zeros_like(times) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, times)
            if rank == 0:
                print(f"round {r + 1}: parameters | ShardedEMA, 2 ranks (CPU-ms per rank per step) | EMA (CPU-ms)")
                per_rank = [max(g[0, i].item() for g in gathered) for i in range(len(rows))]
                for (params, _, t_plain), t_sharded in zip(rows, per_rank):
                    print(f"  {params:.1f}M | {t_sharded * 1e3:.1f} | {t_plain * 1e3:.1f}")
                    run.add(f"ShardedEMA, 2 ranks, {params:.1f}M parameters: CPU per rank per step", t_sharded * 1e3,
                            "ms")  # fmt: skip
                    run.add(f"EMA, 1 process, {params:.1f}M parameters: CPU per step", t_plain * 1e3, "ms")
                (p0, _, u0), (p1, _, u1) = rows
                s0, s1 = per_rank
                ms, mu = (s1 - s0) / (p1 - p0) * 1e3, (u1 - u0) / (p1 - p0) * 1e3
                print(f"marginal: sharded {ms:.3f} ms per M parameters per rank, unsharded {mu:.3f} ms; "
                      f"ratio {mu / ms:.2f}x")  # fmt: skip
                run.add("ShardedEMA marginal, per M parameters, per rank", ms, "ms")
                run.add("EMA marginal, per M parameters", mu, "ms")
                run.add("marginal per rank: EMA / ShardedEMA (2x expected)", mu / ms, "x")
    if rank == 0:
        run.save()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(int(os.environ["BENCH_EMA_ROUNDS"]), os.environ["BENCH_EMA_COMMAND"])
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--rounds", type=int, default=3)
        args = parser.parse_args()
        root = Path(__file__).resolve().parents[1]
        # glibc would hand the 4 MB temporaries of every weight's update back to the OS and page-fault them in
        # again each step (the 2 MB of a half shard it keeps): pinned, both sides reuse their memory, as a GPU's
        # caching allocator does
        env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30), **os.environ,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "BENCH_EMA_ROUNDS": str(args.rounds),
               "BENCH_EMA_COMMAND": "python benchmarks/ema_sharded.py" + "".join(f" {a}" for a in sys.argv[1:])}
        # -m: run as a script, benchmarks/train.py would shadow the train package
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                  "--master_addr", "127.0.0.1", "--master_port", "29677", "-m",
                                  "benchmarks.ema_sharded"], cwd=root, env=env))  # fmt: skip
