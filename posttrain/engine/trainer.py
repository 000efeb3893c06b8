"""The one training loop every trainer runs on.

A trainer subclasses :class:`Trainer` and supplies its step; the base owns the rest:
1. set-up: threads, seeds, validation of config, rewards and data BEFORE any model loads
   (`validate`, `load_session`), the model, LoRA, `setup`, `build_optimizer`, the metrics logger;
2. held-out evaluation before training, every `eval_every` steps, and after;
3. the step loop: `step(step)` returns metrics; the base adds time and peak memory, logs,
   checkpoints every `save_every` steps, drives the progress bar;
4. the final checkpoint (`save`) and `summary.json`.

Hooks: `step` (required), `run_values`, `validate`, `load_model`, `setup`, `optimizer_steps`,
`optimizer_groups`, `state_modules`, `evaluate`, `summary_fields`, `save`, `state_dict` /
`load_state_dict`. Helpers, resume, stop, torchrun, the Python API: docs/trainers.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from posttrain.config import BaseConfig, ConfigError, to_dict
from posttrain.core.device import autocast_ctx, gpu_memory_metrics, reset_gpu_peak
from posttrain.core.io import peak_rss_mb, write_summary
from posttrain.core.runtime import set_seed, setup_threads
from posttrain.engine.async_rollout import refuse_in_sampler
from posttrain.engine.checkpoint import (
    find_resume,
    is_peft,
    load_trainable,
    read_checkpoint,
    read_model_weights,
    rng_state,
    save_config,
    set_rng_state,
    start_checkpoint,
    tmp_path,
    trained_tensors,
    truncate_metrics,
    write_checkpoint,
)
from posttrain.engine.distributed import Dist
from posttrain.engine.forward import PolicyForward, policy_forward, say_full_logits
from posttrain.engine.fsdp import SHARDED, full_weights, load_sharded, save_sharded
from posttrain.engine.launch import StopRequest, check_warmup, enable_checkpointing, resolve_config
from posttrain.engine.optim import build_optimizer
from posttrain.engine.out_dir import config_changes, prepare_out_dir, report_resume, report_stop
from posttrain.engine.preflight import preflight
from posttrain.engine.push_check import check_push, probe_ids
from posttrain.engine.reference import ReferencePolicy
from posttrain.engine.session import Session, load_session, resolve_device
from posttrain.engine.tracking import MetricsLogger, NullLogger
from posttrain.engine.update import CountFn, LossFn, OptimGroup, Plan, padded_step, run_update
from posttrain.models.bf16_copy import BF16Copy
from posttrain.models.loading import save_checkpoint
from posttrain.ops.head_blocks import head_precision
from posttrain.rollout.sampler import Sampler, build_sampler
from posttrain.rollout.weights import lora_merged, named_weights


class Trainer:
    """Base of every trainer: owns the loop, logging, evaluation, checkpoints and summary."""

    name: ClassVar[str] = "train"
    """Command name and progress-bar label."""
    config_class: ClassVar[type[BaseConfig]] = BaseConfig
    run_values: ClassVar[Callable[[Any], Any]] = staticmethod(lambda cfg: None)  # cfg -> RunValues
    data_kind: ClassVar[str] = "prompts"
    """Schema kind that `train_data` rows are validated against (posttrain.data.schemas)."""
    progress_keys: ClassVar[tuple[str, ...]] = ("reward/mean",)
    """Metrics shown next to the progress bar."""
    agent: Any = None
    """The tools and environment of multi-turn episodes (`posttrain.rollout.tools.AgentSpec`,
    set by `validate`), or None: `build_sampler` wraps the sampler in an `AgentSampler`."""
    count_metrics: ClassVar[frozenset[str]] = frozenset()
    """Step metrics that are this rank's counts (summed over ranks; every other key is a mean
    or, ending in ``_max`` / ``_min``, an extreme: `posttrain.engine.distributed.metric_kind`)."""
    supports_bf16_compute: ClassVar[bool] = False
    """Whether the trainer runs its passes through `learner()` / `reference()` (bf16_compute)."""
    shares_prompts: ClassVar[bool] = True
    """Whether rows of a batch repeat a prompt (groups, pairs): `share_prompt_prefix` applies."""
    supports_fsdp: ClassVar[bool] = True
    """Whether `fsdp: true` is supported (validated before any model loads)."""
    fsdp_meta_start: ClassVar[bool] = True
    """Under FSDP2: whether the model is first used after `Dist.wrap` (not in `setup`): ranks
    but 0 build it on ``meta``, a loaded reference is sharded alike (`posttrain.engine.fsdp`)."""

    def __init__(self, cfg: BaseConfig | None = None, session: Session | None = None, *,
                 model: Any = None, tokenizer: Any = None, train_data: Any = None,
                 eval_data: Any = None, rewards: list[Any] | None = None,
                 **config_keys: Any) -> None:
        refuse_in_sampler()  # a script without the __main__ guard, re-imported by async
        cfg, objects = resolve_config(self.config_class, cfg, model, tokenizer, train_data,
                                       eval_data, rewards, config_keys)
        self.cfg = cfg
        self.reward_fns = objects.get("reward_fns")  # function objects given in Python
        setup_threads(cfg.threads)
        slow_bf16 = preflight(cfg, type(self))  # device, precision, FSDP2: before any load
        self.dist = Dist(cfg.device)  # torchrun's process group (a no-op without torchrun)
        self.gen = set_seed(cfg.seed)  # CPU generator: data order and sampling seeds
        self.validate()
        if cfg.rollout_engine == "vllm_colocate":  # vLLM's own checks, before any model loads
            from posttrain.rollout.vllm_sampler import check_engine_args

            try:
                check_engine_args(cfg, self.dist.world)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        if self.dist.is_main:
            check_warmup(cfg, self.optimizer_steps(), self.name)
        self._lock = prepare_out_dir(cfg, self.dist.is_main, self.name)
        self.session = session or load_session(cfg, kind=self.data_kind, loader=self.load_model,
                                               place=not self.sharded_start, agent=self.agent,
                                               values=self.run_values(cfg), **objects)
        self.session.maybe_lora()
        self.session.dist = self.dist  # held-out evaluation: sharded by rank, gathered
        self.device = resolve_device(cfg.device)
        if slow_bf16 and self.dist.is_main:
            print(f"[{self.name}] warning: {slow_bf16}", file=sys.stderr)
        self._order: list[int] = []
        self.ref = ReferencePolicy(cfg, lambda: self.model, self.learner, self.sharded_start)
        self._sampler: Sampler | None = None  # built at the first generation
        self._probe: list[int] | None = None  # the ids each weight push is checked on
        self.push_metrics: dict[str, float] = {}  # of the pushes since the last logged step
        self._weights_version = 0  # +1 whenever the policy's weights change
        self._learner: BF16Copy | None = None  # bf16_compute: the bf16 learner copy
        self._learner_stale = True  # its weights lag the master's (after a step or a resume)
        self.setup()
        if cfg.gradient_checkpointing:
            enable_checkpointing(self.model)
        bf16 = cfg.fsdp and cfg.bf16_compute  # FSDP2 mixed precision (CUDA, validated)
        self.model = self.dist.wrap(self.model, cfg.fsdp, self.device, bf16)
        if self.ref.model is not None and self.sharded_start:  # the reference: sharded alike
            self.ref.model = self.dist.wrap(self.ref.model, True, self.device, bf16)
        if self.dist.is_main and (v := self.session.values).max_len:  # unfused largest logits:
            say_full_logits(self.model, v.micro_batch_size or 1, v.max_len)  # one line now
        # everything that trains is built before a checkpoint is restored into it
        self.groups = self.optimizer_groups()
        self.start_step = 0
        self._resumed: dict[str, Any] = {}
        resume = find_resume(cfg.out_dir, cfg.resume_from)
        if resume is not None:
            self._load_checkpoint(resume)
            if self.dist.is_main:  # the run's config.yaml is two levels above checkpoints/step-N
                report_resume(self.name, self.start_step,
                              config_changes(resume.parent.parent, cfg))
        self.logger: MetricsLogger | NullLogger = (
            MetricsLogger(cfg.out_dir, cfg.report_to, cfg.run_name, to_dict(cfg),
                          purge_step=self.start_step + 1 if resume else None)
            if self.dist.is_main else NullLogger())
        self._full_weights: dict[str, Any] | None = None
        self._saved_at = -1  # the step of the last checkpoint this process wrote

    # ---- the model the base trains, saves and evaluates -------------------------------------
    @property
    def model(self) -> Any:
        return self.session.model

    @model.setter
    def model(self, value: Any) -> None:
        self.session.model = value

    @property
    def tokenizer(self) -> Any:
        return self.session.tokenizer

    # ---- hooks ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Cheap checks before anything loads (the config's own `validate` already ran)."""

    def load_model(self) -> tuple[Any, Any]:
        """(model, tokenizer) from `cfg.model`; default: a causal LM (under FSDP2 built on
        ``meta`` on ranks other than 0: `fsdp_meta_start`)."""
        from posttrain.models import load_model_and_tokenizer

        meta = self.sharded_start and not self.dist.is_main
        return load_model_and_tokenizer(self.cfg.model, dtype=self.cfg.dtype, empty=meta)

    @property
    def sharded_start(self) -> bool:
        """FSDP2 under torchrun with `fsdp_meta_start` (see there)."""
        return self.cfg.fsdp and self.dist.enabled and self.fsdp_meta_start

    def setup(self) -> None:
        """After the model is loaded: reference, critic, tokenised data... (default: nothing)."""

    def optimizer_steps(self) -> int:
        """Total optimizer steps of the run (sets the length of the LR schedule)."""
        return self.cfg.max_steps

    def optimizer_groups(self) -> list[OptimGroup]:
        """What trains, each with its optimizer and schedule (default: the policy's trainable
        parameters). Built after `setup`, before a checkpoint is restored into them; the first
        group is the policy's (`self.opt`, `self.sched`)."""
        return [self.make_group("policy", [p for p in self.model.parameters()
                                           if p.requires_grad])]

    def make_group(self, name: str, params: list[torch.nn.Parameter],
                   lr: float | None = None) -> OptimGroup:
        """An `OptimGroup` with the config's AdamW, schedule and clipping (`lr` overrides)."""
        cfg = self.cfg if lr is None else dataclasses.replace(self.cfg, lr=lr)
        opt, sched = build_optimizer(params, cfg, self.optimizer_steps())
        return OptimGroup(name, params, opt, sched, self.cfg.max_grad_norm)

    def state_modules(self) -> dict[str, torch.nn.Module]:
        """Modules besides the policy whose weights a checkpoint holds (PPO's critic)."""
        return {}

    def step(self, step: int) -> dict[str, float]:
        """One training step (1-based); returns its metrics."""
        raise NotImplementedError

    def watch(self, step: int, metrics: dict[str, float]) -> None:
        """Look at a finished step's metrics (the RL trainers warn on a blow-up)."""

    def evaluate(self, when: str) -> dict[str, Any]:
        """Held-out evaluation; `when` is "before", "during" or "after".

        Default: greedy decoding of the eval prompts scored by the reward functions
        (`accuracy`, `reward_mean`, ...), with per-sample dumps before and after.
        """
        dump = None if when == "during" else f"eval_{when}.jsonl"
        if self.agent is not None:  # greedy episodes through the training sampler
            self.session.sampler = self.sync_sampler()
        return self.session.evaluate(self.model, dump=dump)

    def summary_fields(self) -> dict[str, Any]:
        """Extra keys for summary.json."""
        return {}

    def save(self, path: str) -> None:
        """A `from_pretrained`-loadable checkpoint of the trained model (LoRA merged into the
        saved weights, never into the live model: a PeftModel given by the caller keeps its
        adapters).

        Called on rank 0 only; under FSDP2 `self._full_weights` holds the gathered weights.
        """
        model, weights = self.model, self._full_weights
        if path.endswith("final") and is_peft(model):
            with lora_merged(model):  # merged, read, then restored bit for bit
                weights = dict(named_weights(model, dtype=None))
            model = model.get_base_model()
        elif weights is not None:  # gathered copies: drop the second name of tied weights
            names = {n for n, _ in model.named_parameters()} | {n for n, _ in
                                                                model.named_buffers()}
            weights = {k: v for k, v in weights.items() if k in names}
        save_checkpoint(model, self.tokenizer, path, state_dict=weights)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state for an exact resume (extend with super(); default: none).

        Model, optimizer, schedule, step, data order (`_order`, `gen`) and the global RNGs are
        saved by the base already.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (called after setup, model and optimizer load)."""

    # ---- helpers for subclasses -------------------------------------------------------------
    def num_train_items(self) -> int:
        """How many items an epoch draws from (the training rows; DPO: its tokenized pairs)."""
        return len(self.session.train_rows)

    def next_indices(self, n: int) -> list[int]:
        """The next `n` training-item indices; the order is reshuffled at each epoch boundary."""
        out: list[int] = []
        while len(out) < n:
            if not self._order:
                perm = torch.randperm(self.num_train_items(), generator=self.gen)
                self._order = perm.tolist()
            out.append(self._order.pop())
        return out

    def next_rows(self, n: int) -> list[dict[str, Any]]:
        return [self.session.train_rows[i] for i in self.next_indices(n)]

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.groups[0].opt

    @opt.setter
    def opt(self, value: torch.optim.Optimizer) -> None:
        self.groups[0].opt = value

    @property
    def sched(self) -> Any:
        return self.groups[0].sched

    @sched.setter
    def sched(self, value: Any) -> None:
        self.groups[0].sched = value

    def optimize(self, plan: Plan, counts: CountFn, loss_fn: LossFn,
               groups: list[OptimGroup] | None = None,
               before_step: Callable[[dict[str, float]], bool] | None = None
               ) -> dict[str, float]:
        """Every optimizer step of this trainer step through the one update
        (`posttrain.engine.update.run_update`); the sampler sleeps meanwhile."""
        if self._sampler is not None:
            self._sampler.sleep()
        out = run_update(plan, self.dist, counts, loss_fn,
                         self.groups if groups is None else groups, self._idle_pass,
                         before_step)
        self._learner_stale = True
        self._weights_version += 1
        return out

    def _idle_pass(self) -> None:
        """A zero-gradient forward/backward (FSDP2: every rank runs as many as the others)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        (self.model(input_ids=ids).logits.sum() * 0.0).backward()

    def gathered(self) -> contextlib.AbstractContextManager:
        """Full policy weights for a stretch of forward passes without collectives: wrap
        generation in it (a no-op unless FSDP2 shards the model)."""
        return self.dist.gathered(self.model)

    def sampler(self) -> Sampler:
        """The sampler rollouts are sampled with (`rollout_engine`; `posttrain.rollout.sampler`),
        built on first use, with whatever weights it was last given (`sync_sampler`)."""
        if self._sampler is None:
            self._sampler = build_sampler(self.cfg, self.tokenizer, role="train", dist=self.dist,
                                        agent=self.agent)
        return self._sampler

    def sync_sampler(self) -> Sampler:
        """Give the sampler the policy's current weights (pushed only when changed, checked on a
        vLLM sampler; the `hf` sampler's bf16 copy under bf16 compute re-synced); return it."""
        self.sampler()
        target = getattr(self._sampler, "inner", self._sampler)  # episodes: the sampler inside
        pushes = getattr(target, "weights_version", None) != self._weights_version
        self._sampler.update_weights(self.model, self._weights_version)
        if pushes and hasattr(target, "probe_logprobs") and self.cfg.vllm_push_check > 0:
            if self._probe is None:
                self._probe = probe_ids(target, self.tokenizer, self.session.render(
                    self.session.train_rows[0]["prompt"]))
            self.push_metrics["rollout/push_check_gap"] = check_push(
                target, self.model, self._probe, self.cfg.vllm_push_check, self.device)
        return self._sampler

    def close_sampler(self) -> None:
        """Release the sampler (a vLLM sampler's GPU memory); rebuilt if used again."""
        if self._sampler is not None:
            self._sampler.close()
        self._sampler = None
        self.session.sampler = None

    def learner(self) -> Any:
        """The model the policy's log-probs are computed (and differentiated) with: the policy,
        or under `bf16_compute` its bf16 copy (`posttrain.models.bf16_copy`), re-synced after
        every optimizer step; its gradients land in the policy's fp32 ``.grad``."""
        if not self.cfg.bf16_compute or self.dist.fsdp:  # FSDP2: its own mixed precision
            return self.model
        if self._learner is None:
            self._learner = BF16Copy(self.model, trainable=True,
                                     compile_body=self.cfg.torch_compile)
        elif self._learner_stale:
            self._learner.sync()
        self._learner_stale = False
        if self._learner.model.training != self.model.training:  # a module walk: only on change
            self._learner.model.train(self.model.training)
        return self._learner.model

    @functools.cached_property
    def forward(self) -> PolicyForward:
        """The run's one policy forward (`posttrain.engine.forward.policy_forward`): its
        precision, prompt sharing and temperature are decided there, once."""
        return policy_forward(self.cfg, self.dist.fsdp, self.shares_prompts,
                              self.session.values.generation.temperature)  # the sampling's

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on this trainer's device type when `autocast_bf16` is set."""
        return autocast_ctx(self.cfg.autocast_bf16, self.device)

    def load_reference(self) -> None:
        """Copy the frozen reference now (none with LoRA: the adapters-off policy is it)."""
        self.ref.load_copy()

    def reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The frozen reference policy in eval mode (`posttrain.engine.reference`)."""
        return self.ref.use()

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run steps `start_step + 1 .. max_steps`; returns (and writes) the summary.

        A SIGTERM / SIGINT in any phase (the first evaluation, a step, a checkpoint write, the
        final evaluation) lets that phase finish, then writes a checkpoint and returns the
        summary with `stopped_at_step` (no `final/`); `resume_from: latest` continues from it.
        """
        cfg, start = self.cfg, time.time()
        if getattr(self, "_ran", False):
            raise RuntimeError(f"{type(self).__name__}.train() was already called; to train on,"
                               " build a new trainer with resume_from: latest and more max_steps")
        self._ran = True
        if self.dist.is_main:
            save_config(cfg.out_dir, cfg)
        history: list[dict[str, float]] = list(self._resumed.get("history", []))
        elapsed = float(self._resumed.get("seconds", 0.0))
        clock = elapsed - start
        with StopRequest() as stop:
            if "eval_before" in self._resumed:
                eval_before = self._resumed["eval_before"]
                set_rng_state(self._resumed["rng"][min(self.dist.rank,
                                                       len(self._resumed["rng"]) - 1)])
            else:
                eval_before = self._evaluate("before")
                if eval_before:
                    self.logger.log(0, _eval_metrics(eval_before))
            self.model.train()
            last = self.start_step
            if not self.dist.any(stop.signal is not None):
                last = self._run_steps(history, eval_before, stop, clock)
            if last < cfg.max_steps or self.dist.any(stop.signal is not None):
                return self._stopped(last, history, eval_before, clock)
            eval_after = self._evaluate("after")
            if self.dist.any(stop.signal is not None):
                return self._stopped(last, history, eval_before, clock)
        if eval_after:
            self.logger.log(cfg.max_steps, _eval_metrics(eval_after))
        self.logger.close()
        self.close_sampler()
        self._gather_weights()
        if self.dist.is_main:
            self.save(f"{cfg.out_dir}/final")
        summary = {"eval_before": eval_before.get("accuracy"),
                   "eval_after": eval_after.get("accuracy"),
                   "eval_before_detail": eval_before, "eval_after_detail": eval_after,
                   "seconds": round(elapsed + time.time() - start, 1), "steps": cfg.max_steps,
                   "peak_rss_mb": round(peak_rss_mb(), 1), "history": history,
                   **self.summary_fields()}
        if self.dist.is_main:
            write_summary(cfg.out_dir, cfg, **summary)
            self._lock.release()
        self.dist.slow_barrier()  # rank 0 wrote final/
        return summary

    def _stopped(self, last: int, history: list[dict[str, float]],
                 eval_before: dict[str, Any], clock: float) -> dict[str, Any]:
        """After a signal: a checkpoint at `last` (unless the step loop just wrote it) and the
        summary with `stopped_at_step`."""
        from posttrain.engine.checkpoint import list_checkpoints

        written = [s for s, _ in list_checkpoints(self.cfg.out_dir)]
        if not (self._saved_at == last and last in written):
            self.save_training_state(last, history, eval_before, clock + time.time())
        self.logger.close()
        self.close_sampler()
        summary = {"eval_before": eval_before.get("accuracy"), "stopped_at_step": last,
                   "seconds": round(clock + time.time(), 1), "steps": last,
                   "history": history}
        if self.dist.is_main:
            write_summary(self.cfg.out_dir, self.cfg, **summary)
            report_stop(self.name, last, self.cfg.max_steps, self.cfg.out_dir)
            self._lock.release()
        self.dist.barrier()
        return summary

    def _run_steps(self, history: list[dict[str, float]], eval_before: dict[str, Any],
                   stop: StopRequest, clock: float) -> int:
        """The step loop; returns the last step run (< max_steps when a signal stopped it)."""
        cfg = self.cfg
        step = self.start_step
        with self.session.progress(cfg.max_steps, self.name) as bar:
            for step in range(self.start_step + 1, cfg.max_steps + 1):
                t0 = time.time()
                reset_gpu_peak(self.device)
                with head_precision(cfg.head_precision):  # the fused LM head's arithmetic
                    metrics = padded_step(self.step, step, self.dist)
                metrics |= self.push_metrics  # `rollout/push_check_gap` (vLLM samplers)
                self.push_metrics = {}
                metrics["perf/step_seconds"] = time.time() - t0
                metrics = self.dist.reduce_metrics(metrics, self.count_metrics)
                metrics["perf/peak_rss_mb"] = self.dist.max(peak_rss_mb())
                self.watch(step, metrics)
                for key, mb in gpu_memory_metrics(self.device).items():  # CUDA only
                    metrics[key] = self.dist.max(mb)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                    metrics.update(_eval_metrics(self._evaluate("during")))
                    self.model.train()
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    history.append({"step": step, **self.logger.log(step, metrics)})
                bar.update(**{k.split("/")[-1]: metrics.get(k) for k in self.progress_keys})
                stopping = self.dist.any(stop.signal is not None)
                if stopping or (cfg.save_every and step % cfg.save_every == 0):
                    self.save_training_state(step, history, eval_before,
                                             clock + time.time())
                    stopping = self.dist.any(stop.signal is not None)  # one during the write
                if stopping:
                    return step
        return step

    def _evaluate(self, when: str) -> dict[str, Any]:
        if self.cfg.rollout_engine != "hf":  # evaluation samples with the training sampler
            self.session.sampler = self.sync_sampler()
        with self.gathered():
            return self.evaluate(when)

    def _gather_weights(self) -> None:
        """Under FSDP2 every rank gathers the full weights (not the optimizer) for rank 0."""
        if self.dist.fsdp:
            self._full_weights = full_weights(self.model)

    def save_training_state(self, step: int, history: list[dict[str, float]],
                            eval_before: dict[str, Any], seconds: float) -> None:
        """A resumable checkpoint at `step` (every rank calls; rank 0 writes).

        The model's weights are written once, in `model/` (the `save` hook's
        `from_pretrained` layout; with LoRA the trainable adapters and heads go into the state
        file instead, as peft's adapter files cannot be loaded back into a live model
        exactly); everything else (optimizers, schedules, other modules such as PPO's
        critic, data order, RNGs, the trainer's own state) goes into `trainer_state.pt`; under
        FSDP2 each rank writes its shards of the policy and its AdamW state to `sharded/`.
        """
        policy, fsdp, tmp = self.groups[0], self.dist.fsdp, None
        if fsdp:  # sharded weights + AdamW state, written by every rank; full weights gathered
            if self.dist.is_main:
                start_checkpoint(self.cfg.out_dir, step)
            self.dist.slow_barrier()
            tmp = tmp_path(self.cfg.out_dir, step)
            save_sharded(self.model, policy.opt, tmp / SHARDED, self.dist.slow_group())
            self._gather_weights()
        opt_sd: Any = SHARDED if fsdp else policy.opt.state_dict()
        rngs = self.dist.all_gather_objects(rng_state())
        trainer = self.state_dict()
        if self.dist.is_main:
            trainable = (trained_tensors(self.model, self.groups) if is_peft(self.model)
                         else {})
            state = {"step": step, "trainable": trainable,
                     "optimizers": {g.name: opt_sd if g is policy else g.opt.state_dict()
                                    for g in self.groups},
                     "schedulers": {g.name: g.sched.state_dict() for g in self.groups},
                     "modules": {k: m.state_dict() for k, m in self.state_modules().items()},
                     "order": list(self._order), "generator": self.gen.get_state(),
                     "rng": rngs, "trainer": trainer, "history": history,
                     "eval_before": eval_before, "seconds": seconds,
                     "metrics_bytes": self.logger.tell(), "world_size": self.dist.world}
            write_checkpoint(self.cfg.out_dir, step, state, self.save,
                             self.cfg.keep_checkpoints, started=tmp is not None)
        self._saved_at = step
        self._full_weights = None
        self.dist.slow_barrier()

    def _load_checkpoint(self, path: Any) -> None:
        state = read_checkpoint(path)
        names = {g.name for g in self.groups}
        if set(state["optimizers"]) != names:
            raise ConfigError(f"config key 'resume_from': checkpoint {path} holds optimizers "
                              f"{sorted(state['optimizers'])}, this run trains {sorted(names)}"
                              " (a different trainer or critic set-up)")
        policy, sharded = self.groups[0], path / SHARDED
        if sharded.is_dir() != self.dist.fsdp:
            raise ConfigError(f"config key 'resume_from': checkpoint {path} was written "
                              f"{'with' if sharded.is_dir() else 'without'} FSDP2; resume it "
                              f"with fsdp: {str(sharded.is_dir()).lower()}")
        if self.dist.fsdp:
            load_sharded(self.model, policy.opt, sharded, self.dist.slow_group())
        elif is_peft(self.model):
            load_trainable(self.model, state["trainable"], self.groups)
            policy.opt.load_state_dict(state["optimizers"]["policy"])
        else:
            self.model.load_state_dict(read_model_weights(path, self.model))
            policy.opt.load_state_dict(state["optimizers"]["policy"])
        for g in self.groups:
            if g is not policy:
                g.opt.load_state_dict(state["optimizers"][g.name])
            g.sched.load_state_dict(state["schedulers"][g.name])
        for k, module in self.state_modules().items():
            module.load_state_dict(state["modules"][k])
        self._order = list(state["order"])
        self.gen.set_state(state["generator"])
        self.load_state_dict(state["trainer"])
        self.start_step = int(state["step"])
        self._resumed = state
        self._learner_stale = True
        self._weights_version += 1
        if self.dist.is_main:
            truncate_metrics(self.cfg.out_dir, state.get("metrics_bytes"), self.start_step)
        self.dist.barrier()


def _eval_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Numeric entries of an evaluation result under `eval/`."""
    return {k if k.startswith("eval") else f"eval/{k}": v for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
