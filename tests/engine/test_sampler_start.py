"""Issue 58 item 4: `posttrain grpo` with `async_rollouts` starts the sampler process before the
trainer's imports (`posttrain.engine.sampler_start`); the trainer takes that process, and one it
does not take is ended at once."""

from __future__ import annotations

import time

from posttrain.engine import sampler_start
from posttrain.engine.sampler_start import SAMPLER_NAME, close_early, start_early

TOY = "tests.trainers.toy_rewards:sevens"


def _argv(world: dict[str, str], out: str, *extra: str) -> list[str]:
    return [f"model={world['model']}", f"train_data={world['data']}", f"out_dir={out}",
            f"rewards=[{{name: {TOY}}}]", "group_size=4", "prompts_per_step=2",
            "max_new_tokens=4", "max_steps=2", "progress=false", "threads=1", *extra]


def test_the_trainer_takes_the_process_the_cli_started(toy_world, tmp_path):
    from posttrain.config import GRPOConfig, build_config
    from posttrain.trainers.grpo import GRPOTrainer

    argv = _argv(toy_world, str(tmp_path), "async_rollouts=true", "max_staleness=0")
    start_early("grpo", argv)
    early = sampler_start._EARLY[0].proc
    assert early.is_alive() and early.name == SAMPLER_NAME
    trainer = GRPOTrainer(build_config(GRPOConfig, overrides=argv))
    assert trainer.rollouts_async.proc.proc is early  # taken, not a second one
    assert not sampler_start._EARLY
    trainer.train()
    assert not early.is_alive()  # stopped with the run


def test_no_early_process_unless_an_async_grpo_config_validates(toy_world, tmp_path):
    for command, extra in (("grpo", ()), ("ppo", ("async_rollouts=true",)),
                           ("grpo", ("async_rollouts=true", "max_staleness=-1"))):
        start_early(command, _argv(toy_world, str(tmp_path), *extra))
        assert not sampler_start._EARLY, (command, extra)


def test_an_untaken_process_ends_at_once(toy_world, tmp_path, monkeypatch):
    start_early("grpo", _argv(toy_world, str(tmp_path), "async_rollouts=true"))
    proc = sampler_start._EARLY[0].proc
    t0 = time.time()
    close_early()  # e.g. the trainer refused the run (a GPU, a config error found later)
    assert not proc.is_alive() and time.time() - t0 < 3 and not sampler_start._EARLY
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: the trainer refuses async, nothing starts
    start_early("grpo", _argv(toy_world, str(tmp_path), "async_rollouts=true"))
    assert not sampler_start._EARLY


def test_the_runs_own_build_still_says_its_notes(toy_world, tmp_path, capsys):
    """The early, silent build of the config does not use up a once-per-process note."""
    from posttrain.config import GRPOConfig, build_config, hints

    hints._noted.discard("generation_batch_size")
    argv = _argv(toy_world, str(tmp_path), "async_rollouts=true", "generation_batch_size=8")
    start_early("grpo", argv)
    close_early()
    assert capsys.readouterr().err == ""
    build_config(GRPOConfig, overrides=argv)
    assert "generation_batch_size is posttrain's generation memory bound" in \
        capsys.readouterr().err
