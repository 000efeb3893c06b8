import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, PRMConfig, build_config
from posttrain.data import DataError
from posttrain.models.loading import save_checkpoint
from posttrain.models.reward import check_reward_model_dir, load_reward_model, prm_meta
from posttrain.tasks.arithmetic import step_rows, write_jsonl
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.prm import PRMTrainer, soft_step_loss


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A tiny random Llama and exact step rows with random step errors (train / held-out)."""
    root = tmp_path_factory.mktemp("prm")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2,
                             intermediate_size=128, seed=0)
    save_checkpoint(model, tok, root / "model")
    train = write_jsonl(step_rows(512, seed=0, error_rate=0.3), root / "steps.jsonl")
    held = write_jsonl(step_rows(64, seed=1, error_rate=0.3, split="heldout"),
                       root / "held.jsonl")
    return {"root": str(root), "model": str(root / "model"), "train": str(train),
            "held": str(held)}


def _cfg(world: dict[str, str], out: Path, **kw) -> PRMConfig:
    base = {"model": world["model"], "train_data": world["train"], "out_dir": str(out),
            "max_steps": 1, "batch_size": 32, "micro_batch_size": 32, "progress": False,
            "lr": 3e-3, "max_seq_len": 128, "threads": 1}
    return build_config(PRMConfig, overrides={**base, **kw})


def test_soft_step_loss_golden():
    # logits (0, 0) -> p = (1/2, 1/2): every step costs log 2 whatever q; logits (0, ln 3)
    # -> p_good = 3/4: with q = 1 the cost is -ln(3/4); q = 0.5: -(ln(3/4) + ln(1/4)) / 2
    logits = torch.tensor([[[0.0, 0.0], [0.0, 3.0], [0.0, torch.log(torch.tensor(3.0))]]])
    mask = torch.tensor([[True, False, True]])
    q = torch.tensor([[0.3, 0.9, 1.0]])
    expected = (torch.log(torch.tensor(2.0)) - torch.log(torch.tensor(0.75))) / 2
    torch.testing.assert_close(soft_step_loss(logits, q, mask), expected)
    q2 = torch.tensor([[0.3, 0.0, 0.5]])
    expected2 = (torch.log(torch.tensor(2.0))
                 - 0.5 * (torch.log(torch.tensor(0.75)) + torch.log(torch.tensor(0.25)))) / 2
    torch.testing.assert_close(soft_step_loss(logits, q2, mask), expected2)


def test_step_ends_are_the_separator_tokens(world):
    trainer = PRMTrainer(_cfg(world, Path(world["root"]) / "x"))
    tok = trainer.tokenizer
    item = trainer.tokenize([{"prompt": "1+2*3", "steps": ["1+2=3", "3*3=9"],
                              "labels": [1, -1]}], "x.jsonl")[0]
    # "<s>1+2*3\n" is 7 tokens, "1+2=3\n" 6 more (ends at 12), "3*3=9\n" 6 more (ends at 18)
    assert item["ends"] == [12, 18]
    assert [tok.decode([item["ids"][e]]) for e in item["ends"]] == ["\n", "\n"]
    assert item["labels"] == [1, -1]


def test_bad_step_rows_name_file_line_field(tmp_path):
    cases = [
        ('{"prompt": "1", "steps": ["a", "b"], "labels": [1]}', "'labels': expected one label"),
        ('{"prompt": "1", "steps": ["a"], "labels": [2]}', "'labels': item 0: expected 1, 0"),
        ('{"prompt": "1", "steps": ["a", " "], "labels": [1, 1]}', "'steps': item 1: expected a "
                                                                  "non-empty step"),
        ('{"prompt": "1", "labels": [1]}', "'steps': missing"),
    ]
    for i, (line, msg) in enumerate(cases):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text('{"prompt": "1", "steps": ["a"], "labels": [1]}\n' + line + "\n")
        cfg = build_config(PRMConfig, overrides={"model": str(tmp_path / "no-model"),
                                                 "train_data": str(bad)})
        with pytest.raises(DataError, match=rf"bad{i}\.jsonl:2: field {msg}"):
            PRMTrainer(cfg)
    soft = tmp_path / "soft.jsonl"
    soft.write_text('{"prompt": "1", "steps": ["a", "b"], "labels": [1, 1], '
                    '"soft_labels": [0.5]}\n')
    cfg = build_config(PRMConfig, overrides={"model": str(tmp_path / "no-model"),
                                             "train_data": str(soft), "soft_labels": True})
    with pytest.raises(DataError, match=r"soft\.jsonl:1: field 'soft_labels'"):
        PRMTrainer(cfg)


def test_config_errors(world, tmp_path):
    with pytest.raises(ConfigError, match="'soft_labels'"):
        _cfg(world, tmp_path, soft_labels=True, num_classes=3)
    with pytest.raises(ConfigError, match="num_classes"):
        _cfg(world, tmp_path, num_classes=4)


def test_prm_learns_bad_steps_above_chance(world, tmp_path):
    """From scratch (no arithmetic known) held-out step accuracy beats a constant guess."""
    torch.manual_seed(0)
    cfg = _cfg(world, tmp_path / "run", max_steps=60, eval_data=world["held"], seed=0,
               lr=2e-3)
    summary = PRMTrainer(cfg).train()
    after = summary["eval_after_detail"]
    rows = [json.loads(line) for line in Path(world["held"]).read_text().splitlines()]
    labels = [v for r in rows for v in r["labels"]]
    bad_rate = sum(v == -1 for v in labels) / len(labels)  # about 0.48
    majority = max(bad_rate, 1 - bad_rate)  # accuracy of a constant guess
    assert after["step_accuracy"] > majority + 0.08, after  # measured 0.67 vs 0.52
    assert after["bad_f1"] > 0.5, after  # measured 0.69
    for key in ("first_error_accuracy", "solution_auc", "bad_recall", "n"):
        assert key in after
    out = Path(cfg.out_dir)
    written = json.loads((out / "summary.json").read_text())
    assert written["eval_after"] == after["step_accuracy"] and written["bad_f1"] == after["bad_f1"]
    check_reward_model_dir(out / "final", "prm")
    model, _ = load_reward_model(out / "final", "prm")
    assert type(model).__name__ == "LlamaForTokenClassification"
    assert prm_meta(model) == {"separator": "\n", "split": "think", "num_classes": 2}


def test_shipped_recipe_loads():
    recipe = Path(__file__).parents[2] / "recipes" / "prm_arith.yaml"
    cfg = build_config(PRMConfig, recipe)
    assert cfg.num_classes == 2 and cfg.step_separator == "\n" and cfg.step_split == "think"


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_classifier_dropout_is_the_configured_one(world, dropout):
    """transformers 5 ignores a config key its class lacks: without setting the module, the
    head kept HF's default 0.1 whatever `classifier_dropout` said (and rows' step scores in
    training mode depended on the batch's random masks)."""
    from posttrain.models.reward import build_reward_model

    model = build_reward_model(world["model"], "prm", build_char_tokenizer(), num_labels=2,
                         dropout=dropout)
    drops = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(p == dropout for p in drops)
