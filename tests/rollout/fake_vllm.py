"""A CPU stand-in for vLLM 0.33, built to the real surface that posttrain uses.

`install(monkeypatch)` puts it in `sys.modules["vllm"]`; `FakeServer` answers the HTTP routes of
`vllm serve`. What it reproduces (each read from vLLM 0.33.0's source; scripts/check_vllm_api.py
checks the names, signatures and limits below against the pinned wheel):

- `LLM(model, **kw)`: only the keywords in `LLM_KWARGS` (anything else is a TypeError, as
  `EngineArgs` raises), `logprobs_mode` / `distributed_executor_backend` values checked;
  building it reseeds python / numpy / torch with `seed` (vLLM's `set_random_seed`).
- sleep / wake as `EngineCore`: `sleep` pauses the scheduler and puts "weights" and "kv_cache"
  to sleep; `wake_up(tags)` (None: all) wakes the tags asked and resumes the scheduler only when
  none is left asleep, returning whether it is fully awake; `generate` while paused raises here
  (vLLM would wait forever); loading weights while they are asleep raises too.
- `apply_model(f)` -> [f(model)] (one in-process worker); the model's `load_weights` refuses a
  name the checkpoint does not have (`AutoWeightsLoader`) and returns the set it loaded.
- `SamplingParams`: the fields of `SAMPLING_FIELDS` and the limits of `SAMPLING_LIMITS`.
- outputs: `RequestOutput` / `CompletionOutput` with `logprobs` a list of `{id: Logprob}`.
- `LLMEngine` has no `shutdown`; dropping it runs a finalizer that destroys the default process
  group (`EngineCore.shutdown` -> `cleanup_dist_env_and_memory`).
- the server fills request fields left unset from the checkpoint's generation config
  (`CompletionRequest._DEFAULT_SAMPLING_PARAMS`), and serves dev routes only in dev mode.

Sampling: token t of a sequence is drawn from a generator seeded by the request's seed; its
log-prob is `LOGPROB`. With `scripts` (id lists), the model is scripted instead: the token
after a context is the next one of the script the context begins (its last once the context
covers it), so a multi-turn episode whose tool answers are the script's goes on where it does.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

LLM_KWARGS = ("model", "dtype", "seed", "gpu_memory_utilization", "enable_sleep_mode",
              "logprobs_mode", "max_model_len", "distributed_executor_backend")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")
SAMPLING_FIELDS: dict[str, Any] = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
    "stop_token_ids": None, "max_tokens": 16, "logprobs": None, "detokenize": True,
    "skip_special_tokens": True}
SAMPLING_LIMITS: dict[str, tuple[float | None, bool, float | None, bool]] = {
    # field: (low, low inclusive, high, high inclusive) as `SamplingParams._verify_args` checks
    "presence_penalty": (-2.0, True, 2.0, True), "frequency_penalty": (-2.0, True, 2.0, True),
    "repetition_penalty": (0.0, False, None, False), "temperature": (0.0, True, 2.0, True),
    "top_p": (0.0, False, 1.0, True), "top_k": (-1, True, None, False),
    "min_p": (0.0, True, 1.0, True), "max_tokens": (1, True, None, False)}
SERVER_DEFAULTED = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                    "top_p", "top_k", "min_p")
"""Request fields that `vllm serve` fills from generation_config.json when a request leaves them
unset (`CompletionRequest._DEFAULT_SAMPLING_PARAMS`)."""
REQUEST_FIELDS = ("model", "prompt", "max_tokens", "n", "seed", "logprobs", "stop_token_ids",
                  "return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens",
                  *SERVER_DEFAULTED)
ROUTES = {"GET": ("/v1/models", "/server_info"),
          "POST": ("/v1/completions", "/collective_rpc", "/reset_prefix_cache")}
DEV_ROUTES = ("/server_info", "/collective_rpc", "/reset_prefix_cache")
LOGPROB = -0.5


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


class SamplingParams:
    """vLLM's `SamplingParams`: unknown keywords are a TypeError, limits a ValueError."""

    def __init__(self, **kw: Any) -> None:
        unknown = set(kw) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        for name, default in SAMPLING_FIELDS.items():
            setattr(self, name, kw.get(name, default))
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name, (low, low_in, high, high_in) in SAMPLING_LIMITS.items():
            v = getattr(self, name)
            if v is None:
                continue
            if (low is not None and (v < low or (v == low and not low_in))) or \
                    (high is not None and (v > high or (v == high and not high_in))):
                raise ValueError(f"{name} out of range: {v}")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must contain only integers")


def sample(ids: list[int], sp: SamplingParams, vocab: int,
           scripts: list[list[int]] | None = None) -> CompletionOutput:
    """One completion: tokens from the request's seed (or the `scripts`), ending at a stop id
    or max_tokens."""
    if not all(isinstance(t, int) for t in ids):
        raise TypeError("prompt: token ids expected (a TokensPrompt / a list of ints)")
    g = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 12345)
    out: list[int] = []
    reason = "length"
    for _ in range(sp.max_tokens):
        out.append(int(torch.randint(0, vocab, (1,), generator=g)) if scripts is None
                   else scripted(scripts, ids + out))
        if out[-1] in sp.stop_token_ids:
            reason = "stop"
            break
    lps = None if sp.logprobs is None else [{t: Logprob(LOGPROB, 1)} for t in out]
    return CompletionOutput(0, "", out, None, lps, reason, out[-1] if reason == "stop" else None)


def scripted(scripts: list[list[int]], ctx: list[int]) -> int:
    """The next token of the first script that `ctx` begins (or covers)."""
    for script in scripts:
        n = min(len(ctx), len(script))
        if ctx[:n] == script[:n]:
            return script[min(len(ctx), len(script) - 1)]
    raise ValueError(f"scripted model: the context {ctx[:12]}... begins no script")


class FakeModel(torch.nn.Module):
    """The checkpoint's tensors by their Hugging Face names (what vLLM's loader accepts)."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        self.vocab = int(self.tensors["model.embed_tokens.weight"].shape[0])
        self.asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.asleep:
            raise RuntimeError("load_weights while the weights are asleep (offloaded)")
        loaded = set()
        for name, t in weights:
            if name not in self.tensors:
                raise ValueError(f"There is no module or parameter named {name!r}")
            if self.tensors[name].shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected "
                                 f"{tuple(self.tensors[name].shape)}")
            self.tensors[name].copy_(t)
            loaded.add(name)
        return loaded


def _destroy_default_group() -> None:
    """What vLLM's `cleanup_dist_env_and_memory` does to the default process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class LLMEngine:
    """No `shutdown` (vLLM 0.33): its finalizer tears the process group down."""

    def __init__(self) -> None:
        self._finalizer = weakref.finalize(self, _destroy_default_group)


class LLM:
    """`vllm.LLM` in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); `log` records the calls,
    `requests` each (prompt, SamplingParams) generated; `scripts`: see the module doc."""

    scripts: list[list[int]] | None = None

    def __init__(self, model: str, **kw: Any) -> None:
        unknown = set(kw) - set(LLM_KWARGS)
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments "
                            f"{sorted(unknown)}")
        if kw.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={kw['logprobs_mode']!r}")
        backend = kw.get("distributed_executor_backend")
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r}")
        if not 0 < kw.get("gpu_memory_utilization", 0.92) <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        seed = kw.get("seed", 0)
        random.seed(seed)  # vLLM's set_random_seed, when the worker starts
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.kwargs = kw
        self.model = FakeModel(model)
        self.llm_engine = LLMEngine()
        self.sleep_mode = bool(kw.get("enable_sleep_mode", False))
        self.sleeping_tags: set[str] = set()
        self.paused = False
        self.log: list[tuple[Any, ...]] = []
        self.requests: list[tuple[Any, SamplingParams]] = []

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=True)")
        self.log.append(("sleep", level))
        self.paused = True
        if level >= 1 and not self.sleeping_tags:
            self.sleeping_tags = {"weights", "kv_cache"}
            self.model.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.log.append(("wake_up", None if tags is None else tuple(tags)))
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self.sleeping_tags:
            if tags is None:
                self.sleeping_tags.clear()
            elif all(t in self.sleeping_tags for t in tags):
                self.sleeping_tags -= set(tags)
        self.model.asleep = "weights" in self.sleeping_tags
        if not self.sleeping_tags:
            self.paused = False
        return not self.sleeping_tags

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        self.log.append(("reset_prefix_cache",))
        return True

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        return [func(self.model)]

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: Any = True,
                 lora_request: Any = None, priority: Any = None,
                 tokenization_kwargs: Any = None,
                 mm_processor_kwargs: Any = None) -> list[RequestOutput]:
        if self.paused:
            raise RuntimeError("generate while the scheduler is paused: vLLM would hang")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(sps) != len(prompts) or not all(isinstance(s, SamplingParams) for s in sps):
            raise ValueError("sampling_params: one vllm.SamplingParams per prompt")
        self.log.append(("generate", len(prompts)))
        self.requests += list(zip(prompts, sps, strict=True))
        return [RequestOutput(str(i), None, p["prompt_token_ids"], None,
                              [sample(p["prompt_token_ids"], sp, self.model.vocab, self.scripts)])
                for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))]


def install(monkeypatch: Any) -> types.ModuleType:
    """Make `import vllm` give this fake for the test."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams  # type: ignore[attr-defined]
    logprobs = types.ModuleType("vllm.logprobs")
    logprobs.Logprob = Logprob  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.logprobs", logprobs)
    return module


@dataclass
class FakeServer:
    """`vllm serve MODEL` on 127.0.0.1 (a free port); `requests` / `resolved` / `calls` record
    the completion bodies, the sampling params they resolved to, and the other POSTs;
    `scripts`: see the module doc."""

    model_dir: str
    logprobs_mode: str = "processed_logprobs"
    generation_config: dict[str, Any] = field(default_factory=dict)
    dev_mode: bool = True
    dtype: str = "torch.float32"
    """`--dtype` as the CPU build's /server_info reports it (tests/rollout/test_real_vllm.py)."""
    scripts: list[list[int]] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    resolved: list[SamplingParams] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def __enter__(self) -> FakeServer:
        self.vocab = FakeModel(self.model_dir).vocab
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        route = path.split("?")[0]
        if route not in ROUTES[method] or (route in DEV_ROUTES and not self.dev_mode):
            return 404, {"detail": "Not Found"}
        if route == "/v1/models":
            return 200, {"data": [{"id": self.model_dir}]}
        if route == "/server_info":
            return 200, {"vllm_config": {"model_config": {"logprobs_mode": self.logprobs_mode,
                                                          "dtype": self.dtype},
                                         "device_config": {"device": "cpu"}}}
        if route != "/v1/completions":
            self.calls.append((route, body))
            return 200, None
        return self.complete(body)

    def complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.requests.append(body)
        unknown = set(body) - set(REQUEST_FIELDS)
        if unknown:  # vLLM logs and ignores them; here a field the fake does not model fails
            return 400, {"error": {"message": f"fields not modelled: {sorted(unknown)}"}}
        kw = {k: body.get(k) for k in ("max_tokens", "n", "seed", "logprobs",
                                       "stop_token_ids", "skip_special_tokens")}
        for name in SERVER_DEFAULTED:  # user -> generation_config.json -> OpenAI default
            value = body.get(name)
            kw[name] = value if value is not None else self.generation_config.get(
                name, SAMPLING_FIELDS[name])
        try:
            sp = SamplingParams(**kw)
        except ValueError as err:
            return 400, {"error": {"message": str(err)}}
        self.resolved.append(sp)
        out = sample(body["prompt"], sp, self.vocab, self.scripts)
        logprobs = None if sp.logprobs is None else {
            "tokens": [f"token_id:{t}" for t in out.token_ids],
            "token_logprobs": [LOGPROB] * len(out.token_ids)}
        choice = {"index": 0, "text": "", "logprobs": logprobs,
                  "finish_reason": out.finish_reason,
                  "token_ids": out.token_ids if body.get("return_token_ids") else None}
        return 200, {"choices": [choice]}


def _handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}") if method == "POST" else {}
            code, payload = server.answer(method, self.path, body)
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._reply("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._reply("POST")

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
