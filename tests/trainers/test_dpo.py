import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, DPOConfig, build_config
from posttrain.data import DataError
from posttrain.models import load_model_and_tokenizer
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import write_jsonl
from posttrain.tasks.preferences import offline_pairs
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.dpo import DPOTrainer, pair_logprobs, tokenize_pairs


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A tiny random Llama + char tokenizer on disk and 16 sign-flaw preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    pairs = write_jsonl(offline_pairs(16, seed=0, kind="flaw"), root / "data" / "pairs.jsonl")
    return {"root": str(root), "model": str(root / "model"), "pairs": str(pairs)}


def _cfg(world: dict[str, str], out: Path, **kw) -> DPOConfig:
    base = {"model": world["model"], "train_data": world["pairs"], "out_dir": str(out),
            "max_steps": 1, "batch_size": 8, "micro_batch_size": 16, "progress": False,
            "lr": 1e-3, "max_seq_len": 128}
    return build_config(DPOConfig, overrides={**base, **kw})


def _copy_pairs(world: dict[str, str], dst: Path, edit: bool = False) -> str:
    rows = [json.loads(line) for line in Path(world["pairs"]).read_text().splitlines()]
    if edit:
        rows[3]["rejected"] = rows[3]["rejected"].replace("</think>", ";</think>")
    return str(write_jsonl(rows, dst))


def test_tokenize_pairs_layout():
    tok = build_char_tokenizer()
    rows = [{"prompt": "1-2", "chosen": "-1", "rejected": "1"},
            {"prompt": "10+20", "chosen": "30", "rejected": "31"}]
    pairs = tokenize_pairs(tok, rows, max_len=64, source="x.jsonl")
    # rendered prompts "<s>1-2\n" (5 tokens) and "<s>10+20\n" (7 tokens): left padded to 7
    assert pairs.prompt_mask.sum(1).tolist() == [5, 7]
    assert pairs.prompt_mask[0].tolist() == [False, False] + [True] * 5
    # completions + EOS, right padded to the longest (2 chars + EOS = 3)
    assert pairs.chosen_mask.sum(1).tolist() == [3, 3]
    assert pairs.rejected_mask.sum(1).tolist() == [2, 3]
    assert pairs.rejected_ids[0, 1].item() == tok.eos_token_id
    assert tok.decode(pairs.chosen_ids[1, :2].tolist()) == "30"


def test_bad_pairs_name_the_row_and_field():
    tok = build_char_tokenizer()
    same = [{"prompt": "1+1", "chosen": "a", "rejected": "b"},
            {"prompt": "1+1", "chosen": "2", "rejected": "2"}]
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'rejected': identical"):
        tokenize_pairs(tok, same, max_len=64, source="p.jsonl")
    long = [{"prompt": "1+1", "chosen": "2", "rejected": "x" * 80}]
    with pytest.raises(DataError, match=r"p\.jsonl:1: field 'rejected'.*over max_seq_len=64"):
        tokenize_pairs(tok, long, max_len=64, source="p.jsonl")


def test_malformed_data_fails_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "chosen": "2", "rejected": "3"}\n'
                   '{"prompt": "1+1", "chosen": "2"}\n')
    cfg = build_config(DPOConfig, overrides={"model": str(tmp_path / "no-model"),
                                             "train_data": str(bad), "progress": False})
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'rejected': missing"):
        DPOTrainer(cfg)
    cfg.train_data, cfg.eval_pref_data = str(tmp_path / "x.jsonl"), str(bad)
    write_jsonl([{"prompt": "1", "chosen": "2", "rejected": "3"}], cfg.train_data)
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):  # held-out pairs too
        DPOTrainer(cfg)


def test_config_errors(world, tmp_path):
    for key, value in (("beta", 0.0), ("micro_batch_size", 0), ("label_smoothing", 0.5)):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            DPOTrainer(_cfg(world, tmp_path, **{key: value}))


@pytest.mark.slow
@pytest.mark.parametrize("bf16_compute", [False, True])
def test_dpo_learns_the_train_pairs(world, tmp_path, bf16_compute):
    """Implicit-reward accuracy on the train pairs goes from 0 (policy == reference) to > 0.9,
    in fp32 and with the bf16 learner copy (the reference table then comes from it too)."""
    torch.manual_seed(0)
    cfg = _cfg(world, tmp_path / "run", max_steps=25, batch_size=16, micro_batch_size=32,
               eval_pref_data=world["pairs"], beta=0.5, lr=3e-3, seed=0,
               bf16_compute=bf16_compute)
    summary = DPOTrainer(cfg).train()
    assert summary["implicit_acc_before"] == 0.0  # all margins are exactly 0 at the start
    assert summary["implicit_acc_after"] > 0.9
    hist = summary["history"]
    assert hist[-1]["loss/dpo"] < hist[0]["loss/dpo"] - 0.2
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                "logps/chosen", "logps/rejected"):
        assert key in hist[0]
    out = Path(cfg.out_dir)
    written = json.loads((out / "summary.json").read_text())
    for key in ("eval_before", "eval_after", "implicit_acc_before", "implicit_acc_after",
                "seconds", "peak_rss_mb"):
        assert key in written
    assert (out / "metrics.jsonl").is_file() and any((out / "tb").iterdir())
    assert (out / "final" / "model.safetensors").is_file()
    load_model_and_tokenizer(out / "final")  # from_pretrained-loadable


def test_reference_cache_hit_miss_and_invalidation(world, tmp_path):
    data = _copy_pairs(world, tmp_path / "d" / "pairs.jsonl")
    shared = str(tmp_path / "cache")
    first = DPOTrainer(_cfg(world, tmp_path / "a", train_data=data, ref_cache_dir=shared))
    first.train()
    assert first.ref_cache["train"].startswith("miss ")
    path = Path(first.ref_cache["train"].split(" ", 1)[1])
    assert path.parent == Path(shared) and path.is_file()
    # the cached table equals a fresh forward pass of the reference (the starting model)
    base, _ = load_model_and_tokenizer(world["model"])
    fresh = pair_logprobs(base.eval(), first.pairs)
    for k, v in fresh.items():
        torch.testing.assert_close(first.ref_tables["train"][k], v.detach())
    second = DPOTrainer(_cfg(world, tmp_path / "b", train_data=data, ref_cache_dir=shared))
    second.train()
    assert second.ref_cache["train"] == f"hit {path}"
    # editing one pair changes the key: a miss, written to a new file
    _copy_pairs(world, Path(data), edit=True)
    third = DPOTrainer(_cfg(world, tmp_path / "c", train_data=data, ref_cache_dir=shared))
    third.train()
    status = third.ref_cache["train"]
    assert status.startswith("miss ") and str(path) not in status


def test_reference_cache_defaults_to_out_dir_not_the_data_folder(world, tmp_path):
    data_dir = tmp_path / "ro"
    data = _copy_pairs(world, data_dir / "pairs.jsonl")
    data_dir.chmod(0o555)  # a read-only data folder (root ignores the mode: checked below too)
    try:
        trainer = DPOTrainer(_cfg(world, tmp_path / "out", train_data=data))
    finally:
        data_dir.chmod(0o755)
    path = Path(trainer.ref_cache["train"].split(" ", 1)[1])
    assert path.parent == tmp_path / "out" / "refcache" and path.is_file()
    assert sorted(p.name for p in data_dir.iterdir()) == ["pairs.jsonl"]


def test_reference_cache_keyed_by_the_weights_of_an_in_memory_model(world, tmp_path):
    """Two different in-memory policies with the same name_or_path (a model fine-tuned in
    memory keeps its base's) must not share a reference table."""
    base, tok = load_model_and_tokenizer(world["model"])
    other = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, seed=1)
    other.name_or_path = other.config.name_or_path = base.name_or_path
    assert other.name_or_path == base.name_or_path
    keys = {"out_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 8,
            "micro_batch_size": 16, "progress": False, "max_seq_len": 128,
            "ref_cache_dir": str(tmp_path / "cache"), "rewards": []}
    first = DPOTrainer(model=base, tokenizer=tok, train_data=world["pairs"], **keys)
    second = DPOTrainer(model=other, tokenizer=tok, train_data=world["pairs"], **keys)
    assert first.ref_cache["train"].startswith("miss ")
    assert second.ref_cache["train"].startswith("miss ")
    assert first.ref_cache["train"] != second.ref_cache["train"]
    fresh = pair_logprobs(other.eval(), second.pairs)
    for k, v in fresh.items():
        torch.testing.assert_close(second.ref_tables["train"][k], v.detach())
    again = DPOTrainer(model=other, tokenizer=tok, train_data=world["pairs"], **keys)
    assert again.ref_cache["train"] == "hit " + second.ref_cache["train"].split(" ", 1)[1]


def test_precomputed_and_on_the_fly_reference_agree(world, tmp_path):
    """Same seed, same batch: the first step's metrics match with either reference source."""
    data = _copy_pairs(world, tmp_path / "pairs.jsonl")
    runs = [DPOTrainer(_cfg(world, tmp_path / str(p), train_data=data, precompute_ref=p,
                            max_steps=2, seed=3)).train() for p in (True, False)]
    for step in range(2):
        a, b = runs[0]["history"][step], runs[1]["history"][step]
        for k in ("loss/dpo", "rewards/margin", "logps/chosen"):
            assert a[k] == pytest.approx(b[k], abs=1e-5)


def test_gradient_accumulation_matches_one_big_batch(world, tmp_path):
    params = []
    for micro in (32, 8):
        torch.manual_seed(0)
        trainer = DPOTrainer(_cfg(world, tmp_path / str(micro), batch_size=16,
                                  micro_batch_size=micro, max_grad_norm=0.0, seed=1))
        trainer.ref_tables["train"] = trainer.reference_table(trainer.pairs, trainer.cfg.train_data,
                                                              "train")
        trainer.model.train()
        trainer.update(trainer.next_indices(16))
        params.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_update(world, tmp_path):
    """Checkpointed layers replay the shared-prompt forward (each pair's prompt runs once) in
    the backward: the same update as without checkpointing."""
    params = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        trainer = DPOTrainer(_cfg(world, tmp_path / str(ckpt), batch_size=16,
                                  micro_batch_size=16, seed=1, precompute_ref=False,
                                  gradient_checkpointing=ckpt))
        assert trainer.forward.share_prefix
        trainer.model.train()
        trainer.update(trainer.next_indices(16))
        params.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    moved = (params[0] - torch.cat([p.detach().flatten() for p in DPOTrainer(
        _cfg(world, tmp_path / "init")).model.parameters()])).abs().max()
    assert moved > 1e-4
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)


def test_lora_reference_is_the_base_model(world, tmp_path):
    cfg = _cfg(world, tmp_path / "lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"],
               precompute_ref=False, max_steps=3, lr=5e-2)
    trainer = DPOTrainer(cfg)
    for _ in range(3):
        trainer.update(trainer.next_indices(8))
    base, _ = load_model_and_tokenizer(world["model"])
    with torch.no_grad():
        expected = pair_logprobs(base.eval(), trainer.pairs)
        with trainer.reference() as ref:
            got = pair_logprobs(ref, trainer.pairs)
        trainer.model.eval()
        policy = pair_logprobs(trainer.model, trainer.pairs)
    torch.testing.assert_close(got["chosen_sum"], expected["chosen_sum"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["rejected_mean"], expected["rejected_mean"], atol=1e-5,
                               rtol=1e-5)
    assert not torch.allclose(policy["chosen_sum"], expected["chosen_sum"], atol=1e-3)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_ipo_uses_token_averaged_reference(world, tmp_path):
    trainer = DPOTrainer(_cfg(world, tmp_path / "ipo", loss_type="ipo"))
    table = trainer.reference_table(trainer.pairs, trainer.cfg.train_data, "train")
    trainer.ref_tables["train"] = table
    idx = torch.tensor([0, 5])
    chosen, rejected = trainer.reference_logps(trainer.pairs, idx, "train")
    torch.testing.assert_close(chosen, table["chosen_mean"][idx])
    torch.testing.assert_close(rejected, table["rejected_mean"][idx])
    lengths = trainer.pairs.chosen_mask.sum(1)[idx].float()
    torch.testing.assert_close(table["chosen_sum"][idx] / lengths, chosen)


def test_rpo_adds_the_token_mean_nll_of_chosen(world, tmp_path):
    trainer = DPOTrainer(_cfg(world, tmp_path / "rpo", rpo_alpha=0.5, beta=0.2))
    trainer.ref_tables["train"] = trainer.reference_table(trainer.pairs, trainer.cfg.train_data,
                                                          "train")
    idx = torch.tensor([1, 2, 7])
    with torch.no_grad():
        loss, metrics = trainer.pair_loss(trainer.pairs, idx, "train")
        policy = pair_logprobs(trainer.model, trainer.pairs.select(idx))
    # policy == reference before any update: h = 0, DPO part = -log sigmoid(0) = log 2 per pair
    nll = -policy["chosen_mean"]  # mean NLL per chosen token, [3]
    torch.testing.assert_close(loss, torch.log(torch.tensor(2.0)) + 0.5 * nll)
    torch.testing.assert_close(metrics["loss/nll_chosen"], nll.mean())
    with pytest.raises(ConfigError, match="'rpo_alpha'"):
        DPOTrainer(_cfg(world, tmp_path / "bad", rpo_alpha=-1.0))
