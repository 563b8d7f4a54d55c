"""A vLLM logits processor that makes a decode engine's first sampled token the one prefill already sent.

The gateway streams the prefill leg's token to the client the moment that leg returns (docs/gateway.md,
"First token from prefill"), then sends the decode leg with `kv_transfer_params.first_token_id` set to
it. This processor masks every logit except that token while the request has no output token yet, so every
sampling setting (greedy, temperature, top_p, top_k, min_p, seed, penalties, logit_bias) yields it, and never
touches the request again. The continuation is therefore conditioned on exactly the token the client
got. Seeded requests stay reproducible: the sampler still draws its random numbers for the forced step,
so a seeded request continues as a colocated engine with the same seed would.

How it gets into a decode engine: kvpush declares it in vLLM's `vllm.logits_processors` entry-point group
(pyproject.toml), which vLLM loads into every engine of the environment when it builds the model runner's
sampler. That is the only moment a processor can join: the KV connector is created after the model runner, so
it cannot add one itself. The copy only forces in an engine whose kv_transfer_config names KVPushConnector
with kv_role "kv_consumer"; everywhere else (prefill engines, engines of other connectors) it stays idle: vLLM
skips it on greedy batches, and elsewhere it returns the logits untouched. Deployments that also pass
`--logits-processors kvpush.connector.first_token:ForcePrefillFirstToken` get a second instance in the same
batch; only the first one constructed for an engine forces, the other stays idle.

What got installed is recorded per process (`forcing_installed`); the connector's worker half reports it when
it registers (`RegisterEngineRequest.forces_first_token`), and the gateway uses first token from prefill only
with decode engines that report it. An engine cannot force when:
- its model runner is vLLM's V2 runner (`vllm/v1/worker/gpu/`: the default on GPUs from 0.32 for most models,
  the only one in 0.34): this processor implements only the V1 interface there and stays idle (loading a V1-only
  class would stop the engine). `VLLM_USE_V2_MODEL_RUNNER=0` selects the V1 runner on 0.32 and 0.33;
- speculative decoding is on (vLLM loads no custom processors then);
- `KVPUSH_FIRST_TOKEN_FORCING=0` is set in the engine's environment.

Caller: vLLM's model runner, on the forward thread. `update_state` runs before every step with the
batch's changes; `apply` runs once per step on the batch's logits. Neither waits on anything.

Requests without `first_token_id` are left alone; a malformed one is refused when the request is added
(`validate_params`, HTTP 400) and changes nothing.

The V1 interface is vLLM's `vllm/v1/sample/logits_processor/interface.py`, the same class shape in 0.25 to 0.33
(src/kvpush/connector/compat.py names the one difference); 0.34 removed it with the V1 runner.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvpush.api.params import first_token_id_of
from kvpush.observability import get_logger

try:  # the V1 model runner's interface: vLLM 0.25 to 0.33
    from vllm.v1.sample.logits_processor import LogitsProcessor as _V1Interface
    from vllm.v1.sample.logits_processor import MoveDirectionality
except ImportError:
    _V1Interface = None  # type: ignore[assignment,misc]
    MoveDirectionality = None  # type: ignore[assignment,misc]
try:  # the V2 model runner's interface: vLLM 0.32+; its loader refuses a class that is not one of these
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2Interface
except ImportError:
    _V2Interface = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate

# The class vLLM loads, as `--logits-processors` and the entry point name it.
PROCESSOR_FQCN = "kvpush.connector.first_token:ForcePrefillFirstToken"
# Engine environment: "0" keeps the processor idle in this engine (it then registers forces_first_token false).
FORCING_ENV = "KVPUSH_FIRST_TOKEN_FORCING"

_log = get_logger("connector.first_token")
# The forcing instance of each engine config in this process: id(vllm_config) -> (that config, kept so its id is
# never reused, and the instance). One per model runner.
_forcing: dict[int, tuple[object, ForcePrefillFirstToken]] = {}


def forcing_installed() -> bool:
    """True when a forcing instance was built in this process (the connector's worker half reports it)."""
    return bool(_forcing)


def forced_first_token(params: SamplingParams | None) -> int | None:
    """The token a request's first step must produce, from `extra_args.kv_transfer_params`; None if unset.

    Raises TransferParamsError (a ValueError) for a value that is not a non-negative integer (vLLM turns it into
    a 400).
    """
    extra = getattr(params, "extra_args", None) or {}
    return first_token_id_of(extra.get("kv_transfer_params") if isinstance(extra, dict) else None)


def _is_kvpush_decode(vllm_config: object) -> bool:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return (getattr(transfer, "kv_connector", None) == "KVPushConnector"
            and getattr(transfer, "kv_role", None) == "kv_consumer")


def _named_by_flag(vllm_config: object) -> bool:
    """`--logits-processors` names this class (then it forces in any engine, as it always did)."""
    named = getattr(getattr(vllm_config, "model_config", None), "logits_processors", None) or ()
    return any(entry == PROCESSOR_FQCN or (isinstance(entry, type) and issubclass(entry, ForcePrefillFirstToken))
               for entry in named)


_INTERFACES = tuple(base for base in (_V1Interface, _V2Interface) if base is not None)


class ForcePrefillFirstToken(*_INTERFACES):  # type: ignore[misc]
    """Forces the first sampled token of each request that names one (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, *runner_args: object) -> None:
        # V1 runner: (device, is_pin_memory); V2 runner: (req_states,).
        # batch row -> (forced token, the request's live output-token list). A row leaves once its
        # request has an output token (sampled, or vLLM's async-scheduling placeholder).
        self._rows: dict[int, tuple[int, list[int]]] = {}
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self.forces = self._claim(vllm_config, v1_runner=len(runner_args) == 2)

    def _claim(self, vllm_config: object, *, v1_runner: bool) -> bool:
        """Whether this instance forces: the first one built for a kvpush decode engine (or named by the flag)."""
        if not (_is_kvpush_decode(vllm_config) or _named_by_flag(vllm_config)):
            return False
        engine = id(vllm_config)
        if os.environ.get(FORCING_ENV, "1") == "0":
            _log.warning("first-token forcing turned off; the gateway serves this engine without first token "
                         "from prefill", env=FORCING_ENV)
            return False
        if not v1_runner:
            _log.warning("first-token forcing is not available on vLLM's V2 model runner; the gateway serves this "
                         "engine without first token from prefill (VLLM_USE_V2_MODEL_RUNNER=0 selects V1 on 0.32-0.33)")
            return False
        if engine in _forcing:
            _log.info("first-token processor loaded twice (entry point and --logits-processors); this copy stays idle")
            return False
        _forcing[engine] = (vllm_config, self)
        _log.info("first-token forcing installed")
        return True

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a malformed `first_token_id` when the request arrives (HTTP 400), before it is queued."""
        forced_first_token(sampling_params)

    def is_argmax_invariant(self) -> bool:
        """False when forcing: it changes which token greedy sampling picks, so vLLM applies it for greedy rows too.
        An idle copy is invariant, so vLLM skips it on greedy batches."""
        return not self.forces

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """V2 runner: never modifies a request (module docstring)."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track rows that still await their forced token; apply vLLM's removed -> added -> moved order."""
        if not self.forces:
            return
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

    def apply(self, logits: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """Set every logit of a tracked row to -inf except its forced token's, which becomes 0."""
        if not self._rows:
            return logits
        import torch

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


__all__ = ["FORCING_ENV", "PROCESSOR_FQCN", "ForcePrefillFirstToken", "forced_first_token",
           "forcing_installed"]
