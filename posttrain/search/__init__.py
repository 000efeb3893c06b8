"""Test-time search with verifiers: best-of-N, (weighted) majority vote, PRM beam search.

See ``docs/search.md``. Scorers are small callables (:mod:`posttrain.search.scorers`), so a
trained ORM/PRM (the library's one reward-model path, :mod:`posttrain.models.reward_models`), a
rule or a test fake plug in the same way.
"""

from posttrain.data.steps import split_steps
from posttrain.models.reward_models import aggregate_scores
from posttrain.search.beam import BeamResult, Candidate, PolicyProposer, prm_beam_search
from posttrain.search.measure import (
    Samples,
    build_samples,
    evaluate_selection,
    sample_solutions,
    score_samples,
)
from posttrain.search.scorers import OutcomeScorer, StepScorer, prm_outcome
from posttrain.search.select import best_of_n, group_answers, majority_vote, weighted_vote

__all__ = ["BeamResult", "Candidate", "OutcomeScorer", "PolicyProposer", "Samples", "StepScorer",
           "aggregate_scores", "best_of_n", "build_samples", "evaluate_selection", "group_answers",
           "majority_vote", "prm_beam_search", "prm_outcome", "sample_solutions", "score_samples",
           "split_steps", "weighted_vote"]
