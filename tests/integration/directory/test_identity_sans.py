"""Which certificate names whom, over real mutual TLS: only a certificate's one URI SAN is an identity.

The certificates are signed by the directory's trusted client CA: every one of them passes the TLS
handshake, so each refusal here is the directory's identity rule, not TLS.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvpush.client import ChannelConfig
from kvpush.localstack.pki import HAVE_OPENSSL, make_certificate, make_pki
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from tests.fixtures.directory import DECODE, PREFILL, register_request, running_directory
from tests.integration.directory.helpers import run

# name -> subjectAltName of a client certificate signed by the trusted CA.
CERTIFICATES = {
    "dns_d1": "DNS:spiffe://kvpush/engine/d1",
    "dns_operator": "DNS:spiffe://kvpush/operator",
    "email_operator": "email:spiffe://kvpush/operator",
    "engine_plus_dns_operator": "URI:spiffe://kvpush/engine/e1,DNS:spiffe://kvpush/operator",
    "two_uris": "URI:spiffe://kvpush/engine/e1,URI:spiffe://kvpush/operator",
    "foreign_uri": "URI:spiffe://example/operator",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The CA, the server, d1 and the operator (URI SANs), and the certificates above."""
    if not HAVE_OPENSSL:
        pytest.skip("needs the openssl CLI")
    root = make_pki(tmp_path_factory.mktemp("pki-sans"), {"d1": "engine/d1", "operator": "operator"})
    for name, san in CERTIFICATES.items():
        make_certificate(root, name, san)
    return root


async def _call(pki: Path, address: str, name: str, method: str, request):
    """One unary call with `name`'s certificate; returns (status code, details)."""
    config = ChannelConfig(address=address, root_cert_file=str(pki / "ca.pem"),
                           client_cert_file=str(pki / f"{name}.pem"), client_key_file=str(pki / f"{name}.key"))
    channel = config.create_channel()
    try:
        await getattr(dgrpc.KVDirectoryServiceStub(channel), method)(request, timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    finally:
        await channel.close()


def test_only_one_uri_san_names_the_caller(pki):
    """DNS/e-mail SANs name nobody; an extra DNS SAN changes nothing; two URI SANs or a foreign one are refused."""
    async def body():
        async with running_directory(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                                     tls_client_ca_file=str(pki / "ca.pem")) as directory:
            address = directory.address
            code, _ = await _call(pki, address, "d1", "RegisterEngine", register_request("d1", DECODE))
            assert code == grpc.StatusCode.OK
            lease = directory.server.state.get_engine("d1")[0].lease_id

            # A DNS SAN spelling d1's URI may not register as d1 (its lease must stay as it is).
            code, details = await _call(pki, address, "dns_d1", "RegisterEngine", register_request("d1", DECODE))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "no identity" in details, details
            assert directory.server.state.get_engine("d1")[0].lease_id == lease

            # DNS or e-mail SANs spelling the operator's URI are not the operator.
            for name in ("dns_operator", "email_operator"):
                code, details = await _call(pki, address, name, "ListEngines", dpb.ListEnginesRequest())
                assert code == grpc.StatusCode.UNAUTHENTICATED and "no identity" in details, (name, details)

            # An engine certificate with an extra DNS SAN naming the operator is the engine, nothing more.
            code, details = await _call(pki, address, "engine_plus_dns_operator", "ListEngines",
                                        dpb.ListEnginesRequest())
            assert code == grpc.StatusCode.PERMISSION_DENIED and "engine/e1" in details, details
            code, _ = await _call(pki, address, "engine_plus_dns_operator", "RegisterEngine",
                                  register_request("e1", PREFILL))
            assert code == grpc.StatusCode.OK

            # Two URI SANs: refused whichever comes last; a URI outside kvpush names nobody.
            code, details = await _call(pki, address, "two_uris", "ListEngines", dpb.ListEnginesRequest())
            assert code == grpc.StatusCode.UNAUTHENTICATED and "has 2 URI SANs" in details, details
            code, details = await _call(pki, address, "foreign_uri", "ListEngines", dpb.ListEnginesRequest())
            assert code == grpc.StatusCode.UNAUTHENTICATED and "names no kvpush principal" in details, details

            # The operator's real certificate still works.
            code, _ = await _call(pki, address, "operator", "ListEngines", dpb.ListEnginesRequest())
            assert code == grpc.StatusCode.OK
    run(body())
