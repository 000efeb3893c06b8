"""PRM-guided beam search over reasoning steps.

At each round every live beam (a partial completion) is expanded into M candidate next steps
by the policy, each candidate partial solution is scored by the PRM (its step scores
aggregated), and the top B candidates are kept. A kept candidate that reached the end of the
completion leaves the beam as a finished solution; the others are expanded again. The search
ends when no beam is live or after ``max_steps`` rounds; the answer is the finished solution
with the highest score. The first round expands the prompt into B*M candidates, so every round
samples at most B*M steps. Steps end at the solution format's separator (Lightman et al. 2023).
Compute is reported as generated tokens: every token the policy sampled for any candidate,
kept or not (prompt and prefix re-encoding is a prefill, not counted).
More (Snell et al. 2024, search-and-learn): docs/search.md, "Module notes", posttrain.search.beam.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.models.reward_models import DEFAULT_AGGREGATE, outcome_from_steps
from posttrain.search.scorers import StepScorer, step_splitter

STEP_SEPARATOR = "; "


@dataclass
class Candidate:
    """One proposed continuation of a partial completion."""

    text: str
    """The continuation: one step ending with the separator, or the rest of the completion."""
    tokens: int
    """Tokens the policy generated for it."""
    done: bool
    """True when the completion ended (EOS) instead of stopping at a step separator."""


class StepProposer(Protocol):
    def __call__(self, contexts: Sequence[tuple[Any, str]], n: int) -> list[list[Candidate]]:
        """For each ``(prompt, partial completion)``, ``n`` sampled next steps."""
        ...


@dataclass
class BeamResult:
    completion: str
    """The chosen solution ("" when no solution finished)."""
    score: float
    """Its aggregated PRM score (-inf when none finished)."""
    tokens: int
    """Tokens generated for this prompt, all candidates of all rounds."""
    rounds: int
    """Expansion rounds run."""
    finished: int
    """Finished solutions the choice was made among."""


def _select(pool: list[tuple[str, bool, float]], width: int,
            dedupe: bool) -> list[tuple[str, bool, float]]:
    """Top ``width`` of (text, done, score) by score, stable; duplicates dropped if ``dedupe``."""
    seen: set[str] = set()
    out = []
    for item in sorted(pool, key=lambda x: -x[2]):
        if dedupe and item[0] in seen:
            continue
        seen.add(item[0])
        out.append(item)
        if len(out) == width:
            break
    return out


def prm_beam_search(
    prompts: Sequence[Any],
    propose: StepProposer,
    step_scorer: StepScorer,
    *,
    beam_width: int = 4,
    expansions: int = 4,
    max_steps: int = 10,
    aggregate: str = DEFAULT_AGGREGATE,
    dedupe: bool = True,
) -> list[BeamResult]:
    """PRM beam search for each prompt (see the module docstring); all prompts run together.

    ``beam_width`` B beams are kept, each expanded into ``expansions`` M candidates per round;
    ``dedupe`` drops candidates identical to a better one before keeping the top B (otherwise
    a peaked policy fills the beam with copies). Unfinished beams at the step limit are
    dropped (reported as no solution when nothing finished). A partial solution is split into
    steps by the scorer's own rule (a trained PRM's saved one, see
    :func:`posttrain.search.scorers.step_splitter`) and scored as a finished one would be.
    """
    if beam_width < 1 or expansions < 1 or max_steps < 1:
        raise ValueError(f"need beam_width, expansions, max_steps >= 1, got {beam_width}, "
                         f"{expansions}, {max_steps}")
    beams: list[list[str]] = [[""] for _ in prompts]
    finished: list[list[tuple[str, float]]] = [[] for _ in prompts]
    tokens = [0] * len(prompts)
    rounds = [0] * len(prompts)
    for depth in range(max_steps):
        owners = [p for p in range(len(prompts)) for _ in beams[p]]
        if not owners:
            break
        contexts = [(prompts[p], prefix) for p in range(len(prompts)) for prefix in beams[p]]
        n = beam_width * expansions if depth == 0 else expansions
        proposals = propose(contexts, n)
        pool_owner, pool_text, pool_done = [], [], []
        for p, (_, prefix), cands in zip(owners, contexts, proposals, strict=True):
            for c in cands:
                tokens[p] += c.tokens
                pool_owner.append(p)
                pool_text.append(prefix + c.text)
                pool_done.append(c.done)
        scores = outcome_from_steps(step_scorer, [prompts[p] for p in pool_owner], pool_text,
                                    step_splitter(step_scorer), aggregate)
        pools: dict[int, list[tuple[str, bool, float]]] = {}
        for p, text, done, s in zip(pool_owner, pool_text, pool_done, scores, strict=True):
            pools.setdefault(p, []).append((text, done, s))
        for p, pool in pools.items():
            rounds[p] += 1
            kept = _select(pool, beam_width, dedupe)
            finished[p] += [(t, s) for t, d, s in kept if d]
            beams[p] = [t for t, d, _ in kept if not d]
    results = []
    for p in range(len(prompts)):
        best = max(finished[p], key=lambda x: x[1], default=("", float("-inf")))
        results.append(BeamResult(completion=best[0], score=best[1], tokens=tokens[p],
                                  rounds=rounds[p], finished=len(finished[p])))
    return results


class PolicyProposer:
    """A :class:`StepProposer` that samples next steps from a causal LM.

    Decoding stops at EOS or at any token whose text contains the separator's non-blank part
    (``";"`` for ``"; "``); the continuation is cut after that part and the rest of the
    separator is appended, so every kept candidate ends exactly at a step boundary. Sampling
    uses the rollout decode loop (:func:`posttrain.rollout.hf.sample_tokens`: one prefill per
    context, KV cache repeated ``n`` times, finished rows dropped).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, separator: str = STEP_SEPARATOR,
                 max_step_tokens: int = 48, temperature: float = 1.0, top_p: float = 1.0,
                 batch_size: int = 256, generator: torch.Generator | None = None,
                 autocast: bool = False, template: str = "auto") -> None:
        from posttrain.data.prompts import render_prompt

        self.model, self.tokenizer, self.separator = model, tokenizer, separator
        self.core = separator.strip() or separator
        self.max_step_tokens, self.batch_size = max_step_tokens, batch_size
        self.temperature, self.top_p = temperature, top_p
        self.generator, self.autocast = generator, autocast
        self.render = lambda prompt: render_prompt(tokenizer, prompt, template)
        vocab = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.stop_ids = [i for i, t in enumerate(vocab) if self.core in t]
        if not self.stop_ids:
            raise ValueError(f"no token of the tokenizer contains the step separator "
                             f"{separator!r}: the policy can never end a step")

    @torch.no_grad()
    def __call__(self, contexts: Sequence[tuple[Any, str]], n: int) -> list[list[Candidate]]:
        from posttrain.rollout.hf import SamplingParams
        from posttrain.rollout.sampler import model_sampler

        tok = self.tokenizer
        eos = tok.eos_token_id
        params = SamplingParams(max_new_tokens=self.max_step_tokens,
                                temperature=self.temperature, top_p=self.top_p)
        sampler = model_sampler(self.model, tok, self.autocast)
        out: list[list[Candidate]] = []
        per_batch = max(1, self.batch_size // n)
        for start in range(0, len(contexts), per_batch):
            chunk = contexts[start:start + per_batch]
            texts = [self.render(p) + prefix for p, prefix in chunk]
            rollout = sampler.generate(texts, group_size=n, params=params,
                                      stop_ids=[eos, *self.stop_ids], generator=self.generator)
            comp, resp, decoded = rollout.completion_ids, rollout.response_mask, rollout.completions
            lengths = resp.sum(1).tolist()
            ended = [bool(resp[i].any()) and int(comp[i, lengths[i] - 1]) == eos
                     for i in range(comp.shape[0])]
            for j in range(len(chunk)):
                row = []
                for i in range(j * n, (j + 1) * n):
                    row.append(self._candidate(decoded[i], lengths[i], ended[i]))
                out.append(row)
        return out

    def _candidate(self, text: str, n_tokens: int, ended: bool) -> Candidate:
        if not ended:
            cut = text.find(self.core)
            if cut >= 0:  # stopped at a separator token: end the step exactly there
                return Candidate(text[:cut] + self.separator, n_tokens, False)
        return Candidate(text, n_tokens, True)
