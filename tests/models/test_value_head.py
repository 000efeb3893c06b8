"""The PPO critic: alignment with the policy's positions, masking, the three inits, shared LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForSequenceClassification

from posttrain.models import apply_lora
from posttrain.models.loading import ModelLoadError, save_checkpoint
from posttrain.models.value_head import (
    ValueModel,
    critic_from_policy,
    load_critic,
    shared_lora_critic,
)
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, seed=0):
    return build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, max_position_embeddings=64, seed=seed)


def batch() -> tuple[torch.Tensor, ...]:
    """2 sequences: prompts of 3 and 2 tokens (left padded), completions of 4 and 2 tokens."""
    prompt_ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    prompt_mask = torch.tensor([[True, True, True], [False, True, True]])
    completion_ids = torch.tensor([[10, 11, 12, 2], [13, 2, 0, 0]])
    response_mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    return prompt_ids, prompt_mask, completion_ids, response_mask


def random_head(critic: ValueModel, seed: int = 1) -> ValueModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape, generator=g))
        critic.head.bias.fill_(0.5)
    return critic


def test_values_read_the_state_before_each_completion_token(tok):
    """values[:, t] = head(hidden at the position predicting token t), computed by hand for
    row 0 (no padding): positions 2..5 of the 7-token sequence prompt+completion."""
    policy = tiny(tok)
    critic = random_head(critic_from_policy(policy))
    p_ids, p_mask, c_ids, r_mask = batch()
    values = critic(p_ids, p_mask, c_ids, r_mask)
    assert values.shape == (2, 4)
    ids = torch.cat([p_ids[:1], c_ids[:1]], 1)  # [1, 7]
    hidden = critic.body(input_ids=ids).last_hidden_state  # [1, 7, H]
    expected = critic.head(hidden[0, 2:6]).squeeze(-1)  # predicts completion tokens 0..3
    assert torch.allclose(values[0], expected, atol=1e-5)
    assert torch.equal(values[1, 2:], torch.zeros(2))  # masked slots are 0


def test_values_do_not_depend_on_padding_or_batch_mates(tok):
    critic = random_head(critic_from_policy(tiny(tok)))
    p_ids, p_mask, c_ids, r_mask = batch()
    both = critic(p_ids, p_mask, c_ids, r_mask)
    alone = critic(p_ids[1:, 1:], p_mask[1:, 1:], c_ids[1:, :2], r_mask[1:, :2])
    assert torch.allclose(both[1, :2], alone[0], atol=1e-5)


def test_zero_head_starts_at_zero_and_body_is_a_copy(tok):
    policy = tiny(tok)
    critic = critic_from_policy(policy)
    values = critic(*batch())
    assert torch.equal(values, torch.zeros_like(values))
    with torch.no_grad():
        next(critic.body.parameters()).add_(1.0)
    assert not torch.equal(next(critic.body.parameters()),
                           next(policy.get_decoder().parameters()))


def test_save_and_load_round_trip(tok, tmp_path):
    critic = random_head(critic_from_policy(tiny(tok)))
    critic.save(tmp_path / "critic")
    again = load_critic(tmp_path / "critic")
    assert torch.allclose(again(*batch()), critic(*batch()), atol=1e-6)


def test_from_a_causal_lm_dir_loads_its_body_and_a_zero_head(tok, tmp_path):
    policy = tiny(tok, seed=3)
    save_checkpoint(policy, tok, tmp_path / "lm")
    critic = load_critic(tmp_path / "lm")
    assert torch.equal(critic.head.weight, torch.zeros_like(critic.head.weight))
    for a, b in zip(critic.body.parameters(), policy.get_decoder().parameters(), strict=True):
        assert torch.equal(a, b)


def test_from_a_reward_model_dir_keeps_its_scores(tok, tmp_path):
    """A 1-label sequence classifier: the critic's value at the last real token's successor
    state is the reward model's score for the whole sequence."""
    config = tiny(tok).config
    config.num_labels = 1
    rm = LlamaForSequenceClassification(config).eval()
    save_checkpoint(rm, tok, tmp_path / "rm")
    critic = load_critic(tmp_path / "rm")
    p_ids, p_mask, c_ids, r_mask = batch()
    ids = torch.cat([p_ids[:1], c_ids[:1, :3]], 1)  # prompt + first 3 completion tokens
    score = rm(input_ids=ids).logits[0, 0]  # RM scores the last token of `ids`
    values = critic(p_ids[:1], p_mask[:1], c_ids[:1], r_mask[:1])  # [1, 4]
    assert torch.allclose(values[0, 3], score, atol=1e-5)  # state before token 3 = ids


def test_bad_critic_dirs_are_clear_errors(tok, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_critic(tmp_path)
    config = tiny(tok).config
    config.num_labels = 3
    save_checkpoint(LlamaForSequenceClassification(config), tok, tmp_path / "cls3")
    with pytest.raises(ModelLoadError, match="num_labels=1"):
        load_critic(tmp_path / "cls3")


def test_shared_lora_critic_has_its_own_adapter(tok):
    """Two adapters on one frozen base: the critic's gradients reach only the critic adapter
    and the head; the policy's logits are unchanged by the critic adapter's weights."""
    policy = apply_lora(tiny(tok), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    critic = random_head(shared_lora_critic(policy, r=4, alpha=8,
                                            target_modules=["q_proj", "v_proj"]))
    own = critic.trainable_parameters()
    assert own and all("critic" in n for n, p in policy.named_parameters()
                       if any(p is q for q in own))
    logits_before = policy(input_ids=torch.tensor([[5, 6, 7]])).logits
    with torch.no_grad():  # move the critic adapter: the policy must not notice
        for n, p in policy.named_parameters():
            if "lora_B.critic" in n:
                p.add_(0.5)
    assert torch.equal(policy(input_ids=torch.tensor([[5, 6, 7]])).logits, logits_before)
    critic(*batch()).sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if "lora_" in n}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "critic" in n)
    assert all(g is None for n, g in grads.items() if "default" in n)
    assert policy.active_adapter == "default"
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
