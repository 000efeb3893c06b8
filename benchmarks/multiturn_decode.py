"""Multi-turn decode speed: model tokens per second of tool episodes vs single-turn sampling.

    python benchmarks/multiturn_decode.py MODEL_DIR [--rows 64] [--repeats 3]

MODEL_DIR: a tool-world model (`python -m posttrain.tasks.tool_world`, or a GRPO run on it).
Both sides sample the same held-out prompts at temperature 1 with the `hf` engine on the CPU:
single-turn with `tools=[]` (one completion, no tool), multi-turn through `AgentEngine` with the
calculator (each turn re-prefills the episode so far: the KV cache is not carried over turns).
Tokens counted: the model's sampled tokens only (`response_mask`), not the tool answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from posttrain.data import render_prompt
from posttrain.models import load_model_and_tokenizer
from posttrain.rollout.engine import HFEngine
from posttrain.rollout.episodes import AgentEngine
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.tools import AgentSpec
from posttrain.tasks.tool_world import calculator


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
    inner = HFEngine(tok)
    inner.update_weights(model, 0)
    agent = AgentEngine(inner, AgentSpec({"calculator": calculator}, None, 2, 5.0),
                        lambda msgs, schemas: render_prompt(tok, msgs, "auto"))
    params = SamplingParams(160, temperature=1.0)
    prompts = [render_prompt(tok, r["prompt"], "auto") for r in rows]
    out = {}
    for name, run in (("single_turn", lambda g: inner.generate(prompts, rows=rows, params=params,
                                                                 generator=g)),
                      ("multi_turn", lambda g: agent.generate([], rows=rows, params=params,
                                                              generator=g))):
        best, tokens, calls = 0.0, 0, 0
        for k in range(args.repeats):
            t0 = time.perf_counter()
            r = run(torch.Generator().manual_seed(k))
            dt = time.perf_counter() - t0
            tokens = int(r.response_mask.sum())
            calls = sum(e["calls"] for e in r.episodes)
            best = max(best, tokens / dt)
        out[name] = {"model_tokens_per_sec": round(best, 1), "model_tokens": tokens,
                     "tool_calls": calls}
    out["ratio"] = round(out["multi_turn"]["model_tokens_per_sec"]
                         / out["single_turn"]["model_tokens_per_sec"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
