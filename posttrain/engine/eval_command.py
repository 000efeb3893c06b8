"""`posttrain eval`: greedy held-out evaluation of a model with reward functions (no training)."""

from __future__ import annotations

import time
from typing import Any

from posttrain.config import ConfigError
from posttrain.config.rl import PromptRLConfig
from posttrain.core.io import write_summary
from posttrain.core.runtime import setup_threads
from posttrain.engine.preflight import preflight
from posttrain.engine.session import load_session
from posttrain.engine.values import prompt_values


def run_eval(cfg: PromptRLConfig) -> dict[str, Any]:
    """Greedy held-out evaluation of `model` with the configured rewards; writes summary.json."""
    start = time.time()
    setup_threads(cfg.threads)
    if not cfg.eval_data:
        raise ConfigError("config key 'eval_data': required by `posttrain eval`")
    preflight(cfg)
    s = load_session(cfg, kind="prompts", with_train=False, values=prompt_values(cfg))
    result = s.evaluate(s.model)
    write_summary(cfg.out_dir, cfg, eval_before=result.get("accuracy"),
                  eval_after=result.get("accuracy"), eval_detail=result,
                  seconds=round(time.time() - start, 1))
    return result
