"""The container images, built with podman and started as a P/D stack."""
