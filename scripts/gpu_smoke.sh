#!/usr/bin/env bash
# Smoke test on an accelerator: one step of each trainer on DEVICE, fp32 and bf16 autocast
# (and GRPO/DPO with bf16_compute, GRPO compiled),
# plus the sampler/learner device tests. Prints one PASS/FAIL line per part and exits non-zero
# when any part fails.
#   bash scripts/gpu_smoke.sh                 # DEVICE=cuda (default)
#   DEVICE=cpu bash scripts/gpu_smoke.sh      # the same end to end on the CPU
# Env: DEVICE (cuda), PYTHON (python), WORK (a fresh temp dir), KEEP=1 keeps WORK.
# Nothing is downloaded: a tiny Llama, the char tokenizer and arithmetic data are built locally.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d /tmp/posttrain_smoke.XXXXXX)}
mkdir -p "$WORK"
FAILED=0

part() {  # part NAME CMD... : run CMD, log to $WORK/NAME.log, print PASS/FAIL
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$WORK/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s, log $WORK/$name.log):"
    tail -n 25 "$WORK/$name.log" | sed 's/^/    /'
    FAILED=1
  fi
}

echo "gpu_smoke: DEVICE=$DEVICE WORK=$WORK"
part device "$PY" -c "
import sys, torch
d = torch.device('$DEVICE')
print('torch', torch.__version__, 'device', d)
if d.type == 'cuda':
    assert torch.cuda.is_available(), 'DEVICE=cuda but torch.cuda.is_available() is False'
    print(torch.cuda.get_device_name(0), 'bf16:', torch.cuda.is_bf16_supported())
torch.ones(2, device=d).sum().item()
"
[ "$FAILED" = 0 ] || { echo "gpu_smoke: FAIL (no usable $DEVICE)"; exit 1; }

part world "$PY" -c "
from pathlib import Path
from posttrain.models import build_char_tokenizer, build_tiny_llama
from posttrain.tasks.arithmetic import heldout_rows, prompt_rows, sft_rows, write_jsonl
from posttrain.tasks.preferences import offline_pairs
from posttrain.trainers.common import save_checkpoint
out = Path('$WORK')
tok = build_char_tokenizer()
save_checkpoint(build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4,
                                 intermediate_size=128, seed=0), tok, out / 'init')
write_jsonl(sft_rows(256, 0), out / 'sft.jsonl')
write_jsonl(prompt_rows(64, 1), out / 'prompts.jsonl')
write_jsonl(heldout_rows(8), out / 'heldout.jsonl')
write_jsonl(offline_pairs(64, 0, kind='sign'), out / 'pairs.jsonl')
print('world ready in', out)
"

COMMON=(model="$WORK/init" device="$DEVICE" max_steps=1 threads=1 seed=0)
for bf16 in false true; do
  tag=$([ "$bf16" = true ] && echo "_bf16" || echo "")
  part "sft$tag" "$PY" -m posttrain.cli sft "${COMMON[@]}" autocast_bf16=$bf16 \
    out_dir="$WORK/sft$tag" train_data="$WORK/sft.jsonl" batch_size=8 max_seq_len=96
  part "grpo$tag" "$PY" -m posttrain.cli grpo "${COMMON[@]}" autocast_bf16=$bf16 \
    out_dir="$WORK/grpo$tag" train_data="$WORK/prompts.jsonl" eval_data="$WORK/heldout.jsonl" \
    eval_size=8 prompts_per_step=2 group_size=4 max_new_tokens=16 eval_max_new_tokens=16
  part "dpo$tag" "$PY" -m posttrain.cli dpo "${COMMON[@]}" autocast_bf16=$bf16 \
    out_dir="$WORK/dpo$tag" train_data="$WORK/pairs.jsonl" batch_size=8 micro_batch_size=4 \
    max_seq_len=96
done
# bf16 learner and reference copies (fp32 masters), compiled
part grpo_bf16_compute "$PY" -m posttrain.cli grpo "${COMMON[@]}" bf16_compute=true \
  torch_compile=true kl_coef=0.04 out_dir="$WORK/grpo_bf16c" train_data="$WORK/prompts.jsonl" \
  prompts_per_step=2 group_size=4 max_new_tokens=16
part dpo_bf16_compute "$PY" -m posttrain.cli dpo "${COMMON[@]}" bf16_compute=true \
  out_dir="$WORK/dpo_bf16c" train_data="$WORK/pairs.jsonl" batch_size=8 micro_batch_size=4 \
  max_seq_len=96

# sampler/learner tests: parametrised over cpu and (when available) cuda
part pytest_devices "$PY" -m pytest -q -p no:cacheprovider tests/test_rollout.py \
  tests/trainers/test_forward.py

[ "${KEEP:-0}" = 1 ] || [ "$FAILED" = 1 ] || rm -rf "$WORK"
if [ "$FAILED" = 0 ]; then echo "gpu_smoke: PASS (DEVICE=$DEVICE)"; else echo "gpu_smoke: FAIL"; fi
exit "$FAILED"
