"""Fingerprint every conformance case: a short run of each registered trainer (and variant) and
the hash of its final weights, its `eval_after` and its logged metrics (wall-clock ones left
out). Two commits that should train alike print the same lines: a refactor's check.

``OMP_NUM_THREADS=1 python -m tests.conformance.fingerprint OUT.json [CASE ...]``
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from tests.conformance import conftest as c

EXTRA = {  # recipe paths beyond the registry's cases: (command, keys)
    "gspo": ("grpo", {"ratio_level": "sequence"}),
    "dr_grpo": ("grpo", {"scale": "none", "loss_agg": "seq-mean-token-sum-norm"}),
    "grpo_lora": ("grpo", {"lora_r": 4, "lora_alpha": 8, "lr": 1e-2}),
}


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(world: dict[str, str], case: str, out: Path) -> dict[str, str]:
    if case in EXTRA:
        c.VARIANTS[case] = EXTRA[case]
    keys = c.case_keys(world, case, out, save_every=0)
    c.build(case, keys).train()
    weights = c.weights(out / "final")
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode() + weights[name].float().numpy().tobytes())
    summary = json.loads((out / "summary.json").read_text())
    return {"weights": h.hexdigest()[:16], "eval_after": digest(summary.get("eval_after")),
            "metrics": digest(c.comparable(c.metric_rows(out)))}


def main() -> None:
    dest, cases = Path(sys.argv[1]), sys.argv[2:] or [*c.CASES, *EXTRA]
    root = Path(tempfile.mkdtemp(prefix="fingerprint"))
    factory = SimpleNamespace(mktemp=lambda name: Path(tempfile.mkdtemp(dir=root, prefix=name)))
    world = c.world.__wrapped__(factory)
    result = {case: fingerprint(world, case, root / case) for case in cases}
    dest.write_text(json.dumps(result, indent=1, sort_keys=True))
    for case, fp in result.items():
        print(case, fp)


if __name__ == "__main__":
    main()
