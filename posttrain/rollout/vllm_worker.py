"""The server side of `rollout_engine: vllm_server`: a vLLM worker extension.

Start the server with ``--worker-extension-cls posttrain.rollout.vllm_worker.WeightReceiver``
(and ``VLLM_SERVER_DEV_MODE=1`` for its ``/collective_rpc`` endpoint): vLLM mixes this class
into each GPU worker, and the trainer calls its methods by name through ``/collective_rpc``.
The weights travel over an NCCL group of the workers (ranks 0..w-1; rank 0 hosts the store)
and the trainer's rank 0 (rank w, the broadcast source).

A new group closes the old one first (a second run or a resume against the same server);
`close_weight_group` is the trainer's close. The NCCL side has not run on a GPU yet: written
against vLLM's public pieces (`StatelessProcessGroup`, `PyNcclCommunicator`, `load_weights`).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Methods added to a vLLM GPU worker (which provides `self.device`, `self.model_runner`)."""

    device: Any
    model_runner: Any

    def weight_group_rank(self) -> int:
        """This worker's rank in vLLM's world (the trainer counts the answers)."""
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)

    def server_log(self) -> str | None:
        """The server's log file (`posttrain vllm-serve --log`), for the trainer's errors."""
        return os.environ.get("POSTTRAIN_VLLM_LOG")

    def close_weight_group(self) -> None:
        """Close the group of an earlier run, if any: its communicator, and its rendezvous
        store, which listens on the group's port until the last reference to it goes."""
        comm = getattr(self, "_posttrain_comm", None)
        self._posttrain_comm = None
        if comm is not None:
            if callable(getattr(comm, "destroy", None)):
                comm.destroy()
            comm.group = None  # the store, even if something still holds the communicator
        del comm
        gc.collect()  # the store's C++ object (and its listening socket) goes with the group

    def init_weight_group(self, host: str, port: int, world_size: int,
                          timeout: float = 300.0) -> None:
        """Join the NCCL group with the trainer (the last rank, the source), after closing an
        earlier run's group; `timeout`: seconds to wait for the trainer at the store."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.close_weight_group()
        group = StatelessProcessGroup.create(host=host, port=port,
                                             rank=self.weight_group_rank(),
                                             world_size=world_size, store_timeout=int(timeout))
        self._posttrain_comm = PyNcclCommunicator(group, device=self.device)
        if getattr(self._posttrain_comm, "disabled", False):
            raise RuntimeError(f"vLLM's NCCL communicator disabled itself on the server's worker "
                               f"(world {world_size}): no weights would arrive")
        self._posttrain_src = world_size - 1

    def receive_weights(self, specs: list[list[Any]]) -> None:
        """Receive one bucket [(name, dtype name, shape)] in order and load it."""
        weights = []
        for name, dtype, shape in specs:
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._posttrain_comm.broadcast(buf, src=self._posttrain_src,
                                           stream=torch.cuda.current_stream())
            weights.append((name, buf))
        torch.cuda.current_stream().synchronize()
        self.model_runner.model.load_weights(weights=weights)

    def receive_file(self, path: str) -> None:
        """Reload every weight from the safetensors file at `path` (the CPU path, no NCCL):
        vLLM's in-place reload re-processes each module whose weights arrive (its CPU backend
        repacks linear weights after loading, so `load_weights` alone would not do)."""
        from safetensors.torch import load_file

        weights = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
