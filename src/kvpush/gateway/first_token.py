"""First token from prefill: the prefill leg's token goes to the client at once; decode's copy is dropped.

With `--first-token-from-prefill` (the default, docs/gateway.md) a streamed kvpush request runs:
  1. both legs leave at once, each with `kv_transfer_params.first_token_from_prefill`; the prefill leg
     (max_tokens=1, `return_token_ids`, streamed: `StreamedPrefillAnswer`) returns its token, text and logprobs;
  2. `first_events` turns that answer into the stream's first SSE event(s), sent to the client at once;
     when the prefill already finished the request (EOS, a stop token or string) they end the stream
     and the decode leg is closed;
  3. prefill's token reaches the decode engine with the transfer's COMPLETE event (not in the decode
     request), and decode's `ForcePrefillFirstToken` logits processor samples exactly that token first;
  4. `DecodeStreamRewriter` passes decode's events on without that first token: its token id (checked
     against prefill's), its text, its logprobs entry and the chat role chunk, so the client sees every
     token once and one first token. Usage and finish_reason are decode's, which count the forced token.
max_tokens=1 is answered from the prefill leg alone (no decode leg; the transfer is cancelled).

`hold_back_reason` names the cases where the prefill's text must not go out early (it may be the start
of a stop string, an incomplete character, a tool call): the stream then comes whole from decode, whose
first token is still forced to prefill's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from kvpush.gateway.validation import CHAT_COMPLETIONS, ClientRequest


class FirstTokenMismatch(Exception):
    """Decode's first token is not the one prefill sent (is the logits processor loaded on decode?)."""


@dataclass(frozen=True)
class PrefillToken:
    """The prefill leg's answer, reduced to what the client's first event needs."""

    token_id: int
    text: str
    logprobs: Any  # the choice's logprobs object, in the streamed format of its endpoint, or None
    finish_reason: str | None  # "length" when the prefill stopped only at its max_tokens=1
    stop_reason: Any
    prompt_token_ids: list[int] | None
    response_id: str
    created: int
    model: str
    usage: dict | None


def prefill_token(request: ClientRequest, answer: dict[str, Any]) -> PrefillToken:
    """Read the prefill leg's answer; ValueError when it carries no token id (not a vLLM answer)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("prefill answer has no choices")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or len(token_ids) != 1 or not isinstance(token_ids[0], int):
        raise ValueError(f"prefill answer carries no single token id (token_ids={str(token_ids)[:64]})")
    if request.path == CHAT_COMPLETIONS:
        message = choice.get("message") or {}
        text = message.get("content") or ""
    else:
        text = choice.get("text") or ""
    return PrefillToken(token_id=token_ids[0], text=text, logprobs=choice.get("logprobs"),
                        finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                        prompt_token_ids=choice.get("prompt_token_ids") or answer.get("prompt_token_ids"),
                        response_id=str(answer.get("id") or ""), created=int(answer.get("created") or time.time()),
                        model=str(answer.get("model") or request.body.get("model") or ""),
                        usage=answer.get("usage"))


class StreamedPrefillAnswer:
    """The streamed prefill leg's events folded into the shape of its non-streamed answer (`prefill_token` reads it).

    Feed each event as it comes; `complete` says when the rest of the stream can no longer change the client's
    first event: at the token's event, or, when prefill finished the request (its first token ended it, or the
    client asked for one token), at the usage event that follows it.
    """

    def __init__(self, request: ClientRequest) -> None:
        self._request = request
        self._answer: dict[str, Any] = {"choices": [{"index": 0}]}
        self._token_seen = False
        self._usage_seen = False

    def feed(self, event: dict[str, Any]) -> None:
        """Take one parsed SSE event of the prefill leg."""
        answer, choice = self._answer, self._answer["choices"][0]
        for key in ("id", "created", "model"):
            if key in event and key not in answer:
                answer[key] = event[key]
        if event.get("prompt_token_ids") is not None:  # chat: on the stream's first event
            answer["prompt_token_ids"] = event["prompt_token_ids"]
        if event.get("usage"):
            answer["usage"] = event["usage"]
            self._usage_seen = True
        for streamed in event.get("choices") or ():
            if not isinstance(streamed, dict) or streamed.get("index", 0) != 0:
                continue
            if streamed.get("prompt_token_ids") is not None:  # completions
                choice["prompt_token_ids"] = streamed["prompt_token_ids"]
            ids = streamed.get("token_ids")
            if not (isinstance(ids, list) and ids):
                continue  # chat's role event, or an event without the token
            choice["token_ids"] = list(choice.get("token_ids") or []) + ids
            delta = streamed.get("delta")
            if isinstance(delta, dict):
                message = choice.setdefault("message", {"role": "assistant", "content": ""})
                message["content"] = (message.get("content") or "") + (delta.get("content") or "")
            else:
                choice["text"] = (choice.get("text") or "") + (streamed.get("text") or "")
            choice["logprobs"] = streamed.get("logprobs")
            choice["finish_reason"] = streamed.get("finish_reason")
            choice["stop_reason"] = streamed.get("stop_reason")
            self._token_seen = True

    @property
    def complete(self) -> bool:
        """True once the rest of the leg's stream cannot change what the client is sent first."""
        if not self._token_seen:
            return False
        choice = self._answer["choices"][0]
        finished = client_max_tokens(self._request) == 1 or choice.get("finish_reason") not in ("length", None)
        return self._usage_seen or not finished

    def answer(self) -> dict[str, Any]:
        """The answer as far as it came (`prefill_token` raises ValueError if it holds no token)."""
        return self._answer


def client_max_tokens(request: ClientRequest) -> int | None:
    """The client's output bound (max_completion_tokens wins for chat), None when unbounded."""
    body = request.body
    for key in (("max_completion_tokens", "max_tokens") if request.path == CHAT_COMPLETIONS else ("max_tokens",)):
        if body.get(key) is not None:
            return int(body[key])
    return None


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop if isinstance(s, str) and s] if isinstance(stop, list) else []


def hold_back_reason(request: ClientRequest, token: PrefillToken) -> str:
    """Why prefill's token must not be streamed before decode's ('' when it may go at once)."""
    body = request.body
    if token.finish_reason not in ("length", None) or client_max_tokens(request) == 1:
        return ""  # the prefill finished the request: its answer is final
    if body.get("echo") or body.get("tools") or body.get("response_format") or body.get("structured_outputs"):
        return "echo, tools or structured output"
    if token.text.endswith("\ufffd"):
        return "the token ends inside a character"
    for stop in _stop_strings(body):
        if any(token.text.endswith(stop[:k]) for k in range(1, len(stop))):
            return "the token may start a stop string"
    return ""


def prefill_finished(request: ClientRequest, token: PrefillToken) -> bool:
    """True when prefill's answer is the whole answer (no decode leg needed)."""
    return client_max_tokens(request) == 1 or token.finish_reason not in ("length", None)


def _sse(event: dict) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


# The SSE event that ends a stream.
DONE_EVENT = b"data: [DONE]\n\n"


def first_events(request: ClientRequest, token: PrefillToken) -> bytes:
    """The stream's first SSE event(s) from prefill's answer; complete with usage and [DONE] if it finished."""
    body = request.body
    finished = prefill_finished(request, token)
    finish_reason = token.finish_reason if finished else None
    want_ids = bool(body.get("return_token_ids"))
    choice: dict[str, Any] = {"index": 0}
    if request.path == CHAT_COMPLETIONS:
        obj = "chat.completion.chunk"
        choice["delta"] = {"role": "assistant", "content": token.text}
    else:
        obj = "text_completion"
        choice["text"] = token.text
    choice["logprobs"] = token.logprobs
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = token.stop_reason if finished else None
    if want_ids:
        choice["token_ids"] = [token.token_id]
    event: dict[str, Any] = {"id": token.response_id, "object": obj, "created": token.created,
                             "model": token.model, "choices": [choice]}
    if want_ids and token.prompt_token_ids is not None:
        event["prompt_token_ids"] = token.prompt_token_ids
    out = _sse(event)
    if finished:
        options = body.get("stream_options") or {}
        if options.get("include_usage") and token.usage:
            out += _sse({"id": token.response_id, "object": obj, "created": token.created, "model": token.model,
                         "choices": [], "usage": token.usage})
        out += DONE_EVENT
    return out


@dataclass
class DecodeStreamRewriter:
    """Decode's SSE stream without its first token (the one the client already has from prefill).

    Feed raw bytes as they come (`feed`); it returns the bytes to send on. Events are split on blank
    lines, so a chunk boundary inside an event is fine. Decode was asked for token ids (to check the
    forced token); they are removed again unless the client asked for them.
    """

    request: ClientRequest
    token: PrefillToken
    _buffer: bytes = b""
    _text_to_skip: str = ""
    _id_skipped: bool = False
    _logprob_skipped: bool = False
    _client_wants_ids: bool = False
    events_seen: int = 0
    token_count: int = 0  # decode's tokens passed on (its first, prefill's, not counted)
    error: Any = None  # the first error event's `error`: nothing follows it (no [DONE])

    def __post_init__(self) -> None:
        self._text_to_skip = self.token.text
        self._client_wants_ids = bool(self.request.body.get("return_token_ids"))

    def feed(self, data: bytes) -> bytes:
        """Rewrite every complete event in `data` (plus what was buffered); keep a partial tail."""
        self._buffer += data
        out = b""
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                return out
            raw, self._buffer = self._buffer[:cut], self._buffer[cut + 2:]
            out += self._event(raw)

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream."""
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else b""

    def _event(self, raw: bytes) -> bytes:
        line = raw.strip()
        if self.error is not None:
            return b""
        if not line.startswith(b"data:"):
            return raw + b"\n\n" if line else b""
        data = line[5:].strip()
        if data == b"[DONE]":
            return DONE_EVENT
        try:
            event = orjson.loads(data)
        except ValueError:
            return raw + b"\n\n"
        self.events_seen += 1
        if isinstance(event, dict) and "error" in event:
            self.error = event["error"]
        if not isinstance(event, dict) or "error" in event or not event.get("choices"):
            return _sse(event) if isinstance(event, dict) else raw + b"\n\n"
        if not self._client_wants_ids:
            event.pop("prompt_token_ids", None)
        keep = False
        for choice in event["choices"]:
            keep = self._choice(choice) or keep
        if not keep and not event.get("usage"):
            return b""
        return _sse(event)

    def _choice(self, choice: dict) -> bool:
        """Strip the first token from one choice; True when something is left worth sending."""
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids and not self._id_skipped:
            if ids[0] != self.token.token_id:
                raise FirstTokenMismatch(
                    f"decode's first token {ids[0]} differs from prefill's {self.token.token_id}: the decode engine "
                    "registered forces_first_token but its ForcePrefillFirstToken processor did not force it")
            ids = ids[1:]
            self._id_skipped = True
        if isinstance(ids, list):
            self.token_count += len(ids)
            if self._client_wants_ids:
                choice["token_ids"] = ids
            else:
                choice.pop("token_ids", None)
        if not self._client_wants_ids:
            choice.pop("prompt_token_ids", None)
        self._skip_logprob(choice)
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat
            delta.pop("role", None)  # the client's first event already said "assistant"
            text = delta.get("content")
            if isinstance(text, str):
                delta["content"] = self._skip_text(text)
            if delta.get("content") == "":
                delta.pop("content")
            left = bool(delta)
        else:
            text = choice.get("text")
            if isinstance(text, str):
                choice["text"] = self._skip_text(text)
            left = bool(choice.get("text"))
        return left or bool(choice.get("finish_reason")) or bool(choice.get("token_ids")) or \
            _has_logprobs(choice.get("logprobs"))

    def _skip_text(self, text: str) -> str:
        if not self._text_to_skip:
            return text
        n = min(len(text), len(self._text_to_skip))
        if text[:n] != self._text_to_skip[:n]:
            raise FirstTokenMismatch(f"decode's text {text[:40]!r} does not begin with prefill's "
                                     f"{self._text_to_skip[:40]!r}")
        self._text_to_skip = self._text_to_skip[n:]
        return text[n:]

    def _skip_logprob(self, choice: dict) -> None:
        logprobs = choice.get("logprobs")
        if self._logprob_skipped or not isinstance(logprobs, dict):
            return
        if isinstance(logprobs.get("content"), list):  # chat
            if logprobs["content"]:
                logprobs["content"] = logprobs["content"][1:]
                self._logprob_skipped = True
            return
        lists = [k for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                 if isinstance(logprobs.get(k), list)]
        if lists and logprobs[lists[0]]:
            for key in lists:
                logprobs[key] = logprobs[key][1:]
            self._logprob_skipped = True


def _has_logprobs(logprobs: Any) -> bool:
    if not isinstance(logprobs, dict):
        return False
    if "content" in logprobs:
        return bool(logprobs["content"])
    return bool(logprobs.get("tokens"))
