"""Asynchronous rollouts (`async_rollouts`): a sampler process samples and scores the coming
steps' groups while the learner trains (docs/async.md).

The learner decides everything that makes a run reproducible: the rows of step s (drawn in step
order from the run's data order), their seeds, and the weights they are sampled with: version
`needed_version(s)` = max(start, s - 1 - max_staleness), the learner's weights after that step.
The spawned sampler process keeps a private copy of the policy, loads the version a job needs
from shared memory before the job, samples with the `hf` sampler or a `vllm_server` (pushed that
version and verified against the copy first; multi-turn episodes too), runs the rewards and
sends the scored rollout back. The learner pushes its weights after each step,
once the job that needs the previous version has loaded it, so a job never sees other weights.
The sampler stops itself when the learner's process is gone; the learner stops with the
sampler's last traceback line when the sampler dies (the whole one in sampler_traceback.txt).
This module is the learner's side; the process's own loop is `engine/sampler_loop.py`.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import queue
import sys
import time
import weakref
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.config import ConfigError
from posttrain.core.device import resolve_device
from posttrain.core.errors import UserFunctionError
from posttrain.core.runtime import sequence_seed
from posttrain.data import DataError
from posttrain.engine.push_check import PushCheckError
from posttrain.engine.sampler_loop import POLL_S, Job, Sampled
from posttrain.engine.sampler_start import SAMPLER_NAME, start_sampler, stop, take_early
from posttrain.rewards.registry import ScoreResult
from posttrain.rollout import Rollout
from posttrain.rollout.tools import python_mode
from posttrain.rollout.vllm_server import ServerError

REIMPORTED = 86
"""The sampler's exit code when the script that started the run trained again at its import."""
REIMPORT_LINE = ("config key 'async_rollouts': the sampler process imports the script that "
                 "started this run again (Python's spawn), and this script trains when it is "
                 "imported: put its training under `if __name__ == \"__main__\":` "
                 "(docs/async.md)")


def refuse_in_sampler() -> None:
    """Stop a trainer being built in the sampler process (during spawn's re-import of a script
    without the `__main__` guard) with `REIMPORTED`, before it takes the run's out_dir; the
    learner then raises `REIMPORT_LINE`."""
    if mp.current_process().name == SAMPLER_NAME:
        raise SystemExit(REIMPORTED)


def needed_version(step: int, start: int, max_staleness: int) -> int:
    """The weights (the learner's after that step) step `step`'s groups are sampled with."""
    return max(start, step - 1 - max_staleness)


def fresh(items: list[Sampled], learner_version: int, max_staleness: int
          ) -> tuple[list[Sampled], int]:
    """(the groups at most `max_staleness` versions behind `learner_version`, how many groups
    were dropped as older). The schedule never sends an older one: this is the guard."""
    keep = [s for s in items if learner_version - s.version <= max_staleness]
    dropped = sum(s.rollout.num_sequences // s.rollout.group_size
                  for s in items if s not in keep)
    return keep, dropped


class SamplerDied(RuntimeError):
    """The sampler process stopped without a result (killed, or an error outside a job)."""


class SamplerProcess:
    """The learner's side: starts the sampler process, sends jobs, pushes weights, takes
    results. The process is the one the CLI started before its imports, or spawned now (at
    validation: its imports overlap the model's load); `attach` then sends it what it samples
    with. `agent`, `reward_fns`: what the trainer's own sampler and rewards were built from."""

    def __init__(self, cfg: Any, agent: Any, reward_fns: dict[str, Any] | None,
                 threads: int) -> None:
        self.out_dir = cfg.out_dir  # where the sampler's traceback is written when it raised
        self.buffers: dict[str, torch.Tensor] | None = None  # the push buffers, once attached
        self.config = (cfg, agent, reward_fns, threads)  # sent with the setup
        parts = take_early() or start_sampler()  # the CLI's: started before the imports
        self.proc, self.setup, self.jobs, self.results = (parts.proc, parts.setup, parts.jobs,
                                                          parts.results)
        self.version, self.loaded, self.lock = parts.version, parts.loaded, parts.lock
        self.ready: dict[int, Sampled] = {}
        self.sent: set[int] = set()  # steps whose jobs went to the process
        self._finalizer = weakref.finalize(self, stop, self.proc, self.jobs, self.setup)

    def attach(self, tokenizer: Any, model: torch.nn.Module, probe: str = "") -> None:
        """Send the process what it samples with: the config, agent and reward functions,
        `model`'s copy in shared memory (the push buffers; `model` is the policy, a plain
        module on the CPU) and the push check's text, once."""
        if self.buffers is None:
            skeleton = copy.deepcopy(model).share_memory()
            self.buffers = skeleton.state_dict()
            self.setup.put((*self.config, python_mode(), tokenizer, skeleton, probe))

    def submit(self, job: Job) -> None:
        self.sent.add(job.step)
        self.jobs.put(job)

    def push(self, model: torch.nn.Module, version: int, waits_for: int) -> tuple[float, float]:
        """Copy `model`'s weights as `version` once step `waits_for`'s job (the last to need the
        previous version) has loaded its weights; returns (seconds waited, seconds copying)."""
        t0 = time.time()
        while waits_for in self.sent and self.loaded.value < waits_for:
            if not self._receive(POLL_S) and not self.proc.is_alive():
                self._wait_for(waits_for)  # raises: the process is gone
        t1 = time.time()
        with torch.no_grad(), self.lock:
            for name, tensor in model.state_dict().items():
                self.buffers[name].copy_(tensor)
            self.version.value = version
        return t1 - t0, time.time() - t1

    def take(self, step: int) -> tuple[Sampled, float, int]:
        """Step `step`'s result: (it, seconds the learner waited, groups done and not taken)."""
        t0 = time.time()
        while self._receive(0.0):
            pass
        self._wait_for(step)
        waited = time.time() - t0
        out = self.ready.pop(step)
        queued = sum(s.rollout.num_sequences // s.rollout.group_size for s in self.ready.values())
        return out, waited, queued

    def pending(self) -> list[Sampled]:
        """Every job sent and not taken, waited for (a checkpoint holds them), in step order."""
        for step in sorted(self.sent):
            self._wait_for(step)
        return [self.ready[s] for s in sorted(self.ready)]

    def _wait_for(self, step: int) -> None:
        while step not in self.ready:
            if not self._receive(POLL_S) and not self.proc.is_alive():
                self._receive(0.0)  # an error it sent as it ended
                if self.proc.exitcode == REIMPORTED:
                    raise ConfigError(REIMPORT_LINE)
                raise SamplerDied(f"the sampler process exited (code {self.proc.exitcode}) "
                                  "without a result; docs/async.md")

    def _receive(self, timeout: float) -> bool:
        """Take one message if one comes within `timeout`; an error message is raised."""
        try:
            payload = self.results.get(timeout=timeout) if timeout else self.results.get_nowait()
        except queue.Empty:
            return False
        kind, value = pickle.loads(payload)
        if kind == "error":
            err, text = value
            path = Path(self.out_dir) / "sampler_traceback.txt"
            with contextlib.suppress(OSError):
                path.write_text(text)
            if isinstance(err, (UserFunctionError, ConfigError, DataError, ServerError,
                                PushCheckError)):
                raise err  # said in one line, as in a synchronous run
            raise SamplerDied(f"the sampler process failed: {text.strip().splitlines()[-1]} "
                              f"(its traceback: {path})") from err
        self.ready[value.step] = value
        self.sent.discard(value.step)
        return True

    def close(self) -> None:
        self._finalizer()


class AsyncRollouts:
    """`async_rollouts` behind the synchronous interface: the trainer asks `take(step)` for a
    step's scored groups where it would sample them and calls `push(step)` after its update;
    the schedule, the staleness guard, the weight pushes, the refusals and what a checkpoint
    holds live here. `trainer`: a prompt-RL trainer (cfg, dist, model, tokenizer, session,
    agent, reward_fns, next_rows, sampling, start_step, push_metrics)."""

    def __init__(self, trainer: Any) -> None:
        """The refusals made before anything else is checked."""
        cfg, self.t = trainer.cfg, trainer
        if trainer.dist.world > 1 or resolve_device(cfg.device).type != "cpu":
            raise ConfigError("config key 'async_rollouts': the sampler process runs beside one "
                              "learner process on the CPU; torchrun and GPUs are not "
                              "implemented yet (docs/async.md)")
        self.proc: SamplerProcess | None = None
        self.started = False
        self.next_job = 0  # the next step whose job is drawn and sent (0: none yet)
        self.held: list[Sampled] = []  # results a checkpoint held, given at the start

    def spawn(self) -> None:
        """The sampler process (at validation: its start overlaps the learner's own), once
        what it is sent pickles (checked before any model loads)."""
        if self.proc is not None:
            return
        try:
            pickle.dumps((self.t.reward_fns, self.t.agent))
        except Exception as err:  # noqa: BLE001 - pickle raises several kinds
            raise ConfigError(f"config key 'async_rollouts': the reward functions and tools go "
                              f"to the sampler process by pickling, which failed ({err}); "
                              "define them at module level") from err
        self.proc = SamplerProcess(self.t.cfg, self.t.agent, self.t.reward_fns,
                                   self.t.cfg.sampler_threads)
        self.started = False

    def start(self) -> SamplerProcess:
        """The sampler process with its setup and first jobs, at the first call."""
        t = self.t
        self.spawn()
        if not self.started:
            self.proc.attach(t.tokenizer, t.model,
                             t.session.render(t.session.train_rows[0]["prompt"]))
            self.started = True
            self.proc.ready.update({s.step: s for s in self.held})
            self.proc.push(t.model, t.start_step, -1)
            self.next_job = self.next_job or t.start_step + 1
            self.send_jobs(t.start_step)
        return self.proc

    def around_first_eval(self, evaluate: Any) -> Any:
        """The evaluation before training, with sampling started meanwhile (on a vLLM server
        after it: both would push to the one server)."""
        if self.t.cfg.rollout_engine == "vllm_server":
            out = evaluate()
            self.start()
            return out
        self.start()
        return evaluate()

    def take(self, step: int) -> tuple[Rollout, ScoreResult, dict[str, float]]:
        """Step `step`'s scored groups (the staleness guard applied) and seconds, with the
        `async/*` metrics of taking them in the result's metrics."""
        cfg = self.t.cfg
        got, waited, queued = self.start().take(step)
        kept, dropped = fresh([got], step - 1, cfg.max_staleness)
        if dropped:  # never by the schedule: a guard
            print(f"[{self.t.name}] warning: step {step}: its groups were sampled with weights "
                  f"{got.version}, over max_staleness={cfg.max_staleness} behind", file=sys.stderr)
        stale = float(step - 1 - got.version)
        if got.push_gap is not None:  # a vllm_server push, checked in the sampler process
            self.t.push_metrics["rollout/push_check_gap"] = got.push_gap
        got.result.metrics.update({
            "async/staleness_mean": stale, "async/staleness_max": stale,
            "async/dropped_stale": float(dropped), "async/queue_groups": float(queued),
            "async/learner_wait_s": waited, "async/sampler_wait_s": got.seconds["wait"]})
        rollout = got.rollout if kept else got.rollout.select(torch.zeros(0, dtype=torch.long))
        return rollout, got.result, {"gen": got.seconds["gen"], "score": got.seconds["score"]}

    def send_jobs(self, done: int) -> None:
        """Draw and send the jobs that may be sampled once step `done`'s weights are pushed."""
        t, cfg = self.t, self.t.cfg
        while self.next_job <= min(cfg.max_steps, done + 1 + cfg.max_staleness):
            s = self.next_job
            rows = t.next_rows(cfg.prompts_per_step)
            prompts = [] if t.agent is not None else [t.session.render(r["prompt"])
                                                      for r in rows]
            seeds = [sequence_seed(cfg.seed, s, i, j) for i in range(len(rows))
                     for j in range(cfg.group_size)]
            version = needed_version(s, t.start_step, cfg.max_staleness)
            self.proc.submit(Job(s, version, rows, prompts, seeds, t.sampling))
            self.next_job += 1

    def push(self, step: int) -> dict[str, float]:
        """After step `step`'s update: push its weights for the jobs that need them, send
        those jobs; `async/*` metrics of the push."""
        if self.proc is None or self.next_job > self.t.cfg.max_steps:
            return {"async/weight_sync_s": 0.0}
        waited, copied = self.proc.push(self.t.model, step, step + self.t.cfg.max_staleness)
        self.send_jobs(step)
        return {"async/weight_sync_s": copied, "async/learner_wait_s": waited}

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: the next job and every result sent and not taken (waited
        for), so a resumed run trains on the very same samples."""
        held = self.proc.pending() if self.proc is not None else self.held
        return {"next_job": self.next_job, "held": [
            {"step": h.step, "version": h.version, "seconds": h.seconds,
             "rollout": {f.name: getattr(h.rollout, f.name) for f in fields(h.rollout)},
             "result": {f.name: getattr(h.result, f.name) for f in fields(h.result)}}
            for h in held]}

    def load(self, state: dict[str, Any]) -> None:
        self.next_job = state["next_job"]
        self.held = [Sampled(h["step"], h["version"], Rollout(**h["rollout"]),
                             ScoreResult(**h["result"]), h["seconds"]) for h in state["held"]]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc, self.started = None, False
