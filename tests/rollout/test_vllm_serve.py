"""`posttrain vllm-serve` (issue 58, item 6): the server's words and environment for each machine
kind; the real server starts through it in the lane (tests/rollout/test_real_vllm.py)."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.rollout.vllm_serve import EXTENSION, LOG_ENV, serve_command


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_cpu_build_serves_float32_eager_with_every_flag_posttrain_needs(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env, argv = serve_command("DIR", port=8123, cpu=True, amx=True, extra=["--seed", "3"])
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "DIR" and _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--worker-extension-cls") == EXTENSION
    assert _flag(argv, "--host") == "127.0.0.1" and _flag(argv, "--port") == "8123"
    assert "--enforce-eager" in argv and argv[-2:] == ["--seed", "3"]


def test_a_gpu_serves_bf16_and_a_users_kv_cache_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env, argv = serve_command("Qwen/Qwen2.5-0.5B", cpu=False, log=str(tmp_path / "s.log"))
    assert _flag(argv, "--dtype") == "bfloat16" and "--enforce-eager" not in argv
    assert env[LOG_ENV] == str(tmp_path / "s.log") and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert serve_command("D", cpu=True, amx=False)[0]["VLLM_CPU_KVCACHE_SPACE"] == "4"


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_on_the_cpu_build_is_refused_only_on_a_cpu_with_amx(amx):
    if not amx:
        assert _flag(serve_command("D", dtype="bfloat16", cpu=True, amx=False)[1],
                     "--dtype") == "bfloat16"
        return
    with pytest.raises(ValueError, match=r"AMX tiles\); use --dtype float32") as err:
        serve_command("D", dtype="bfloat16", cpu=True, amx=True)
    assert "\n" not in str(err.value)


def test_the_command_prints_what_it_would_start(capsys):
    assert main(["vllm-serve", "DIR", "--port", "8200", "--max-model-len", "1024",
                 "--print"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 ")
    assert "--model DIR" in out and "--port 8200" in out and out.rstrip().endswith(
        "--max-model-len 1024")
