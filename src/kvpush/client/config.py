"""How a client reaches the directory: address, token, TLS files, deadlines, retry policy.

Sources: `ChannelConfig.from_env()` reads `KVPUSH_DIRECTORY_*` variables; `from_dict()` reads a
mapping such as vLLM's `kv_connector_extra_config` (keys below, with or without a
`directory_` prefix). `create_channel()` opens a grpc.aio channel on the running loop.

| field | env | dict key |
| --- | --- | --- |
| address | KVPUSH_DIRECTORY_ADDRESS | directory_address (one host:port, or replicas comma-separated) |
| token | KVPUSH_DIRECTORY_TOKEN | directory_token |
| root_cert_file | KVPUSH_DIRECTORY_TLS_ROOT_CERT | directory_tls_root_cert |
| client_cert_file | KVPUSH_DIRECTORY_TLS_CLIENT_CERT | directory_tls_client_cert |
| client_key_file | KVPUSH_DIRECTORY_TLS_CLIENT_KEY | directory_tls_client_key |
| server_name_override | KVPUSH_DIRECTORY_TLS_SERVER_NAME | directory_tls_server_name |
| timeout_s | KVPUSH_DIRECTORY_TIMEOUT_S | directory_timeout_s |
| max_attempts | KVPUSH_DIRECTORY_MAX_ATTEMPTS | directory_max_attempts |
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields

import grpc

_ENV = {
    "address": "KVPUSH_DIRECTORY_ADDRESS",
    "token": "KVPUSH_DIRECTORY_TOKEN",
    "root_cert_file": "KVPUSH_DIRECTORY_TLS_ROOT_CERT",
    "client_cert_file": "KVPUSH_DIRECTORY_TLS_CLIENT_CERT",
    "client_key_file": "KVPUSH_DIRECTORY_TLS_CLIENT_KEY",
    "server_name_override": "KVPUSH_DIRECTORY_TLS_SERVER_NAME",
    "timeout_s": "KVPUSH_DIRECTORY_TIMEOUT_S",
    "max_attempts": "KVPUSH_DIRECTORY_MAX_ATTEMPTS",
}
_DICT_KEYS = {
    "address": "directory_address",
    "token": "directory_token",
    "root_cert_file": "directory_tls_root_cert",
    "client_cert_file": "directory_tls_client_cert",
    "client_key_file": "directory_tls_client_key",
    "server_name_override": "directory_tls_server_name",
    "timeout_s": "directory_timeout_s",
    "max_attempts": "directory_max_attempts",
}


@dataclass(frozen=True)
class ChannelConfig:
    """Connection settings of a directory client. `tls` is on when a root cert file is given."""

    address: str = "127.0.0.1:50051"
    token: str = ""
    root_cert_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    server_name_override: str = ""
    # Deadline of each unary call attempt.
    timeout_s: float = 5.0
    # Attempts of a unary call on UNAVAILABLE (1 = no retry).
    max_attempts: int = 5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address is required")
        if self.timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("timeout_s must be positive and max_attempts at least 1")
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise ValueError("client_cert_file and client_key_file go together")
        if self.client_cert_file and not self.root_cert_file:
            raise ValueError("a client certificate needs root_cert_file (TLS)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> ChannelConfig:
        """Settings from KVPUSH_DIRECTORY_* variables (unset ones keep defaults), then overrides."""
        environ = os.environ if environ is None else environ
        values = {name: environ[var] for name, var in _ENV.items() if environ.get(var)}
        return cls._build({**values, **overrides})

    @classmethod
    def from_dict(cls, mapping: Mapping[str, object], **overrides) -> ChannelConfig:
        """Settings from a dict (e.g. kv_connector_extra_config); env fills what it lacks."""
        values: dict[str, object] = {name: os.environ[var] for name, var in _ENV.items() if os.environ.get(var)}
        for name, key in _DICT_KEYS.items():
            for candidate in (key, name):
                if candidate in mapping and mapping[candidate] not in (None, ""):
                    values[name] = mapping[candidate]
                    break
        return cls._build({**values, **overrides})

    @classmethod
    def _build(cls, values: dict[str, object]) -> ChannelConfig:
        types = {f.name: f.type for f in fields(cls)}
        converted: dict[str, str | float | int] = {}
        for name, value in values.items():
            if name not in types:
                raise ValueError(f"unknown setting {name!r}")
            kind = types[name]
            if kind in ("float", "int"):
                if not isinstance(value, (str, int, float)):  # from env or a dict: a number, or one as a string
                    raise TypeError(f"setting {name!r} must be a number, got {type(value).__name__}")
                converted[name] = float(value) if kind == "float" else int(value)
            else:
                converted[name] = str(value)
        return cls(**converted)  # type: ignore[arg-type]  # each value was converted to its field's type above

    @property
    def addresses(self) -> list[str]:
        """The directory addresses: one, or several replicas ("a:50051,b:50051")."""
        return [a.strip() for a in self.address.split(",") if a.strip()]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token when one is set."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry `attempt` (0-based): exponential, capped, with full jitter."""
        return random.uniform(0, min(self.backoff_max_s, self.backoff_initial_s * (2 ** attempt)))

    def create_channel(self, address: str = "") -> grpc.aio.Channel:
        """A grpc.aio channel to `address` (default: the first configured) with this config's TLS and options;
        call on the loop that uses it."""
        address = address or self.addresses[0]
        options: list[tuple[str, int | str]] = [
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
        if not self.root_cert_file:
            return grpc.aio.insecure_channel(address, options=options)
        if self.server_name_override:
            options.append(("grpc.ssl_target_name_override", self.server_name_override))
        with open(self.root_cert_file, "rb") as handle:
            root = handle.read()
        key = cert = None
        if self.client_cert_file:
            with open(self.client_key_file, "rb") as handle:
                key = handle.read()
            with open(self.client_cert_file, "rb") as handle:
                cert = handle.read()
        credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
        return grpc.aio.secure_channel(address, credentials, options=options)
