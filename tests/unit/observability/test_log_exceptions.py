"""A logged exception shows its type, message and frames (file, line, function), never a frame's locals."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from kvpush.observability import logs

SECRET = "sk-live-4f1c9e"  # an API key a handler held in a local
PROMPT = "my medical history is private"  # a prompt a handler held in a local


def _fail_holding_secrets() -> None:
    api_key = SECRET  # noqa: F841 (a local the renderer must not show)
    body = {"prompt": PROMPT, "authorization": f"Bearer {SECRET}"}  # noqa: F841
    raise ConnectionResetError("Cannot write to closing transport")


def _wrapped() -> None:
    try:
        _fail_holding_secrets()
    except ConnectionResetError as error:
        raise RuntimeError("stream ended badly") from error


@pytest.fixture(params=["json", "console"])
def output(request, monkeypatch):
    """What the real configuration (`configure_logging`) writes, in each format."""
    buffer = io.StringIO()
    monkeypatch.setattr(logs.sys, "stderr", buffer)
    logs.configure_logging(level="INFO", fmt=request.param, force=True)
    yield request.param, buffer
    structlog.reset_defaults()
    logs._configured = False


def test_a_logged_exception_shows_no_locals(output):
    """log.exception in a frame whose locals hold a key and a prompt: the line names the exception, its cause and
    the functions it passed through, and holds neither the key nor the prompt."""
    fmt, buffer = output
    try:
        _wrapped()
    except RuntimeError:
        logs.get_logger("test").exception("unhandled error", path="/v1/completions")
    text = buffer.getvalue()
    assert SECRET not in text and PROMPT not in text
    assert "Cannot write to closing transport" in text and "stream ended badly" in text
    assert "_fail_holding_secrets" in text and "_wrapped" in text
    if fmt == "json":
        (line,) = [json.loads(raw) for raw in text.splitlines()]
        outer, cause = line["exception"]
        assert outer["type"] == "builtins.RuntimeError" and outer["message"] == "stream ended badly"
        assert cause["type"] == "builtins.ConnectionResetError"
        assert [f["function"] for f in cause["frames"]] == ["_wrapped", "_fail_holding_secrets"]
        assert all(set(f) == {"file", "line", "function"} for f in outer["frames"] + cause["frames"])
        assert cause["frames"][-1]["file"] == __file__


def test_exc_info_given_as_an_exception_is_rendered_the_same_way(output):
    """`exc_info=error` outside the except block: the same summary, no locals."""
    _fmt, buffer = output
    try:
        _fail_holding_secrets()
    except ConnectionResetError as caught:
        error = caught
    logs.get_logger("test").warning("stream broke", exc_info=error)
    text = buffer.getvalue()
    assert SECRET not in text and PROMPT not in text
    assert "ConnectionResetError" in text and "_fail_holding_secrets" in text
