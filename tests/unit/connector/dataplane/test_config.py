"""NixlConfig and NIXL agent construction (kvpush.dataplane.config)."""

from __future__ import annotations

import resource
import time

import pytest

from kvpush.dataplane.config import NixlConfig, create_nixl_agent


def test_from_dict_refuses_unknown_keys():
    """A typo in the extra config is an error, not a silent default."""
    with pytest.raises(ValueError, match="unknown NixlConfig keys: \\['num_thread'\\]"):
        NixlConfig.from_dict({"num_thread": 4})


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"backends": []}, "backends is empty"),
        ({"poll_min_s": 0.0}, "poll_min_s"),
        ({"poll_min_s": 0.01, "poll_max_s": 0.001}, "poll_min_s <= poll_max_s"),
        ({"transfer_timeout_s": 0}, "timeouts must be positive"),
        ({"num_threads": -1}, "num_threads"),
    ],
)
def test_bad_settings_are_refused(raw, message):
    """Settings that cannot work raise ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        NixlConfig.from_dict(raw)


def test_from_dict_reads_backends_as_tuple():
    """Lists from JSON become the tuple the frozen config holds."""
    assert NixlConfig.from_dict({"backends": ["LIBFABRIC"]}).backends == ("LIBFABRIC",)


@pytest.mark.nixl
def test_unknown_backend_is_refused():
    """Asking for a backend NIXL lacks fails at construction, not at the first transfer."""
    with pytest.raises(RuntimeError, match="NOPE"):
        create_nixl_agent("cfg-test-missing", NixlConfig(backends=("NOPE",)))


@pytest.mark.nixl
def test_paced_progress_thread_sleeps():
    """With the progress thread on and a 1 ms delay, an idle agent uses far less than a core."""
    agent = create_nixl_agent("cfg-test-paced", NixlConfig(enable_prog_thread=True, progress_thread_delay_us=1000))
    assert "UCX" in agent.backends
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.5, f"idle agent used {cpu:.2f} CPU-s in 1 s"
    del agent
