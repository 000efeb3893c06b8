"""Resumable training checkpoints: atomic, complete, the newest `keep_checkpoints` kept.

Layout: ``out_dir/checkpoints/step-00000012/`` holds ``model/`` (the trainer's `save` hook,
`from_pretrained`-loadable; a resume reads the policy's weights from it), ``sharded/`` (FSDP2
only: the policy's weights and AdamW state as each rank's shards, read instead) and
``trainer_state.pt`` (everything else an exact resume needs: optimizer states and schedules,
other trained modules, LoRA adapters, step, data position, RNG states, `Trainer.state_dict`,
the byte length of ``metrics.jsonl``, the history for summary.json).

Written to ``checkpoints/.tmp-step-N`` and renamed into place only when complete, so a crash
(even ``kill -9``) never damages the last good one; leftover ``.tmp-*`` directories are ignored
and cleared by the next write. ``trainer_state.pt`` holds tensors and plain Python values only
and is read with ``torch.load(weights_only=True)``.
More: docs/distributed.md, "Module notes", posttrain.engine.checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.config import BaseConfig, ConfigError, to_dict

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `out_dir/checkpoints`, oldest first, as (step, path)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if name.startswith("step-") and name[5:].isdigit() and (path / STATE_FILE).is_file():
            found.append((int(name[5:]), path))
    return sorted(found)


def find_resume(out_dir: str | Path, resume_from: str) -> Path | None:
    """The checkpoint `resume_from` names: "" none, "latest" the newest (None when there is
    none yet), else a checkpoint directory, which must exist and be complete."""
    if not resume_from:
        return None
    if resume_from == "latest":
        found = list_checkpoints(out_dir)
        return found[-1][1] if found else None
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"config key 'resume_from'={resume_from!r}: not a complete checkpoint "
                          f"(expected {path / STATE_FILE}); use 'latest' or a "
                          f"{CHECKPOINTS}/step-N directory")
    return path


def rng_state() -> dict[str, Any]:
    """python, torch CPU (and CUDA, numpy when present) global RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def tmp_path(out_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is renamed into place."""
    final = checkpoint_path(out_dir, step)
    return final.with_name(f".tmp-{final.name}")


def start_checkpoint(out_dir: str | Path, step: int) -> Path:
    """The empty temporary directory that the checkpoint of `step` is written into (other
    writers, such as FSDP2's sharded files, may add to it before `write_checkpoint`)."""
    tmp = tmp_path(out_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any],
                     save_model: Callable[[str], None] | None, keep: int,
                     started: bool = False) -> Path:
    """Write `state` (+ the model through `save_model(dir)`) atomically; keep the newest `keep`.

    `started`: `start_checkpoint` made the temporary directory already (keep what is in it).
    Returns the checkpoint directory.
    """
    final, tmp = checkpoint_path(out_dir, step), tmp_path(out_dir, step)
    if not started:
        start_checkpoint(out_dir, step)
    if save_model is not None:
        save_model(str(tmp / "model"))
    state_file = tmp / STATE_FILE
    with state_file.open("wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():  # the same step written again (a stop right after a periodic save)
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    for _, path in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(path)
    return final


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state of a checkpoint written by :func:`write_checkpoint` (on the CPU)."""
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trained_tensors(model: torch.nn.Module, groups: list[Any]) -> dict[str, torch.Tensor]:
    """The parameters of `model` that an optimizer group trains (LoRA adapters, heads), by
    name, on the CPU."""
    trained = {id(p) for g in groups for p in g.params}
    return {n: p.detach().cpu() for n, p in model.named_parameters() if id(p) in trained}


def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                   groups: list[Any]) -> None:
    """Copy saved trained parameters (`trained_tensors`) back into `model`, every one."""
    params = dict(model.named_parameters())
    wanted = set(trained_tensors(model, groups))
    if set(tensors) != wanted:
        raise ValueError(f"checkpoint's trained parameters do not match the model's: "
                         f"missing {sorted(wanted - set(tensors))[:3]}, unexpected "
                         f"{sorted(set(tensors) - wanted)[:3]}")
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)


def read_model_weights(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of `model` from a checkpoint's ``model/`` safetensors files.

    `save_pretrained` writes one name of each tied (shared) tensor; the others are filled in
    from it. Any other missing or unexpected key is an error.
    """
    from safetensors.torch import load_file

    folder = Path(path) / "model"
    files = [f for f in sorted(folder.glob("*.safetensors")) if not f.name.startswith("adapter")]
    if not files:
        raise ValueError(f"checkpoint {path}: no model weights under {folder}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    for names in aliases.values():
        have = [n for n in names if n in sd]
        for n in names:
            if n not in sd and have:
                sd[n] = sd[have[0]]
    expected = set(model.state_dict())
    if set(sd) != expected:
        raise ValueError(f"checkpoint {path}: model weights do not match the model: missing "
                         f"{sorted(expected - set(sd))[:3]}, unexpected "
                         f"{sorted(set(sd) - expected)[:3]}")
    return sd


def truncate_metrics(out_dir: str | Path, size: int | None, step: int) -> None:
    """Cut ``metrics.jsonl`` back to what it held when the checkpoint was written.

    `size` is its byte length then; if the file is shorter (rotated by hand) the rows logged
    after `step` are dropped instead. Either way no step is duplicated after a resume.
    """
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    if size is not None and path.stat().st_size >= size:
        with path.open("r+b") as fh:
            fh.truncate(size)
        return
    import json

    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
    path.write_text("".join(r + "\n" for r in kept))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_config(out_dir: str | Path, cfg: BaseConfig) -> None:
    import yaml

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
