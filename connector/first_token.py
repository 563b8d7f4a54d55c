"""A vLLM logits processor that makes a decode engine's first sampled token the one prefill already sent.

The gateway streams the prefill leg's token to the client the moment that leg returns (docs/gateway.md,
"First token from prefill"), then sends the decode leg with `kv_transfer_params.first_token_id` set to
it. This processor, loaded into the decode engine with

    --logits-processors kvpush.connector.first_token:ForcePrefillFirstToken

masks every logit except that token while the request has no output token yet, so every sampling
setting (greedy, temperature, top_p, top_k, min_p, seed, penalties, logit_bias) yields it, and never
touches the request again. The continuation is therefore conditioned on exactly the token the client
got. Seeded requests stay reproducible: the sampler still draws its random numbers for the forced step,
so a seeded request continues as a colocated engine with the same seed would.

Caller: vLLM's model runner, on the forward thread. `update_state` runs before every step with the
batch's changes; `apply` runs once per step on the batch's logits. Neither waits on anything.

Requests without `first_token_id` are left alone; a malformed one is refused when the request is added
(`validate_params`, HTTP 400) and changes nothing.

The API is vLLM's v1 `LogitsProcessor` (`vllm/v1/sample/logits_processor/interface.py`), the same
class shape in 0.25 and 0.32 (connector/compat.py names the one difference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from kvpush.observability import get_logger

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

# The key inside kv_transfer_params (connector/params.py reads the same one).
FIRST_TOKEN_KEY = "first_token_id"

_log = get_logger("connector.first_token")


def forced_first_token(params: SamplingParams | None) -> int | None:
    """The token a request's first step must produce, from `extra_args.kv_transfer_params`; None if unset.

    Raises ValueError for a value that is not a non-negative integer (vLLM turns it into a 400).
    """
    extra = getattr(params, "extra_args", None) or {}
    transfer = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if not isinstance(transfer, dict) or transfer.get(FIRST_TOKEN_KEY) is None:
        return None
    token = transfer[FIRST_TOKEN_KEY]
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"kv_transfer_params.{FIRST_TOKEN_KEY} must be a non-negative token id, got {token!r}")
    return token


class ForcePrefillFirstToken(LogitsProcessor):
    """Forces the first sampled token of each request that names one (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (forced token, the request's live output-token list). A row leaves once its
        # request has an output token (sampled, or vLLM's async-scheduling placeholder).
        self._rows: dict[int, tuple[int, list[int]]] = {}
        self._vocab_size = vllm_config.model_config.get_vocab_size()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a malformed `first_token_id` when the request arrives (HTTP 400), before it is queued."""
        forced_first_token(sampling_params)

    def is_argmax_invariant(self) -> bool:
        """False: it changes which token greedy sampling picks, so vLLM applies it for greedy rows too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track rows that still await their forced token; apply vLLM's removed -> added -> moved order."""
        if batch_update is not None:
            for index in batch_update.removed:
                self._rows.pop(index, None)
            for index, params, _prompt, output_token_ids in batch_update.added:
                token = forced_first_token(params)
                if token is not None and not output_token_ids:
                    self._rows[index] = (token, output_token_ids)
                else:
                    self._rows.pop(index, None)  # an added request replaces whatever held this row
            for first, second, direction in batch_update.moved:
                a, b = self._rows.pop(first, None), self._rows.pop(second, None)
                if a is not None:
                    self._rows[second] = a
                if direction == MoveDirectionality.SWAP and b is not None:
                    self._rows[first] = b
        # The output list is vLLM's own, updated in place: a token there means the forced step is done.
        for index in [i for i, (_, outputs) in self._rows.items() if outputs]:
            del self._rows[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set every logit of a tracked row to -inf except its forced token's, which becomes 0."""
        if not self._rows:
            return logits
        rows = [i for i in self._rows if i < logits.shape[0]]
        if not rows:
            return logits
        tokens = [self._rows[i][0] for i in rows]
        if max(tokens) >= self._vocab_size:
            # Only a broken gateway sends a token the model lacks; raising here would kill the engine, so
            # the row samples normally and the error is logged (validate_params cannot know the vocabulary).
            for i, token in zip(list(rows), list(tokens)):
                if token >= self._vocab_size:
                    _log.error("forced first token outside the vocabulary; sampling normally",
                               token=token, vocab_size=self._vocab_size)
                    del self._rows[i]
            rows = [i for i in rows if i in self._rows]
            tokens = [self._rows[i][0] for i in rows]
            if not rows:
                return logits
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        token_index = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        logits[row_index] = float("-inf")
        # 0, not the old logit: stays finite after penalties, temperature, top-k/top-p and min_p.
        logits[row_index, token_index] = 0.0
        return logits


__all__ = ["FIRST_TOKEN_KEY", "ForcePrefillFirstToken", "forced_first_token"]
