"""What an RL step says on the console besides its metrics line: reward errors (a NaN too)
with their sample, samples no reward function scored, completions cut at `max_new_tokens`,
and `log_completions` (N sampled training completions per step, also in
`out_dir/completions.jsonl`), and a blow-up (truncated share or KL jumping against the steps
before: `blowup`), the training reward rising while `audit_rewards` fall (`tripwire`). One
line each, from rank 0; a problem that only a part of a step
shows is said the first time, one that hits most of a step every time it does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_EXCERPT = 160


class StepNotes:
    """The warnings and sample lines of one run (`name`: the console tag; `enabled`: rank 0)."""

    def __init__(self, name: str, enabled: bool) -> None:
        self.name, self.enabled = name, enabled
        self._said: set[str] = set()
        self._trend: list[dict[str, float]] = []
        self._audited: list[dict[str, float]] = []

    def _say(self, key: str, text: str, always: bool = False) -> None:
        if self.enabled and (always or key not in self._said):
            self._said.add(key)
            print(f"[{self.name}] {text}", file=sys.stderr, flush=True)

    def rewards(self, step: int, errors: list[dict[str, Any]], n: int) -> None:
        """Reward errors by function (first time, or every step where most samples fail) and
        samples no function scored (`function` None in the records of `Rewards`)."""
        by_fn: dict[Any, list[dict[str, Any]]] = {}
        for err in errors:
            by_fn.setdefault(err["function"], []).append(err)
        for fn, errs in by_fn.items():
            first = errs[0]
            most = 2 * len(errs) > n
            if fn is None:
                text = (f"{len(errs)} of {n} samples were scored by no reward function (each "
                        "returned None) and count as reward 0")
            else:
                text = (f"reward {fn!r} failed on {len(errs)} of {n} samples (scored 0), "
                        f"first: {first['error']} on {first['completion']!r}")
            self._say(f"reward:{fn}", f"warning (step {step}): {text}; every one is in "
                      "out_dir/reward_errors.jsonl", always=most)

    def truncation(self, step: int, frac: float, max_new_tokens: int) -> None:
        """Most completions of the step hit `max_new_tokens` (their reward is likely 0)."""
        if frac > 0.5:
            self._say("truncated", f"warning (step {step}): {frac:.0%} of the completions hit "
                      f"max_new_tokens={max_new_tokens} and were cut (response/truncated_frac);"
                      " raise max_new_tokens if the task needs longer answers")

    def trend(self, step: int, metrics: dict[str, float]) -> None:
        """A step's truncated share and KL against the steps before it (`blowup`): one line
        the first time they jump."""
        self._trend.append({"step": step, **{k: metrics[k] for k in BLOWUP if k in metrics}})
        seen = blowup(self._trend)
        if seen:
            self._say("blowup", f"warning (step {step}): the policy is blowing up: {seen}; "
                      "long wrong completions weigh less per token under loss_agg "
                      "seq-mean-token-mean; loss_agg: token-mean (DAPO), a lower lr or a larger "
                      "kl_coef hold it")

    def tripwire(self, step: int, metrics: dict[str, float]) -> None:
        """The training reward rising while `audit_rewards` fall (`overoptimised`): one line."""
        if "reward/audit_mean" in metrics:
            self._audited.append({"step": step, **{k: metrics.get(k, float("nan"))
                                                   for k in TRIPWIRE}})
        seen = overoptimised(self._audited)
        if seen:
            self._say("tripwire", f"warning (step {step}): the training reward rises while the "
                      f"audit reward falls: {seen}; the policy may be gaming the training "
                      "reward (docs/rewards.md, 'Tripwires'): read out_dir/completions.jsonl "
                      "and run `posttrain audit` on it")

    def tool_answers(self, step: int, overflows: list[int], max_new_tokens: int) -> None:
        """Episodes that ended because a tool's answer did not fit in their budget."""
        if any(overflows):
            n = sum(o > 0 for o in overflows)
            self._say("tool_answers", f"warning (step {step}): {n} episode(s) ended because a "
                      f"tool's answer (up to {max(overflows)} tokens) did not fit in "
                      f"max_new_tokens={max_new_tokens} (agent/cut_by_tool_answer): bound what "
                      "the tool returns, or raise max_new_tokens")

    def completions(self, out_dir: str, step: int, samples: list[dict[str, Any]]) -> None:
        """`log_completions`: the samples to `out_dir/completions.jsonl` and the console."""
        if not (self.enabled and samples):
            return
        path = Path(out_dir) / "completions.jsonl"
        with path.open("a") as fh:
            for s in samples:
                fh.write(json.dumps({"step": step, **s}, default=str) + "\n")
        for i, s in enumerate(samples, 1):
            self._say("", f"step {step} sample {i}/{len(samples)}: reward={s['reward']:.4g} "
                      f"prompt={str(s['prompt'])[-_EXCERPT:]!r} "
                      f"completion={s['completion'][:_EXCERPT]!r}", always=True)


BLOWUP = {"response/truncated_frac": ("rise", 0.3), "kl/token_mean": ("ratio", 5.0)}
"""What counts as a jump: the truncated share up by 0.3 (absolute) over the lowest of the window
before it, the KL 5x the window's median (and at least `KL_FLOOR`). Chosen on the tool world's
runs (docs/results.md): fires in the three that blew up, in none of the nine that did not."""
KL_FLOOR = 0.1


def blowup(trend: list[dict[str, float]], window: int = 10) -> str | None:
    """The metrics of `BLOWUP` whose last value jumped against the `window` steps before it, as
    "key a -> b (steps i-j)", or None (fewer steps, or no jump). Pure function of the rows."""
    if len(trend) <= window:
        return None
    last, before = trend[-1], trend[-window - 1:-1]
    seen = []
    for key, (kind, size) in BLOWUP.items():
        past = sorted(r[key] for r in before if key in r)
        if key not in last or len(past) < window:
            continue
        ref = past[0] if kind == "rise" else past[len(past) // 2]
        jumped = (last[key] - ref >= size if kind == "rise"
                  else last[key] >= max(size * ref, KL_FLOOR))
        if jumped:
            seen.append(f"{key} {ref:.3g} -> {last[key]:.3g}")
    span = f"(steps {before[0]['step']}-{last['step']})"
    return f"{', '.join(seen)} {span}" if seen else None


TRIPWIRE = ("reward/mean", "reward/audit_mean")
"""The training reward of the whole step and `audit_rewards` on its audited samples."""
TRIPWIRE_WINDOW, TRIPWIRE_MOVE = 6, 0.05


def overoptimised(rows: list[dict[str, float]], window: int = TRIPWIRE_WINDOW,
                  move: float = TRIPWIRE_MOVE) -> str | None:
    """Over the last `window` audited steps: the training reward's mean over the later half up
    by at least `move` on the earlier half while the audit reward's is down by at least `move`,
    as "reward/mean a -> b while reward/audit_mean c -> d (steps i-j)"; else None (fewer
    steps, a NaN). Pure function of the rows."""
    last = rows[-window:]
    if len(last) < window or any(r[k] != r[k] for r in last for k in TRIPWIRE):
        return None
    half = window // 2
    (t0, a0), (t1, a1) = ([sum(r[k] for r in part) / len(part) for k in TRIPWIRE]
                          for part in (last[:half], last[half:]))
    if t1 - t0 < move or a0 - a1 < move:
        return None
    return (f"reward/mean {t0:.3g} -> {t1:.3g} while reward/audit_mean {a0:.3g} -> {a1:.3g} "
            f"(steps {last[0]['step']}-{last[-1]['step']})")


def completion_samples(rollout: Any, result: Any, n: int) -> list[dict[str, Any]]:
    """The first `n` completions of a rollout with their prompt, weighted reward and each
    reward function's value (None where it did not score the sample); for a multi-turn
    episode also its `messages` (the tool answers as `tool` messages)."""
    out = []
    for i in range(min(n, len(rollout.completions))):
        per_fn = {k: (None if v[i] != v[i] else v[i]) for k, v in result.per_function.items()}
        out.append({"prompt": rollout.rows[i].get("prompt"),
                    "completion": rollout.completions[i], "reward": result.scores[i],
                    "rewards": per_fn, "truncated": bool(rollout.truncated[i])})
        if "messages" in rollout.rows[i]:  # an episode: its turns, tool messages by role
            out[-1]["messages"] = rollout.rows[i]["messages"]
    return out
