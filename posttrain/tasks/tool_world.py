"""The offline tool world: products of 3-digit numbers (317..999, so every product has 6 digits),
which a 0.4M-parameter model cannot compute in its head, and a `calculator` tool that can.

``python -m posttrain.tasks.tool_world --out runs/tools`` (or :func:`build_tool_world`) writes

1. ``init/``: the character tokenizer and a randomly initialised tiny Llama (nothing downloaded);
2. ``data/sft.jsonl``: SFT conversations where the tool is used only ``tool_rate`` of the time
   (the rest answer directly, which the model can only guess), ``data/prompts.jsonl``
   (train-split RL rows) and ``data/heldout.jsonl`` (held-out problems, none in a train file);
3. ``sft/final``: the SFT warm start ``recipes/grpo_tools.yaml`` trains with GRPO and the tool
   (two SFT phases on the same data, ``sft_phase1/`` then ``sft/``: see `WORLD`);
4. ``summary.json``: paths, SFT loss, timings.

A tool trace, in the fallback call format of `posttrain.rollout.tools` (the character
tokenizer's template defines no tool format):
``<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call></s>``
``<tool_response>56088</tool_response>\\n<answer>56088</answer></s>``.

``--family qwen3`` builds the same world with a real family's tokenizer and chat template and a
tiny random model of its class (`FAMILY_WORLD`, `family_sft_rows`; the calls and the tool's
answers as that template renders them; then ``recipes/grpo_tools_qwen3.yaml``).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import time
from pathlib import Path
from typing import Any

from posttrain.config import SFTConfig, build_config
from posttrain.core.io import peak_rss_mb, write_summary
from posttrain.models.loading import save_checkpoint

WORLD: dict[str, Any] = {
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512,
              "max_position_embeddings": 192},
    "sft": {"rows": 40_000, "tool_rate": 0.5, "max_steps": 600, "batch_size": 64, "lr": 3e-3,
            "warmup_steps": 50, "micro_batch_size": 0},
    # a second SFT phase on the same data at a constant lr: after the first the model calls the
    # tool but does not copy its answer (0 of 64 held-out); the copy appears at steps 300-400 of
    # this phase (64 of 64); 400 steps decayed by cosine to 1.5e-4 never got it (docs/results.md)
    "sft_more": {"max_steps": 600, "batch_size": 64, "lr": 1.5e-3, "warmup_steps": 10,
                 "lr_schedule": "constant", "micro_batch_size": 0},
    "prompts": 20_000,
    "heldout": 500,
}
QUICK: dict[str, Any] = {"sft": {"rows": 500, "max_steps": 5}, "sft_more": {"max_steps": 2},
                         "prompts": 100, "heldout": 32}
FAMILY_WORLD: dict[str, Any] = {
    # --family: the same task on a tiny random model of the family's class with its real
    # tokenizer and chat template (posttrain.tasks.families); the 151,936-row head of Qwen3
    # costs ~40x the demo's per token, so fewer rows and steps (docs/results.md)
    "model": {"hidden_size": 64, "num_layers": 2},
    "sft": {"rows": 4_000, "tool_rate": 0.5, "max_steps": 300, "batch_size": 16, "lr": 3e-3,
            "warmup_steps": 20, "micro_batch_size": 0},
    # phase 2 in two runs (the second from the first's final, a fresh optimizer): after 400
    # steps the calls copied the prompt's expression half the time and the answers only its
    # first digits (docs/results.md), so 300 more were run on that start
    "sft_more": [{"max_steps": steps, "batch_size": 16, "lr": 1.5e-3, "warmup_steps": 10,
                  "lr_schedule": "constant", "micro_batch_size": 0} for steps in (400, 300)],
    "prompts": 4_000,
    "heldout": 256,
}
FAMILY_CHOICES = ("qwen3",)
"""Families whose tool world is built (Hermes calls; others: docs/agents.md "Model families")."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, *, //, %, parentheses).

    Args:
        expression: the expression, e.g. "123*456".
    """
    try:
        return _evaluate(expression)
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, RecursionError,
            MemoryError) as err:  # a bad expression is the tool's answer, not its failure
        return f"error: {type(err).__name__}: {err}"


def _evaluate(expression: str) -> str:
    """The value of an integer arithmetic expression as text; raises on anything else."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not an integer arithmetic expression: {expression!r}")

    return str(ev(ast.parse(expression, mode="eval").body))


def tool_call(expression: str) -> str:
    """The model's call of `calculator` in the fallback format."""
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{args}</tool_call>"


def _is_heldout(a: int, b: int) -> bool:
    return (a * 7 + b * 13) % 10 == 0


def problems(n: int, seed: int, split: str) -> list[tuple[int, int]]:
    """`n` pairs of 3-digit numbers of `split` (train / heldout; disjoint). Fixed-width
    products keep the copy from the tool's answer at one distance (a tiny model learns it)."""
    rng, out = random.Random(f"{seed}:{split}"), []
    while len(out) < n:
        a, b = rng.randint(317, 999), rng.randint(317, 999)  # 317 * 317 = 100489
        if _is_heldout(a, b) == (split == "heldout"):
            out.append((a, b))
    return out


def prompt_rows(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    return [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in problems(n, seed, split)]


def sft_rows(n: int, seed: int, tool_rate: float) -> list[dict[str, Any]]:
    """SFT conversations: on `tool_rate` of the problems the tool is used (two rows: the call,
    and the answer after the tool's message, so the loss of the second is the copy alone and
    the tool's digits are context, never targets); on the rest a direct answer (a guess)."""
    rng = random.Random(f"{seed}:sft")
    rows = []
    for a, b in problems(n, seed + 7, "train"):
        expr, value = f"{a}*{b}", str(a * b)
        user = {"role": "user", "content": expr}
        final = {"role": "assistant", "content": f"<answer>{value}</answer>"}
        if rng.random() < tool_rate:
            call = {"role": "assistant", "content": tool_call(expr)}
            tool = {"role": "tool", "content": f"<tool_response>{value}</tool_response>"}
            rows += [{"messages": [user, call]}, {"messages": [user, call, tool, final]}]
        else:
            rows.append({"messages": [user, final]})
    return rng.sample(rows, len(rows))


def _split(tokenizer: Any, head: str, whole: str) -> dict[str, str]:
    """A pre-rendered SFT row: `head` (the text the model continues) and the rest of `whole`
    up to the template's end of turn (what the template writes after it is never sampled)."""
    from posttrain.data.prompts import turn_end_id

    assert whole.startswith(head), "the template does not render the prompt as a prefix"
    tail, end = whole[len(head):], turn_end_id(tokenizer)
    mark = tokenizer.convert_ids_to_tokens(end) if end is not None else None
    if mark and mark in tail:  # cut after the last end of turn
        tail = tail[:tail.rindex(mark) + len(mark)]
    return {"prompt": head, "completion": tail}


def family_sft_rows(tokenizer: Any, n: int, seed: int, tool_rate: float) -> list[dict[str, str]]:
    """`sft_rows` rendered by a real chat template (Hermes calls), as prompt/completion text:
    the call as the template writes the assistant's `tool_calls` (Qwen3: after an empty
    `<think>` block), and the copy row's prompt exactly as an episode builds it: the call turn
    the model samples, then the tool's answer as the template renders it
    (`posttrain.rollout.call_formats.answer_text`), then the generation prompt."""
    from posttrain.data.prompts import turn_end_id
    from posttrain.rollout.call_formats import answer_text

    end = tokenizer.convert_ids_to_tokens(turn_end_id(tokenizer))
    render = tokenizer.apply_chat_template
    rng, rows = random.Random(f"{seed}:sft"), []
    for a, b in problems(n, seed + 7, "train"):
        expr, value = f"{a}*{b}", str(a * b)
        user = [{"role": "user", "content": expr}]
        ask = render(user, tokenize=False, add_generation_prompt=True)
        final = {"role": "assistant", "content": f"<answer>{value}</answer>"}
        if rng.random() < tool_rate:
            call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expr}}}]}
            turn = _split(tokenizer, ask, render([*user, call], tokenize=False))
            tool = {"role": "tool", "name": "calculator", "content": value}
            whole = render([*user, call, tool, final], tokenize=False)
            last = render([*user, call, tool], tokenize=False, add_generation_prompt=True)
            copy = _split(tokenizer, last, whole)
            context = ask + turn["completion"] + answer_text(
                tokenizer, "hermes", "calculator", [("calculator", value)], end)
            rows += [turn, {"prompt": context, "completion": copy["completion"]}]
        else:
            rows.append(_split(tokenizer, ask, render([*user, final], tokenize=False)))
    return rng.sample(rows, len(rows))


def _world_parts(family: str | None, seed: int, s: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(tokenizer, tiny model, SFT rows) of the demo world or of `family`'s."""
    if family is None:
        from posttrain.tasks.tiny import build_tiny_llama
        from posttrain.tasks.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        return (tok, build_tiny_llama(tok, **s["model"], seed=seed),
                sft_rows(s["sft"]["rows"], seed, s["sft"]["tool_rate"]))
    from transformers import AutoTokenizer

    from posttrain.tasks.families import build_tiny_model, family_tokenizer_dir

    if family not in FAMILY_CHOICES:
        raise ValueError(f"--family {family!r}: the tool world is built for {FAMILY_CHOICES}")
    tok = AutoTokenizer.from_pretrained(family_tokenizer_dir(family))
    return (tok, build_tiny_model(family, seed, **s["model"]),
            family_sft_rows(tok, s["sft"]["rows"], seed, s["sft"]["tool_rate"]))


def build_tool_world(out_dir: str | Path, seed: int = 0, *, quick: bool = False,
                     threads: int = 1, progress: bool = True,
                     family: str | None = None) -> dict[str, Any]:
    """Build the world under `out_dir` and run the SFT warm start; returns the summary.
    `family` (`FAMILY_CHOICES`): that family's real tokenizer, template and model class,
    sized by `FAMILY_WORLD`; None: the demo's character tokenizer and tiny Llama (`WORLD`)."""
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.trainers.sft import SFTTrainer

    start, out = time.time(), Path(out_dir)
    base = WORLD if family is None else FAMILY_WORLD
    s = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in (QUICK if quick else {}).items():
        if isinstance(s[key], list):  # phases run one after the other: each made quick
            s[key] = [{**phase, **value} for phase in s[key]]
        else:
            s[key] = {**s[key], **value} if isinstance(value, dict) else value
    tok, model, rows = _world_parts(family, seed, s)
    save_checkpoint(model, tok, out / "init")
    data = out / "data"
    paths = {"init": str(out / "init"),
             "sft": str(write_jsonl(rows, data / "sft.jsonl")),
             "prompts": str(write_jsonl(prompt_rows(s["prompts"], seed), data / "prompts.jsonl")),
             "heldout": str(write_jsonl(prompt_rows(s["heldout"], seed, "heldout"),
                                        data / "heldout.jsonl"))}
    sft_keys = {k: v for k, v in s["sft"].items() if k not in ("rows", "tool_rate")}
    common = {"train_data": paths["sft"], "seed": seed, "lr_schedule": "cosine",
              "max_seq_len": 160, "threads": threads, "eval_rewards": [],
              "progress": progress}
    first = SFTTrainer(build_config(SFTConfig, overrides={
        "model": paths["init"], "out_dir": str(out / "sft_phase1"), **common, **sft_keys})).train()
    more = s["sft_more"] if isinstance(s["sft_more"], list) else [s["sft_more"]]
    for i, phase in enumerate(more, 2):  # the last phase writes sft/, the others sft_phaseN/
        where = out / ("sft" if i == len(more) + 1 else f"sft_phase{i}")
        sft = SFTTrainer(build_config(SFTConfig, overrides={
            "model": str(out / f"sft_phase{i - 1}" / "final"), "out_dir": str(where),
            **common, **phase})).train()
        first["seconds"] += sft["seconds"]
    sft["seconds"] = first["seconds"]
    summary = {"paths": {**paths, "sft_model": str(out / "sft" / "final")},
               "sft_loss_last": sft["train"]["loss_last"], "sft_seconds": sft["seconds"],
               "seconds": round(time.time() - start, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
               "quick": quick, "seed": seed, "family": family, "settings": s}
    write_summary(out, None, **summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.tasks.tool_world",
        description="Build the offline tool world (3-digit products, a calculator tool) and run "
                    "its SFT warm start; then: posttrain grpo --config recipes/grpo_tools.yaml")
    parser.add_argument("--out", default="runs/tools", help="output directory [runs/tools]")
    parser.add_argument("--seed", type=int, default=0, help="random seed [0]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads [1]")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--family", choices=FAMILY_CHOICES, default=None,
                        help="a real family's tokenizer, chat template and model class "
                             "(npm; posttrain.tasks.families) [the demo's]")
    args = parser.parse_args(argv)
    summary = build_tool_world(args.out, args.seed, quick=args.quick, threads=args.threads,
                               family=args.family)
    recipe = "grpo_tools.yaml" if args.family is None else f"grpo_tools_{args.family}.yaml"
    print(json.dumps({"sft_loss_last": summary["sft_loss_last"], "seconds": summary["seconds"]}))
    print(f"wrote {Path(args.out) / 'summary.json'}; next: posttrain grpo --config "
          f"recipes/{recipe}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
