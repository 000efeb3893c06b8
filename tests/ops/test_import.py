"""`posttrain.ops` must import with torch alone (no transformers / peft / datasets)."""

import subprocess
import sys

import posttrain.ops


def test_ops_import_is_light():
    code = (
        "import sys, posttrain.ops; "
        "heavy = [m for m in ('transformers', 'peft', 'datasets') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_all_names_exported():
    for name in posttrain.ops.__all__:
        assert hasattr(posttrain.ops, name), name
    for name in ("token_logprobs", "entropy_from_logits", "kl_penalty", "gae",
                 "group_advantages", "policy_loss", "value_loss", "dpo_loss",
                 "bradley_terry_loss", "aggregate_loss", "rloo_advantages",
                 "process_advantages", "prm_step_loss", "aggregate_step_scores"):
        assert name in posttrain.ops.__all__, name
