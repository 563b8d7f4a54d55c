"""Unit tests of `kvpush.client.config.ChannelConfig`."""

from __future__ import annotations

import pytest

from kvpush.client import ChannelConfig


def test_from_env_reads_kvpush_directory_variables():
    """KVPUSH_DIRECTORY_* variables fill the config, with types converted."""
    config = ChannelConfig.from_env({"KVPUSH_DIRECTORY_ADDRESS": "dir:7000", "KVPUSH_DIRECTORY_TOKEN": "t",
                                     "KVPUSH_DIRECTORY_TIMEOUT_S": "2.5", "KVPUSH_DIRECTORY_MAX_ATTEMPTS": "3"})
    assert (config.address, config.token, config.timeout_s, config.max_attempts) == ("dir:7000", "t", 2.5, 3)
    assert config.metadata == (("authorization", "Bearer t"),)


def test_from_dict_accepts_connector_extra_config_keys(monkeypatch):
    """kv_connector_extra_config keys (directory_ prefixed or bare) override the environment."""
    monkeypatch.setenv("KVPUSH_DIRECTORY_ADDRESS", "env:1")
    monkeypatch.setenv("KVPUSH_DIRECTORY_TOKEN", "env-token")
    config = ChannelConfig.from_dict({"directory_address": "dict:2", "timeout_s": 1, "unrelated": "x"})
    assert (config.address, config.token, config.timeout_s) == ("dict:2", "env-token", 1.0)


def test_invalid_settings_are_refused():
    """Half a client key pair, a client cert without TLS, or a zero timeout raise ValueError."""
    with pytest.raises(ValueError):
        ChannelConfig(root_cert_file="ca.pem", client_cert_file="c.pem")
    with pytest.raises(ValueError):
        ChannelConfig(client_cert_file="c.pem", client_key_file="k.pem")
    with pytest.raises(ValueError):
        ChannelConfig(timeout_s=0)
    with pytest.raises(ValueError):
        ChannelConfig.from_env({}, bogus=1)


def test_backoff_is_capped_and_jittered():
    """Backoff grows exponentially up to the cap and never exceeds it."""
    config = ChannelConfig(backoff_initial_s=0.1, backoff_max_s=0.5)
    delays = [config.backoff_s(attempt) for attempt in range(10) for _ in range(20)]
    assert max(delays) <= 0.5 and min(delays) >= 0
    assert max(config.backoff_s(0) for _ in range(50)) <= 0.1
