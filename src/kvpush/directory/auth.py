"""Who is calling: principals from credentials, and the checks every RPC makes with them.

A caller's principal comes from its credentials (docs/security.md):
- mutual TLS: the URI SAN of the client certificate, `spiffe://kvpush/engine/<engine_id>` for an
  engine, `spiffe://kvpush/operator` for a gateway or an inspection tool. Only URI SANs name anyone
  (a DNS or e-mail SAN spelling the same text names nobody), read from the peer certificate itself
  (`x509_pem_cert`), and a certificate carries exactly one: two or more URI SANs are refused
  (UNAUTHENTICATED), whatever they say; none leaves the token, if any, to name the caller;
- a per-engine token: `--tokens-file` maps tokens to the same principals, one `<principal> <token>`
  a line, principal `engine/<engine_id>` or `operator` (`#` starts a comment). The file is re-read
  when it changes (rotation without a restart).
A shared `--token` admits callers (UNAUTHENTICATED before the request is read) but names nobody.

Modes: identities are on when a tokens file or a client CA (mutual TLS) is configured: then every
call needs a principal (UNAUTHENTICATED otherwise); an engine acts only as itself, the operator
plans, cancels and inspects. Without identities every caller is `ANYONE` (may act as every engine
and as the operator), which the directory logs loudly at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from cryptography import x509

from kvpush.directory.errors import DirectoryError, PermissionDenied
from kvpush.directory.validation import ID_PATTERN
from kvpush.observability import get_logger

log = get_logger("directory.auth")
# gRPC invocation metadata: (key, value) pairs, binary values as bytes (None: no metadata).
Metadata = Iterable[tuple[str, str | bytes]] | None

ENGINE_URI_PREFIX = "spiffe://kvpush/engine/"
OPERATOR_URI = "spiffe://kvpush/operator"
# How often a changed tokens file is noticed (its mtime is checked at most this often).
TOKENS_RELOAD_INTERVAL_S = 1.0


class Unauthenticated(DirectoryError):
    """No acceptable credentials (UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: one engine, the operator, or (without identities) anyone."""

    engine_id: str = ""
    operator: bool = False
    anyone: bool = False

    def __str__(self) -> str:
        if self.anyone:
            return "anyone"
        return "operator" if self.operator else f"engine/{self.engine_id}"

    def require_engine(self, engine_id: str, *, or_operator: bool = False) -> None:
        """Refuse PERMISSION_DENIED unless the caller is `engine_id` (or, when allowed, the operator)."""
        if self.anyone or self.engine_id == engine_id or (or_operator and self.operator):
            return
        raise PermissionDenied(f"{self} may not act for engine {engine_id!r}")

    def require_operator(self, what: str) -> None:
        """Refuse PERMISSION_DENIED unless the caller is the operator."""
        if not (self.anyone or self.operator):
            raise PermissionDenied(f"{what} is the operator's; {self} may not")

    def require_party(self, engine_ids: tuple[str, str], what: str) -> None:
        """Refuse PERMISSION_DENIED unless the caller is the operator or one of `engine_ids`."""
        if not (self.anyone or self.operator or self.engine_id in engine_ids):
            raise PermissionDenied(f"{self} takes no part in {what}")


ANYONE = Principal(anyone=True)
OPERATOR = Principal(operator=True)


def parse_principal(text: str) -> Principal:
    """`engine/<id>` or `operator` (the tokens file's and the SAN's vocabulary)."""
    if text == "operator":
        return OPERATOR
    if text.startswith("engine/") and len(text) > len("engine/"):
        return Principal(engine_id=text[len("engine/"):])
    raise ValueError(f"principal {text!r} is neither 'operator' nor 'engine/<engine_id>'")


def principal_from_uri(uri: str) -> Principal | None:
    """The principal a certificate URI SAN names, None for another URI (or an engine id that is no valid id)."""
    if uri == OPERATOR_URI:
        return OPERATOR
    if uri.startswith(ENGINE_URI_PREFIX) and ID_PATTERN.fullmatch(uri[len(ENGINE_URI_PREFIX):]):
        return Principal(engine_id=uri[len(ENGINE_URI_PREFIX):])
    return None


@lru_cache(maxsize=1024)
def certificate_uris(pem: bytes) -> tuple[str, ...]:
    """Every URI SAN of a PEM certificate, in order (other SAN kinds are not identities); cached per certificate."""
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError as error:
        raise Unauthenticated(f"the client certificate could not be parsed: {error}") from None
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(names.get_values_for_type(x509.UniformResourceIdentifier))


def principal_from_certificate(pem: bytes) -> Principal | None:
    """The principal a client certificate names: its one URI SAN (None: it has no URI SAN).

    Unauthenticated for two or more URI SANs, or one that names no kvpush principal.
    """
    uris = certificate_uris(pem)
    if not uris:
        return None
    if len(uris) > 1:
        raise Unauthenticated(f"the client certificate has {len(uris)} URI SANs; a kvpush identity "
                              "needs exactly one")
    principal = principal_from_uri(uris[0])
    if principal is None:
        raise Unauthenticated(f"the client certificate's URI SAN {uris[0][:200]!r} names no kvpush principal "
                              f"({ENGINE_URI_PREFIX}<engine_id> or {OPERATOR_URI})")
    return principal


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def read_tokens_file(path: str) -> dict[bytes, Principal]:
    """Token digests -> principals from a tokens file; ValueError names a malformed line."""
    tokens: dict[bytes, Principal] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{number}: expected '<principal> <token>'")
            if len(parts[1]) < 16:
                raise ValueError(f"{path}:{number}: a token must be at least 16 characters")
            try:
                tokens[_digest(parts[1])] = parse_principal(parts[0])
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return tokens


class Authenticator:
    """Resolves a call's principal from its metadata and TLS peer (module docstring)."""

    def __init__(self, shared_token: str = "", tokens_file: str = "", mutual_tls: bool = False) -> None:
        self._shared = f"Bearer {shared_token}".encode() if shared_token else b""
        self._tokens_file = tokens_file
        self._tokens: dict[bytes, Principal] = read_tokens_file(tokens_file) if tokens_file else {}
        self._tokens_mtime = os.stat(tokens_file).st_mtime_ns if tokens_file else 0
        self._tokens_checked = time.monotonic()
        self._mutual_tls = mutual_tls
        self.identities = bool(tokens_file) or mutual_tls
        # A bearer token is required when any token is configured (checked before the request is read).
        self.token_required = bool(shared_token or tokens_file)

    def describe(self) -> str:
        """One phrase for the start-up log."""
        if not self.identities:
            return "no identities: every caller may act as every engine and as the operator"
        sources = [s for s, on in (("client certificates", self._mutual_tls), ("tokens file", self._tokens_file))
                   if on]
        return "per-engine identities from " + " and ".join(sources)

    def _reload_tokens(self) -> None:
        now = time.monotonic()
        if not self._tokens_file or now - self._tokens_checked < TOKENS_RELOAD_INTERVAL_S:
            return
        self._tokens_checked = now
        try:
            mtime = os.stat(self._tokens_file).st_mtime_ns
            if mtime != self._tokens_mtime:
                self._tokens = read_tokens_file(self._tokens_file)
                self._tokens_mtime = mtime
                log.info("tokens file reloaded", principal_count=len(self._tokens))
        except (OSError, ValueError) as error:
            # Keep the last good tokens: a half-written file must not lock every engine out.
            log.warning("tokens file changed but could not be read; keeping the previous tokens", error=str(error))

    def _bearer(self, metadata: Metadata) -> bytes:
        for key, value in metadata or ():
            if key == "authorization":
                return value.encode() if isinstance(value, str) else bytes(value)
        return b""

    def admits(self, metadata: Metadata) -> bool:
        """The early check (headers only): a required token is present and known."""
        if not self.token_required:
            return True
        presented = self._bearer(metadata)
        if self._shared and hmac.compare_digest(presented, self._shared):
            return True
        self._reload_tokens()
        return presented.startswith(b"Bearer ") and _digest(presented[7:]) in self._tokens

    def principal(self, metadata: Metadata, auth_context: Mapping[str, Sequence[bytes]] | None) -> Principal:
        """The caller's principal; raises Unauthenticated when identities are on and none is proved."""
        if not self.identities:
            return ANYONE
        from_cert = None
        if self._mutual_tls and auth_context:
            certificates = auth_context.get("x509_pem_cert", ())
            if certificates:
                from_cert = principal_from_certificate(bytes(certificates[0]))
        presented = self._bearer(metadata)
        from_token = self._tokens.get(_digest(presented[7:])) if presented.startswith(b"Bearer ") else None
        if from_cert and from_token and from_cert != from_token:
            raise Unauthenticated(f"the certificate names {from_cert}, the token {from_token}")
        principal = from_cert or from_token
        if principal is None:
            raise Unauthenticated("no identity: present a client certificate with one kvpush URI SAN or a "
                                  "per-engine token")
        return principal
