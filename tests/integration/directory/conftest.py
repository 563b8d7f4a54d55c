"""Fixtures for directory integration tests: structlog reset so captured logs stay per-test."""

from __future__ import annotations

import pytest
import structlog

from tests.integration.directory.test_cli import DirectoryProcess


@pytest.fixture(autouse=True)
def _reset_structlog():
    """Each test starts from structlog's defaults (no cached loggers from a previous configuration)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def directory_process():
    """A `kvpush directory` subprocess (no tracing), stopped afterwards."""
    processes: list[DirectoryProcess] = []

    def start(*flags: str) -> DirectoryProcess:
        process = DirectoryProcess({"OTEL_SDK_DISABLED": "true"}, *flags)
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.stop()
