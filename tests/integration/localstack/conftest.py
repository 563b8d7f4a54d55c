"""One whole stack for every real-engine test of this folder.

`local_stack` is a `LocalStack` (directory, prefill + decode with KVPushConnector, colocated engine,
gateway, and a second gateway hosted in the prefill engine's API server; every process exporting spans to the
session's OTLP receiver, each engine's connector serving /metrics) started once for this package and stopped when
its last test ends, so its three engines are gone before other suites start theirs (tests/conftest.py runs this
folder first): the 24 GiB machine cannot hold every suite's engines at once (~3 GiB each). The stack runs with
mutual TLS and per-engine identities (when the openssl CLI is there to make certificates), so every test here also
proves the whole P/D path works with security on.
"""

from __future__ import annotations

import pytest

from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.pki import HAVE_OPENSSL
from kvpush.localstack.stack import LocalStack


@pytest.fixture(scope="package")
def local_stack(session_log_dir, otlp_receiver):
    """Directory, P/D engines with KVPushConnector, a colocated engine and the gateway, for this folder."""
    stack = LocalStack(spec=TinyModelSpec(), log_dir=session_log_dir / "localstack", progress=None,
                       engine_timeout_s=600.0, engine_env={"UCX_NET_DEVICES": "lo",
                                                           **otlp_receiver.env("kvpush-localstack-engine")},
                       service_env=otlp_receiver.env("kvpush-localstack"), mutual_tls=HAVE_OPENSSL,
                       first_token_from_prefill=True, hosted_gateway=True)
    stack.start()
    yield stack
    stack.stop()
