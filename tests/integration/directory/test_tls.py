"""TLS and mutual TLS on the directory, with certificates made by the openssl CLI for this test."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvpush.client import ChannelConfig, DirectoryCallError, DirectoryClient
from kvpush.localstack.pki import HAVE_OPENSSL, make_pki
from tests.fixtures.directory import PREFILL, register_request, running_directory
from tests.integration.directory.helpers import run

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and an operator client certificate, all signed by the CA."""
    return make_pki(tmp_path_factory.mktemp("pki"), {"client": "operator"})


def test_tls_server_accepts_verified_clients_only(pki):
    """Over TLS a client trusting the CA registers; a plaintext client cannot talk to it."""
    async def body():
        async with running_directory(tls_cert_file=str(pki / "server.pem"),
                                     tls_key_file=str(pki / "server.key")) as directory:
            config = ChannelConfig(address=directory.address, root_cert_file=str(pki / "ca.pem"))
            async with DirectoryClient(config) as client:
                assert (await client.register_engine(register_request("p1", PREFILL))).lease_id
            async with DirectoryClient(ChannelConfig(address=directory.address, max_attempts=1,
                                                     timeout_s=2)) as plain:
                with pytest.raises(DirectoryCallError) as caught:
                    await plain.list_engines()
                assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_mutual_tls_requires_a_client_certificate(pki):
    """With a client CA configured, a client without a certificate is refused; one with it is served."""
    async def body():
        async with running_directory(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                                     tls_client_ca_file=str(pki / "ca.pem"), token="tok") as directory:
            anonymous = ChannelConfig(address=directory.address, root_cert_file=str(pki / "ca.pem"), token="tok",
                                      max_attempts=1, timeout_s=2)
            async with DirectoryClient(anonymous) as client:
                with pytest.raises(DirectoryCallError) as caught:
                    await client.list_engines()
                assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            mutual = ChannelConfig(address=directory.address, root_cert_file=str(pki / "ca.pem"), token="tok",
                                   client_cert_file=str(pki / "client.pem"), client_key_file=str(pki / "client.key"))
            async with DirectoryClient(mutual) as client:  # the operator's certificate: inspects, registers nothing
                assert await client.list_engines() == []
                with pytest.raises(DirectoryCallError) as caught:
                    await client.register_engine(register_request("p1", PREFILL))
                assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
    run(body())
