"""Running untrusted (model-written) code: the jail, the supervisor, the judge and the wire.

Standard library and :mod:`posttrain.data` only. :func:`run_sandboxed` is the entry point;
:mod:`posttrain.rewards.code` is its client. The guarantees are in ``docs/sandbox.md``.
"""

import os
import threading

from posttrain.sandbox.jail import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
)

__all__ = ["SANDBOXES", "SandboxLimits", "SandboxResult", "SandboxUnavailableError",
           "run_sandboxed"]

SANDBOXES = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
"""The process's one bound on sandboxes at once (one per core): code rewards and the `python`
tool both hold it around `run_sandboxed`."""
