"""One stack with two decode engines for this folder: the soak's CI form and the failover test share it.

`soak_stack` is bench/soak.py's stack (directory with 30 s leases, one prefill and two decode vLLM CPU engines
with KVPushConnector, a colocated reference, the gateway with failover on), started once for this package and
stopped when its last test ends, so its four engines are gone before other suites start theirs
(tests/conftest.py runs this folder early).
"""

from __future__ import annotations

import pytest

from tests.fixtures.bench_scripts import load_bench


@pytest.fixture(scope="package")
def soak():
    """The bench/soak.py module."""
    return load_bench("soak")


@pytest.fixture(scope="package")
def soak_stack(soak, session_log_dir):
    """The soak's stack, up for this folder's tests."""
    stack = soak.soak_stack(session_log_dir / "reliability", progress=None)
    stack.start()
    yield stack
    stack.stop()
