"""Torch threads on a busy CPU: seconds per step of the demo's model at each thread setting,
idle and beside other work (issue 48, item 15).

    python benchmarks/busy_threads.py              # idle, then beside 1 and 2 busy processes
    python benchmarks/busy_threads.py --load 0 1 --reps 3 --rounds 3

Each setting runs in a fresh process (OpenMP reads `OMP_WAIT_POLICY` when torch loads): the
demo's tiny Llama (hidden 128, 2 layers, vocabulary 100), an SFT step (64 x 64 tokens,
forward, backward, AdamW) and a sampling step (16 sequences, 32 new tokens). `--load N`
starts N pure-Python busy loops beside it (what another user's job looks like to the
scheduler) and stops them after; other users' jobs add to it. Every setting runs once per
round, rounds interleaved; prints each run's median milliseconds per step, the median over
rounds, the load average and the busy cores `threads: 0` sees; never used by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS: dict[str, dict[str, str]] = {  # name -> threads and environment of the child
    "threads=1": {"threads": "1"},
    "threads=2": {"threads": "2"},
    "threads=2 OMP_WAIT_POLICY=PASSIVE": {"threads": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "threads=auto (posttrain: 0)": {"threads": "0"},
}


def child(threads: int, reps: int) -> dict[str, float]:
    """Median ms of an SFT step and of a sampling step, in this process."""
    import torch

    from posttrain.core.runtime import setup_threads
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    setup_threads(threads)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=128, num_layers=2, num_heads=4,
                             intermediate_size=512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(5, len(tok), (64, 64))
    sft, sample = [], []
    for _ in range(reps + 1):  # the first of each is a warm-up
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sft.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids[:16, :16], max_new_tokens=32, do_sample=True,
                           pad_token_id=tok.pad_token_id)
        sample.append(time.perf_counter() - start)
    return {"threads": torch.get_num_threads(), "sft_ms": 1000 * statistics.median(sft[1:]),
            "sample_ms": 1000 * statistics.median(sample[1:])}


def _child_run(env: dict[str, str], reps: int) -> dict[str, float]:
    child_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    child_env.update({k: v for k, v in env.items() if k != "threads"})
    out = subprocess.run([sys.executable, __file__, "--child", env["threads"], "--reps",
                          str(reps)], env=child_env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(load: int, reps: int, rounds: int) -> None:
    """Every setting once per round, the rounds interleaved (other users' load drifts)."""
    from posttrain.core.runtime import busy_cores

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(load)]
    try:
        time.sleep(2 if load else 0)
        print(f"{load} busy loop(s) of ours; load average {os.getloadavg()[0]:.2f}, busy cores "
              f"now {busy_cores():.2f}")
        got: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
        for _ in range(rounds):
            for name, env in SETTINGS.items():
                got[name].append(_child_run(env, reps))
        for name, runs in got.items():
            sft = [r["sft_ms"] for r in runs]
            sample = [r["sample_ms"] for r in runs]
            print(f"  {name:36s} threads {'/'.join(str(r['threads']) for r in runs)}: SFT step "
                  f"median {statistics.median(sft):7.1f} ms ({' '.join(f'{x:.0f}' for x in sft)}),"
                  f" sampling median {statistics.median(sample):7.1f} ms "
                  f"({' '.join(f'{x:.0f}' for x in sample)})")
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--reps", type=int, default=5, help="steps timed per process")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs of every setting")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.reps)))
        return
    print(f"{os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    for load in args.load:
        run(load, args.reps, args.rounds)


if __name__ == "__main__":
    main()
