"""kvpush's benchmarks: `python -m bench <subcommand> ...` from the checkout's root (`python -m bench --help`).

Each subcommand runs one script of this folder; every script writes its JSON through `bench_io`, which records the
command, the commit and the machine with the figures. Figures of record: docs/benchmarks.md; their history:
docs/performance-log.md.
"""
