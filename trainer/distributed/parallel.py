"""Where training runs: the device, the process group torchrun describes, the data-parallel
wrapper (DDP, or FSDP2 sharding each decoder layer), and full (unsharded) state dicts for
checkpoints."""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from pipeline.contract import UserError


@dataclass
class DistInfo:
    """This process's place in the run (rank 0 of 1 when not under torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False
    owns_group: bool = False  # this run created the process group (and destroys it at its end)
    device: torch.device | None = None  # this rank's device

    def barrier(self) -> None:
        """Wait for every rank. On CUDA the barrier names this rank's GPU (NCCL's barrier is a
        collective on a device; unnamed, PyTorch warns that it guesses the current one)."""
        if not self.enabled:
            return
        if self.device is not None and self.device.type == "cuda":  # indexed: pick_device sees to it
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


def pick_device(requested: str) -> torch.device:
    """`--device`: auto (this rank's GPU, else the CPU), cpu, cuda or cuda:N."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {requested}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {requested}: no CUDA device is available here; use --device cpu")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def process_group_backend(device: torch.device, cpu_collectives: bool = False) -> str:
    """The backend of the run's process group: NCCL on CUDA, gloo on the CPU. `cpu_collectives`
    (--offload-states, whose shards and gradients live in CPU memory): on CUDA, NCCL for CUDA
    tensors and gloo for CPU ones, as torchtitan does for FSDP2's CPU offload."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def setup_distributed(device: torch.device, cpu_collectives: bool = False) -> DistInfo:
    """Join the process group torchrun describes in the environment (`process_group_backend`)."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend=process_group_backend(device, cpu_collectives))
    return DistInfo(rank=rank, world_size=world, local_rank=local, enabled=True, owns_group=owns, device=device)


def close_distributed(info: DistInfo) -> None:
    """Leave the process group `setup_distributed` created (one a caller created stays theirs);
    PyTorch warns at exit about a group left open."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (each rank passes its own seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _bf16_allreduce_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP rejects string annotations here)
    """DDP comm hook: average a gradient bucket (dist.GradBucket) across ranks in bf16, write it
    back in fp32; returns a Future of the bucket's tensor.

    torch's `bf16_compress_hook` does the same but insists on NCCL; this one also runs on gloo,
    so the CPU tests exercise it."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(sent, async_op=True).get_future()

    def back(done: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(back)


def wrap_parallel(
    module: torch.nn.Module,
    layers: list[torch.nn.Module],
    info: DistInfo,
    *,
    fsdp: bool,
    bf16: bool,
    bucket_mb: int,
    reduce_bf16: bool = False,
    reshard_after_forward: bool = True,
    offload_states: bool = False,
) -> torch.nn.Module:
    """DDP, or FSDP2 (`fully_shard` on each of `layers`, then on `module`), or `module` itself (one
    process). Returns the module to call in the training step.

    `reduce_bf16` sends gradients across ranks in bf16 (DDP comm hook / FSDP2 reduce_dtype); they
    are accumulated and applied in fp32 either way. `reshard_after_forward=False` keeps each FSDP2
    layer's parameters gathered from its forward to its backward (one all-gather per micro-batch
    instead of two, at the memory of the unsharded bf16 parameters). `offload_states` (FSDP2's
    `CPUOffloadPolicy`): each rank's fp32 shards and their gradients live in pinned CPU memory, and
    so do the optimizer's states, which it updates there; a layer's parameters come to the GPU for
    its forward and backward only. An 8B model's AdamW training then holds no 16 bytes a parameter
    on the GPUs (64 GB a GPU on two), at the cost of copies and a CPU optimizer step.

    DDP all-reduces the gradients in buckets of `bucket_mb` MiB while the backward still runs, and
    its gradients are views into those buckets (`gradient_as_bucket_view`): no copy of every
    gradient into a bucket, no second gradient-sized buffer. The step therefore zeroes them in
    place rather than setting them to None (`trainer.run.loop`), so that they stay bucket views.
    """
    if fsdp:
        # here, not at the top: torch.distributed.fsdp exports fully_shard only from torch 2.6 on
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_states else OffloadPolicy()
        for layer in layers:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward, offload_policy=offload)
        fully_shard(module, mp_policy=policy, offload_policy=offload)
        return module
    if info.enabled:
        # no buffer sync before each forward: the only buffers are the rotary frequencies, equal on
        # every rank by construction; syncing them before every forward would lock the ranks together
        # on each micro-batch, no_sync ones included (torch 2.13 renamed broadcast_buffers, which it
        # warns about, to forward_sync_buffers)
        # frozen parameters (a LoRA run's base) are equal on every rank by construction, as the
        # buffers are: DDP need not broadcast them at the start (a --qlora base's NF4 weights, which
        # it could not broadcast, an --int8-base base's int8 weights and scales, or an 8B bf16 base's
        # 14.5 GB); LoRA under FSDP2 is refused (`refuse_combinations`), so neither base is sharded
        DDP = torch.nn.parallel.DistributedDataParallel
        DDP._set_params_and_buffers_to_ignore_for_model(
            module, [name for name, param in module.named_parameters() if not param.requires_grad]
        )
        no_sync = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters else {"broadcast_buffers": False}
        )
        ddp = DDP(module, **no_sync, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        if reduce_bf16:
            ddp.register_comm_hook(None, _bf16_allreduce_hook)
        return ddp
    return module


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2-sharded module, on the CPU (collective: every rank calls it)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> dict:
    """The optimizer's full state (collective under FSDP2)."""
    if not fsdp:
        return optimizer.state_dict()
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, fsdp: bool) -> None:
    """Load what `optimizer_state` returned (under FSDP2 each rank keeps its own shard of it)."""
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
