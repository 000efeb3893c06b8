"""Run under torchrun by tests/engine/test_distributed.py: FSDP2 start-up and mixed precision.

``python -m torch.distributed.run --nproc_per_node 2 fsdp_startup_check.py MODEL PROMPTS OUT``:
builds a GRPO trainer with ``fsdp: true`` and a KL reference, then checks on every rank that
only rank 0 read the weights file (the others built the model on ``meta``), that the sharded
policy and the sharded reference hold exactly the saved weights and buffers, and that their
forward passes equal a plainly loaded model's; then that `Dist.wrap(bf16=True)` all-gathers the
decoder layers in bf16 and the root group (embeddings, norm, head) in fp32, with fp32 sharded
gradients. Prints ``startup ok <rank>`` on success.
"""

from __future__ import annotations

import copy
import sys

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from posttrain.config import GRPOConfig, build_config
from posttrain.engine.distributed import close_process_group
from posttrain.engine.fsdp import full_weights
from posttrain.trainers.grpo import GRPOTrainer

READS = [0]
_orig = AutoModelForCausalLM.from_pretrained.__func__


def _counting(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
    READS[0] += 1
    return _orig(cls, *args, **kwargs)


def main(model_dir: str, prompts: str, out: str) -> None:
    AutoModelForCausalLM.from_pretrained = classmethod(_counting)  # type: ignore[method-assign]
    keys = {"model": model_dir, "train_data": prompts, "out_dir": out, "fsdp": True,
            "kl_coef": 0.04, "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4,
            "max_steps": 1, "threads": 1, "report_to": [], "progress": False,
            "rewards": [{"name": "tests.trainers.toy_rewards:digits", "weight": 1.0}],
            "device": "cpu", "share_prompt_prefix": False}
    trainer = GRPOTrainer(build_config(GRPOConfig, overrides=keys))
    rank = trainer.dist.rank
    assert READS[0] == (1 if rank == 0 else 0), (rank, READS[0])  # rank 1: meta, no read
    plain = _orig(AutoModelForCausalLM, model_dir).eval()
    saved = load_file(f"{model_dir}/model.safetensors")
    ref = trainer.ref.model
    for name, model in (("policy", trainer.model), ("reference", ref)):
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params), name
        local = sum(p.to_local().numel() for p in params)
        assert local < sum(p.numel() for p in params), name  # a shard, not a replica
        weights = full_weights(model)  # rank 0 only (cpu_offload)
        if rank == 0:
            for k, v in saved.items():
                assert torch.equal(weights[k], v), (name, k)
            assert set(weights) == set(plain.state_dict()), name
        for (k, b), (k2, b2) in zip(model.named_buffers(), plain.named_buffers(), strict=True):
            assert k == k2 and torch.equal(b, b2), (name, k)
    assert ref.training is False and not any(p.requires_grad for p in ref.parameters())
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        with trainer.dist.gathered(ref):
            assert torch.equal(ref(input_ids=ids).logits, want)
        trainer.model.eval()
        assert torch.equal(trainer.model(input_ids=ids).logits, want)
    check_mixed_precision(trainer, plain, ids)
    print(f"startup ok {rank}", flush=True)


def check_mixed_precision(trainer: GRPOTrainer, plain: torch.nn.Module,
                          ids: torch.Tensor) -> None:
    """bf16 decoder layers with fp32 reductions, fp32 root group, fp32 master shards."""
    mp = trainer.dist.wrap(copy.deepcopy(plain).train(), True, torch.device("cpu"), bf16=True)
    with trainer.dist.gathered(mp):
        layer = mp.model.layers[0]
        assert layer.mlp.up_proj.weight.dtype == torch.bfloat16
        assert mp.lm_head.weight.dtype == torch.float32
        assert mp.model.embed_tokens.weight.dtype == torch.float32
    out = mp(input_ids=ids).logits
    assert out.dtype == torch.float32
    want = plain(input_ids=ids).logits
    err = float((out - want).abs().max())
    assert 0 < err < 0.05, err  # bf16 rounding in the layers, not fp32 (0) nor garbage
    out.float().logsumexp(-1).sum().backward()
    for p in mp.parameters():
        assert p.dtype == torch.float32 and p.grad is not None
        assert p.grad.dtype == torch.float32


if __name__ == "__main__":
    main(*sys.argv[1:4])
    close_process_group(finished=True)  # the trainer is gone; the ranks meet and leave (cli.py)
