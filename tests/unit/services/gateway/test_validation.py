"""Client-input validation and leg bodies: precise 400s, and legs derived without touching the client's body."""

from __future__ import annotations

import copy

import pytest

from kvpush.gateway.errors import GatewayError
from kvpush.gateway.validation import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    decode_body,
    prefill_body,
    request_id_from,
    validate,
)


def test_token_id_prompt_reports_its_length():
    """A prompt of token ids gives the planner its length; a text prompt gives 0 (unknown)."""
    assert validate(COMPLETIONS, {"prompt": [1, 2, 3]}).prompt_token_count == 3
    assert validate(COMPLETIONS, {"prompt": ["hello"]}).prompt_token_count == 0
    assert validate(COMPLETIONS, {"prompt": [[4, 5]]}).prompt_token_count == 2


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": True}, "n"),
])
def test_bad_completion_bodies_name_the_field(body, param):
    """Each malformed body is a 400 whose param names the offending field."""
    with pytest.raises(GatewayError) as caught:
        validate(COMPLETIONS, body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_chat_messages_need_roles():
    """Chat messages must be objects with a string role."""
    with pytest.raises(GatewayError, match=r"messages\[1\]"):
        validate(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})


def test_request_id_is_kept_generated_or_refused():
    """A good X-Request-Id is kept, a missing one is generated, a malformed one is a 400."""
    assert request_id_from("abc-1.2:3") == "abc-1.2:3"
    assert request_id_from(None).startswith("kvpush-")
    with pytest.raises(GatewayError):
        request_id_from("x" * 129)


def test_legs_are_derived_without_mutating_the_client_body():
    """The prefill leg computes one unstreamed token, the decode leg is the client's; the original is untouched."""
    body = {"prompt": [1, 2], "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 2, "max_completion_tokens": 9}
    request = validate(CHAT_COMPLETIONS, {**body, "messages": [{"role": "user", "content": "x"}]})
    original = copy.deepcopy(request.body)
    prefill = prefill_body(request, {"transfer_id": "t"})
    decode = decode_body(request, {"transfer_id": "t", "do_remote_prefill": True})
    streamed = prefill_body(request, {"transfer_id": "t"}, first_token=True, streamed=True)
    first = decode_body(request, {"transfer_id": "t"}, first_token_id=7)
    assert streamed["stream_options"] == {"include_usage": True} and streamed["min_tokens"] == 1
    assert first["kv_transfer_params"] == {"transfer_id": "t", "first_token_id": 7} and first["return_token_ids"]
    assert request.body == original, "building the legs changed the client's body"
    assert (prefill["max_tokens"], prefill["max_completion_tokens"], prefill["stream"]) == (1, 1, False)
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert decode["max_tokens"] == 9 and decode["stream"] is True and decode["stream_options"]
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert "kv_transfer_params" not in request.body
