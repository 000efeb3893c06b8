"""The sampler process's side of `async_rollouts` (docs/async.md): its entry `sampler_main`,
which waits for its setup, then per job loads the weights the job needs from shared memory,
pushes them to a `vllm_server` (verified against its own copy), samples, scores and sends the
result back; the learner's side is `engine/async_rollout.py`, the start `engine/sampler_start.py`.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.engine.push_check import check_push, probe_ids
from posttrain.rewards.registry import ScoreResult
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.sampler import build_sampler
from posttrain.rollout.tools import python_mode

POLL_S = 0.2
"""How often a waiting side looks whether the other one is still alive."""


@dataclass
class Job:
    """One step's sampling work: `rows` [B] with G `seeds` each, rendered `prompts` (empty when
    the sampler renders rows itself), sampled with weights `version`."""

    step: int
    version: int
    rows: list[dict[str, Any]]
    prompts: list[str]
    seeds: list[int]
    params: SamplingParams


@dataclass
class Sampled:
    """A job's scored rollout, as the learner gets it; `seconds`: gen, score and wait (the
    sampler idle before the job: no job or its weights not pushed yet)."""

    step: int
    version: int
    rollout: Rollout
    result: ScoreResult
    seconds: dict[str, float] = field(default_factory=dict)
    push_gap: float | None = None
    """The push check's gap when this job pushed its weights to a vLLM server, else None."""


def _watch_parent(parent: int) -> None:
    """End this process when the learner's is gone (killed: it cannot stop us)."""
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os._exit(3)


def sampler_main(parent: int, setup: Any, jobs: Any, results: Any, version: Any, loaded: Any,
                 lock: Any) -> None:
    """The sampler process: wait for `setup` (the config, agent, reward functions, torch
    threads, the learner's `python` tool mode (a spawned process starts from the module
    default), the tokenizer, the policy's shared copy and the push check's text; None: stop),
    then per job load its weights, sample, score, send; errors are sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the learner stops us after its save
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        import transformers.modeling_utils  # noqa: F401 - what the policy's class imports

        from posttrain.engine.session import build_rewards
        from posttrain.engine.values import prompt_values

        if (got := setup.get()) is None:  # the run ended before it sampled
            return
        cfg, agent, reward_fns, threads, sandbox_mode, tokenizer, skeleton, probe = got
        python_mode(sandbox_mode)
        torch.set_num_threads(threads)
        buffers, model = skeleton.state_dict(), copy.deepcopy(skeleton)
        sampler = build_sampler(cfg, tokenizer, role="train", agent=agent)
        rewards, _ = build_rewards(prompt_values(cfg).rewards, reward_fns)
        pusher = _Pusher(sampler, tokenizer, probe, cfg.vllm_push_check)
        while (job := jobs.get()) is not None:
            results.put(_run_job(job, model, buffers, pusher, rewards, cfg, version, loaded,
                                 lock))
    except BaseException as err:  # noqa: BLE001 - every failure goes to the learner
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(("error", (err, text)))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            payload = pickle.dumps(("error", (None, text)))
        results.put(payload)


class _Pusher:
    """The sampler process's sampler and its weight pushes: a push to a vLLM server is checked
    against the sampler's copy of the same version (`posttrain.engine.push_check`; the probe
    is the learner's text and the server's greedy continuation, fixed at the first push)."""

    def __init__(self, sampler: Any, tokenizer: Any, text: str, bound: float) -> None:
        self.sampler, self.tokenizer, self.text, self.bound = sampler, tokenizer, text, bound
        self.target = getattr(sampler, "inner", sampler)  # episodes: the sampler inside
        self.ids: list[int] | None = None

    def push(self, model: torch.nn.Module, version: int) -> float | None:
        """Push `version` (nothing when the sampler has it); the check's gap, or None."""
        pushes = getattr(self.target, "weights_version", None) != version
        self.sampler.update_weights(model, version)
        if not (pushes and hasattr(self.target, "probe_logprobs") and self.bound > 0):
            return None
        if self.ids is None:
            self.ids = probe_ids(self.target, self.tokenizer, self.text)
        return check_push(self.target, model, self.ids, self.bound, "cpu")


def _run_job(job: Job, model: torch.nn.Module, buffers: dict[str, torch.Tensor],
             pusher: _Pusher, rewards: Any, cfg: Any, version: Any, loaded: Any,
             lock: Any) -> bytes:
    """One job, pickled for the learner."""
    t0 = time.time()
    while version.value != job.version:
        if version.value > job.version:
            raise RuntimeError(f"step {job.step} needs weights {job.version}, the learner "
                               f"pushed {version.value} already")
        time.sleep(0.001)
    with torch.no_grad(), lock:
        model.load_state_dict(buffers)
    loaded.value = job.step  # the learner may overwrite the buffers: the copy is private
    gap = pusher.push(model, job.version)
    t1 = time.time()
    rollout = pusher.sampler.generate(job.prompts, group_size=cfg.group_size, rows=job.rows,
                              params=job.params, seeds=job.seeds,
                              batch_size=cfg.generation_batch_size)
    t2 = time.time()
    result = rewards.score(rollout.completions, rollout.rows)
    rollout.rows = [{k: v for k, v in r.items() if k != "environments"} for r in rollout.rows]
    seconds = {"gen": t2 - t1, "score": time.time() - t2, "wait": t1 - t0}
    return pickle.dumps(("ok", Sampled(job.step, job.version, rollout, result, seconds, gap)))
