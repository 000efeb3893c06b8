"""Verifiable rewards (formulas §10): math, format and code, their registry and `Rewards`.

Pure Python: this package never imports torch. ``math_reward`` needs ``math-verify``;
``code_reward`` runs programs in the sandbox of :mod:`posttrain.sandbox.jail`.
"""

from posttrain.rewards.code import (
    code_reward,
    code_reward_detailed,
    code_rewards_batch,
    extract_program,
    split_tests,
)
from posttrain.rewards.errors import (
    RewardFunctionError,
    UnscorableError,
)
from posttrain.rewards.format import format_reward
from posttrain.rewards.math import extract_answer, math_equal, math_reward
from posttrain.rewards.registry import (
    BUILTIN_REWARDS,
    Rewards,
    RewardSpec,
    ScoreResult,
    resolve_reward,
    validate_specs,
)
from posttrain.sandbox.jail import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
)
from posttrain.sandbox.tests import CompareOptions

__all__ = [
    "BUILTIN_REWARDS",
    "CompareOptions",
    "RewardFunctionError",
    "Rewards",
    "RewardSpec",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "ScoreResult",
    "UnscorableError",
    "code_reward",
    "code_reward_detailed",
    "code_rewards_batch",
    "extract_answer",
    "extract_program",
    "format_reward",
    "math_equal",
    "math_reward",
    "resolve_reward",
    "run_sandboxed",
    "split_tests",
    "validate_specs",
]
