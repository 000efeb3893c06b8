"""What a CPU can show of the GPU-only parts: the per-step `gpu/*` memory metrics are absent
off CUDA, the bf16-capability refusal (a fake capability flag), and config key
`head_precision` reaching the fused head inside every step."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError, GRPOConfig
from posttrain.core.device import gpu_memory_metrics, reset_gpu_peak
from posttrain.engine.preflight import bf16_device_error
from posttrain.ops.head_blocks import current_head_precision
from posttrain.tasks.arithmetic import sft_rows
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.sft import SFTTrainer

COMMON = {"progress": False, "threads": 1, "report_to": [], "seed": 0}


def test_gpu_memory_metrics_are_absent_off_cuda():
    reset_gpu_peak("cpu")  # a no-op
    assert gpu_memory_metrics("cpu") == {}
    assert gpu_memory_metrics(torch.device("cpu")) == {}


@pytest.mark.parametrize(("keys", "named"), [
    ({"bf16_compute": True}, "bf16_compute"), ({"autocast_bf16": True}, "autocast_bf16"),
    ({"head_precision": "bf16"}, "head_precision"),
    ({"dtype": "bfloat16", "lora_r": 8}, "dtype")])
def test_bf16_options_are_refused_on_a_gpu_without_native_bf16(keys, named):
    cfg = GRPOConfig(**keys)  # made on the CPU: no refusal here
    err = bf16_device_error(cfg, "cuda", native_bf16=False)
    assert err is not None and err.startswith(f"config key '{named}': this GPU has no native "
                                              "bf16") and "\n" not in err
    assert bf16_device_error(cfg, "cuda", native_bf16=True) is None
    assert bf16_device_error(cfg, "cpu", native_bf16=False) is None  # the CPU warns instead


def test_fp32_runs_are_never_refused():
    assert bf16_device_error(GRPOConfig(head_precision="tf32"), "cuda", False) is None


def test_head_precision_is_checked_and_set_around_each_step(tmp_path, monkeypatch):
    """The config key is a closed set; a trainer's steps run inside `head_precision`, whose
    value `head_logprobs` takes when the call names none; outside a step it is fp32 again."""
    with pytest.raises(ConfigError, match="head_precision"):
        GRPOConfig(head_precision="fp16")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=128, seed=0)
    seen: list[str] = []
    trainer = SFTTrainer(model=model, tokenizer=tok, train_data=sft_rows(8), rewards=[],
                         out_dir=str(tmp_path), batch_size=4, max_steps=2,
                         head_precision="bf16", **COMMON)
    step = trainer.step
    monkeypatch.setattr(trainer, "step", lambda s: (seen.append(current_head_precision()),
                                                    step(s))[1])
    summary = trainer.train()
    assert seen == ["bf16", "bf16"] and current_head_precision() == "fp32"
    assert not any(k.startswith("gpu/") for row in summary["history"] for k in row)
