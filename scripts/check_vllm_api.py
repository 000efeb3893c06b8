"""Check the vLLM surface posttrain uses against a vLLM wheel's source, without importing it.

The CPU tests run the vLLM samplers against a stand-in (tests/rollout/fake_vllm.py); this script
checks that every name the stand-in models exists in the real release with the same signature,
fields, defaults and limits, by reading the wheel's Python files with `ast`:

    python scripts/check_vllm_api.py                  # vllm==PINNED, via pip download --no-deps
    python scripts/check_vllm_api.py --version 0.34.0 # another release
    python scripts/check_vllm_api.py --wheel path/to/vllm-*.whl

One line per check (ok / FAIL); exits 1 when any fails. Nothing is installed or imported from
vLLM, so it runs on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.rollout.vllm_sampler import NEUTRAL  # noqa: E402
from tests.rollout import fake_vllm as fake  # noqa: E402

PINNED = "0.33.0"
WEIGHT_TRANSFER_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update",
                          "/update_weights", "/finish_weight_update")


class Source:
    """The parsed Python files of a vLLM wheel."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.names = [n for n in self.zip.namelist() if n.endswith(".py")]
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.zip.read(path).decode())
        return self._trees[path]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise LookupError(f"class {name} not in {path}")

    def func(self, node: ast.AST, name: str) -> ast.FunctionDef:
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return item  # type: ignore[return-value]
        raise LookupError(f"function {name} not found")


def fields(cls: ast.ClassDef) -> dict[str, str | None]:
    """Annotated class attributes -> the source of their default (None: no default)."""
    return {n.target.id: (ast.unparse(n.value) if n.value is not None else None)
            for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def params(fn: ast.FunctionDef) -> list[tuple[str, str | None]]:
    """(name, default source) of every parameter but self, positional then keyword-only."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = list(zip([p.arg for p in pos], defaults, strict=True))
    out += [(p.arg, ast.unparse(d) if d is not None else None)
            for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return [p for p in out if p[0] != "self"]


def literal(src: Source, path: str, name: str) -> tuple[str, ...]:
    """The values of `name = Literal[...]` in `path`."""
    for node in src.tree(path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name
                                                for t in node.targets):
            return tuple(ast.literal_eval(e) for e in node.value.slice.elts)  # type: ignore
    raise LookupError(f"{name} not in {path}")


def _number(node: ast.AST) -> float | None:
    try:
        v = ast.literal_eval(node)
    except ValueError:
        return None
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def bounds(fn: ast.FunctionDef, name: str) -> tuple[float | None, bool, float | None, bool]:
    """(low, low inclusive, high, high inclusive) of `self.<name>` as `fn` refuses values:
    `if not a <= self.x <= b: raise` is a range; `if self.x > c: raise` a bound."""
    low, low_in, high, high_in = None, False, None, False
    ops = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If) or not any(isinstance(n, ast.Raise) for n in node.body):
            continue
        accept = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
        test = node.test.operand if accept else node.test
        parts = test.values if isinstance(test, ast.BoolOp) else [test]
        for cmp in (p for p in parts if isinstance(p, ast.Compare)):
            items = [cmp.left, *cmp.comparators]
            for left, op, right in zip(items, cmp.ops, items[1:], strict=False):
                if type(op) not in ops:
                    continue
                sym = ops[type(op)]
                if ast.unparse(left) == f"self.{name}" and _number(right) is not None:
                    v, subject_left = _number(right), True
                elif ast.unparse(right) == f"self.{name}" and _number(left) is not None:
                    v, subject_left = _number(left), False
                else:
                    continue
                upper = (sym in "<=" and subject_left) or (sym in ">=" and not subject_left)
                strict = sym in ("<", ">")
                if accept:  # the comparison says what is allowed
                    if upper:
                        high, high_in = v, not strict
                    else:
                        low, low_in = v, not strict
                elif upper:  # x < c refused: c is the lowest allowed
                    low, low_in = v, strict
                else:
                    high, high_in = v, strict
    return low, low_in, high, high_in


def routes(src: Source) -> dict[str, set[str]]:
    """HTTP method -> every path in a `@router.get/post("...")` / `@app...` decorator."""
    out: dict[str, set[str]] = {"GET": set(), "POST": set()}
    for name in (n for n in src.names if n.startswith("vllm/entrypoints/")):
        for node in ast.walk(src.tree(name)):
            for dec in getattr(node, "decorator_list", []):
                f = getattr(dec, "func", None)
                if (isinstance(f, ast.Attribute) and f.attr in ("get", "post") and dec.args
                        and isinstance(dec.args[0], ast.Constant)):
                    out[f.attr.upper()].add(dec.args[0].value)
    return out


Check = Callable[[Source], list[str]]
"""A check returns its problems (empty: ok)."""


def check_llm(src: Source) -> list[str]:
    """LLM(...) keywords: `LLM.__init__` parameters or `EngineArgs` fields; their values."""
    known = {n for n, _ in params(src.func(src.cls("vllm/entrypoints/llm.py", "LLM"),
                                           "__init__"))}
    known |= set(fields(src.cls("vllm/engine/arg_utils.py", "EngineArgs")))
    bad = [f"LLM keyword {k!r} is neither an LLM.__init__ parameter nor an EngineArgs field"
           for k in fake.LLM_KWARGS if k not in known]
    modes = literal(src, "vllm/config/model.py", "LogprobsMode")
    backends = literal(src, "vllm/config/parallel.py", "DistributedExecutorBackend")
    bad += [f"LogprobsMode {modes} != fake {fake.LOGPROBS_MODES}"] * (
        set(modes) != set(fake.LOGPROBS_MODES))
    bad += [f"DistributedExecutorBackend {backends} != fake {fake.EXECUTOR_BACKENDS}"] * (
        set(backends) != set(fake.EXECUTOR_BACKENDS))
    return bad


def check_sampling(src: Source) -> list[str]:
    """SamplingParams: every field the fake has, its default, and its limits."""
    cls = src.cls("vllm/sampling_params.py", "SamplingParams")
    real = fields(cls)
    bad = [f"SamplingParams.{k}: missing" for k in fake.SAMPLING_FIELDS if k not in real]
    bad += [f"SamplingParams.{k}: default {real[k]} != fake {v!r}"
            for k, v in fake.SAMPLING_FIELDS.items() if k in real and real[k] != repr(v)]
    verify = src.func(cls, "_verify_args")
    bad += [f"SamplingParams.{k} limits {bounds(verify, k)} != fake {v}"
            for k, v in fake.SAMPLING_LIMITS.items() if bounds(verify, k) != v]
    return bad


def check_methods(src: Source) -> list[str]:
    """LLM methods: the fake's parameters (names, order, defaults) are the real ones."""
    llm = src.cls("vllm/entrypoints/llm.py", "LLM")
    bad = []
    for name in ("sleep", "wake_up", "reset_prefix_cache", "apply_model", "generate"):
        real = [n for n, _ in params(src.func(llm, name))]
        mine = [p for p in inspect.signature(getattr(fake.LLM, name)).parameters if p != "self"]
        if real != mine:
            bad.append(f"LLM.{name}{tuple(real)} != fake {tuple(mine)}")
        defaults = dict(params(src.func(llm, name)))
        for p in inspect.signature(getattr(fake.LLM, name)).parameters.values():
            if p.name in ("self", "prompts", "func") or p.name not in defaults:
                continue
            if name != "generate" and defaults[p.name] != repr(p.default):
                bad.append(f"LLM.{name}({p.name}={defaults[p.name]}) != fake {p.default!r}")
    if src.func(llm, "wake_up").returns is None or \
            ast.unparse(src.func(llm, "wake_up").returns) != "bool":
        bad.append("LLM.wake_up does not return bool (fully awake)")
    return bad


def check_engine_semantics(src: Source) -> list[str]:
    """What the fake assumes of vLLM's insides: no LLMEngine.shutdown; its teardown destroys
    the default process group; the worker reseeds python/numpy/torch; wake resumes the
    scheduler only when fully awake."""
    bad = []
    engine = src.cls("vllm/v1/engine/llm_engine.py", "LLMEngine")
    if any(isinstance(n, ast.FunctionDef) and n.name == "shutdown" for n in engine.body):
        bad.append("LLMEngine has shutdown (the fake and VLLMColocateSampler.close assume not)")
    teardown = ast.unparse(src.func(src.tree("vllm/distributed/parallel_state.py"),
                                    "destroy_distributed_environment"))
    if "torch.distributed.destroy_process_group()" not in teardown:
        bad.append("destroy_distributed_environment no longer destroys the default group")
    seed = ast.unparse(src.func(src.tree("vllm/utils/torch_utils.py"), "set_random_seed"))
    bad += [f"set_random_seed no longer calls {c}" for c in
            ("random.seed(seed)", "np.random.seed(seed)", "torch.manual_seed(seed)")
            if c not in seed]
    wake = src.func(src.cls("vllm/v1/engine/core.py", "EngineCore"), "wake_up")
    guarded = [n for n in ast.walk(wake) if isinstance(n, ast.If)
               and ast.unparse(n.test) == "fully_awake" and "resume_scheduler" in ast.unparse(n)]
    bad += ["EngineCore.wake_up no longer resumes the scheduler only when fully awake"] * (
        not guarded)
    return bad


def check_outputs(src: Source) -> list[str]:
    """Logprob, CompletionOutput: the fake's fields, in order."""
    bad = []
    for path, name, cls in (("vllm/logprobs.py", "Logprob", fake.Logprob),
                            ("vllm/outputs.py", "CompletionOutput", fake.CompletionOutput)):
        real = list(fields(src.cls(path, name)))
        mine = list(cls.__dataclass_fields__)
        if real[:len(mine)] != mine and not set(mine) <= set(real):
            bad.append(f"{name} fields {real} do not hold the fake's {mine}")
    return bad


def check_server(src: Source) -> list[str]:
    """Routes, request fields, the fields filled from generation_config, /server_info."""
    found = routes(src)
    bad = [f"{m} {r}: no such route" for m, rs in fake.ROUTES.items() for r in rs
           if r not in found[m]]
    request = src.cls("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest")
    real = fields(request)
    bad += [f"CompletionRequest.{k}: missing" for k in fake.REQUEST_FIELDS if k not in real]
    defaults = next(ast.literal_eval(n.value) for n in request.body
                    if isinstance(n, ast.AnnAssign)
                    and getattr(n.target, "id", "") == "_DEFAULT_SAMPLING_PARAMS")
    if set(defaults) != set(fake.SERVER_DEFAULTED):
        bad.append(f"fields filled from generation_config {sorted(defaults)} != fake "
                   f"{sorted(fake.SERVER_DEFAULTED)}")
    bad += [f"NEUTRAL[{k!r}]={v} is not vLLM's own default {defaults.get(k)}"
            for k, v in NEUTRAL.items() if defaults.get(k) != v]
    info = ast.unparse(src.tree("vllm/entrypoints/serve/dev/server_info/api_router.py"))
    bad += ["/server_info has no config_format=json"] * ("config_format" not in info
                                                          or "'json'" not in info)
    bad += ["ModelConfig has no logprobs_mode"] * (
        "logprobs_mode" not in fields(src.cls("vllm/config/model.py", "ModelConfig")))
    return bad


def check_server_side(src: Source) -> list[str]:
    """What `vllm serve` flags, env vars and the worker extension / NCCL group rely on."""
    args = fields(src.cls("vllm/engine/arg_utils.py", "EngineArgs"))
    bad = [f"EngineArgs.{k} (--{k.replace('_', '-')}): missing"
           for k in ("logprobs_mode", "worker_extension_cls", "enable_sleep_mode") if k not in args]
    envs = fields(src.cls("vllm/envs.py", "_EnvVars")) if _has_class(src, "vllm/envs.py",
                                                                    "_EnvVars") else {}
    text = src.zip.read("vllm/envs.py").decode()
    bad += [f"env {e}: missing" for e in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                          "VLLM_SERVER_DEV_MODE") if e not in envs and
            f'"{e}"' not in text]
    nccl = src.cls("vllm/distributed/device_communicators/pynccl.py", "PyNcclCommunicator")
    want = {"__init__": ["group", "device"], "broadcast": ["tensor", "src", "stream"]}
    bad += [f"PyNcclCommunicator.{m}{tuple(p)}: not a prefix of its parameters"
            for m, p in want.items() if [n for n, _ in params(src.func(nccl, m))][:len(p)] != p]
    group = src.cls("vllm/distributed/utils.py", "StatelessProcessGroup")
    got = [n for n, _ in params(src.func(group, "create"))][:4]
    bad += [f"StatelessProcessGroup.create{tuple(got)}"] * (
        got != ["host", "port", "rank", "world_size"])
    src.func(src.tree("vllm/distributed/parallel_state.py"), "get_world_group")
    return bad


def _has_class(src: Source, path: str, name: str) -> bool:
    try:
        src.cls(path, name)
    except LookupError:
        return False
    return True


CHECKS: dict[str, Check] = {
    "LLM keywords and values": check_llm, "SamplingParams fields, defaults, limits": check_sampling,
    "LLM method signatures": check_methods, "engine semantics": check_engine_semantics,
    "output records": check_outputs, "server routes and request fields": check_server,
    "server flags, env, NCCL pieces": check_server_side}


def wheel_for(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    f"vllm=={version}", "-d", str(into)], check=True)
    return next(into.glob(f"vllm-{version}-*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=PINNED)
    ap.add_argument("--wheel", type=Path, default=None, help="a downloaded vllm wheel")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or wheel_for(args.version, Path(tmp))
        src = Source(wheel)
        print(f"check_vllm_api: {wheel.name}")
        failed = 0
        for title, check in CHECKS.items():
            try:
                problems = check(src)
            except (LookupError, KeyError, StopIteration) as err:
                problems = [f"not found: {err}"]
            print(f"{'ok  ' if not problems else 'FAIL'} {title}")
            for p in problems:
                print(f"     {p}")
            failed += bool(problems)
        found = routes(src)["POST"]
        have = [r for r in WEIGHT_TRANSFER_ROUTES if r in found]
        print(f"info vLLM's own weight-transfer routes present: {have or 'none'}")
    print(f"check_vllm_api: {'FAIL' if failed else 'PASS'} ({len(CHECKS) - failed}/"
          f"{len(CHECKS)} checks)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
