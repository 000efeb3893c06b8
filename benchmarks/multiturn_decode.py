"""Multi-turn decode speed: model tokens per second of tool episodes vs single-turn sampling.

    python benchmarks/multiturn_decode.py MODEL_DIR [--rows 64] [--repeats 3]

MODEL_DIR: a tool-world model (`python -m posttrain.tasks.tool_world`, or a GRPO run on it).
Every side samples the same held-out prompts at temperature 1 with the `hf` sampler on the CPU
(one thread), interleaved (one run of each side per repeat; reported: the best of each side,
their ratios, and the median over repeats of each repeat's own ratio, steadier under load):
`single_turn` with `tools=[]` (one completion, no tool); `multi_turn` through `AgentSampler` with
the calculator, each turn continued on the KV cache of the last (only the tool answers are
prefilled); `multi_turn_reprefill`, the same episodes with the cache dropped after every turn
(each turn prefills the whole episode so far, as before the cache was carried). Each side is
timed from the rows to the `Rollout`, prompt rendering included.
Tokens counted: the model's sampled tokens only (`response_mask`), not the tool answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import posttrain.rollout.sampler as sampler_module
from posttrain.data import render_prompt
from posttrain.models import load_model_and_tokenizer
from posttrain.rollout.episodes import AgentSampler
from posttrain.rollout.hf import SamplingParams, sample_turn
from posttrain.rollout.sampler import HFSampler
from posttrain.rollout.tools import AgentSpec
from posttrain.tasks.tool_world import calculator


def reprefill_turn(*args: Any) -> Any:
    """`sample_turn` that carries nothing: the next turn prefills the whole episode."""
    return (*sample_turn(*args[:-1], None)[:4], None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heldout", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(args.model)
    heldout = args.heldout or str(Path(args.model).parents[1] / "data" / "heldout.jsonl")
    rows = [json.loads(x) for x in Path(heldout).read_text().splitlines()][: args.rows]
    inner = HFSampler(tok)
    inner.update_weights(model, 0)
    agent = AgentSampler(inner, AgentSpec({"calculator": calculator}, None, 2, 5.0))
    params = SamplingParams(160, temperature=1.0)

    def single(g: torch.Generator) -> Any:  # rendered here, as `AgentSampler` renders its own
        prompts = [render_prompt(tok, r["prompt"], "auto") for r in rows]
        return inner.generate(prompts, rows=rows, params=params, generator=g)

    def multi(g: torch.Generator, turn: Any = sample_turn) -> Any:
        sampler_module.sample_turn = turn
        try:
            return agent.generate([], rows=rows, params=params, generator=g)
        finally:
            sampler_module.sample_turn = sample_turn

    sides = {"single_turn": single, "multi_turn": multi,
             "multi_turn_reprefill": lambda g: multi(g, reprefill_turn)}
    out: dict[str, Any] = {name: {"model_tokens_per_sec": 0.0} for name in sides}
    paired: dict[str, list[float]] = {name: [] for name in sides}
    for k in range(args.repeats):
        for name, run in sides.items():
            t0 = time.perf_counter()
            r = run(torch.Generator().manual_seed(k))
            dt = time.perf_counter() - t0
            tokens = int(r.response_mask.sum())
            paired[name].append(tokens / dt)
            best = max(out[name]["model_tokens_per_sec"], round(tokens / dt, 1))
            out[name] = {"model_tokens_per_sec": best, "model_tokens": tokens,
                         "tool_calls": sum(e["calls"] for e in r.episodes or [])}
    single = out["single_turn"]["model_tokens_per_sec"]
    for name in ("multi_turn", "multi_turn_reprefill"):
        out[f"ratio_{name}"] = round(out[name]["model_tokens_per_sec"] / single, 3)
        # the median of the repeats' own ratios: the sides of a repeat ran back to back
        ratios = sorted(a / b for a, b in zip(paired[name], paired["single_turn"], strict=True))
        out[f"median_paired_ratio_{name}"] = round(ratios[len(ratios) // 2], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
