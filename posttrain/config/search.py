"""``SearchConfig``: the recipe of ``posttrain search`` (test-time search with verifiers; see
docs/search.md). Every field is documented by the string under it (``posttrain search --help``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from posttrain.config.base import BaseConfig, ConfigError, check_table
from posttrain.config.keys import GenerationBatchKeys, PromptKeys, StepKeys

METHODS = ("best_of_n", "majority", "weighted", "beam")


@dataclass
class SearchConfig(StepKeys, PromptKeys, GenerationBatchKeys, BaseConfig):
    trains_weights: ClassVar[bool] = False
    required: ClassVar[tuple[str, ...]] = ("model", "eval_data")
    eval_size: int = 200
    """Number of problems searched (the first rows of eval_data)."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """Methods to run: best_of_n (ranked by each verifier given), majority, weighted (votes
    weighted by the PRM, else the ORM), beam (PRM beam search; needs `prm`)."""
    n: list[int] = field(default_factory=lambda: [1, 4, 16])
    """Solutions per problem for the sampling methods. max(n) are sampled once and every n is
    measured on disjoint groups of them, so each n must divide max(n)."""
    orm: str = ""
    """Outcome reward model directory (written by `posttrain rm`); empty: none."""
    prm: str = ""
    """Process reward model directory (written by `posttrain prm`); empty: none."""
    aggregate: Literal["prod", "min", "last", "mean"] = "prod"
    """How a PRM's step scores make a solution score (prod: P(every step is correct), Lightman
    et al. 2023; a PRM reward's default is min). Steps are cut by the PRM's own saved rule."""
    beam_width: int = 4
    """PRM beam search: beams kept per round (B)."""
    expansions: int = 4
    """PRM beam search: next steps sampled per beam (M); a round samples up to B*M steps."""
    beam_max_steps: int = 10
    """PRM beam search: rounds before giving up on unfinished beams."""
    step_separator: str = "; "
    """Where beam search stops generating a step (the arithmetic task's "; "); the PRM splits
    and scores solutions with its own saved rule, which must cut at this separator."""
    generation_batch_size: int = 512

    def validate(self) -> None:
        validate_search(self)


def validate_search(cfg: SearchConfig) -> None:
    """Cross-field checks (the verifier directories are checked by ``posttrain.search.command``,
    before any model loads)."""
    if not cfg.eval_data:
        raise ConfigError("config key 'eval_data': required (problems with gold answers)")
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown or not cfg.methods:
        raise ConfigError(f"config key 'methods'={cfg.methods!r}: expected a non-empty list of "
                          f"{list(METHODS)}")
    if not cfg.n or min(cfg.n) < 1 or any(max(cfg.n) % k for k in cfg.n):
        raise ConfigError(f"config key 'n'={cfg.n!r}: expected values >= 1 that divide max(n)")
    check_table(cfg, {**{k: (getattr(cfg, k) >= 1, "expected >= 1") for k in (
        "beam_width", "expansions", "beam_max_steps", "eval_size", "max_new_tokens",
        "generation_batch_size")}, "temperature": (cfg.temperature > 0, "expected > 0")})
    needs = {"best_of_n": cfg.orm or cfg.prm, "weighted": cfg.orm or cfg.prm, "beam": cfg.prm}
    for method, ok in needs.items():
        if method in cfg.methods and not ok:
            what = "'prm'" if method == "beam" else "'orm' or 'prm'"
            raise ConfigError(f"config key 'methods' includes {method}, which needs a verifier: "
                              f"set {what}")
