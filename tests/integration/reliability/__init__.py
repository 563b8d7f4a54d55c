"""Real-engine reliability tests: gateway failover and the soak's CI form."""
