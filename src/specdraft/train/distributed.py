"""Distributed runs (`torchrun`): the process group, DDP or FSDP2 around the TTT model, all-reduces.

Every helper is a no-op in a single process, so the loop reads the same with one rank or many.
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch import nn


def _init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world, device): joins the torchrun process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), dev


@contextlib.contextmanager
def leaving_process_group():
    """Around a run (or decorating its function): the process group `_init_distributed` joined during it is left
    at its end, failed or not (a process that exits with gloo's threads still running can abort after its work is
    done: "terminate called without an active exception", SIGABRT); a group there before is its creator's. The
    run's model is freed first: FSDP2's state is cyclic garbage holding the group's mesh and communication state,
    which the interpreter's teardown would otherwise free after the group is gone (CI: rank 1 aborted so)."""
    before = dist.is_initialized()
    try:
        yield
    finally:
        if not before and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def wrap_model(model: nn.Module, world: int, fsdp: bool, device: torch.device) -> nn.Module:
    """What the loop calls forward on: the model (one process, or FSDP2 sharding it in place) or DDP."""
    if world > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard

        # shard at the TTT module: its forward gathers the parameters once for all K steps (the draft's fuse and
        # compute_logits are called inside it); kept gathered until backward, where the head is recomputed
        fully_shard(model, reshard_after_forward=False)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       broadcast_buffers=False)  # fmt: skip
    return model


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    """All-reduce a copy of `t` (moved to the process group's device: NCCL needs CUDA tensors)."""
    if not dist.is_initialized():
        return t
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    r = t.detach().to(dev).clone()
    dist.all_reduce(r, op=op)
    return r.to(t.device)


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.SUM) if dist.is_initialized() else t


def _all_min(t: torch.Tensor) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.MIN) if dist.is_initialized() else t


def barrier(world: int) -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if world > 1:
        dist.barrier()
