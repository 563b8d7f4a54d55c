"""Principals from credentials (auth.py): the tokens file, certificate URIs, and what each principal may do."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvpush.directory.auth import (
    ANYONE,
    OPERATOR,
    Authenticator,
    Principal,
    Unauthenticated,
    principal_from_certificate,
    principal_from_uri,
    read_tokens_file,
)
from kvpush.directory.errors import PermissionDenied


def test_tokens_file_maps_tokens_to_principals(tmp_path):
    """Comments and blank lines are skipped; engine/<id> and operator are the two principals."""
    path = tmp_path / "tokens"
    path.write_text("# principal token\n\nengine/p1 aaaaaaaaaaaaaaaaaaaa\noperator bbbbbbbbbbbbbbbbbbbb  # gateway\n")
    auth = Authenticator(tokens_file=str(path))
    assert auth.identities and auth.token_required
    assert auth.principal((("authorization", "Bearer aaaaaaaaaaaaaaaaaaaa"),), None) == Principal(engine_id="p1")
    assert auth.principal((("authorization", "Bearer bbbbbbbbbbbbbbbbbbbb"),), None) == OPERATOR
    assert not auth.admits((("authorization", "Bearer cccccccccccccccccccc"),))
    with pytest.raises(Unauthenticated):
        auth.principal((), None)


@pytest.mark.parametrize("text", ["engine/p1\n", "root aaaaaaaaaaaaaaaaaaaa\n", "engine/p1 short\n",
                                  "engine/ aaaaaaaaaaaaaaaaaaaa\n"])
def test_malformed_tokens_files_are_refused(tmp_path, text):
    """A line without a token, an unknown principal, a short token: ValueError naming the line."""
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match="tokens:1"):
        read_tokens_file(str(path))


def certificate_pem(*names: x509.GeneralName) -> bytes:
    """A self-signed certificate (real X.509, EC key) with these subject alternative names."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpush-test")])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now)
               .not_valid_after(now + datetime.timedelta(days=1)))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


URI, DNS, EMAIL = x509.UniformResourceIdentifier, x509.DNSName, x509.RFC822Name


def test_certificate_uris_name_principals():
    """spiffe://kvpush/engine/<id> and spiffe://kvpush/operator; other URIs name nobody."""
    assert principal_from_uri("spiffe://kvpush/engine/decode-0") == Principal(engine_id="decode-0")
    assert principal_from_uri("spiffe://kvpush/operator") == OPERATOR
    assert principal_from_uri("spiffe://other/engine/decode-0") is None
    assert principal_from_uri("spiffe://kvpush/engine/") is None
    assert principal_from_uri("spiffe://kvpush/engine/d1/../x") is None  # not an engine id
    auth = Authenticator(mutual_tls=True)
    pem = certificate_pem(DNS("localhost"), URI("spiffe://kvpush/engine/p1"))
    assert auth.principal((), {"x509_pem_cert": [pem]}) == Principal(engine_id="p1")
    with pytest.raises(Unauthenticated, match="no identity"):
        auth.principal((), {"x509_pem_cert": [certificate_pem(DNS("localhost"))]})


@pytest.mark.parametrize("names", [
    (DNS("spiffe://kvpush/engine/d1"),),
    (DNS("spiffe://kvpush/operator"),),
    (EMAIL("spiffe://kvpush/operator"),),
])
def test_only_uri_sans_name_anyone(names):
    """A DNS or e-mail SAN spelling a kvpush URI names nobody (the certificate has no identity)."""
    pem = certificate_pem(*names)
    assert principal_from_certificate(pem) is None
    # Even when gRPC's own property list (which mixes every SAN kind) would show the text.
    context = {"x509_pem_cert": [pem], "x509_subject_alternative_name": [names[0].value.encode()]}
    with pytest.raises(Unauthenticated, match="no identity"):
        Authenticator(mutual_tls=True).principal((), context)


def test_an_extra_dns_san_does_not_change_the_identity():
    """An engine certificate with a DNS SAN spelling the operator's URI after its URI SAN is still the engine."""
    pem = certificate_pem(URI("spiffe://kvpush/engine/e1"), DNS("spiffe://kvpush/operator"))
    assert principal_from_certificate(pem) == Principal(engine_id="e1")


@pytest.mark.parametrize("names, message", [
    ((URI("spiffe://kvpush/engine/e1"), URI("spiffe://kvpush/operator")), "has 2 URI SANs"),
    ((URI("spiffe://kvpush/engine/e1"), URI("spiffe://kvpush/engine/e1")), "has 2 URI SANs"),
    ((URI("spiffe://other/engine/e1"),), "names no kvpush principal"),
])
def test_ambiguous_or_foreign_uri_sans_are_refused(names, message):
    """Two URI SANs (even equal ones) or one outside kvpush's namespace: UNAUTHENTICATED naming why."""
    with pytest.raises(Unauthenticated, match=message):
        Authenticator(mutual_tls=True).principal((), {"x509_pem_cert": [certificate_pem(*names)]})


def test_what_each_principal_may_do():
    """An engine acts as itself and on its transfers; the operator plans and inspects; anyone does everything."""
    engine = Principal(engine_id="p1")
    engine.require_engine("p1")
    engine.require_party(("p1", "d1"), "t")
    with pytest.raises(PermissionDenied):
        engine.require_engine("d1")
    with pytest.raises(PermissionDenied):
        engine.require_operator("PlanTransfer")
    with pytest.raises(PermissionDenied):
        engine.require_party(("p2", "d1"), "t")
    OPERATOR.require_operator("PlanTransfer")
    OPERATOR.require_engine("d1", or_operator=True)
    with pytest.raises(PermissionDenied):
        OPERATOR.require_engine("d1")
    for check in (lambda: ANYONE.require_engine("x"), lambda: ANYONE.require_operator("x"),
                  lambda: ANYONE.require_party(("a", "b"), "t")):
        check()
    assert Authenticator().principal((), None) is ANYONE and not Authenticator().identities
