"""The `vllm_server` sampler: a `vllm serve` process reached over HTTP.

Requests go to `/v1/completions` as token ids (one per sequence, its seed); weights go over an
NCCL group with the server's workers (`posttrain.rollout.vllm_worker.WeightReceiver`), or
without CUDA as one safetensors file in shared memory that the workers reload. Start the server
with `posttrain vllm-serve MODEL` (`posttrain.rollout.vllm_serve`). Lifecycle:
1. start: the dev-mode routes, the log-probs mode, a dtype this CPU serves, the worker
   extension (which also reports the server's log file) are checked in one line each;
2. every request and every push is bounded by `vllm_server_timeout`: a server that dies or
   hangs ends the run with one `ServerError` naming the server's log, never a hang;
3. `close` closes the weight group, so a second run or a resume can open its own.
More: docs/rollout.md.
"""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from posttrain.rollout.completion import Completion
from posttrain.rollout.vllm_sampler import NEUTRAL, _import_vllm, _model_dir, _stops, _VLLMSampler
from posttrain.rollout.weights import DEFAULT_BUCKET_BYTES, iter_weights

__all__ = ["ServerError", "VLLMServerSampler", "amx_tiles", "cpu_server_dtype_problem",
           "server_choice"]


class ServerError(RuntimeError):
    """The server stopped, hung or failed a request (one line, naming the server's log)."""


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (an Intel Xeon since Sapphire Rapids)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def cpu_server_dtype_problem(vllm_config: dict[str, Any], amx: bool) -> str | None:
    """Why a server of vLLM's CPU build cannot serve here, or None (of its `/server_info`
    `vllm_config`): in bf16 on a CPU with AMX tiles vLLM 0.32 picks its AMX attention kernel,
    and the server's worker dies at the first request (float32: its vector kernel)."""
    device = str((vllm_config.get("device_config") or {}).get("device", ""))
    dtype = str((vllm_config.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
    if amx and device == "cpu" and dtype == "bfloat16":
        return ("serves bfloat16 on vLLM's CPU build, whose worker dies at the first request "
                "on this CPU (AMX tiles: vLLM's bf16 AMX attention kernel)")
    return None


class VLLMServerSampler(_VLLMSampler):
    """A `vllm serve` process reached over HTTP; weights over NCCL (see the module doc)."""

    name = "vllm_server"
    runs_policy = False

    def __init__(self, base_url: str, tokenizer: Any, stops: list[int], *, group_host: str,
                 group_port: int, timeout: float, is_main: bool = True,
                 barrier: Callable[[], None] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.base_url, self.tokenizer, self.stops = base_url.rstrip("/"), tokenizer, stops
        self.group_host, self.group_port, self.timeout = group_host, group_port, timeout
        self.is_main, self.bucket_bytes = is_main, bucket_bytes
        self.barrier = barrier
        """Every torchrun rank's barrier (None: one process): no rank samples before rank 0
        has pushed the weights."""
        self.weights_version: int | None = None
        self.via_file = not torch.cuda.is_available()
        """No CUDA: weights go through a file in shared memory (same machine), not NCCL."""
        self._comm: Any = None
        self._src = 0
        self.log: str | None = None
        """The server's log file, as its worker reports it (`posttrain vllm-serve --log`)."""
        self._served = self._get("/v1/models")["data"][0]["id"]
        self._check_logprobs_mode()
        self.log = self._server_log()

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, *, role: str = "eval", dist: Any = None,
                    model: Any = None) -> VLLMServerSampler:
        if torch.cuda.is_available():  # the NCCL group needs vLLM's communicator here too
            _import_vllm(cls.name)
        path = _model_dir(cfg, cls.name)
        return cls(f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}", tokenizer,
                   _stops(tokenizer, path, None), group_host=cfg.vllm_server_host,
                   group_port=cfg.vllm_group_port, timeout=cfg.vllm_server_timeout,
                   is_main=getattr(dist, "is_main", True),
                   barrier=dist.barrier if getattr(dist, "enabled", False) else None)

    # ---- HTTP ---------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        text = self._open(req, "POST " + path)
        return json.loads(text) if text else None

    def _get(self, path: str) -> Any:
        return json.loads(self._open(urllib.request.Request(self.base_url + path), "GET " + path))

    def _open(self, req: urllib.request.Request, what: str) -> str:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise ServerError(f"vllm_server at {self.base_url}: {what} -> {err.code} "
                              f"{detail}; {self.where()}") from err
        except TimeoutError as err:
            raise self.error(f"{what}: no answer within vllm_server_timeout="
                             f"{self.timeout:g} s") from err
        except (OSError, http.client.HTTPException) as err:  # refused, reset, closed
            reason = getattr(err, "reason", None) or err
            raise self.error(f"{what} failed ({reason}): the server stopped or does not "
                             "answer") from err

    def where(self) -> str:
        """Where the server's own account of a failure is."""
        if self.log:
            return f"the server's log: {self.log}"
        return ("see the server's output (`posttrain vllm-serve MODEL --log FILE` writes it to "
                "a file that these errors name)")

    def error(self, text: str) -> ServerError:
        return ServerError(f"vllm_server at {self.base_url}: {text}; {self.where()}")

    def _server_log(self) -> str | None:
        """The worker extension's answer (its log file or None); a server without the
        extension is refused in one line."""
        try:
            answer = self._post("/collective_rpc", {"method": "server_log"})
        except ServerError as err:
            raise RuntimeError(f"config key 'rollout_engine'=vllm_server: the server at "
                               f"{self.base_url} has no posttrain worker extension ({err}); "
                               f"restart it with: posttrain vllm-serve {self._served}") from err
        results = (answer or {}).get("results") or [None]
        return results[0]

    def _check_logprobs_mode(self) -> None:
        """Refuse a server whose log-probs are not the learner's (after temperature), or whose
        dtype its CPU build cannot serve on this machine (`cpu_server_dtype_problem`)."""
        fix = f"restart it with: posttrain vllm-serve {self._served}"
        try:
            info = self._get("/server_info?config_format=json")
        except RuntimeError as err:
            raise RuntimeError(f"config key 'rollout_engine'=vllm_server: cannot read the "
                               f"server's /server_info ({err}); {fix}") from err
        mode = info["vllm_config"]["model_config"]["logprobs_mode"]
        if mode != "processed_logprobs":
            raise RuntimeError(f"config key 'rollout_engine'=vllm_server: the server at "
                               f"{self.base_url} returns logprobs_mode={mode}, not the "
                               f"log-probs after temperature that the learner compares; {fix}")
        problem = cpu_server_dtype_problem(info["vllm_config"], amx_tiles())
        if problem:
            raise RuntimeError(f"config key 'rollout_engine'=vllm_server: the server at "
                               f"{self.base_url} {problem}; {fix} --dtype float32")

    # ---- memory: the server has its own GPUs ----------------------------------------------------
    def sleep(self) -> None:
        """Nothing to free here (the server's memory is its own)."""

    def wake(self) -> None:
        """Nothing to take back."""

    def close(self) -> None:
        """Close the weight group on both sides (the server's workers then accept the next
        run's group on the same port)."""
        if self._comm is None:
            return
        comm, self._comm = self._comm, None
        try:
            self._post("/collective_rpc", {"method": "close_weight_group"})
        finally:
            if callable(getattr(comm, "destroy", None)):
                comm.destroy()

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        """Rank 0 sends every bucket to the server's workers (NCCL; on a CPU, one safetensors
        file in shared memory that the workers reload); under FSDP2 every rank iterates (each
        parameter's `full_tensor()` is a collective) and only rank 0 sends. Every server-side
        error of a push is raised here with the server's message."""
        if weights_version == self.weights_version:
            return
        sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
        if self.is_main and self.via_file:
            self._push_file(model)
        elif self.is_main or sharded:
            if self.is_main and self._comm is None:
                self._init_group()
            for bucket in iter_weights(model, self.bucket_bytes):
                if self.is_main:
                    self._send(bucket)
        if self.is_main:
            self._post("/reset_prefix_cache")
        if self.barrier is not None:  # the other ranks wait for the push before sampling
            self.barrier()
        self.weights_version = weights_version

    def _push_file(self, model: torch.nn.Module) -> None:
        """The CPU path (no NCCL): every weight, the tied head under its own name too, in one
        safetensors file in shared memory, reloaded by the workers (`receive_file`)."""
        from safetensors.torch import save_file

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=folder, prefix="posttrain-push-") as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file({n: t.contiguous() for b in iter_weights(model, self.bucket_bytes, tied=True)
                       for n, t in b}, path)
            self._post("/collective_rpc", {"method": "receive_file", "args": [path]})

    def _init_group(self) -> None:
        """An NCCL group of the server's workers (ranks 0..w-1, rank 0 hosts the store, after
        closing an earlier run's group) and this process (rank w, the broadcast source); both
        sides wait at most `timeout`; a communicator that disabled itself is refused."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        workers = len(self._post("/collective_rpc", {"method": "weight_group_rank"})["results"])
        world, device = workers + 1, torch.cuda.current_device()
        rpc = {"method": "init_weight_group",
               "args": [self.group_host, self.group_port, world, self.timeout]}

        def join() -> None:  # the workers block in their request until this process joins
            group = StatelessProcessGroup.create(host=self.group_host, port=self.group_port,
                                                 rank=workers, world_size=world,
                                                 store_timeout=int(self.timeout))
            self._comm = PyNcclCommunicator(group, device=device)

        _Request(self, rpc).run(join)
        if getattr(self._comm, "disabled", False):
            raise RuntimeError(f"vllm_server: vLLM's NCCL communicator disabled itself on "
                               f"the trainer's side (world {world}): nothing would be sent")
        self._src = workers

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
        device = torch.cuda.current_device()

        def send() -> None:  # the workers allocate and wait on these broadcasts
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream()
                for _, t in bucket:
                    self._comm.broadcast(t.to(device), src=self._src, stream=stream)
                stream.synchronize()

        _Request(self, {"method": "receive_weights", "args": [specs]}).run(send)

    # ---- sampling -----------------------------------------------------------------------------
    def _run(self, contexts: list[list[int]], kwargs: list[dict[str, Any]],
             batch_size: int) -> list[Completion]:
        """Every request at once (up to 64 in flight; `batch_size` > 0 bounds it too)."""
        workers = min(64, batch_size if batch_size > 0 else len(contexts)) or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self._complete, contexts, kwargs))

    def _prompt_logprobs(self, ids: list[int]) -> list[Any]:
        body = {"model": self._served, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, **NEUTRAL}
        entries = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [{int(k): v["logprob"] for k, v in e.items()} if isinstance(e, dict) else e
                for e in entries]  # JSON: {"id": {"logprob": ...}}

    def _complete(self, ids: list[int], kw: dict[str, Any]) -> Completion:
        body = {"model": self._served, "prompt": ids, "max_tokens": kw["max_tokens"],
                "temperature": kw["temperature"], "n": 1, "seed": kw["seed"],
                "logprobs": kw["logprobs"], "stop_token_ids": kw["stop_token_ids"],
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, **NEUTRAL}
        return server_choice(self._post("/v1/completions", body)["choices"][0])


class _Background:
    """`fn()` in a daemon thread (one that hangs on a dead peer never blocks the exit)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.done, self.error = threading.Event(), None
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as err:  # raised in the caller's thread by `_Request.run`
            self.error = err
        finally:
            self.done.set()


class _Request:
    """A `/collective_rpc` request in the background while `run(block)` talks to the workers
    (NCCL). Either's error is raised as soon as it comes (the server's answer first), and a
    request or block still running after the sampler's timeout (a worker that never joins or
    died mid-transfer) is a `ServerError` naming the server's log: never a hang."""

    def __init__(self, sampler: VLLMServerSampler, rpc: dict[str, Any]) -> None:
        self.sampler, self.method = sampler, rpc["method"]
        self.request = _Background(lambda: sampler._post("/collective_rpc", rpc))

    def run(self, block: Callable[[], Any]) -> None:
        work = _Background(block)
        deadline = time.monotonic() + self.sampler.timeout
        while not (self.request.done.is_set() and work.done.is_set()):
            for job in (self.request, work):
                if job.error is not None:
                    raise job.error
            if time.monotonic() > deadline:
                raise self.sampler.error(
                    f"the weight transfer ({self.method}) did not end within "
                    f"vllm_server_timeout={self.sampler.timeout:g} s: a worker that never "
                    "joined the weight group, or a server that died during the push")
            self.request.done.wait(0.02)
        for job in (self.request, work):
            if job.error is not None:
                raise job.error


def server_choice(choice: dict[str, Any]) -> Completion:
    """A `Completion` from one choice of `/v1/completions`: token ids from `token_ids`
    (`return_token_ids`), else from the `token_id:N` strings of `logprobs.tokens`
    (`return_tokens_as_token_ids`); log-probs from `logprobs.token_logprobs`."""
    lp = choice.get("logprobs") or {}
    tokens = choice.get("token_ids")
    if tokens is None:
        tokens = [int(str(t).removeprefix("token_id:")) for t in lp.get("tokens") or []]
    logprobs = lp.get("token_logprobs")
    return Completion([int(t) for t in tokens],
                      [float(x) for x in logprobs] if logprobs is not None else None,
                      choice.get("finish_reason"))
