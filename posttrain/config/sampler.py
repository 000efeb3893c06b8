"""Checks of the sampler keys (`rollout_engine`, `vllm_*`, `generation_batch_size`),
shared by every config: all of them generate, at least for held-out evaluation."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import Any

from posttrain.config.errors import ConfigError, check_table

VLLM_SAMPLERS = ("vllm_colocate", "vllm_server")
VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's `SamplingParams` refuses a temperature above this (scripts/check_vllm_api.py)."""


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` package; nothing imported)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_available() -> bool:
    """Whether `import vllm` would find the package (nothing is imported)."""
    return importlib.util.find_spec("vllm") is not None


def check_rollout_engine(cfg: Any) -> None:
    """Refuse sampler settings that cannot work, in one line naming the key, before any model
    loads: a vLLM sampler without vLLM, or on a CPU without vLLM's CPU build, with top-k /
    top-p truncation (vLLM's log-probs are renormalised after truncation, the learner's are
    not: the importance ratio would compare two different distributions), or with a
    temperature vLLM refuses (> 2). On the CPU build, `vllm_sleep` is turned off (one line)."""
    batch = getattr(cfg, "generation_batch_size", 0)
    if batch < 0:
        raise ConfigError(f"config key 'generation_batch_size'={batch}: expected >= 0 (0: every "
                          "sequence of a step in one generation batch)")
    sampler = getattr(cfg, "rollout_engine", "hf")
    if sampler not in VLLM_SAMPLERS:
        return
    where = f"config key 'rollout_engine'={sampler}"
    if not vllm_available():
        raise ConfigError(f"{where} needs vLLM: pip install 'posttrain[vllm]' (or use "
                          "rollout_engine: hf)")
    if (cfg.device.startswith("cpu") or (cfg.device == "auto" and not _cuda())) and \
            not vllm_cpu_build():
        raise ConfigError(f"{where} on a CPU (device={cfg.device}) needs vLLM's CPU build: "
                          "bash scripts/install.sh --vllm-cpu (docs/rollout.md), or use "
                          "rollout_engine: hf")
    if vllm_cpu_build() and sampler == "vllm_colocate" and cfg.vllm_sleep:
        cfg.vllm_sleep = False
        print("[posttrain] vllm_sleep: off (vLLM's CPU backend has no sleep mode)",
              file=sys.stderr)
    if getattr(cfg, "top_k", 0) > 0 or getattr(cfg, "top_p", 1.0) < 1.0:
        raise ConfigError(f"{where} with top_k={getattr(cfg, 'top_k', 0)} / "
                          f"top_p={getattr(cfg, 'top_p', 1.0)}: vLLM's log-probs would be "
                          "renormalised after truncation and the learner's not; set top_k: 0 "
                          "and top_p: 1.0, or use rollout_engine: hf")
    temperature = getattr(cfg, "temperature", 1.0)
    if temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(f"config key 'temperature'={temperature}: {where} samples at a "
                          f"temperature in [0, {VLLM_MAX_TEMPERATURE}] (vLLM refuses more); "
                          "lower it or use rollout_engine: hf")
    check_table(cfg, {
        "vllm_gpu_memory_utilization": (0.0 < cfg.vllm_gpu_memory_utilization < 1.0,
                                        "expected in (0, 1)"),
        **{k: (0 < getattr(cfg, k) < 65536, "expected a TCP port (1-65535)")
           for k in ("vllm_server_port", "vllm_group_port")},
        "vllm_server_timeout": (cfg.vllm_server_timeout > 0, "expected > 0 seconds"),
        "vllm_max_model_len": (cfg.vllm_max_model_len >= 0, "expected >= 0 (0: the model's "
                               "context)")})


_ENGINE_KEYS = {"vllm_colocate": ("vllm_gpu_memory_utilization", "vllm_sleep",
                                   "vllm_max_model_len"),
                "vllm_server": ("vllm_server_host", "vllm_server_port", "vllm_group_port",
                                "vllm_server_timeout")}


def sampler_key_needs(cfg: Any) -> dict[str, tuple[bool, str]]:
    """The `vllm_*` keys and the sampler that reads them (TRL's `vllm_mode`), for
    `check_idle_keys`: a server's address with the `hf` sampler would be set and unused."""
    sampler = getattr(cfg, "rollout_engine", "hf")
    out = {key: (sampler == name, f"rollout_engine: {name}")
           for name, keys in _ENGINE_KEYS.items() for key in keys}
    out["vllm_push_check"] = (sampler in VLLM_SAMPLERS,
                              "rollout_engine: vllm_colocate or vllm_server")
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
