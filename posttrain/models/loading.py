"""Load a causal LM and its tokenizer from a local directory or a Hugging Face Hub name.

Local directories (e.g. a checkpoint written by ``save_pretrained``) never touch the network.
Anything else is treated as a Hub name; when the Hub cannot provide it (offline machine, typo,
gated repository) the error says so plainly and tells how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.data import hub

DTYPES: dict[str, Any] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


class ModelLoadError(OSError):
    """A model or tokenizer could not be loaded (bad local directory or unreachable Hub)."""


def resolve_dtype(dtype: str | torch.dtype) -> Any:
    """``"float32" | "bfloat16" | "float16" | "auto"`` (or a torch.dtype) to what HF expects."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {sorted(DTYPES)}")
    return DTYPES[dtype]


def _check_local_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} exists but is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json; expected a directory written "
            "by save_pretrained (config.json, model.safetensors, tokenizer files)")


def _preflight(what: str, path_or_name: str | Path, filename: str) -> None:
    """Fail at once (not after ~50 s of Hub retries) on a bad directory or an offline Hub."""
    path = Path(path_or_name)
    if path.exists():
        _check_local_dir(path)
    elif _is_path(str(path_or_name)):
        raise _load_error(what, path_or_name, FileNotFoundError(str(path_or_name)))
    elif not hub.is_cached(str(path_or_name), filename) and not hub.hub_reachable():
        raise _load_error(what, path_or_name, OSError("the Hub endpoint is unreachable"))


def load_tokenizer(path_or_name: str | Path, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` with a clear error; a missing pad token becomes EOS."""
    _preflight("tokenizer", path_or_name, "tokenizer_config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path_or_name), **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error("tokenizer", path_or_name, err) from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(
    path_or_name: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    tokenizer_path: str | Path | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    empty: bool = False,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``; ``model`` is an ``AutoModelForCausalLM`` in ``dtype``.

    ``tokenizer_path`` defaults to ``path_or_name``. The model's generation config gets the
    tokenizer's pad/eos ids when it lacks them. ``empty``: the same model built from its
    config on the ``meta`` device, no weights read (FSDP2 ranks that receive rank 0's).
    """
    torch_dtype = resolve_dtype(dtype)
    _preflight("model", path_or_name, "config.json")
    extra = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        extra["revision"] = revision
    tokenizer = load_tokenizer(tokenizer_path or path_or_name, **extra)
    try:
        model = (_empty_model(path_or_name, torch_dtype, extra) if empty else
                 AutoModelForCausalLM.from_pretrained(str(path_or_name), dtype=torch_dtype,
                                                      **extra, **model_kwargs))
    except (OSError, ValueError) as err:
        raise _load_error("model", path_or_name, err) from err
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        if gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _empty_model(path_or_name: str | Path, dtype: torch.dtype, extra: dict[str, Any]) -> Any:
    """The causal LM of `path_or_name`'s config on the ``meta`` device, with its generation
    config (as `from_pretrained` would set it)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(path_or_name), **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 trust_remote_code=extra["trust_remote_code"])
    with contextlib.suppress(OSError):  # none saved: from_config's default, as from_pretrained
        model.generation_config = GenerationConfig.from_pretrained(str(path_or_name), **extra)
    return model


def _is_path(name: str) -> bool:
    """A name that can only be a local path (absolute, ./, ../, ~/, or more than one /): never
    a Hub repository id (`org/name`)."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def _load_error(what: str, path_or_name: str | Path, err: Exception) -> ModelLoadError:
    if Path(path_or_name).exists():
        return ModelLoadError(f"could not load the {what} from local directory "
                              f"{str(path_or_name)!r}: {err}")
    if _is_path(str(path_or_name)):
        return ModelLoadError(f"could not load the {what}: the local path {str(path_or_name)!r}"
                              " does not exist (a local path: the Hub was not asked)")
    return ModelLoadError(
        f"could not load the {what} {str(path_or_name)!r}: it is not a local directory, so it "
        "was looked up on the Hugging Face Hub, which could not provide it (the machine may be "
        "offline, the name may be wrong, or the repository may be gated). Download it on a "
        "connected machine (e.g. `huggingface-cli download NAME --local-dir DIR`) and pass the "
        f"local directory instead. Underlying error: {type(err).__name__}: {err}")


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(model_or_path: Any) -> int | None:
    """The model's context length in tokens (`max_position_embeddings`, GPT-2's `n_positions`,
    ...), read from a model object's config or, for a path, from its config file alone
    (`AutoConfig`, before any weights load); None when it is not known."""
    config = getattr(model_or_path, "config", None)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(model_or_path))
        except (OSError, ValueError):
            return None
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path,
                    state_dict: dict[str, Any] | None = None) -> Path:
    """Write a `from_pretrained`-loadable safetensors checkpoint atomically.

    The files go to a temporary sibling directory that is renamed into place only when complete,
    so a crash never leaves a half-written checkpoint under `path`. `state_dict`: the weights to
    write instead of the model's own (the gathered full weights of an FSDP2-sharded model).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(tmp, safe_serialization=True, **extra)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
    return path
