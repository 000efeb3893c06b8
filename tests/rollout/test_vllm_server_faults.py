"""The server's lifecycle and faults without a GPU (issue 58, item 7): a server that stops or
hangs, a weight group that never joins or is refused, each one `ServerError` line naming the
server's log within `vllm_server_timeout`, never a hang; the worker closes an earlier run's
group before a new one. The CPU push against a real server killed mid-run is in the lane
(tests/rollout/test_real_vllm.py)."""

from __future__ import annotations

import gc
import socket
import sys
import threading
import time
import types
import weakref

import pytest
import torch

from posttrain.cli import main
from posttrain.models.loading import save_checkpoint
from posttrain.rollout import SamplingParams
from posttrain.rollout.vllm_server import ServerError, VLLMServerSampler
from posttrain.rollout.vllm_worker import WeightReceiver
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout import fake_vllm

NEVER = threading.Event()  # waited on by whatever never joins


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_faults")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    return {"model": model, "tok": tok, "dir": str(root / "model")}


def _engine(server: fake_vllm.FakeServer, tok, timeout: float = 1.0) -> VLLMServerSampler:
    sampler = VLLMServerSampler(server.url, tok, [tok.eos_token_id], group_host="127.0.0.1",
                              group_port=51216, timeout=timeout)
    sampler.log = "/var/log/vllm.log"  # what `posttrain vllm-serve --log` makes the worker report
    return sampler


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("the server's log: /var/log/vllm.log"), msg
    assert all(n in msg for n in needles), msg
    return msg


def test_a_stopped_server_is_one_error_at_the_next_request(world):
    with fake_vllm.FakeServer(world["dir"]) as server:
        sampler = _engine(server, world["tok"])
    with pytest.raises(ServerError) as err:  # the server is gone: connection refused
        sampler.sample_ids([[1, 2]], SamplingParams(4, temperature=1.0), sampler.stops, seeds=[1])
    _one_line(err, "POST /v1/completions failed", "the server stopped or does not answer")


def test_a_silent_server_is_one_error_within_the_timeout(world):
    """A server that takes the connection and never answers (a hung worker)."""
    with socket.socket() as silent, fake_vllm.FakeServer(world["dir"]) as server:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        sampler = _engine(server, world["tok"])
        sampler.base_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            sampler.update_weights(world["model"], 1)  # the CPU push: one POST of the file
        assert time.monotonic() - start < 5
    _one_line(err, "POST /collective_rpc: no answer within vllm_server_timeout=1 s")


def test_a_server_dying_during_the_push_is_one_error(world):
    """The server takes the push request and dies before it answers (the connection closed
    mid-request): one line, at once."""
    with socket.socket() as dying, fake_vllm.FakeServer(world["dir"]) as server:
        dying.bind(("127.0.0.1", 0))
        dying.listen()

        def die() -> None:
            conn, _ = dying.accept()
            conn.recv(65536)  # the request has started to arrive
            conn.close()

        threading.Thread(target=die, daemon=True).start()
        sampler = _engine(server, world["tok"], timeout=30)
        sampler.base_url = f"http://127.0.0.1:{dying.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            sampler.update_weights(world["model"], 1)
        assert time.monotonic() - start < 5  # not the 30 s timeout
    _one_line(err, "POST /collective_rpc failed (", "the server stopped or does not answer")


def _nccl(monkeypatch, create) -> list:
    """vLLM's NCCL pieces as the trainer imports them; `create` stands for the group's join."""
    made: list = []

    class Comm:
        disabled = False

        def __init__(self, group, device):
            self.group, self.destroyed = group, False
            made.append(self)

        def destroy(self):
            self.destroyed = True

    pynccl = types.ModuleType("pynccl")
    pynccl.PyNcclCommunicator = Comm
    utils = types.ModuleType("utils")
    utils.StatelessProcessGroup = types.SimpleNamespace(create=create)
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", pynccl)
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", utils)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return made


@pytest.mark.parametrize("server_side", ["never joins", "refuses"])
def test_a_weight_group_that_never_forms_ends_within_the_timeout(world, monkeypatch,
                                                                  server_side):
    """The NCCL path's join: the trainer waits at the group's store for workers that never come
    (their request hangs), or that answered the join with an error at once."""
    _nccl(monkeypatch, lambda **kw: NEVER.wait())
    with fake_vllm.FakeServer(world["dir"]) as server:
        sampler = _engine(server, world["tok"])

        def post(path, body=None):
            if body and body.get("method") == "weight_group_rank":
                return {"results": [0]}
            if server_side == "refuses":
                raise ServerError("vllm_server at X: POST /collective_rpc -> 500 address in use")
            NEVER.wait()

        monkeypatch.setattr(sampler, "_post", post)
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            sampler._init_group()
        took = time.monotonic() - start
    if server_side == "refuses":  # the server's answer, without waiting for the timeout
        assert took < 0.5 and "500 address in use" in str(err.value)
        return
    assert 1 <= took < 3
    _one_line(err, "the weight transfer (init_weight_group) did not end within "
                   "vllm_server_timeout=1 s", "never joined")


def test_a_second_run_on_one_server_closes_the_first_runs_group(monkeypatch):
    """The worker closes the old communicator and drops its group (whose store listens on the
    group port) before it joins a new run's group; the trainer's close does it too."""
    groups: list = []

    class Group:
        def __init__(self, **kw):
            groups.append(weakref.ref(self))

    made = _nccl(monkeypatch, lambda **kw: Group(**kw))
    worker = WeightReceiver()
    worker.device = "cpu"
    monkeypatch.setattr(WeightReceiver, "weight_group_rank", lambda self: 0)
    worker.init_weight_group("127.0.0.1", 51216, 2)
    worker.init_weight_group("127.0.0.1", 51216, 2)  # a second run, or a resume
    gc.collect()
    assert made[0].destroyed and not made[1].destroyed
    assert groups[0]() is None and groups[1]() is not None  # the first store is gone
    worker.close_weight_group()
    gc.collect()
    assert made[1].destroyed and groups[1]() is None


def test_the_engine_closes_its_group_on_the_server(world, monkeypatch):
    with fake_vllm.FakeServer(world["dir"]) as server:
        sampler = _engine(server, world["tok"])
        sampler._comm = comm = types.SimpleNamespace(destroyed=False)
        comm.destroy = lambda: setattr(comm, "destroyed", True)
        sampler.close()
        sampler.close()  # once
    assert server.calls.count(("/collective_rpc", {"method": "close_weight_group"})) == 1
    assert comm.destroyed and sampler._comm is None


def test_the_command_line_says_a_server_error_in_one_line(monkeypatch, capsys, tmp_path):
    def train(command, cfg):
        raise ServerError("vllm_server at http://h:1: POST /collective_rpc failed (Connection "
                          "reset by peer): the server stopped or does not answer; the "
                          "server's log: /l")

    monkeypatch.setattr("posttrain.cli.train", train)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main(["grpo", "model=m", f"train_data={data}", f"out_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain grpo: vllm_server at http://h:1: POST /collective_rpc "
                          "failed") and "\n" not in err and err.endswith("log: /l")
