"""Running untrusted (model-written) code: the jail, the supervisor, the judge and the wire.

Standard library and :mod:`posttrain.data` only. :func:`run_sandboxed` is the entry point;
:mod:`posttrain.rewards.code` is its client. The guarantees are in ``docs/sandbox.md``.
"""

from posttrain.sandbox.run import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
)

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailableError", "run_sandboxed"]
