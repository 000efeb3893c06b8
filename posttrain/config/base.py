"""Config machinery and the fields every trainer shares.

One dataclass per trainer (``posttrain/config/<trainer>.py``), every field documented by the
string under it.

The string literal placed directly under a field is that field's documentation and the single
source of truth: ``posttrain <command> --help`` prints it. Configs load from a YAML recipe plus
``key=value`` overrides; an unknown key, a wrong type or a value outside a field's choices is a
:class:`ConfigError` that names the key (and the file) before any model is loaded, every such
key of a config in one error (hints for TRL's and verl's names: ``posttrain.config.hints``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from posttrain.config.errors import ConfigError, check_table
from posttrain.config.hints import note_shared_names, null_note, renamed_key, unknown_key_message
from posttrain.config.sampler import check_rollout_engine, sampler_key_needs

TRACKERS = ("tensorboard", "trackio", "wandb")


def math_and_format() -> list[dict[str, Any]]:
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
    """Dtype of the weights as loaded. Training refuses bfloat16 for a full fine-tune (pure-bf16
    AdamW rounds most small updates away: use bf16_compute or autocast_bf16, which keep fp32
    master weights); with LoRA it is allowed (the frozen base in bf16, the adapters fp32)."""
    autocast_bf16: bool = False
    """Run forward passes under bf16 autocast (weights stay fp32; the LM head and log-probs stay
    fp32). Fast on CPUs with a bf16 matrix unit and on GPUs. GRPO and PPO then sample from a
    bf16 copy of the policy (re-synced before every generation; the policy's fp32 head), not
    under autocast: see docs/performance.md."""
    bf16_compute: bool = False
    """Forward and backward passes on a bf16 copy of the weights (mixed precision with fp32
    master weights, fp32 AdamW state, fp32 LM head and log-probs; the frozen reference is a bf16
    copy too). Faster than autocast_bf16 on CPUs with a bf16 matrix unit (no per-op casts);
    a precision change, so opt-in. grpo and dpo only; not with LoRA. Samples from the bf16
    sampler copy like autocast_bf16: see docs/performance.md. With `fsdp: true` (CUDA only) it
    is FSDP2's mixed precision instead: bf16 decoder layers, fp32 gradient reductions, fp32
    embeddings, norm and head (docs/distributed.md)."""
    head_precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    """Arithmetic of the fused LM head in the learner's and the reference's log-probs (the
    families and sizes where the head is fused, docs/performance.md): fp32 (the head's
    weight dtype; exact), tf32 (TF32 matmuls on CUDA, fp32 elsewhere) or bf16 (inputs rounded
    to bf16, fp32 accumulation and log-softmax). tf32 and bf16 are faster on a GPU; their
    inputs keep 11 and 8 significant bits (relative rounding 2^-11 and 2^-9), which moves
    the log-probs accordingly; the sampler's head stays fp32."""
    torch_compile: bool = False
    """With bf16_compute: `torch.compile` each decoder layer of the bf16 learner and reference
    copies (fused element-wise work in the forward and backward; one graph shared by all
    layers, so compilation does not grow with depth). The first step pays the compilation;
    no-grad passes (reference, old log-probs) run without grad (docs/performance.md)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of storing them
    (transformers' activation checkpointing, non-reentrant): less memory for one more forward
    of the layers; same gradients. TRL turns it on by default."""
    share_prompt_prefix: bool = True
    """grpo, dpo and ppo: rows of a micro-batch with the same prompt (the group_size samples of
    a prompt, DPO's chosen and rejected) run the prompt through the model once and their
    completions on its KV cache, in the forward and the backward pass: the same log-probs and
    gradients up to float summation order, (rows - distinct prompts) x prompt tokens fewer
    token passes (the PPO critic keeps the plain forward); the completions run in up to 4
    groups of similar length, each padded only to its own longest. Llama, Qwen2/3, Mistral,
    Phi-3 and OLMo-2 families, also with gradient_checkpointing (each checkpointed layer's
    replay recomputes its part of the shared cache); the plain forward runs with torch_compile
    or active dropout and for other families (docs/performance.md)."""
    micro_batch_tokens: int = 0
    """grpo and ppo: when > 0, the update's micro-batches hold at most this many token
    positions (rows x (longest prompt + longest completion)) instead of `micro_batch_size` rows:
    rows sorted by width and grouped greedily (verl's dynamic batch size), so a long tail does
    not widen every short row. A row wider than the budget gets a micro-batch of its own. The
    update is the same for any grouping (losses are divided by the whole step's counts); the
    no-grad passes keep `micro_batch_size`. 0: off (docs/performance.md)."""
    packing: bool = False
    """Pack the rows of each micro-batch into one sequence [1, sum of widths] (position ids
    restart per row, attention kept within each row: sdpa per row or transformers' packed mask),
    for the learner's, the reference's and the old log-probs' forwards: no compute on padding.
    Same log-probs as padded (fp32 within 1e-5). Every trainer (PPO's critic, the RM's and
    PRM reward model too); refused in one line for a model whose attention cannot keep rows apart
    and with torch_compile (docs/performance.md)."""
    threads: int = 0
    """torch.set_num_threads; 0: torch's default (OMP_NUM_THREADS, else one per core) less the
    cores other processes keep busy when the run starts, said in one line (threads waiting on
    a taken core run steps several times slower: benchmarks/busy_threads.py)."""
    device: str = "auto"
    """Where the models run: auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights. With LoRA the reference is the model with adapters off
    (no second copy of the weights) and the final checkpoint is saved merged."""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Modules that get LoRA adapters: name suffixes ([q_proj, v_proj]) or `all-linear` (every
    linear layer but the LM head, as in peft); checked against the model before it loads."""
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
    min_lr_ratio: float = 0.0
    """Floor of the decayed learning rate, as a fraction of `lr` (linear and cosine schedules)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_steps: int = 100
    """Training steps (one step = one rollout batch for RL, one optimizer step for SFT)."""
    log_every: int = 1
    """Write metrics every this many steps."""
    save_every: int = 0
    """Write a resumable checkpoint (`out_dir/checkpoints/step-N/`: model, optimizer, schedule,
    data position, RNG states, trainer state) every this many steps; 0: none besides `final/`."""
    keep_checkpoints: int = 2
    """Keep only the newest this many resumable checkpoints (older ones are deleted)."""
    resume_from: str = ""
    """Resume a run: `latest` (the newest complete checkpoint in `out_dir/checkpoints`; starts
    fresh when there is none) or the path of a `checkpoints/step-N` directory; empty: fresh."""
    overwrite: bool = False
    """Start afresh in an `out_dir` that holds an earlier run (metrics.jsonl or checkpoints/),
    deleting its metrics.jsonl, checkpoints/, summary.json, reward_errors.jsonl and tb/ events;
    without it (and without `resume_from`) such an `out_dir` is refused."""
    fsdp: bool = False
    """Under torchrun: shard the policy (and any other trained model) with FSDP2
    (`torch.distributed.fsdp.fully_shard`) instead of replicating it (data parallel)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: only before and after training)."""
    train_data: str = ""
    """Training rows, a JSONL path or a `datasets` name, in the trainer's format: prompts
    {"prompt", "answer", ...} (grpo, ppo, online_dpo), {"prompt", "completion"} (sft), pairs
    {"prompt", "chosen", "rejected"} (dpo, rm), unpaired {"prompt", "completion", "label"} (kto,
    rm objective=binary), steps {"prompt", "steps", "labels"} (prm): docs/trainers.md "Data
    formats"."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    eval_data: str = ""
    """Held-out prompts (JSONL path or `datasets` name); empty: no held-out evaluation (search:
    the problems {"prompt", "answer"} searched)."""
    eval_split: str = "test"
    """Split name when `eval_data` is a `datasets` name."""
    eval_size: int = 1000
    """Number of held-out prompts evaluated (greedy)."""
    eval_batch_size: int = 256
    """Prompts per generation batch during evaluation."""
    rollout_engine: Literal["hf", "vllm_colocate", "vllm_server"] = "hf"
    """What samples completions (rollouts and held-out evaluation): hf, the built-in
    transformers sampler (CPU and GPU); vllm_colocate, a vLLM sampler in each trainer process
    that sleeps while the trainer trains; vllm_server, a `vllm serve` process elsewhere that
    gets the weights over NCCL. The vLLM samplers need CUDA and `pip install 'posttrain[vllm]'`
    (docs/rollout.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm_colocate: fraction of the GPU's memory vLLM may take (weights and KV cache); the
    trainer shares the GPU with it."""
    vllm_sleep: bool = True
    """vllm_colocate: put vLLM to sleep (weights to CPU memory, KV cache freed) while the
    trainer trains, and wake it for the next generation."""
    vllm_max_model_len: int = 0
    """vllm_colocate: longest prompt + completion vLLM reserves KV cache for; 0: the model's
    context."""
    vllm_push_check: float = 0.1
    """vLLM samplers: after every weight push, the mean |log-prob| gap between the sampler and
    the learner on a probe may be at most this, else the run stops (a push that landed
    measures 0.001-0.007 with vLLM's bf16 weights; a stale head 0.2-0.4); 0 turns the check
    off (docs/rollout.md, "Verified weight pushes")."""
    vllm_server_host: str = "127.0.0.1"
    """vllm_server: host of the `vllm serve` process."""
    vllm_server_port: int = 8000
    """vllm_server: its HTTP port."""
    vllm_group_port: int = 51216
    """vllm_server: TCP port of the NCCL group that carries the weights to the server."""
    vllm_server_timeout: float = 240.0
    """vllm_server: seconds to wait for the server to answer before giving up."""
    data_subset: str = ""
    """Configuration name of a `datasets` dataset (GSM8K: "main"); empty: none."""
    columns: dict[str, str] = field(default_factory=dict)
    """Schema fields read from other source columns: {prompt: question} for GSM8K."""
    system_prompt: str = ""
    """A system message put before each prompt by the chat template; empty: none."""
    chat_template: str = "auto"
    """auto: the tokenizer's chat template renders conversational rows (chat-message lists) and
    wraps a plain-string prompt as a user message; a tokenizer without one takes strings as
    they are, and a conversational row is then an error. none: never apply a template (strings
    as they are; a conversational row is an error). Any other value: a Jinja chat template used
    instead of the tokenizer's, and saved with the trained model's tokenizer."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template wherever a prompt or row is rendered (TRL's key):
    `{enable_thinking: false}` for Qwen3 (docs/agents.md, "Thinking models")."""
    progress: bool = True
    """Show a progress bar on a terminal; when stderr is not one (a pipe, nohup, Slurm,
    Jupyter), print a line of key metrics every `log_every` steps instead. false: neither."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers besides `metrics.jsonl` (always written): any of tensorboard,
    trackio (local-first, works offline; `pip install trackio`), wandb; [] for none."""
    run_name: str = ""
    """Run name shown by the trackers; empty: the last part of `out_dir`."""

    trains_weights: ClassVar[bool] = True
    """False for commands that only run a model (search): they may load it in bf16."""
    required: ClassVar[tuple[str, ...]] = ("model", "train_data")
    """Keys a run needs; checked by `build_config` / a trainer, not when the object is made (so
    `GRPOConfig(lr=1e-5)` can be handed to a trainer with `model=` and `train_data=` objects)."""

    def __post_init__(self) -> None:
        """A config object is checked when it is made: types (named by key), then the
        cross-field rules of `validate()`."""
        check_fields(self)
        validate_config(self, require=False)

    def validate(self) -> None:
        """Cross-field checks of one trainer's config (types are checked already)."""

    def key_needs(self) -> dict[str, tuple[bool, str]]:
        """Keys read only under another setting: key -> (that setting holds, the setting)."""
        return sampler_key_needs(self)


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
            raise ConfigError(f"{where}{key}={value!r}: expected an integer{null_note(key)}")
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


def normalize_report_to(value: Any) -> Any:
    """`report_to` as TRL spells it too: a string (`tensorboard`, `"wandb,tensorboard"`) and
    `none` (no tracker) are accepted besides a list."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)) and [str(v).lower() for v in value] == ["none"]:
        return []
    return list(value) if isinstance(value, tuple) else value


def _coerce(value: Any, tp: Any) -> Any:
    """Python-API conveniences before the type check: a Path for a str, a tuple for a list, a
    string for a list of strings."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple) and typing.get_origin(tp) is list:
        return list(value)
    if isinstance(value, str) and typing.get_args(tp) == (str,) and typing.get_origin(tp) is list:
        return [value]  # one name for a list of names (peft's `lora_target_modules: all-linear`)
    return value


def check_fields(cfg: BaseConfig) -> None:
    """Type-check (and convert: 1 -> 1.0 for a float) every field of a config object."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "report_to":
            value = normalize_report_to(value)
        value = _check_value(f.name, _coerce(value, hints[f.name]), hints[f.name],
                             "config key ")
        setattr(cfg, f.name, value)


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
    base: BaseConfig | None = None,
) -> BaseConfig:
    """Build and validate a config from an optional YAML recipe and overrides (applied on top
    of `base`, a config object, when one is given)."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
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
    values = _checked_values(sources, hints, valid, cls.__name__)
    note_shared_names(list(values))
    cfg = dataclasses.replace(base, **values) if base is not None else cls(**values)
    validate_config(cfg, given=values)
    return cfg


def _flat(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """verl-style nested sections (`data: {train_batch_size: 8}`) as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _checked_values(sources: list[tuple[dict[str, Any], str]], hints: dict[str, Any],
                    valid: list[str], trainer: str) -> dict[str, Any]:
    """Every key of every source type-checked; all unknown or wrong keys in one ConfigError
    (one line each, the valid keys once at the end; hints for `trainer`, a config class)."""
    values: dict[str, Any] = {}
    errors: list[str] = []
    unknown = False
    for mapping, where in sources:
        for key, value in mapping.items():
            key = renamed_key(key, valid, trainer)
            if key not in hints or key not in valid:
                nested = _flat(value, f"{key}.") if isinstance(value, dict) and value else {
                    key: value}  # an empty mapping (`generation_kwargs: {}`) is named too
                errors += [unknown_key_message(str(k), valid, where, False, trainer,
                                               _configs_with(str(k))) for k in nested]
                unknown = True
                continue
            if key == "report_to":
                value = normalize_report_to(value)
            try:
                values[key] = _check_value(key, _coerce(value, hints[key]), hints[key], where)
            except ConfigError as err:
                errors.append(str(err))
    if errors:
        tail = f" Valid keys: {', '.join(valid)}" if unknown else ""
        if len(errors) == 1:
            raise ConfigError(errors[0] + tail)
        raise ConfigError(f"{len(errors)} config keys are wrong:\n  " + "\n  ".join(errors)
                          + (f"\n {tail}" if tail else ""))
    return values


def _configs_with(key: str) -> tuple[str, ...]:
    """Names of the config classes that have `key` (every subclass of BaseConfig)."""
    found, todo = [], list(BaseConfig.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if key in {f.name for f in dataclasses.fields(cls)}:
            found.append(cls.__name__)
    return tuple(sorted(set(found)))


_REQUIRED_HINTS = {"model": " (a local model directory or hub name)",
                   "eval_data": " (problems with gold answers)"}


def validate_config(cfg: BaseConfig, require: bool = True, given: Iterable[str] = ()) -> None:
    """Cross-field checks that types alone cannot express; `require`: also the keys a run
    needs (`required`); `given`: the keys a recipe or override set (`check_idle_keys`)."""
    for key in cfg.required if require else ():
        if not getattr(cfg, key):
            raise ConfigError(f"config key '{key}': required{_REQUIRED_HINTS.get(key, '')}")
    template = cfg.chat_template
    check_table(cfg, {
        "max_steps": (cfg.max_steps >= 0, "expected >= 0"),
        "lr": (cfg.lr > 0, "expected > 0"),
        "keep_checkpoints": (cfg.keep_checkpoints >= 1, "expected >= 1"),
        "micro_batch_tokens": (cfg.micro_batch_tokens >= 0, "expected >= 0 (0: off)"),
        "packing": (not (cfg.packing and cfg.torch_compile), "not with torch_compile yet (the "
                    "compiled layers are traced for the padded forward); turn one off"),
        "min_lr_ratio": (0.0 <= cfg.min_lr_ratio <= 1.0, "expected in [0, 1]"),
        "chat_template": (template in ("auto", "none") or "{{" in template or "{%" in template,
                          "expected auto, none or a Jinja chat template (with {{ ... }} / "
                          "{% ... %})")})
    _check_dtype(cfg)
    unknown = sorted(set(cfg.report_to) - set(TRACKERS))
    if unknown:
        raise ConfigError(f"config key 'report_to': unknown tracker(s) {unknown}; valid: "
                          f"{list(TRACKERS)}")
    if require:
        _check_run_keys(cfg)
    check_rollout_engine(cfg)
    cfg.validate()
    check_idle_keys(cfg, set(given))


def check_idle_keys(cfg: BaseConfig, given: set[str]) -> None:
    """Refuse a key this run would not read (`key_needs`), set away from its default or
    given without its setting (a full config.yaml, with both, passes at the defaults): one
    line naming the keys and the setting they need."""
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
                else f.default for f in dataclasses.fields(cfg)}
    idle: dict[str, list[str]] = {}
    for key, (ok, need) in cfg.key_needs().items():
        setting = need.split(":")[0]
        if not ok and (getattr(cfg, key) != defaults[key] or
                       (key in given and setting not in given)):
            idle.setdefault(need, []).append(f"'{key}'={getattr(cfg, key)!r}")
    for need, keys in idle.items():
        setting = need.split(":")[0]
        raise ConfigError(f"config key{'s' * (len(keys) > 1)} {', '.join(keys)}: only read "
                          f"with {need}, and this run has {setting}: "
                          f"{_yaml_value(getattr(cfg, setting))}; set {need}, or drop "
                          f"{'them' if len(keys) > 1 else 'it'}")


def _yaml_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_run_keys(cfg: BaseConfig) -> None:
    """Before a run: `eval_every` has held-out data to evaluate."""
    if cfg.eval_every and not (cfg.eval_data or getattr(cfg, "eval_pref_data", "")):
        raise ConfigError(f"config key 'eval_every'={cfg.eval_every}: no eval_data is set, so "
                          "nothing would be evaluated; set eval_data or eval_every: 0")


def check_trackers(cfg: BaseConfig) -> None:
    """Every tracker of `report_to` is installed (checked before any model loads)."""
    import importlib.util

    for tracker in cfg.report_to:
        if importlib.util.find_spec(tracker) is None:
            raise ConfigError(f"config key 'report_to': {tracker} is not installed (pip "
                              f"install {tracker}), or drop it from report_to")


def check_generation_budget(cfg: BaseConfig, *keys: str) -> None:
    """Token budgets of generation must be >= 1 (0 would sample empty completions and train on
    nothing)."""
    check_table(cfg, {key: (getattr(cfg, key, 1) >= 1, "expected >= 1 (tokens generated per "
                            "completion)") for key in keys})


def _check_dtype(cfg: BaseConfig) -> None:
    """Pure-bf16 weights only where nothing trains them in bf16 (LoRA adapters stay fp32)."""
    if cfg.dtype == "bfloat16" and cfg.trains_weights and cfg.lora_r == 0:
        raise ConfigError(
            "config key 'dtype'=bfloat16: a full fine-tune with bf16 weights loses most AdamW "
            "updates to rounding (the model silently does not learn); keep dtype: float32 and "
            "set bf16_compute: true (bf16 passes, fp32 master weights) or autocast_bf16: true, "
            "or train LoRA adapters (lora_r > 0; they stay fp32)")


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
