"""One stack for this folder: a directory, a prefill and two decode vLLM CPU engines with KVPushConnector and the
gateway (first token from prefill, its default), with short first-byte bounds on both legs so a frozen engine is
failed over quickly. Started once for the package and stopped when its last test ends (tests/conftest.py runs this
folder early, before session-long engines start)."""

from __future__ import annotations

import pytest

from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.stack import LocalStack

# Seconds a leg may wait for its engine's response headers here (the gateway's default is 10).
FIRST_BYTE_BOUND_S = 3.0


@pytest.fixture(scope="package")
def gateway_stack(session_log_dir):
    """Directory, one prefill and two decode engines, and the gateway with 3 s first-byte bounds."""
    stack = LocalStack(spec=TinyModelSpec(), log_dir=session_log_dir / "gateway_reliability", progress=None,
                       engine_timeout_s=600.0, with_colocated=False, decode_engine_count=2,
                       gateway_args=("--prefill-first-byte-timeout", str(FIRST_BYTE_BOUND_S),
                                     "--decode-first-byte-timeout", str(FIRST_BYTE_BOUND_S)))
    stack.start()
    yield stack
    stack.stop()
