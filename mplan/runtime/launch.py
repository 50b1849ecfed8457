"""Joining the job's default process group, the way `torchrun` sets it up.

Input: the process environment. Output: the default (world) process group, or `None` when
this process runs alone. Called by `autoparallel` on every rank before anything else.

Invariants: an existing default group is reused, never re-initialized (the user or a test
may have created it); the backend is NCCL when CUDA is available, else gloo; a partial
torchrun environment is an error naming the missing variables, not a silent single run.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mplan.refusal import install_excepthook

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What `init_method="env://"` reads; torchrun and most cluster launchers set all four."""


class LaunchError(RuntimeError):
    """The process environment is neither a whole torchrun job nor a single process: the message
    names the variables missing (a refusal, `mplan.refusal`: one line, no traceback)."""


def init_distributed_from_env() -> dist.ProcessGroup | None:
    """The world process group: existing, or initialized from torchrun's variables, or None.
    Under torchrun it also installs `mplan.refusal.install_excepthook`: an mplan error that
    escapes the user's script (raised alike on every rank) prints once, on rank 0, as one line."""
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if present:
        install_excepthook()
    if dist.is_initialized():
        return dist.group.WORLD
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise LaunchError(
            f"incomplete torchrun environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; launch with torchrun or set all of "
            f"{', '.join(TORCHRUN_VARIABLES)}"
        )
    if torch.cuda.is_available():
        # One GPU per process: bind before NCCL creates its communicator on the current device.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", init_method="env://", device_id=device)
    else:
        dist.init_process_group("gloo", init_method="env://")
    return dist.group.WORLD


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors must live for `group`'s backend: NCCL takes only CUDA tensors
    (the current device, which `init_distributed_from_env` binds), gloo takes CPU ones. (On 2
    H200s a CPU tensor's all-gather failed with "No backend type associated with device type cpu".)"""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
