"""``posttrain search --config ...``: test-time search on held-out problems, with its compute.

1. validate the config and the verifier directories (config.json only, before any model
   loads);
2. load the problems, the policy and the verifiers;
3. sample max(n) solutions per problem once; score each with every verifier;
4. best-of-n / majority / weighted vote at every n (disjoint groups of the samples);
5. PRM beam search;
6. ``out_dir/summary.json``: accuracy AND mean generated tokens per problem for every method.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config import ConfigError
from posttrain.config.search import SearchConfig, validate_search
from posttrain.core.device import resolve_device
from posttrain.core.io import write_summary
from posttrain.core.runtime import set_seed, setup_threads
from posttrain.data.render_checks import check_renderable
from posttrain.data.steps import THINK, split_steps
from posttrain.models.reward import PRM_META_KEY, RewardModelError, check_reward_model_dir


def _rows(cfg: SearchConfig) -> list[dict[str, Any]]:
    from posttrain.data.loading import load_rows

    columns = dict(cfg.columns)
    if cfg.prompt_field != "prompt":
        columns["prompt"] = cfg.prompt_field
    if cfg.answer_field != "answer":
        columns["answer"] = cfg.answer_field
    rows = load_rows(cfg.eval_data, "prompts", split=cfg.eval_split,
                     subset=cfg.data_subset or None, columns=columns or None,
                     limit=cfg.eval_size)
    for row in rows:
        answer = str(row.get("answer", ""))
        if cfg.answer_marker and cfg.answer_marker in answer:
            answer = answer.rsplit(cfg.answer_marker, 1)[1]
        row["answer"] = answer.strip()
    return rows


def check_verifiers(cfg: SearchConfig) -> None:
    """The ORM / PRM directories hold reward models of their kind (config.json only), and beam
    search's ``step_separator`` is a boundary of the PRM's saved split rule (else every partial
    solution would be one step to the PRM)."""
    configs = {}
    for key in ("orm", "prm"):
        path = getattr(cfg, key)
        if not path:
            continue
        if not Path(path).exists():
            raise ConfigError(f"config key '{key}'={path!r}: directory not found")
        try:
            configs[key] = check_reward_model_dir(path, key)
        except RewardModelError as err:
            raise ConfigError(f"config key '{key}': {err}") from err
    if "prm" in configs and "beam" in cfg.methods:
        rule = (configs["prm"].get(PRM_META_KEY) or {}).get("split", THINK)
        if len(split_steps(f"<think>a{cfg.step_separator}b", rule)) != 2:
            raise ConfigError(f"config key 'step_separator'={cfg.step_separator!r}: the PRM "
                              f"splits steps by its saved rule {rule!r}, which does not cut "
                              "there; set the separator the PRM's steps end with")


def run_search(cfg: SearchConfig) -> dict[str, Any]:
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.rollout.sampler import build_sampler
    from posttrain.search import evaluate_selection, prm_outcome, sample_solutions, score_samples
    from posttrain.search.verifiers import load_orm_scorer, load_prm_scorer

    start = time.time()
    validate_search(cfg)  # 1
    check_verifiers(cfg)
    setup_threads(cfg.threads)
    set_seed(cfg.seed)
    rows = _rows(cfg)  # 2
    device = resolve_device(cfg.device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    policy, tok = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype)
    if cfg.chat_template not in ("auto", "none"):
        tok.chat_template = cfg.chat_template
    check_renderable(tok, rows, cfg.eval_data, cfg.chat_template)
    policy.to(device)
    outcome, prm_steps, batch = {}, None, cfg.generation_batch_size
    if cfg.orm:
        outcome["orm"] = load_orm_scorer(cfg.orm, batch_size=batch, device=device)
    if cfg.prm:
        prm_steps = load_prm_scorer(cfg.prm, batch_size=batch, device=device)
        outcome["prm"] = prm_outcome(prm_steps, cfg.aggregate)
    summary: dict[str, Any] = {"problems": len(rows), "methods": {}}
    if any(m != "beam" for m in cfg.methods):
        sampler = build_sampler(cfg, tok, role="eval", model=policy)  # `rollout_engine`
        samples = sample_solutions(  # 3
            policy, tok, rows, max(cfg.n), max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, batch_size=batch,
            generator=gen, autocast=cfg.autocast_bf16, template=cfg.chat_template,
            sampler=sampler)
        sampler.close()
        scores = {name: score_samples(samples, fn, batch) for name, fn in outcome.items()}
        sel = evaluate_selection(samples, sorted(set(cfg.n)), scores)  # 4
        weight_by = "prm" if "prm" in scores else "orm"
        wanted = {"majority": "majority", "oracle": "pass@n"}
        if "best_of_n" in cfg.methods:
            wanted.update({f"best_of_n:{name}": f"best_of_n:{name}" for name in scores})
        if "weighted" in cfg.methods:
            wanted[f"weighted:{weight_by}"] = f"weighted:{weight_by}"
        if "majority" not in cfg.methods:
            wanted.pop("majority")
        for key, name in wanted.items():
            summary["methods"][name] = {str(n): v for n, v in sel[key].items()}
    if "beam" in cfg.methods and prm_steps is not None:
        summary["methods"]["beam"] = _beam(cfg, rows, policy, tok, prm_steps, gen, device)  # 5
    summary["seconds"] = round(time.time() - start, 1)
    write_summary(cfg.out_dir, cfg, **summary)  # 6
    return summary


def _beam(cfg: SearchConfig, rows: list[dict[str, Any]], policy: Any, tok: Any, prm_steps: Any,
          gen: torch.Generator, device: Any) -> dict[str, Any]:
    from posttrain.rewards.math import extract_answer
    from posttrain.search import PolicyProposer, prm_beam_search
    from posttrain.search.measure import is_correct

    propose = PolicyProposer(policy, tok, separator=cfg.step_separator,
                             max_step_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p, batch_size=cfg.generation_batch_size, generator=gen,
                             autocast=cfg.autocast_bf16, template=cfg.chat_template)
    results = prm_beam_search([r["prompt"] for r in rows], propose, prm_steps,
                              beam_width=cfg.beam_width, expansions=cfg.expansions,
                              max_steps=cfg.beam_max_steps, aggregate=cfg.aggregate)
    correct = [is_correct(extract_answer(b.completion), r["answer"])
               for b, r in zip(results, rows, strict=True)]
    return {"accuracy": sum(correct) / len(correct),
            "tokens": sum(b.tokens for b in results) / len(results),
            "beam_width": cfg.beam_width, "expansions": cfg.expansions,
            "no_solution": sum(not b.completion for b in results)}
