import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, RMConfig, build_config
from posttrain.data import DataError
from posttrain.models.loading import save_checkpoint
from posttrain.models.reward import (
    RewardModelError,
    check_reward_model_dir,
    load_reward_model,
    position_scores,
    sequence_scores,
)
from posttrain.tasks.arithmetic import write_jsonl
from posttrain.tasks.preferences import offline_pairs
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.reward_model import RewardModelTrainer, completion_starts, encode


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A tiny random Llama + char tokenizer and sign-flaw preference pairs (train / held-out)."""
    root = tmp_path_factory.mktemp("rm")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    train = write_jsonl(offline_pairs(64, seed=0, kind="flaw"), root / "pairs.jsonl")
    held = write_jsonl(offline_pairs(32, seed=0, kind="flaw", split="heldout"),
                       root / "held.jsonl")
    return {"root": str(root), "model": str(root / "model"), "train": str(train),
            "held": str(held)}


def _cfg(world: dict[str, str], out: Path, **kw) -> RMConfig:
    base = {"model": world["model"], "train_data": world["train"], "out_dir": str(out),
            "max_steps": 1, "batch_size": 16, "micro_batch_size": 32, "progress": False,
            "lr": 3e-3, "max_seq_len": 128, "threads": 1}
    return build_config(RMConfig, overrides={**base, **kw})


def test_score_is_read_at_the_last_real_token(world):
    model = RewardModelTrainer(_cfg(world, Path(world["root"]) / "x")).model
    model.eval()
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        batched = sequence_scores(model, ids, mask)
        alone = sequence_scores(model, ids[1:, :2], mask[1:, :2])
        left = sequence_scores(model, torch.tensor([[0, 0, 5, 6]]), torch.tensor([[0, 0, 1, 1]]))
    torch.testing.assert_close(batched[1:], alone)  # padding changes nothing
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)  # either padding side
    with torch.no_grad():  # the token-level objective's scores: the same head at every position
        every = position_scores(model, ids, mask)  # [2, 4]
    torch.testing.assert_close(every[:, [3, 1]].diagonal(), batched, atol=1e-5, rtol=1e-5)


def test_completion_starts(world):
    from posttrain.models.loading import load_tokenizer

    tok = load_tokenizer(world["model"])
    rows = [{"prompt": "1+2", "completion": "<answer>3</answer>"},
            {"prompt": "10-4", "completion": "x"}]
    seqs = encode(tok, rows, "completion", 128, "rows")
    starts = completion_starts(tok, rows, seqs)
    for seq, start, row in zip(seqs, starts, rows, strict=True):
        assert tok.decode(seq[start:], skip_special_tokens=True) == row["completion"]


def test_bad_rows_fail_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "chosen": "2", "rejected": "3"}\n'
                   '{"prompt": "1+1", "chosen": "2"}\n')
    cfg = build_config(RMConfig, overrides={"model": str(tmp_path / "no-model"),
                                            "train_data": str(bad)})
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'rejected': missing"):
        RewardModelTrainer(cfg)
    outcomes = tmp_path / "o.jsonl"
    outcomes.write_text('{"prompt": "1+1", "completion": "2", "label": 1}\n'
                        '{"prompt": "1+1", "completion": "3", "label": 0.5}\n')
    cfg = build_config(RMConfig, overrides={"model": str(tmp_path / "no-model"),
                                            "train_data": str(outcomes), "objective": "binary"})
    with pytest.raises(DataError, match=r"o\.jsonl:2: field 'label': expected 1 / 0"):
        RewardModelTrainer(cfg)
    margin = tmp_path / "m.jsonl"
    margin.write_text('{"prompt": "1", "chosen": "2", "rejected": "3", "margin": "big"}\n')
    cfg = build_config(RMConfig, overrides={"model": str(tmp_path / "no-model"),
                                            "train_data": str(margin)})
    with pytest.raises(DataError, match=r"m\.jsonl:1: field 'margin'"):
        RewardModelTrainer(cfg)


def test_config_errors(world, tmp_path):
    for key, value in (("micro_batch_size", 1), ("lora_r", 4)):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            _cfg(world, tmp_path, **{key: value})
    with pytest.raises(ConfigError, match="objective"):
        _cfg(world, tmp_path, objective="hinge")
    with pytest.raises(ConfigError, match="'token_level': needs objective=binary"):
        _cfg(world, tmp_path, token_level=True)


def test_orm_learns_pairs_above_chance(world, tmp_path):
    """Held-out pair accuracy rises from chance to > 0.8 in 40 tiny steps."""
    torch.manual_seed(0)
    cfg = _cfg(world, tmp_path / "run", max_steps=40, eval_data=world["held"], seed=0)
    summary = RewardModelTrainer(cfg).train()
    after = summary["eval_after_detail"]
    assert after["accuracy"] > 0.8 and after["auc"] > 0.8
    assert after["accuracy"] > summary["eval_before"] + 0.2
    assert after["margin"] > 0
    for key in ("chosen_mean", "chosen_std", "rejected_mean", "rejected_std", "loss"):
        assert key in after
    out = Path(cfg.out_dir)
    written = json.loads((out / "summary.json").read_text())
    assert written["eval_after"] == after["accuracy"]
    check_reward_model_dir(out / "final", "orm")
    model, _ = load_reward_model(out / "final", "orm")  # from_pretrained-loadable
    assert type(model).__name__ == "LlamaForSequenceClassification"
    with pytest.raises(RewardModelError, match="not a process reward model"):
        check_reward_model_dir(out / "final", "prm")
    with pytest.raises(RewardModelError, match="LlamaForCausalLM"):
        check_reward_model_dir(world["model"], "orm")


def test_binary_objective_learns(world, tmp_path):
    data = _outcome_rows(world, tmp_path)
    torch.manual_seed(0)
    cfg = _cfg(world, tmp_path / "bin", objective="binary", train_data=data,
               eval_data=data, max_steps=40)
    summary = RewardModelTrainer(cfg).train()
    after = summary["eval_after_detail"]
    assert after["auc"] > 0.8 and after["accuracy"] > 0.7
    assert after["positive_mean"] > after["negative_mean"]


def _outcome_rows(world: dict[str, str], tmp_path: Path) -> str:
    rows = []
    for line in Path(world["train"]).read_text().splitlines():
        r = json.loads(line)
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], "label": 1},
                 {"prompt": r["prompt"], "completion": r["rejected"], "label": 0}]
    return str(write_jsonl(rows, tmp_path / "outcomes.jsonl"))


def test_token_level_objective_learns(world, tmp_path):
    """token_level: the label at every completion token; the last-token score ranks."""
    data = _outcome_rows(world, tmp_path)
    torch.manual_seed(0)
    cfg = _cfg(world, tmp_path / "tok", objective="binary", token_level=True, train_data=data,
               eval_data=data, max_steps=40)
    summary = RewardModelTrainer(cfg).train()
    after = summary["eval_after_detail"]
    assert after["auc"] > 0.8 and after["accuracy"] > 0.7
    assert after["positive_mean"] > after["negative_mean"]
    check_reward_model_dir(Path(cfg.out_dir) / "final", "orm")


def test_cli_and_python_api(world, tmp_path, capsys):
    from posttrain.cli import main
    from posttrain.models import load_model_and_tokenizer

    out = tmp_path / "cli"
    code = main(["rm", f"model={world['model']}", f"train_data={world['train']}",
                 f"out_dir={out}", "max_steps=2", "batch_size=4", "progress=false",
                 "max_seq_len=128"])
    assert code == 0 and (out / "final" / "config.json").is_file()
    assert main(["rm", f"model={world['model']}", f"train_data={tmp_path / 'none.jsonl'}"]) == 2
    assert "file not found" in capsys.readouterr().err
    # Python API: a causal LM object and in-memory rows
    lm, tok = load_model_and_tokenizer(world["model"])
    rows = [json.loads(line) for line in Path(world["train"]).read_text().splitlines()]
    trainer = RewardModelTrainer(model=lm, tokenizer=tok, train_data=rows[:8],
                                 out_dir=str(tmp_path / "api"), max_steps=1, batch_size=4,
                                 progress=False, max_seq_len=128)
    assert type(trainer.model).__name__ == "LlamaForSequenceClassification"
    trainer.train()


def test_shipped_recipe_loads():
    recipe = Path(__file__).parents[2] / "recipes" / "rm_arith.yaml"
    cfg = build_config(RMConfig, recipe)
    assert cfg.objective == "bradley_terry" and cfg.train_data.endswith("pairs_train.jsonl")
