"""On one CUDA GPU: the decode loop and the fused head's forward/backward make no host sync
where none is expected, and the per-step `gpu/*` metrics and `head_precision` work there.

    python benchmarks/gpu_sync_check.py          # prints one line per check; exit 1 on failure

A locally built random Qwen2-shaped model (151,936 vocabulary, tied, qkv bias; 2 layers) so
nothing is downloaded. ``torch.cuda.set_sync_debug_mode("error")`` turns any synchronising
CUDA call into an error; the decode loop is allowed its one sync every `sync_every` steps
(counted as warnings instead), the fused head none at all. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch


def _model(device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151_936, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device).eval()


def check_decode(model: torch.nn.Module) -> str:
    """Syncs in a 32-token decode of 16 left-padded rows: <= 32 / sync_every + a few."""
    from posttrain.rollout.hf import SamplingParams, sample_tokens, sequence_uniforms

    dev = next(model.parameters()).device
    ids = torch.randint(10, 1000, (4, 12), device=dev)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :5] = False  # padding: the mask matters
    params = SamplingParams(max_new_tokens=32)
    u = sequence_uniforms(list(range(16)), 32)
    sample_tokens(model, ids, mask, params, [151_643], 151_643, group_size=4, uniforms=u)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            sample_tokens(model, ids, mask, params, [151_643], 151_643, group_size=4,
                          uniforms=u)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1000
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in seen)
    ok = syncs <= 32 // 8 + 8  # the cadence's reads, the prefill, the final cut
    return f"{'OK' if ok else 'FAIL'} decode 16 rows x 32 tokens: {syncs} host syncs, {ms:.0f} ms"


def check_fused_head(precision: str) -> str:
    from posttrain.ops import head_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 896, device="cuda", generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(151_936, 896, device="cuda", generator=g) * 0.02)
    tok = torch.randint(0, 151_936, (4096,), device="cuda", generator=g)
    ref, _ = head_logprobs(h.detach(), w.detach(), tok, precision="fp32")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, _ = head_logprobs(h, w, tok, precision=precision, grad_in_place=True)
        lp.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    diff = float((lp.detach() - ref).abs().max())
    ok = torch.isfinite(w.grad).all() and diff < (1e-4 if precision == "fp32" else 0.5)
    return f"{'OK' if ok else 'FAIL'} fused head {precision}: no host sync, max |dlogp| {diff:.2e}"


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP no CUDA device")
        return 0
    from posttrain.core.device import cuda_bf16_native, gpu_memory_metrics, reset_gpu_peak

    lines = [check_decode(_model("cuda"))]
    lines += [check_fused_head(p) for p in ("fp32", "tf32", "bf16")]
    reset_gpu_peak("cuda")
    metrics = gpu_memory_metrics("cuda")
    ok = set(metrics) == {"gpu/max_allocated_mb", "gpu/reserved_mb"}
    lines.append(f"{'OK' if ok else 'FAIL'} gpu metrics {metrics}; native bf16 "
                 f"{cuda_bf16_native('cuda')}")
    print("\n".join(lines))
    return 0 if all(line.startswith("OK") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
