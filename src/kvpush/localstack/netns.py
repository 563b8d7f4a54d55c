"""A prefill/decode network for one host: two network namespaces joined by a shaped veth pair.

Topology (every address is on links this module creates; nothing touches the host's own network):

    root ns                      prefill ns ("<prefix>-p")            decode ns ("<prefix>-d")
    <prefix>-rp 10.78.<n>.1/30 -- <prefix>-pr 10.78.<n>.2/30
    <prefix>-rd 10.78.<n+1>.1/30 ---------------------------------- <prefix>-dr 10.78.<n+1>.2/30
                                 <prefix>-pd 10.77.<n>.1/30 ======= <prefix>-dp 10.77.<n>.2/30
                                            (KV data link, tc tbf at `rate` both ways)

The control links (root <-> each namespace) are unshaped: HTTP from the gateway and gRPC to the
directory use them. The data link carries NIXL/UCX traffic: engines get `UCX_TLS=tcp` and
`UCX_NET_DEVICES=<data veth>` (else UCX on one host would use shared memory and never touch the
link) and the NIXL side channel binds the data address.

Life cycle: `create()` builds everything (removing leftovers of the same prefix first), `set_rate()`
reshapes the data link in place, `destroy()` deletes both namespaces (which deletes their veths).
Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from kvpush.observability import get_logger

_log = get_logger("localstack.netns")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for suffix, factor in units.items():
        if rate.endswith(suffix):
            return int(float(rate[: -len(suffix)]) * factor)
    raise ValueError(f"rate {rate!r} must end with bit, kbit, mbit or gbit")


@dataclass
class PDNetwork:
    """Two namespaces for a prefill and a decode engine; see the module docstring."""

    prefix: str = "kvb"
    subnet_index: int = 10  # picks 10.77.<i>.0/30 and 10.78.<i>, <i+1>.0/30
    rate: str | None = "1gbit"
    mtu: int = 1500

    @property
    def prefill_ns(self) -> str:
        """The prefill namespace's name."""
        return f"{self.prefix}-p"

    @property
    def decode_ns(self) -> str:
        """The decode namespace's name."""
        return f"{self.prefix}-d"

    @property
    def prefill_data_ip(self) -> str:
        """Prefill's address on the shaped data link."""
        return f"10.77.{self.subnet_index}.1"

    @property
    def decode_data_ip(self) -> str:
        """Decode's address on the shaped data link."""
        return f"10.77.{self.subnet_index}.2"

    @property
    def prefill_ctl_ip(self) -> str:
        """Prefill's address on its unshaped control link to the root namespace."""
        return f"10.78.{self.subnet_index}.2"

    @property
    def decode_ctl_ip(self) -> str:
        """Decode's address on its unshaped control link to the root namespace."""
        return f"10.78.{self.subnet_index + 1}.2"

    @property
    def root_ip_for_prefill(self) -> str:
        """The root namespace's address as seen from the prefill namespace (run shared services here)."""
        return f"10.78.{self.subnet_index}.1"

    @property
    def root_ip_for_decode(self) -> str:
        """The root namespace's address as seen from the decode namespace."""
        return f"10.78.{self.subnet_index + 1}.1"

    @property
    def prefill_data_dev(self) -> str:
        """The prefill end of the data link."""
        return f"{self.prefix}-pd"

    @property
    def decode_data_dev(self) -> str:
        """The decode end of the data link."""
        return f"{self.prefix}-dp"

    def ucx_env(self, role: str) -> dict[str, str]:
        """UCX settings that force NIXL traffic of `role` ("prefill"/"decode") onto the data link over TCP."""
        device = self.prefill_data_dev if role == "prefill" else self.decode_data_dev
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": device}

    def create(self) -> PDNetwork:
        """Build the namespaces, links, addresses, routes and shaping."""
        self.destroy()
        i = self.subnet_index
        p, d = self.prefill_ns, self.decode_ns
        _run("ip", "netns", "add", p)
        _run("ip", "netns", "add", d)
        # Data link P <-> D.
        _run("ip", "link", "add", self.prefill_data_dev, "type", "veth", "peer", "name", self.decode_data_dev)
        _run("ip", "link", "set", self.prefill_data_dev, "netns", p)
        _run("ip", "link", "set", self.decode_data_dev, "netns", d)
        _run("ip", "-n", p, "addr", "add", f"{self.prefill_data_ip}/30", "dev", self.prefill_data_dev)
        _run("ip", "-n", d, "addr", "add", f"{self.decode_data_ip}/30", "dev", self.decode_data_dev)
        # Control links root <-> P and root <-> D.
        for ns, root_dev, ns_dev, net in ((p, f"{self.prefix}-rp", f"{self.prefix}-pr", i),
                                          (d, f"{self.prefix}-rd", f"{self.prefix}-dr", i + 1)):
            _run("ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev)
            _run("ip", "link", "set", ns_dev, "netns", ns)
            _run("ip", "addr", "add", f"10.78.{net}.1/30", "dev", root_dev)
            _run("ip", "-n", ns, "addr", "add", f"10.78.{net}.2/30", "dev", ns_dev)
            _run("ip", "link", "set", root_dev, "up")
            _run("ip", "-n", ns, "link", "set", ns_dev, "up")
        for ns, dev in ((p, self.prefill_data_dev), (d, self.decode_data_dev)):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
        self.set_rate(self.rate)
        _log.info("pd network created", prefill_ns=p, decode_ns=d, rate=self.rate)
        return self

    def set_rate(self, rate: str | None) -> None:
        """Shape the data link both ways to `rate` (e.g. "1gbit"); None removes the shaping."""
        # tbf needs a bucket of at least rate/HZ; 4 ms of traffic (min 64 KiB) is enough at 250 Hz.
        burst = max(64 * 1024, _rate_bits(rate) // 8 // 250) if rate else 0
        for ns, dev in ((self.prefill_ns, self.prefill_data_dev), (self.decode_ns, self.decode_data_dev)):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "200ms")
        self.rate = rate

    def destroy(self) -> None:
        """Delete both namespaces (and with them every veth); missing ones are ignored."""
        for ns in (self.prefill_ns, self.decode_ns):
            _run("ip", "netns", "del", ns, check=False)
        for dev in (f"{self.prefix}-rp", f"{self.prefix}-rd"):
            _run("ip", "link", "del", dev, check=False)

    def __enter__(self) -> PDNetwork:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()
