#!/usr/bin/env bash
# Smoke test on an accelerator (docs/distributed.md, "GPU smoke test"). Every trainer on a
# random Qwen2-shaped model with the real 151,936-token vocabulary (tied embeddings, q/k/v
# biases), fp32 and bf16 autocast, checked beyond the exit code (scripts/smoke_checks.py:
# finite losses, first-step KL < 1e-4, the sampler/learner gap, final/ reloads); a stop by
# SIGTERM and a resume; torchrun data parallel and FSDP2; the vLLM samplers when vLLM imports
# (colocated, also with a tool; on 2 GPUs also 2 torchrun ranks each with its own engine, and
# a `vllm serve` on 127.0.0.1 with the trainer on another GPU), at temperature 0.7 with the
# sampler/learner gap bounded, every push verified, a clean exit and the samples shown to come
# from vLLM; (full mode)
# bf16_compute, torch.compile, the device tests and a recipe-shaped probe. Not run yet: no GPU
# has been lent to this project.
# One PASS/FAIL/SKIP line per part; exits non-zero when any part fails.
#   bash scripts/gpu_smoke.sh                      # DEVICE=cuda MODE=quick (<= 5 min, one H200)
#   MODE=full bash scripts/gpu_smoke.sh            # + the parts listed under "full" below
#   ONLY="probe vllm*" bash scripts/gpu_smoke.sh   # only these parts (shell patterns)
#   DEVICE=cpu MODE=quick bash scripts/gpu_smoke.sh  # the same end to end on the CPU, smaller
# Env: DEVICE (cuda), MODE (quick), ONLY (all parts of MODE), PYTHON (python), WORK (a fresh
# temp dir), KEEP=1 keeps WORK, PART_TIMEOUT (seconds per part: 300, 600 on the CPU).
# Nothing is downloaded: the model, the char tokenizer and arithmetic data are built locally.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
MODE=${MODE:-quick}
PY=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d /tmp/posttrain_smoke.XXXXXX)}
ONLY=${ONLY:-}
if [ "$DEVICE" = cpu ]; then SIZE=cpu; else SIZE=gpu; fi
PART_TIMEOUT=${PART_TIMEOUT:-$([ "$SIZE" = cpu ] && echo 600 || echo 300)}
export PYTHONPATH="$PWD/scripts:$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK"
FAILED=0
CHECK=("$PY" scripts/smoke_checks.py)
case "$MODE" in quick|full) ;; *) echo "gpu_smoke: MODE=$MODE: expected quick or full"; exit 2;; esac

selected() {  # selected NAME: is NAME one of the ONLY patterns (or is ONLY empty)?
  [ -z "$ONLY" ] && return 0
  local pat
  for pat in $ONLY; do
    # shellcheck disable=SC2053
    [[ $1 == $pat ]] && return 0
  done
  return 1
}

part() {  # part NAME CMD... : run CMD under `timeout`, log to $WORK/NAME.log, print PASS/FAIL
  local name=$1; shift
  selected "$name" || return 0
  local start=$SECONDS rc=0
  timeout -k 20 "$PART_TIMEOUT" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    echo "PASS $name ($((SECONDS - start)) s)"
    grep '^smoke: ' "$WORK/$name.log" | sed 's/^/    /'
  else
    local why="exit $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timeout after ${PART_TIMEOUT} s"
    echo "FAIL $name ($((SECONDS - start)) s, $why, log $WORK/$name.log):"
    tail -n 25 "$WORK/$name.log" | sed 's/^/    /'
    FAILED=1
  fi
}

skip() {  # skip NAME REASON...
  selected "$1" || return 0
  local name=$1; shift
  echo "SKIP $name: $*"
}

echo "gpu_smoke: DEVICE=$DEVICE MODE=$MODE WORK=$WORK"
T0=$SECONDS
ONLY_SAVED=$ONLY; ONLY=""  # the device and the world are needed by every part
part device "$PY" -c "
import torch
d = torch.device('$DEVICE')
print('smoke: torch', torch.__version__, 'device', d)
if d.type == 'cuda':
    assert torch.cuda.is_available(), 'DEVICE=cuda but torch.cuda.is_available() is False'
    print('smoke:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0),
          'bf16:', torch.cuda.is_bf16_supported())
torch.ones(2, device=d).sum().item()
"
[ "$FAILED" = 0 ] || { echo "gpu_smoke: FAIL (no usable $DEVICE)"; exit 1; }
part world "${CHECK[@]}" world "$WORK" --size "$SIZE"
[ "$FAILED" = 0 ] || { echo "gpu_smoke: FAIL (could not build the smoke world)"; exit 1; }
ONLY=$ONLY_SAVED

W=$WORK
BASE=(model="$W/init" device="$DEVICE" threads=1 seed=0 progress=false report_to=none)
COMMON=("${BASE[@]}" max_steps=2)
REWARDS='rewards=[{name: "smoke_checks:text_chars", weight: 1.0}, {name: math, weight: 1.0}]'
RL=(train_data="$W/prompts.jsonl" eval_data="$W/heldout.jsonl" eval_size=4
    max_new_tokens=16 eval_max_new_tokens=16 "$REWARDS")
GRPO=("${RL[@]}" prompts_per_step=2 group_size=4 kl_coef=0.04)
PPO=("${RL[@]}" prompts_per_step=4 group_size=2 ppo_epochs=1 mini_batches=2 kl_coef=0.05)
SCORER=(batch_size=8 micro_batch_size=8 max_seq_len=128)
train() {  # train NAME CHECK-FLAGS... -- COMMAND KEYS... : one trainer run, checked
  local name=$1; shift
  local flags=()
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  part "$name" "${CHECK[@]}" run --out "$W/$name" "${flags[@]}" -- \
    "$PY" -m posttrain "$@" out_dir="$W/$name"
}

# ---- every trainer, fp32 and bf16 autocast -------------------------------------------------
for bf16 in false true; do
  t=$([ "$bf16" = true ] && echo _bf16 || echo "")
  B=("${COMMON[@]}" autocast_bf16=$bf16)
  train "sft$t" -- sft "${B[@]}" train_data="$W/sft.jsonl" batch_size=8 max_seq_len=96
  train "grpo$t" --kl --gap -- grpo "${B[@]}" "${GRPO[@]}"
  train "dpo$t" -- dpo "${B[@]}" train_data="$W/pairs.jsonl" batch_size=8 micro_batch_size=4 \
    max_seq_len=96
  train "ppo$t" --kl --gap -- ppo "${B[@]}" "${PPO[@]}"                 # copied critic
  train "ppo_lora$t" --kl --gap -- ppo "${B[@]}" "${PPO[@]}" lora_r=8   # LoRA critic
  train "rm$t" -- rm "${B[@]}" train_data="$W/pairs.jsonl" "${SCORER[@]}"
  train "prm$t" -- prm "${B[@]}" train_data="$W/steps.jsonl" "${SCORER[@]}"
  train "grpo_process$t" --kl --gap -- grpo "${B[@]}" "${GRPO[@]}" advantage=grpo_process \
    process_reward_model="$W/prm$t/final"
  train "search$t" --no-metrics --no-reload -- search model="$W/init" device="$DEVICE" \
    threads=1 seed=0 autocast_bf16=$bf16 eval_data="$W/heldout.jsonl" eval_size=4 \
    orm="$W/rm$t/final" prm="$W/prm$t/final" "n=[1, 2]" beam_width=2 expansions=2 \
    beam_max_steps=2 max_new_tokens=16
  train "eval$t" --no-metrics --no-reload -- eval model="$W/grpo$t/final" device="$DEVICE" \
    threads=1 autocast_bf16=$bf16 eval_data="$W/heldout.jsonl" eval_size=4 \
    eval_max_new_tokens=16 "$REWARDS"
done

# ---- a stop by SIGTERM after the first checkpoint, then resume_from=latest -----------------
part resume "${CHECK[@]}" resume --out "$W/resume" --steps 8 -- "$PY" -m posttrain grpo \
  "${BASE[@]}" "${GRPO[@]}" eval_data= out_dir="$W/resume"

# ---- torchrun: data parallel and FSDP2 on 2 processes (gloo on the CPU, NCCL on 2 GPUs) -----
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m posttrain)
DIST=(grpo sft dpo prm)
[ "$MODE" = quick ] && DIST=(grpo)
for trainer in "${DIST[@]}"; do
  case $trainer in
    grpo) keys=("${GRPO[@]}");;
    sft) keys=(train_data="$W/sft.jsonl" batch_size=8 max_seq_len=96);;
    dpo) keys=(train_data="$W/pairs.jsonl" batch_size=8 micro_batch_size=4 max_seq_len=96);;
    prm) keys=(train_data="$W/steps.jsonl" "${SCORER[@]}");;
  esac
  for fsdp in false true; do
    name="torchrun_${trainer}_$([ "$fsdp" = true ] && echo fsdp2 || echo dp)"
    if [ "$DEVICE" != cpu ] && [ "$NGPU" -lt 2 ]; then
      skip "$name" "needs >= 2 GPUs ($NGPU visible)"
      continue
    fi
    part "$name" "${CHECK[@]}" run --out "$W/$name" -- "${TORCHRUN[@]}" "$trainer" \
      "${COMMON[@]}" "${keys[@]}" fsdp=$fsdp out_dir="$W/$name"
  done
done

# ---- the vLLM samplers ----------------------------------------------------------------
# temperature 0.7: vLLM's log-probs must be the tempered ones (logprobs_mode), or the gap is
# large; the mean |logp diff| is bounded (bf16 sampler vs learner); a gap of exactly 0 or no
# "Initializing a V1 LLM engine" line means the samples did not come from vLLM; the server part
# requires the server to have answered completions; every weight push is verified
# (rollout/push_check_gap at every step) and no traceback may follow a run that exited 0 (the
# process-group teardown). NCCL needs the trainer and the server on
# different GPUs, hence 2 GPUs for vllm_server and 3 for its torchrun variant.
VLLM_RUN=(--kl --gap --gap-max 0.05 --push-check --clean-exit)
VLLM_KEYS=("${COMMON[@]}" "${GRPO[@]}" autocast_bf16=true temperature=0.7)
VLLM_MARK="Initializing a V1 LLM engine"
VLLM_PARTS=(vllm_colocate vllm_colocate_tools vllm_colocate_torchrun vllm_server
            vllm_server_torchrun)
if VLLM_ERR=$("$PY" -c "import vllm" 2>&1); then
  train vllm_colocate "${VLLM_RUN[@]}" --log-has "$VLLM_MARK" -- grpo "${VLLM_KEYS[@]}" \
    rollout_engine=vllm_colocate
  # multi-turn tool episodes on the colocated sampler (token-id requests per turn, each with its
  # own budget): the path runs on the real vLLM with the same checks; a random model seldom
  # writes a call, so a second turn is shown only on the CPU (tests/rollout/test_vllm_episodes.py)
  train vllm_colocate_tools "${VLLM_RUN[@]}" --log-has "$VLLM_MARK" -- grpo "${VLLM_KEYS[@]}" \
    rollout_engine=vllm_colocate "tools=[posttrain.tasks.tool_world:calculator]" tool_schemas=none
  if [ "$NGPU" -ge 2 ]; then  # each rank its own engine (external_launcher) on its own GPU
    part vllm_colocate_torchrun "${CHECK[@]}" run --out "$W/vllm_colocate_torchrun" \
      "${VLLM_RUN[@]}" --log-has "$VLLM_MARK" -- "${TORCHRUN[@]}" grpo "${VLLM_KEYS[@]}" \
      rollout_engine=vllm_colocate out_dir="$W/vllm_colocate_torchrun"
    part vllm_server "${CHECK[@]}" vllm_server --model "$W/init" --port 18000 --gpus 1 \
      --out "$W/vllm_server" "${VLLM_RUN[@]}" -- env CUDA_VISIBLE_DEVICES=0 "$PY" -m posttrain \
      grpo "${VLLM_KEYS[@]}" rollout_engine=vllm_server vllm_server_host=127.0.0.1 \
      vllm_server_port=18000 out_dir="$W/vllm_server"
  else
    for p in vllm_colocate_torchrun vllm_server; do skip "$p" "needs >= 2 GPUs ($NGPU visible)"; done
  fi
  if [ "$NGPU" -ge 3 ]; then  # 2 trainer ranks on GPUs 0-1, rank 0 pushes, both wait for it
    part vllm_server_torchrun "${CHECK[@]}" vllm_server --model "$W/init" --port 18001 \
      --gpus 2 --out "$W/vllm_server_torchrun" "${VLLM_RUN[@]}" -- env CUDA_VISIBLE_DEVICES=0,1 \
      "${TORCHRUN[@]}" grpo "${VLLM_KEYS[@]}" rollout_engine=vllm_server \
      vllm_server_host=127.0.0.1 vllm_server_port=18001 out_dir="$W/vllm_server_torchrun"
  else
    skip vllm_server_torchrun "needs >= 3 GPUs ($NGPU visible)"
  fi
else
  for p in "${VLLM_PARTS[@]}"; do
    skip "$p" "python -c 'import vllm' failed: $(echo "$VLLM_ERR" | tail -n 1)"
  done
fi

# ---- full mode: bf16 copies, compile, gradient checkpointing, device tests, the probe -------
if [ "$MODE" = full ]; then
  train grpo_bf16_compute --kl --gap -- grpo "${COMMON[@]}" "${GRPO[@]}" bf16_compute=true \
    torch_compile=true
  train dpo_bf16_compute -- dpo "${COMMON[@]}" bf16_compute=true train_data="$W/pairs.jsonl" \
    batch_size=8 micro_batch_size=4 max_seq_len=96
  train grpo_checkpointing --kl --gap -- grpo "${COMMON[@]}" "${GRPO[@]}" autocast_bf16=true \
    gradient_checkpointing=true
  # sampler/learner tests: parametrised over cpu and (when available) cuda
  part pytest_devices "$PY" -m pytest -q -p no:cacheprovider tests/rollout/test_decode.py \
    tests/engine/test_forward.py
fi
# recipe-shaped probe: recipes/grpo_gsm8k_qwen.yaml on a random model of Qwen2.5-0.5B's shape,
# 16 prompts x 8 samples x 512 new tokens, one step (tiny on the CPU: 2 x 2 x 16)
PROBE=(grpo --config recipes/grpo_gsm8k_qwen.yaml device="$DEVICE" train_data="$W/prompts.jsonl"
       eval_data= data_subset= "columns={}" answer_marker= max_steps=1 save_every=0 threads=1
       progress=false report_to=none)
if [ "$SIZE" = cpu ]; then
  PROBE+=(prompts_per_step=2 group_size=2 max_new_tokens=16 micro_batch_size=4)
  part probe "${CHECK[@]}" probe --out "$W/probe" --shape tiny -- "${PROBE[@]}"
elif [ "$MODE" = full ] || [ -n "$ONLY" ]; then
  part probe "${CHECK[@]}" probe --out "$W/probe" --shape 0.5b -- "${PROBE[@]}"
fi

[ "${KEEP:-0}" = 1 ] || [ "$FAILED" = 1 ] || rm -rf "$WORK"
if [ "$FAILED" = 0 ]; then RESULT=PASS; else RESULT=FAIL; fi
echo "gpu_smoke: $RESULT (DEVICE=$DEVICE MODE=$MODE, $((SECONDS - T0)) s)"
exit "$FAILED"
