"""Local stack: tiny model, process launchers, network namespaces, for the demo, tests and benchmarks."""
