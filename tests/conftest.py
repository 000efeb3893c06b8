"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import json
import os
import tempfile

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: N processes share the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, for every child
    # a working directory of its own: a run left with the default out_dir (runs/experiment)
    # locks it, and another worker's run there would be refused as a second run
    os.chdir(tempfile.mkdtemp(prefix=f"posttrain-{os.environ['PYTEST_XDIST_WORKER']}-"))

import pytest

from posttrain.models.loading import save_checkpoint
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory) -> dict[str, str]:
    """A random tiny Llama and 72 one-character prompts (answer "7"); the toy reward
    (`tests.trainers.toy_rewards:sevens`) counts '7's. Read-only: runs write to their own dirs."""
    root = tmp_path_factory.mktemp("toy_world")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c, "answer": "7"}) + "\n"
                            for c in "abcdefghijklmnopqrstuvwxyz0123456789" * 2))
    return {"model": str(root / "model"), "data": str(data), "root": str(root)}
