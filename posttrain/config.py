"""Trainer configs: one dataclass per trainer, every field documented by the string under it.

The string literal placed directly under a field is that field's documentation and the single
source of truth: ``posttrain <command> --help`` prints it. Configs load from a YAML recipe plus
``key=value`` overrides; an unknown key, a wrong type or a value outside a field's choices is a
:class:`ConfigError` that names the key (and the file) before any model is loaded.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe or override that does not fit the config: names the key and what was expected."""


def _math_and_format() -> list[dict[str, Any]]:
    """The default rewards: verifiable correctness (1.0) plus the <think> format bonus (0.1)."""
    return [{"name": "math", "weight": 1.0}, {"name": "format", "weight": 1.0}]


# ----------------------------------------------------------------------------------------------
# Shared fields
# ----------------------------------------------------------------------------------------------
@dataclass
class BaseConfig:
    model: str = ""
    """Policy model: a local directory saved with save_pretrained, or a Hugging Face hub name."""
    out_dir: str = "runs/experiment"
    """Where checkpoints, metrics.jsonl, TensorBoard events and summary.json are written."""
    seed: int = 0
    """Random seed for data order, sampling and initialisation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights as loaded."""
    autocast_bf16: bool = False
    """Run forward passes under bf16 autocast (weights stay fp32; the LM head and log-probs stay
    fp32). Fast on CPUs with a bf16 matrix unit and on GPUs."""
    threads: int = 0
    """torch.set_num_threads; 0 keeps torch's default."""
    device: str = "auto"
    """Where the models run: auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights. With LoRA the reference is the model with adapters off
    (no second copy of the weights) and the final checkpoint is saved merged."""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Modules that get LoRA adapters."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_steps: int = 100
    """Training steps (one step = one rollout batch for RL, one optimizer step for SFT)."""
    log_every: int = 1
    """Write metrics every this many steps."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: only before and after training)."""
    eval_data: str = ""
    """Held-out prompts (JSONL path or `datasets` name); empty: no held-out evaluation."""
    eval_split: str = "test"
    """Split name when `eval_data` is a `datasets` name."""
    eval_size: int = 1000
    """Number of held-out prompts evaluated (greedy)."""
    eval_batch_size: int = 256
    """Prompts per generation batch during evaluation."""
    data_subset: str = ""
    """Configuration name of a `datasets` dataset (GSM8K: "main"); empty: none."""
    columns: dict[str, str] = field(default_factory=dict)
    """Schema fields read from other source columns: {prompt: question} for GSM8K."""
    system_prompt: str = ""
    """A system message put before each prompt by the chat template; empty: none."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class SFTConfig(BaseConfig):
    train_data: str = ""
    """SFT rows {"prompt", "completion"} (JSONL path or `datasets` name)."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    batch_size: int = 64
    """Sequences per optimizer step."""
    max_len: int = 256
    """Longest prompt+completion kept, in tokens (longer rows are an error, not silently cut)."""
    max_new_tokens: int = 64
    """Generation budget for held-out evaluation."""
    rewards: list[dict[str, Any]] = field(default_factory=_math_and_format)
    """Reward functions used to score held-out greedy samples (evaluation only)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""


@dataclass
class GRPOConfig(BaseConfig):
    # --- data and rewards ---
    train_data: str = ""
    """RL prompts {"prompt", "answer", ...} (JSONL path or `datasets` name)."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    prompt_field: str = "prompt"
    """Row field holding the prompt (str or list of chat messages)."""
    answer_field: str = "answer"
    """Row field passed to reward functions as `answer`."""
    answer_marker: str = ""
    """If set, the gold answer is the text after the last occurrence of this marker in the
    answer field (GSM8K solutions end with "#### 72": use "####")."""
    rewards: list[dict[str, Any]] = field(default_factory=_math_and_format)
    """Reward functions and weights: [{name: math|format|code|pkg.module:function, weight: w}]."""
    reward_on_error: Literal["zero", "raise"] = "zero"
    """A reward function that raises: score 0 (counted in reward/errors) or stop training."""
    # --- rollout ---
    group_size: int = 8
    """G: completions sampled per prompt (>= 2)."""
    prompts_per_step: int = 8
    """B: prompts per rollout batch; N = B*G sequences per step."""
    max_new_tokens: int = 64
    """Longest completion sampled; longer ones are truncated and flagged."""
    temperature: float = 1.0
    """Sampling temperature (log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 disables."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    # --- advantages ---
    advantage: Literal["grpo", "rloo"] = "grpo"
    """Advantage estimator: group-normalised (GRPO) or leave-one-out (RLOO)."""
    scale: Literal["group", "batch", "none"] = "group"
    """GRPO std scaling: per group, whole batch, or none (Dr. GRPO)."""
    std_ddof: int = 0
    """0: population std as in the GRPO paper; 1: sample std as TRL/verl."""
    # --- policy loss ---
    ratio_level: Literal["token", "sequence", "sequence_token"] = "token"
    """Importance ratio per token (PPO/GRPO), per sequence (GSPO) or GSPO-token."""
    sequence_ratio: Literal["geometric", "product"] = "geometric"
    """GSPO sequence ratio: length-normalised (paper) or the plain product (seed note form)."""
    clip_eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_eps_high (DAPO clip-higher: > clip_eps_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c (e.g. 3.0) for negative advantages; null disables."""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    """Loss aggregation: GRPO paper, DAPO token-mean, or Dr. GRPO sum / (N * max_new_tokens)."""
    # --- KL to the reference model ---
    kl_coef: float = 0.0
    """beta. 0 loads no reference model and runs no reference forward pass."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (k3 = DeepSeekMath)."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """KL added to the loss (GRPO) or subtracted from each sequence's score before advantages."""
    # --- update ---
    num_iterations: int = 1
    """Passes over each rollout batch (GRPO's mu)."""
    mini_batches: int = 1
    """Optimizer steps per pass over a rollout batch."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation within a mini-batch)."""
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    """Off-policy updates: reuse the sampler's log-probs or run one more forward pass. Under
    autocast_bf16 the sampler's log-probs come from a bf16 decode, so `recompute` is used (a
    ratio must start at exactly 1 for tight clip ranges such as GSPO's)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens from the loss (DAPO)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO) and refill with new prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Extra generation rounds to refill dropped groups; after that train on what is left."""
    eval_max_new_tokens: int = 64
    """Generation budget for held-out greedy evaluation."""
    lr: float = 3e-5
    """Peak learning rate (AdamW)."""


@dataclass
class DPOConfig(BaseConfig):
    train_data: str = ""
    """Preference rows {"prompt", "chosen", "rejected"} (JSONL path or `datasets` name)."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    eval_pref_data: str = ""
    """Held-out preference rows for implicit-reward accuracy; empty: none."""
    beta: float = 0.1
    """DPO beta: strength of the implicit KL anchor to the reference."""
    loss_type: Literal["sigmoid", "cdpo", "robust", "ipo", "hinge"] = "sigmoid"
    """Preference loss (formulas.md section 8); ipo averages log-probs over tokens."""
    label_smoothing: float = 0.0
    """Assumed label-noise rate s for cdpo / robust."""
    rpo_alpha: float = 0.0
    """Weight of the chosen completion's NLL (mean over its tokens) added to each pair's loss:
    RPO, Pang et al. 2024 (arXiv:2404.19733) eq. 1. Keeps the chosen log-probs from falling;
    0 disables."""
    batch_size: int = 32
    """Preference pairs per optimizer step."""
    micro_batch_size: int = 32
    """Pairs per forward/backward (gradient accumulation)."""
    max_len: int = 256
    """Longest prompt+completion in tokens; longer rows are an error."""
    precompute_ref: bool = True
    """Compute reference log-probs once for the whole dataset (cached next to the data, keyed by
    model and data hash) instead of a reference forward pass every step."""
    max_new_tokens: int = 64
    """Generation budget for held-out greedy evaluation."""
    rewards: list[dict[str, Any]] = field(default_factory=_math_and_format)
    """Reward functions used to score held-out greedy samples (evaluation only)."""
    lr: float = 5e-6
    """Peak learning rate (AdamW)."""


CONFIGS: dict[str, type[BaseConfig]] = {"sft": SFTConfig, "grpo": GRPOConfig, "dpo": DPOConfig}


# ----------------------------------------------------------------------------------------------
# Field documentation from the source (the string under each field)
# ----------------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a config dataclass (and its bases) to the string literal under it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ----------------------------------------------------------------------------------------------
# Type checking of values from YAML / key=value
# ----------------------------------------------------------------------------------------------
def _check_value(key: str, value: Any, tp: Any, where: str) -> Any:
    """Return `value` converted to `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}{key}={value!r}: expected one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(key, value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{where}{key}={value!r}: expected {tp}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}{key}={value!r}: expected a list")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_check_value(f"{key}[{i}]", v, item_tp, where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}{key}={value!r}: expected a mapping")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}{key}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}{key}={value!r}: expected a string")
        return value
    raise ConfigError(f"{where}{key}: unsupported field type {tp}")


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"{where}unknown config key '{key}'.{hint} Valid keys: {', '.join(valid)}")


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings; values are read as YAML (``lr=1e-5``, ``rewards=[...]``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override '{pair}': expected key=value")
        key, raw = pair.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def build_config(
    cls: type[BaseConfig],
    recipe: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> BaseConfig:
    """Build and validate a config from an optional YAML recipe and overrides."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    sources: list[tuple[dict[str, Any], str]] = []
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {path}: file not found")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"recipe {path}: not valid YAML: {err}") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path}: expected a mapping of config keys at top level")
        loaded.pop("trainer", None)  # recipes name their command; not a config field
        sources.append((loaded, f"{path}: "))
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
        sources.append((ov, "override "))
    for mapping, where in sources:
        for key, value in mapping.items():
            if key not in hints or key not in valid:
                raise _unknown_key(str(key), valid, where)
            values[key] = _check_value(key, value, hints[key], where)
    cfg = cls(**values)
    validate_config(cfg)
    return cfg


def validate_config(cfg: BaseConfig) -> None:
    """Cross-field checks that types alone cannot express."""
    if not cfg.model:
        raise ConfigError("config key 'model': required (a local model directory or hub name)")
    if cfg.max_steps < 0:
        raise ConfigError(f"config key 'max_steps'={cfg.max_steps}: expected >= 0")
    if cfg.lr <= 0:
        raise ConfigError(f"config key 'lr'={cfg.lr}: expected > 0")
    if isinstance(cfg, GRPOConfig):
        if cfg.group_size < 2:
            raise ConfigError(
                f"config key 'group_size'={cfg.group_size}: GRPO needs at least 2 samples per "
                "prompt to form a group baseline"
            )
        if cfg.prompts_per_step < 1:
            raise ConfigError("config key 'prompts_per_step': expected >= 1")
        n = cfg.group_size * cfg.prompts_per_step
        if cfg.mini_batches < 1 or n % cfg.mini_batches:
            raise ConfigError(
                f"config key 'mini_batches'={cfg.mini_batches}: must divide the "
                f"{n} sequences of a step (prompts_per_step*group_size)"
            )
        if cfg.temperature <= 0:
            raise ConfigError("config key 'temperature': expected > 0 (sampling is required)")
        if not cfg.train_data:
            raise ConfigError("config key 'train_data': required")
        if not cfg.rewards:
            raise ConfigError("config key 'rewards': at least one reward function is required")
    if isinstance(cfg, (SFTConfig, DPOConfig)) and not cfg.train_data:
        raise ConfigError("config key 'train_data': required")


def config_help(cls: type[BaseConfig]) -> str:
    """Render every field with its type, default and documentation, for ``--help``."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        tp = hints[f.name]
        tp = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
        lines.append(f"  {f.name} ({tp}, default {default!r})")
        lines.append(textwrap.fill(docs.get(f.name, ""), 96, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6))
    return "\n".join(lines)


def to_dict(cfg: BaseConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
