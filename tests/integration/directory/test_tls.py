"""TLS and mutual TLS on the directory, with certificates made by the openssl CLI for this test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from kvpush.services.client import ChannelConfig, DirectoryCallError, DirectoryClient
from tests.fixtures.directory import PREFILL, register_request, running_directory
from tests.integration.directory.helpers import run

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    root = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kvpush-test-ca", cwd=root)
    (root / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=kvpush-{name}", cwd=root)
        extra = ["-extfile", "server.ext"] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *extra, cwd=root)
    return root


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
            async with DirectoryClient(mutual) as client:
                assert (await client.register_engine(register_request("p1", PREFILL))).lease_id
                assert [w.engine_id for w in await client.list_engines()] == ["p1"]
    run(body())
