"""First token from prefill: the first events built from prefill's answer and decode's stream without its first
token."""

from __future__ import annotations

import json

import pytest

from kvpush.gateway import legs
from kvpush.gateway.first_token import (
    DecodeStreamRewriter,
    FirstTokenMismatch,
    first_events,
    hold_back_reason,
    prefill_finished,
    prefill_token,
)
from kvpush.gateway.validation import CHAT_COMPLETIONS, COMPLETIONS, validate


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _events(data: bytes) -> list:
    out = []
    for block in data.split(b"\n\n"):
        block = block.strip()
        if block:
            payload = block[5:].strip()
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def _completion_answer(token_id=17, text=" sea", finish="length", logprob=-0.5):
    return {"id": "cmpl-r1", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "text": text, "token_ids": [token_id], "finish_reason": finish,
                         "logprobs": {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [None],
                                      "text_offset": [0]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _completion_chunk(ids, text, finish=None, logprob=-1.0):
    return {"id": "cmpl-r1", "object": "text_completion", "choices": [{
        "index": 0, "text": text, "token_ids": ids, "finish_reason": finish,
        "logprobs": {"tokens": [text], "token_logprobs": [logprob] * len(ids), "top_logprobs": [None] * len(ids),
                     "text_offset": [0] * len(ids)}}]}


def test_first_event_carries_prefill_token_text_and_logprob():
    """The first event is prefill's token in the completions stream format, with its logprobs, not finished."""
    request = validate(COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "logprobs": 1})
    token = prefill_token(request, _completion_answer())
    events = _events(first_events(request, token))
    assert len(events) == 1
    choice = events[0]["choices"][0]
    assert choice["text"] == " sea" and choice["finish_reason"] is None
    assert choice["logprobs"]["token_logprobs"] == [-0.5]
    assert "token_ids" not in choice  # the client did not ask for ids


def test_one_token_request_is_complete_from_prefill():
    """max_tokens=1: the first events end the stream with prefill's finish_reason, usage and [DONE]."""
    request = validate(COMPLETIONS, {"prompt": [1, 2], "max_tokens": 1, "stream": True, "return_token_ids": True,
                                     "stream_options": {"include_usage": True}})
    token = prefill_token(request, _completion_answer())
    assert prefill_finished(request, token)
    events = _events(first_events(request, token))
    assert events[0]["choices"][0]["finish_reason"] == "length"
    assert events[0]["choices"][0]["token_ids"] == [17]
    assert events[1]["usage"]["completion_tokens"] == 1 and events[2] == "[DONE]"


def test_eos_from_prefill_finishes_the_request():
    """A prefill that stopped (EOS, stop token) finishes the request even when max_tokens is larger."""
    request = validate(COMPLETIONS, {"prompt": [1], "max_tokens": 9, "stream": True})
    assert prefill_finished(request, prefill_token(request, _completion_answer(finish="stop")))


def test_decode_stream_loses_exactly_its_first_token():
    """Decode's first token (id, text, logprob) is dropped once, in whatever chunks the bytes arrive."""
    request = validate(COMPLETIONS, {"prompt": [1], "max_tokens": 3, "stream": True, "logprobs": 1})
    token = prefill_token(request, _completion_answer())
    stream = _sse(_completion_chunk([17], " sea"), _completion_chunk([18], " is"),
                  _completion_chunk([19], " blue", "length"), b"[DONE]")
    rewriter = DecodeStreamRewriter(request, token)
    out = b"".join(rewriter.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + rewriter.flush()
    events = _events(out)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" is", " blue"]
    assert [e["choices"][0]["logprobs"]["token_logprobs"] for e in events[:-1]] == [[-1.0], [-1.0]]
    assert all("token_ids" not in e["choices"][0] for e in events[:-1])
    assert events[-1] == "[DONE]" and events[1]["choices"][0]["finish_reason"] == "length"


def test_first_token_inside_a_multi_token_chunk():
    """A decode chunk holding tokens 1 and 2 keeps token 2's id and text only."""
    request = validate(COMPLETIONS, {"prompt": [1], "max_tokens": 3, "stream": True, "return_token_ids": True})
    token = prefill_token(request, _completion_answer())
    out = DecodeStreamRewriter(request, token).feed(_sse(_completion_chunk([17, 18], " sea is")))
    choice = _events(out)[0]["choices"][0]
    assert choice["token_ids"] == [18] and choice["text"] == " is"


def test_decode_not_forced_is_an_error():
    """A decode engine that sampled another first token (no logits processor) is reported, not streamed."""
    request = validate(COMPLETIONS, {"prompt": [1], "max_tokens": 3, "stream": True})
    token = prefill_token(request, _completion_answer())
    with pytest.raises(FirstTokenMismatch, match="ForcePrefillFirstToken"):
        DecodeStreamRewriter(request, token).feed(_sse(_completion_chunk([99], " sky")))


def test_chat_stream_drops_role_chunk_and_first_token():
    """Chat: the client's first event has the role and prefill's content; decode's role chunk and token go."""
    request = validate(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                          "stream": True})
    answer = {"id": "chatcmpl-r1", "created": 5, "model": "tiny", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "Hello"}, "token_ids": [40],
        "finish_reason": "length", "logprobs": None}]}
    token = prefill_token(request, answer)
    first = _events(first_events(request, token))[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": "Hello"}
    decode = _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]},
                  {"choices": [{"index": 0, "delta": {"content": "Hello"}, "token_ids": [40]}]},
                  {"choices": [{"index": 0, "delta": {"content": " there"}, "token_ids": [41]}]})
    events = _events(DecodeStreamRewriter(request, token).feed(decode))
    assert [e["choices"][0]["delta"] for e in events] == [{"content": " there"}]


def test_possible_stop_string_start_is_held_back():
    """A token whose text may begin a stop string is not streamed early; a plain one is."""
    request = validate(COMPLETIONS, {"prompt": [1], "max_tokens": 3, "stream": True, "stop": ["ab"]})
    assert hold_back_reason(request, prefill_token(request, _completion_answer(text=" a")))
    assert not hold_back_reason(request, prefill_token(request, _completion_answer(text=" b")))


@pytest.mark.parametrize("event", [
    # completions: the ids sit in the choice; vLLM's compact JSON
    {"id": "c", "choices": [{"index": 0, "text": " sea", "token_ids": [17], "prompt_token_ids": [5, 6, 7]}]},
    # chat: on the event itself
    {"id": "c", "prompt_token_ids": list(range(8192)), "choices": [{"index": 0, "delta": {"content": "]"},
                                                                    "token_ids": [17]}]},
])
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_a_token_event_without_its_prompt_ids_keeps_everything_else(event, separators):
    """The prefill leg's token event reaches the gateway with the whole prompt's ids; when the client did not ask for
    them they are cut from the bytes before decoding (legs.without_prompt_token_ids): they read as null, the token's
    id, text and every other field are intact, whatever the JSON's spacing."""
    raw = json.dumps(event, separators=separators).encode()
    parsed = json.loads(legs.without_prompt_token_ids(raw))
    expected = json.loads(raw)
    for holder in (expected, *expected["choices"]):
        if "prompt_token_ids" in holder:
            holder["prompt_token_ids"] = None
    assert parsed == expected
    untouched = b'{"choices":[{"index":0,"text":"x"}]}'
    assert legs.without_prompt_token_ids(untouched) == untouched
