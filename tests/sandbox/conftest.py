"""The sandbox tests' fixtures."""

from __future__ import annotations

import psutil
import pytest

from tests.sandbox import test_adversarial_programs as adversarial


@pytest.fixture(autouse=True)
def _children_before_the_test():
    """Descendants alive when a test starts are not the test's (`_own_children` leaves them out)."""
    adversarial._EARLIER.clear()
    adversarial._EARLIER.update((p.pid, p.create_time())
                                for p in psutil.Process().children(recursive=True))
    yield
