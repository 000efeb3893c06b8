"""posttrain: reinforcement-learning post-training for language models.

The pure math lives in :mod:`posttrain.ops` (torch only), verifiable rewards in
:mod:`posttrain.rewards` (no torch), trainers in :mod:`posttrain.trainers`.
Keep this file light: ``import posttrain.ops`` must not pull in transformers.
"""

__version__ = "0.1.0"
