"""Principals from credentials (auth.py): the tokens file, certificate URIs, and what each principal may do."""

from __future__ import annotations

import pytest

from kvpush.services.directory.auth import (
    ANYONE,
    OPERATOR,
    Authenticator,
    Principal,
    Unauthenticated,
    principal_from_uri,
    read_tokens_file,
)
from kvpush.services.directory.errors import PermissionDenied


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


def test_certificate_uris_name_principals():
    """spiffe://kvpush/engine/<id> and spiffe://kvpush/operator; other URIs name nobody."""
    assert principal_from_uri("spiffe://kvpush/engine/decode-0") == Principal(engine_id="decode-0")
    assert principal_from_uri("spiffe://kvpush/operator") == OPERATOR
    assert principal_from_uri("spiffe://other/engine/decode-0") is None
    assert principal_from_uri("spiffe://kvpush/engine/") is None
    auth = Authenticator(mutual_tls=True)
    context = {"x509_subject_alternative_name": [b"localhost", b"spiffe://kvpush/engine/p1"]}
    assert auth.principal((), context) == Principal(engine_id="p1")
    with pytest.raises(Unauthenticated):
        auth.principal((), {"x509_subject_alternative_name": [b"localhost"]})


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
