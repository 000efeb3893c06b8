"""`posttrain vllm-serve MODEL`: start the `vllm serve` that `rollout_engine: vllm_server` needs.

1. `serve_command` builds the server's environment and words (pure): dev-mode routes
   (`VLLM_SERVER_DEV_MODE=1`), posttrain's worker extension, `--logprobs-mode
   processed_logprobs`, and a dtype this machine serves (`auto`: bfloat16 with CUDA, float32 on
   vLLM's CPU build, which also runs eager with a 1 GiB KV cache); a bf16 CPU server on a CPU
   with AMX tiles is refused in one line (its worker dies at the first request).
2. `main` replaces this process with the server (`exec`), its output in `--log FILE` if given.
Binds 127.0.0.1 unless `--host` says otherwise: the dev-mode routes run any worker method.
Words after the known options go to vLLM as they are (`--max-model-len 1024`). docs/rollout.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.config.sampler import vllm_cpu_build
from posttrain.rollout.vllm_server import amx_tiles

__all__ = ["LOG_ENV", "serve_command", "main"]

EXTENSION = "posttrain.rollout.vllm_worker.WeightReceiver"
LOG_ENV = "POSTTRAIN_VLLM_LOG"
"""The server's log file (`--log`), which the worker reports so a trainer's error can name it."""


def serve_command(model: str, *, port: int = 8000, host: str = "127.0.0.1",
                  dtype: str = "auto", cpu: bool | None = None, amx: bool | None = None,
                  log: str | None = None, extra: list[str] | tuple[str, ...] = ()
                  ) -> tuple[dict[str, str], list[str]]:
    """(environment variables to add, argv) of the server; `cpu`: vLLM's CPU build (default:
    whether it is installed); `amx`: this CPU has AMX tiles (default: probed)."""
    cpu = vllm_cpu_build() if cpu is None else cpu
    if dtype == "auto":
        dtype = "float32" if cpu else "bfloat16"
    if cpu and dtype in ("bfloat16", "bf16") and (amx_tiles() if amx is None else amx):
        raise ValueError("posttrain vllm-serve: --dtype bfloat16 on vLLM's CPU build kills the "
                         "server's worker at the first request on this CPU (AMX tiles); use "
                         "--dtype float32 (the default here)")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if log:
        env[LOG_ENV] = os.path.abspath(log)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", EXTENSION, "--host", host, "--port", str(port)]
    if cpu:  # no graph compile; vLLM's default CPU KV cache takes most of the machine
        argv.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return env, argv + list(extra)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain vllm-serve",
        description="Start `vllm serve MODEL` with what rollout_engine=vllm_server needs (dev-mode "
                    "routes, posttrain's worker extension, processed log-probs, a dtype this "
                    "machine serves). Other options go to vLLM unchanged.")
    parser.add_argument("model", help="the trainer's `model` (a directory or hub name)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (vllm_server_port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (vllm_server_host); the dev-mode routes run any "
                             "worker method, so bind another address only on a trusted network")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 with CUDA, float32 on vLLM's CPU build")
    parser.add_argument("--log", default=None,
                        help="write the server's output to this file (trainer errors name it)")
    parser.add_argument("--print", action="store_true", dest="dry",
                        help="print the command instead of starting it")
    return parser


def main(argv: list[str]) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        env, words = serve_command(args.model, port=args.port, host=args.host, dtype=args.dtype,
                                   log=args.log, extra=extra)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.dry:
        print(" ".join([f"{k}={v}" for k, v in env.items()] + words))
        return 0
    if args.log:
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.stdout.flush()
    os.execve(words[0], words, {**os.environ, **env})
    return 1  # pragma: no cover - execve does not return
