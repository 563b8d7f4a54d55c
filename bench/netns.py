"""Create, reshape or remove the benchmark's P/D network by hand (the TTFT benchmark does it itself).

    python bench/netns.py up [--rate 1gbit]      # namespaces kvb-p / kvb-d, shaped data link
    python bench/netns.py rate 10gbit            # reshape in place ("none" removes shaping)
    python bench/netns.py down                   # remove both namespaces and their links
    python bench/netns.py show                   # addresses and UCX settings to use

Then run an engine inside with `ip netns exec kvb-p ...` plus the printed environment. Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpush.localstack.netns import PDNetwork


def main(argv: list[str] | None = None) -> int:
    """Dispatch the sub-command."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "rate", "down", "show"])
    parser.add_argument("value", nargs="?", help="rate for `rate` (e.g. 10gbit, none)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--prefix", default="kvb")
    parser.add_argument("--subnet-index", type=int, default=10)
    args = parser.parse_args(argv)
    network = PDNetwork(prefix=args.prefix, subnet_index=args.subnet_index, rate=args.rate)
    if args.command == "up":
        network.create()
    elif args.command == "rate":
        if not args.value:
            parser.error("rate needs a value, e.g. 10gbit or none")
        network.set_rate(None if args.value == "none" else args.value)
    elif args.command == "down":
        network.destroy()
        return 0
    print(json.dumps({
        "prefill": {"netns": network.prefill_ns, "data_ip": network.prefill_data_ip, "ctl_ip": network.prefill_ctl_ip,
                    "env": network.ucx_env("prefill")},
        "decode": {"netns": network.decode_ns, "data_ip": network.decode_data_ip, "ctl_ip": network.decode_ctl_ip,
                   "env": network.ucx_env("decode")},
        "root_ip_for_prefill": network.root_ip_for_prefill, "root_ip_for_decode": network.root_ip_for_decode,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
