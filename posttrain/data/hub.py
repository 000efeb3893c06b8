"""A fast check of whether the Hugging Face Hub can be reached.

Without it, asking an offline machine for a Hub name takes ~50 s of retries inside
``huggingface_hub`` before failing; a single short TCP connect tells the same thing at once.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """False when offline mode is set or the Hub endpoint does not accept a TCP connection."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers/datasets
        return False
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_cached(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    """True when ``filename`` of ``repo_id`` is already in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str)
    except Exception:  # malformed repo ids raise validation errors
        return False
