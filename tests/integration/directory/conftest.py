"""Fixtures for directory integration tests: structlog reset so captured logs stay per-test."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _reset_structlog():
    """Each test starts from structlog's defaults (no cached loggers from a previous configuration)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
