"""GRPO with process supervision (`advantage: grpo_process`): step tensors, advantages, e2e.

The step scorers here are fakes with the step-scorer protocol of
`posttrain.trainers.process_steps` (loaded by "module:name" like a user's own scorer), so the
trainer is tested without a trained PRM; `tests/rewards/test_learned.py` covers the PRM itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.models.loading import save_checkpoint
from posttrain.rollout import Rollout, concat_rollouts
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.process_steps import step_tensors, token_ends
from tests.trainers.toy_rewards import sevens

HERE = "tests.trainers.test_grpo_process"
TOY = "tests.trainers.toy_rewards:sevens"


# ---- fake step scorers (the protocol: prompts, completions -> [(char ends, scores)]) ------
def char_steps(prompts, completions):
    """Every character is a step; it scores 1 when it is a '7' among the first 8."""
    return [(list(range(1, len(c) + 1)), [float(ch == "7" and j < 8) for j, ch in enumerate(c)])
            for c in completions]


def one_step(prompts, completions):
    """The whole completion is one step scored by the toy outcome reward."""
    return [([len(c)], [sevens(c)]) if c else ([], []) for c in completions]


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(toy_world: dict[str, str]) -> dict[str, str]:
    return toy_world


def _cfg(world: dict[str, str], out: str, **kw) -> GRPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": [{"name": TOY, "weight": 0.0}, {"name": "math", "weight": 0.0}],
            "advantage": "grpo_process", "process_reward_model": f"{HERE}:char_steps",
            "group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "lr": 1e-2,
            "max_steps": 12, "progress": False, "seed": 0, "threads": 1}
    return build_config(GRPOConfig, overrides={**base, **kw})


def _rollout(completions: list[str], T: int = 10, group_size: int = 2) -> Rollout:
    """A hand-made rollout of character completions, right padded to T."""
    tok = build_char_tokenizer()
    N = len(completions)
    ids = torch.full((N, T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(N, T, dtype=torch.bool)
    for i, c in enumerate(completions):
        toks = tok(c, add_special_tokens=False)["input_ids"]
        ids[i, :len(toks)] = torch.tensor(toks)
        mask[i, :len(toks)] = True
    return Rollout(prompt_ids=torch.ones(N, 1, dtype=torch.long),
                   prompt_mask=torch.ones(N, 1, dtype=torch.bool), completion_ids=ids,
                   response_mask=mask, logprobs=torch.zeros(N, T),
                   truncated=torch.zeros(N, dtype=torch.bool), group_size=group_size,
                   completions=completions, rows=[{"prompt": "p", "answer": "7"}] * N,
                   scores=torch.zeros(N))


class FixedSteps:
    """Steps at fixed character ends with scores set by the test."""

    def __init__(self, steps: list[tuple[list[int], list[float]]]) -> None:
        self.steps = steps

    def __call__(self, prompts, completions):
        return self.steps


def _advantages(trainer: GRPOTrainer, rollout: Rollout, steps) -> torch.Tensor:
    trainer.step_scorer = FixedSteps(steps)
    trainer.compute_advantages(rollout, {})
    return rollout.advantages


@pytest.fixture(scope="module")
def trainer(world, tmp_path_factory) -> GRPOTrainer:
    return GRPOTrainer(_cfg(world, str(tmp_path_factory.mktemp("t")), group_size=2))


# ---- step positions --------------------------------------------------------------------------
def test_token_ends_follow_characters_and_tags():
    tok = build_char_tokenizer()
    text = "<think>1+2=3;3*4=12</think><answer>12</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # tokens: <think>=0, "1+2=3" = 1..5, ";" = 6, "3*4=12" = 7..12, </think> = 13,
    # <answer> = 14, "12" = 15,16, </answer> = 17, EOS = 18.
    # char ends: step 1 ends after "3" (char 12 -> token 5), step 2 after "12" (char 19 ->
    # token 12), the answer step is the last: it ends at the last token (EOS, 18).
    assert token_ends(tok, ids, [12, 19, len(text)]) == [5, 12, 18]
    assert token_ends(tok, ids, []) == [18]  # no step: one step at the end
    assert token_ends(tok, [], [3]) == []


def test_step_tensors_pad_and_check():
    r = _rollout(["abc", "abcdef"], T=8)
    ends, scores = step_tensors(build_char_tokenizer(), r.completion_ids, r.response_mask,
                                [([1, 3], [0.5, 0.25]), ([], [])])
    assert ends.tolist() == [[0, 2], [5, -1]]  # no step: one step on its last token
    assert scores.tolist() == [[0.5, 0.25], [0.0, 0.0]]
    with pytest.raises(ValueError, match="2 step ends but 1 scores"):
        step_tensors(build_char_tokenizer(), r.completion_ids, r.response_mask,
                     [([1, 3], [0.5]), ([1], [1.0])])


def test_rollout_select_and_concat_keep_steps():
    a, b = _rollout(["ab", "abc"], T=4), _rollout(["a", "abcd"], T=6)
    a.step_ends, a.step_scores = torch.tensor([[1], [2]]), torch.tensor([[0.5], [0.1]])
    b.step_ends, b.step_scores = torch.tensor([[0, -1], [1, 3]]), torch.tensor([[1., 0], [.2, .3]])
    both = concat_rollouts([a, b], pad_token_id=0)
    assert both.step_ends.tolist() == [[1, -1], [2, -1], [0, -1], [1, 3]]
    assert both.step_scores[:, 0].tolist() == pytest.approx([0.5, 0.1, 1.0, 0.2])
    assert both.select([3]).step_ends.tolist() == [[1, 3]]


# ---- the three properties of the issue --------------------------------------------------------
def test_step_advantage_depends_only_on_own_and_later_steps(trainer):
    # completion 0 has 3 steps ending at chars 2, 4, 6; completion 1 has 2 steps.
    completions = ["aabbcc", "ddeeff"]
    base = [([2, 4, 6], [0.9, 0.2, 0.7]), ([3, 6], [0.4, 0.1])]
    # swap step 1 of completion 0 (0.2) with step 0 of completion 1 (0.4): the group's multiset
    # of step scores, hence its mean and std, is unchanged, so only the swapped steps' normalised
    # rewards change; in completion 0 the tokens of step 2 (chars 4..5) must not move.
    swapped = [([2, 4, 6], [0.9, 0.4, 0.7]), ([3, 6], [0.2, 0.1])]
    a0 = _advantages(trainer, _rollout(completions), base)
    a1 = _advantages(trainer, _rollout(completions), swapped)
    # (mean and std are recomputed, so "unchanged" is up to float rounding: 1e-6)
    torch.testing.assert_close(a0[0, 4:6], a1[0, 4:6], atol=1e-6, rtol=0)  # later: untouched
    assert ((a0[0, :4] - a1[0, :4]).abs() > 0.1).all()  # own step and the one before it move
    assert ((a0[1, :3] - a1[1, :3]).abs() > 0.1).all()
    torch.testing.assert_close(a0[1, 3:6], a1[1, 3:6], atol=1e-6, rtol=0)
    # and a change of the LAST step's score reaches every earlier token of that completion
    later = [([2, 4, 6], [0.9, 0.2, 0.1]), ([3, 6], [0.4, 0.7])]  # swap the last steps
    a2 = _advantages(trainer, _rollout(completions), later)
    assert ((a0[0, :6] - a2[0, :6]).abs() > 0.1).all()


def test_masked_and_padded_positions_have_no_effect(trainer):
    completions = ["aabbcc", "dd"]
    steps = [([2, 6], [0.9, 0.2]), ([2], [0.5])]
    a = _advantages(trainer, _rollout(completions, T=6), steps)
    r = _rollout(completions, T=10)
    r.completion_ids[~r.response_mask] = 7  # garbage on padded positions
    b = _advantages(trainer, r, steps)
    torch.testing.assert_close(b[:, :6], a)
    assert (b[~r.response_mask] == 0).all() and (a[~_rollout(completions, T=6).response_mask]
                                                 == 0).all()
    # and the loss ignores whatever advantage sits on a masked position
    from posttrain.ops import policy_loss

    lp = torch.randn(2, 10)
    noisy = b.clone()
    noisy[~r.response_mask] = 123.0
    l1, _ = policy_loss(lp, lp.detach(), b, r.response_mask)
    l2, _ = policy_loss(lp, lp.detach(), noisy, r.response_mask)
    assert torch.equal(l1, l2)


def test_advantage_metric_ignores_padding(trainer):
    """`advantage/abs_mean` of [N, T] advantages averages counted tokens only: more padding
    leaves it unchanged."""
    completions = ["aabbcc", "dd"]
    steps = [([2, 6], [0.9, 0.2]), ([2], [0.5])]
    logged = []
    for T in (6, 12):
        metrics: dict[str, float] = {}
        trainer.step_scorer = FixedSteps(steps)
        trainer.compute_advantages(_rollout(completions, T=T), metrics)
        logged.append(metrics["advantage/abs_mean"])
    assert logged[0] > 0 and logged[0] == pytest.approx(logged[1])


def test_one_step_per_completion_equals_outcome_grpo(world, tmp_path):
    """Same seed, one step per completion scored like the outcome: identical training."""
    outcome = GRPOTrainer(_cfg(world, str(tmp_path / "o"), advantage="grpo",
                               process_reward_model="", max_steps=3,
                               rewards=[{"name": TOY, "weight": 1.0}]))
    process = GRPOTrainer(_cfg(world, str(tmp_path / "p"), max_steps=3,
                               process_reward_model=f"{HERE}:one_step",
                               rewards=[{"name": TOY, "weight": 0.0}]))
    r_o, _ = outcome.rollout_step()
    r_p, _ = process.rollout_step()
    assert r_o.completions == r_p.completions
    outcome.compute_advantages(r_o, {})
    process.compute_advantages(r_p, {})
    assert r_o.advantages.dim() == 1 and r_p.advantages.dim() == 2
    want = r_o.advantages[:, None] * r_o.response_mask  # [N, T]
    torch.testing.assert_close(r_p.advantages, want, atol=1e-6, rtol=0)
    assert bool((want != 0).any())  # not a vacuous comparison
    outcome.train()
    process.train()
    for (name, p), q in zip(outcome.model.named_parameters(), process.model.parameters(),
                            strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


# ---- end to end --------------------------------------------------------------------------------
def test_process_only_grpo_learns_and_logs_the_verifier(world, tmp_path):
    out = tmp_path / "run"
    # 24 steps: with per-sample seeded sampling (docs/distributed.md) 12 were borderline
    # eval_max_new_tokens: the default 64 leaves no room for a prompt in the 64-position model
    GRPOTrainer(_cfg(world, str(out), eval_data=world["data"], eval_size=8, max_steps=24,
                     eval_max_new_tokens=8)).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    key = "reward/tests.trainers.toy_rewards.sevens_mean"  # weight 0: measured, not trained on
    curve = [r[key] for r in rows if key in r]
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert last > first + 0.1 and last > 4 * first, curve
    assert all("reward/verifier_accuracy" in r and "process/steps_mean" in r
               for r in rows if key in r)
    dumped = [json.loads(x) for x in (out / "eval_after.jsonl").read_text().splitlines()]
    assert dumped and all(len(d["steps"]) == len(d["completion"]) for d in dumped if
                          d["completion"])
    assert {"text", "score"} <= set(dumped[0]["steps"][0]) and "blamed_step" in dumped[0]


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_process_config(world, tmp_path):
    with pytest.raises(ConfigError, match="process_reward_model"):
        _cfg(world, str(tmp_path), process_reward_model="")
    with pytest.raises(ConfigError, match="only used by advantage=grpo_process"):
        _cfg(world, str(tmp_path), advantage="grpo")
    with pytest.raises(ConfigError, match="process_weight"):
        _cfg(world, str(tmp_path), process_weight=-1.0)
    with pytest.raises(ConfigError, match="process_reward_model"):
        GRPOTrainer(_cfg(world, str(tmp_path), process_reward_model=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="cannot load"):
        GRPOTrainer(_cfg(world, str(tmp_path), process_reward_model=f"{HERE}:missing"))
    assert not Path(tmp_path / "metrics.jsonl").exists()


def test_shipped_process_recipes_load():
    root = Path(__file__).resolve().parents[2] / "recipes"
    proc = build_config(GRPOConfig, root / "grpo_process.yaml")
    both = build_config(GRPOConfig, root / "grpo_prm_rlvr.yaml")
    assert proc.advantage == both.advantage == "grpo_process"
    assert all(r["weight"] == 0 for r in proc.rewards) and proc.process_weight == 1.0
    assert [r["name"] for r in both.rewards][0] == "math" and both.process_weight == 0.5


def test_a_saved_prm_drives_grpo_process(world, tmp_path):
    """The real path: a PRM directory, steps cut with its saved rule, scores stored per step."""
    from posttrain.models.reward import PRM_META_KEY, build_reward_model
    from posttrain.trainers.process_steps import PRMStepScorer

    tok = build_char_tokenizer()
    prm = build_reward_model(world["model"], "prm", tok, num_labels=2)
    setattr(prm.config, PRM_META_KEY, {"separator": "\n", "split": ";"})
    save_checkpoint(prm, tok, tmp_path / "prm")
    scorer = PRMStepScorer(str(tmp_path / "prm"), device="cpu")
    (ends, scores), = scorer(["p"], ["1+1=2; 2+2=4;x"])
    assert ends == [5, 12, 14] and len(scores) == 3 and all(0 < s < 1 for s in scores)
    trainer = GRPOTrainer(_cfg(world, str(tmp_path / "run"), max_steps=1,
                               process_reward_model=str(tmp_path / "prm")))
    trainer.train()
    rollout, _ = trainer.rollout_step()
    trainer.compute_advantages(rollout, {})
    real = rollout.step_ends >= 0
    assert rollout.advantages.shape == rollout.completion_ids.shape
    assert bool(real.any(1).all()) and bool(((rollout.step_scores > 0) == real).all())
