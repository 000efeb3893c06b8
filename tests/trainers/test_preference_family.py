"""KTO, SimPO and online DPO trainers: data, reference handling, refusals, learning."""


import pytest
import torch

from posttrain.config import ConfigError
from posttrain.data import DataError
from posttrain.data.pairs import tokenize_unpaired
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import write_jsonl
from posttrain.tasks.preferences import offline_pairs, unpaired_rows
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.kto import KTOTrainer
from posttrain.trainers.online_dpo import OnlineDPOTrainer


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefs")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    pairs = offline_pairs(8, seed=0, kind="sign")
    prompts = [{"prompt": p["prompt"], "answer": p["answer"]} for p in pairs]
    return {"model": str(root / "model"),
            "pairs": str(write_jsonl(pairs, root / "pairs.jsonl")),
            "unpaired": str(write_jsonl(unpaired_rows(pairs), root / "unpaired.jsonl")),
            "prompts": str(write_jsonl(prompts, root / "prompts.jsonl"))}


COMMON = {"progress": False, "report_to": [], "threads": 1, "max_steps": 1, "lr": 1e-3}


def test_unpaired_rows_get_another_rows_completion_as_the_mismatched_one():
    tok = build_char_tokenizer()
    rows = [{"prompt": f"{i}+1", "completion": f"c{i}", "label": i % 2 == 0} for i in range(5)]
    t = tokenize_unpaired(tok, rows, 64, "x.jsonl")
    own = [tok.decode(t.chosen_ids[i][t.chosen_mask[i]].tolist()[:-1]) for i in range(5)]
    other = [tok.decode(t.rejected_ids[i][t.rejected_mask[i]].tolist()[:-1]) for i in range(5)]
    assert own == [f"c{i}" for i in range(5)]
    assert sorted(other) == sorted(own) and all(o != w for o, w in zip(other, own, strict=True))
    with pytest.raises(DataError, match=r"x.jsonl:1: field 'completion'.*max_seq_len=6"):
        tokenize_unpaired(tok, rows, 6, "x.jsonl")


def test_kto_rows_are_checked_before_the_model_loads(world, tmp_path):
    bad = write_jsonl([{"prompt": "1+1", "completion": "2", "label": "yes"}], tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"b.jsonl:1: field 'label'"):
        KTOTrainer(model=str(tmp_path / "missing"), train_data=str(bad),
                   out_dir=str(tmp_path / "o"), **COMMON)
    with pytest.raises(ConfigError, match="'batch_size'=1"):
        KTOTrainer(model=world["model"], train_data=world["unpaired"], batch_size=1,
                   out_dir=str(tmp_path / "o"), **COMMON)


def test_kto_learns_desirable_over_undesirable(world, tmp_path):
    t = KTOTrainer(model=world["model"], train_data=world["unpaired"], batch_size=16,
                   micro_batch_size=8, max_seq_len=128, rewards=[], out_dir=str(tmp_path / "k"),
                   **{**COMMON, "max_steps": 15, "lr": 3e-3})
    first = t.step(1)["rewards/accuracy"]
    for s in range(2, 16):
        last = t.step(s)
    assert first == 0.0 and last["rewards/accuracy"] > 0.8, last
    assert last["kto/reference_point"] >= 0.0 and "refcache" in t.ref_cache["train"]


@pytest.mark.parametrize("precompute", [True, False])
def test_simpo_loads_and_precomputes_no_reference(world, tmp_path, precompute):
    t = DPOTrainer(model=world["model"], train_data=world["pairs"], eval_pref_data=world["pairs"],
                   loss_type="simpo", beta=2.0, simpo_gamma=0.5, precompute_ref=precompute,
                   batch_size=8, max_seq_len=128, rewards=[], out_dir=str(tmp_path / "s"),
                   **COMMON)
    assert t.ref.model is None and not t.ref_tables and not t.ref_cache
    metrics = t.step(1)
    assert "rewards/ref_accuracy" not in metrics and metrics["loss/dpo"] > 0


@pytest.mark.parametrize("key", ["simpo_gamma", "gamma"])
def test_simpo_gamma_is_refused_for_a_loss_without_a_margin(world, tmp_path, capsys, key):
    """SimPO's margin is `simpo_gamma` (PPO's `gamma` is the discount); the old `gamma` of
    `posttrain dpo` is read as `simpo_gamma`, said in one line."""
    with pytest.raises(ConfigError, match="config key 'simpo_gamma'=0.5: loss_type=sigmoid"):
        DPOTrainer(model=str(tmp_path / "missing"), train_data=world["pairs"], out_dir=str(
            tmp_path / "o"), **{key: 0.5}, **COMMON)
    said = [x for x in capsys.readouterr().err.splitlines() if "is now" in x]
    assert said == ([] if key == "simpo_gamma" else [
        "posttrain: config key 'gamma' is now 'simpo_gamma' in posttrain dpo: read as "
        "'simpo_gamma'"])


@pytest.mark.parametrize("keys, message", [
    ({"group_size": 1}, "'group_size'=1"),
    ({"clip_eps_low": 0.3}, "'clip_eps_low': not used by online DPO"),
    ({"rollout_is": "token_mask"}, "'rollout_is'='token_mask'"),
])
def test_online_dpo_refuses_what_it_does_not_use(world, tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        OnlineDPOTrainer(model=str(tmp_path / "missing"), train_data=world["prompts"],
                         out_dir=str(tmp_path / "o"), **COMMON, **keys)


def test_online_dpo_trains_on_best_vs_worst_with_a_frozen_reference(world, tmp_path):
    t = OnlineDPOTrainer(model=world["model"], train_data=world["prompts"], group_size=4,
                         prompts_per_step=4, max_new_tokens=10, micro_batch_size=4,
                         rewards=["tests.trainers.toy_rewards:digits"],
                         out_dir=str(tmp_path / "d"), **COMMON)
    ref = {k: v.clone() for k, v in t.ref.model.state_dict().items()}
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    metrics = t.step(1)
    assert metrics["pairs/trained"] > 0 and metrics["pairs/score_margin"] > 0
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert all(torch.equal(ref[k], v) for k, v in t.ref.model.state_dict().items())


def test_online_dpo_says_when_a_step_has_no_pair(world, tmp_path, capsys):
    t = OnlineDPOTrainer(model=world["model"], train_data=world["prompts"], group_size=2,
                         prompts_per_step=2, max_new_tokens=4, micro_batch_size=4,
                         rewards=["tests.trainers.toy_rewards:always_one"],
                         out_dir=str(tmp_path / "c"), **COMMON)
    metrics = t.step(1)
    assert metrics["pairs/trained"] == 0 and "train/grad_norm" not in metrics
    assert "step 1: every group's scores are tied" in capsys.readouterr().err
