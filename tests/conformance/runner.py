"""Run one trainer in this process for the conformance tests that need a real process.

``python -m tests.conformance.runner COMMAND KEYS_JSON [--kill-step N] [--signal PHASE SIG]``

--kill-step N: SIGKILL this process inside step N, after its first backward, right before its
first optimizer step (the middle of a step: nothing of it is saved).
--signal PHASE SIG: send SIG (TERM or INT) to this process during PHASE: ``eval_before``,
``step`` (step 2), ``checkpoint`` (the first checkpoint write) or ``eval_after``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

from posttrain.config import build_config
from posttrain.engine import update
from posttrain.trainers import trainer_class


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command")
    p.add_argument("keys")
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--signal", nargs=2, default=None)
    args = p.parse_args()
    cls = trainer_class(args.command)
    trainer = cls(build_config(cls.config_class, overrides=json.loads(args.keys)))
    current = [0]
    step = trainer.step

    def send(sig: str) -> None:
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))

    def run_step(n: int) -> dict:
        current[0] = n
        if args.signal and args.signal[0] == "step" and n == 2:
            send(args.signal[1])
        return step(n)

    trainer.step = run_step
    if args.kill_step:
        step_groups = update.step_groups

        def killing(groups, dist):  # noqa: ANN001, ANN202 - update.step_groups' signature
            if current[0] == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return step_groups(groups, dist)

        update.step_groups = killing
    if args.signal and args.signal[0] in ("eval_before", "eval_after"):
        evaluate, when_ = trainer.evaluate, args.signal[0].split("_")[1]

        def signalled_eval(when: str) -> dict:
            if when == when_:
                send(args.signal[1])
            return evaluate(when)

        trainer.evaluate = signalled_eval
    if args.signal and args.signal[0] == "checkpoint":
        save, sent = trainer.save_training_state, []

        def signalled_save(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if not sent:
                sent.append(1)
                send(args.signal[1])
            return save(*a, **k)

        trainer.save_training_state = signalled_save
    trainer.train()


if __name__ == "__main__":
    main()
