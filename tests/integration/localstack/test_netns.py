"""The P/D network: namespaces joined by a shaped data link and unshaped control links, removed afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvpush.localstack.netns import PDNetwork

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="needs root with ip and tc")


def _connects(netns: str, host: str) -> bool:
    """True when something in `netns` can reach host:1 (refused counts as reachable; unreachable does not)."""
    script = ("import socket, sys\n"
              f"try:\n    socket.create_connection(({host!r}, 1), timeout=1)\n"
              "except ConnectionRefusedError:\n    sys.exit(0)\nexcept OSError:\n    sys.exit(1)\n")
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", script], timeout=20).returncode == 0


def test_links_are_reachable_shaped_and_removed():
    """Data and control addresses answer, the data link carries a tbf qdisc at the rate, destroy removes it all."""
    network = PDNetwork(prefix="kvt", subnet_index=40, rate="1gbit")
    with network:
        assert _connects(network.prefill_ns, network.decode_data_ip)
        assert _connects(network.decode_ns, network.prefill_data_ip)
        assert _connects(network.prefill_ns, network.root_ip_for_prefill)
        qdisc = subprocess.run(["ip", "netns", "exec", network.prefill_ns, "tc", "qdisc", "show", "dev",
                                network.prefill_data_dev], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc
        network.set_rate("10gbit")
        qdisc = subprocess.run(["ip", "netns", "exec", network.decode_ns, "tc", "qdisc", "show", "dev",
                                network.decode_data_dev], capture_output=True, text=True).stdout
        assert "10Gbit" in qdisc
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvt-p" not in names and "kvt-d" not in names
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert "kvt-rp" not in links


def test_bad_rate_is_refused():
    """A rate without a unit is refused before any namespace is touched."""
    with pytest.raises(ValueError, match="rate"):
        PDNetwork(prefix="kvt", subnet_index=42, rate="fast").set_rate("fast")
