"""Real-engine tests sharing one stack: a package, so the package-scoped `local_stack` ends with its last test."""
