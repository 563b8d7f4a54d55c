"""The first-token processor as vLLM loads it: from kvpush's entry point (no flag) and/or `--logits-processors`.

Built with vLLM's own builders (`build_logitsprocs` for the V1 model runner, `build_custom_logits_processors` for
V2) on real `VllmConfig`s of the tiny model: it forces only in a KVPushConnector decode engine, once per engine
however often it is loaded, and stays idle (and says so through `forcing_installed`) where it cannot force.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdateBuilder, build_logitsprocs

from kvpush.connector import first_token
from kvpush.connector.first_token import FORCING_ENV, PROCESSOR_FQCN, ForcePrefillFirstToken
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model

ROOT = Path(__file__).resolve().parents[3]
ENTRY_POINT_GROUP = "vllm.logits_processors"


def _entry_point() -> EntryPoint:
    """kvpush's entry point in the group vLLM loads, as pyproject.toml declares it (what a wheel installs)."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    ((name, value),) = table.items()
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


@pytest.fixture(scope="module")
def config():
    """config(kv_role, flag=...) -> a real VllmConfig of the tiny model; kv_role None: no KV connector at all."""
    model_dir = str(ensure_tiny_model(TinyModelSpec()))
    made: list[VllmConfig] = []  # kept alive: the processor tells engines apart by their config's identity

    def make(kv_role: str | None, flag: bool = False) -> VllmConfig:
        transfer = None if kv_role is None else KVTransferConfig(
            kv_connector="KVPushConnector", kv_role=kv_role, kv_connector_module_path="kvpush.connector")
        model = ModelConfig(model=model_dir, logits_processors=[PROCESSOR_FQCN] if flag else None)
        made.append(VllmConfig(model_config=model, kv_transfer_config=transfer))
        return made[-1]
    return make


def _ours(processors) -> list[ForcePrefillFirstToken]:
    """Our copies among vLLM's processors: the one asked for, plus the entry point's where it is installed."""
    return [p for p in processors.all if isinstance(p, ForcePrefillFirstToken)]


def _step(processor, builder: BatchUpdateBuilder, batch_size: int, vocab: int = 1024) -> torch.Tensor:
    processor.update_state(builder.get_and_reset(batch_size))
    return processor.apply(torch.zeros(batch_size, vocab))


def _params(token: int | None) -> SamplingParams:
    return SamplingParams(extra_args={"kv_transfer_params": {"first_token_id": token}} if token is not None else None)


def test_the_entry_point_names_the_processor_and_both_runners_accept_it():
    """vLLM's V1 loader and (where the release has it) the V2 runner's loader take the class the entry point names;
    the V2 loader refuses a class that is not a V2 processor, which would stop every engine of the environment."""
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    entry = _entry_point()
    assert entry.value == PROCESSOR_FQCN and entry.load() is ForcePrefillFirstToken
    assert _load_logitsprocs_by_fqcns([entry.value]) == [ForcePrefillFirstToken]
    v2 = pytest.importorskip("vllm.v1.worker.gpu.sample.logits_processor.loader")
    assert v2._load_v2_logitsprocs_by_fqcns([entry.value]) == [ForcePrefillFirstToken]


def test_a_decode_engine_forces_without_the_flag(config):
    """Loaded as the entry point loads it (a class, no flag): the decode engine's copy forces the first token of the
    request that names one, under vLLM's row bookkeeping, and lets go once the request has its first output."""
    processors = build_logitsprocs(config("kv_consumer"), torch.device("cpu"), False, False, (ForcePrefillFirstToken,))
    (processor,) = [p for p in _ours(processors) if p.forces]
    assert processor in processors.non_argmax_invariant
    assert first_token.forcing_installed()
    builder = BatchUpdateBuilder()
    outputs: list[int] = []
    builder.added.append((0, _params(None), [1, 2], []))
    builder.added.append((1, _params(77), [1, 2], outputs))
    logits = _step(processor, builder, 2)
    assert logits[0].eq(0).all()  # a request without the param is untouched
    assert logits[1].argmax().item() == 77 and torch.isinf(logits[1]).sum().item() == 1023
    outputs.append(77)
    assert _step(processor, builder, 2).eq(0).all()


def test_entry_point_and_flag_together_force_once(config):
    """A deployment that still passes --logits-processors also gets the entry point's copy: one forces, the other
    stays idle (vLLM skips it on greedy batches), so nothing is applied twice."""
    vllm_config = config("kv_consumer", flag=True)
    processors = build_logitsprocs(vllm_config, torch.device("cpu"), False, False,
                                   (_entry_point().load(), *vllm_config.model_config.logits_processors))
    copies = _ours(processors)
    assert len(copies) >= 2
    assert [p.forces for p in copies].count(True) == 1
    idle = [p for p in copies if not p.forces]
    assert all(p in processors.argmax_invariant for p in idle)
    builder = BatchUpdateBuilder()
    builder.added.append((0, _params(5), [1], []))
    assert _step(idle[0], builder, 1).eq(0).all()


@pytest.mark.parametrize("kv_role", ["kv_producer", None])
def test_other_engines_keep_an_idle_copy(config, kv_role):
    """A prefill engine, and an engine without kvpush, load the entry point's copy too: it never touches logits,
    not even for a request that names a first token."""
    processors = build_logitsprocs(config(kv_role), torch.device("cpu"), False, False, (ForcePrefillFirstToken,))
    copies = _ours(processors)
    assert copies and not any(p.forces for p in copies)
    for processor in copies:
        assert processor in processors.argmax_invariant
        builder = BatchUpdateBuilder()
        builder.added.append((0, _params(5), [1], []))
        assert _step(processor, builder, 1).eq(0).all()


def test_the_flag_still_forces_in_any_engine(config):
    """--logits-processors named explicitly keeps its old meaning: that engine forces, connector or not."""
    vllm_config = config(None, flag=True)
    processors = build_logitsprocs(vllm_config, torch.device("cpu"), False, False,
                                   tuple(vllm_config.model_config.logits_processors))
    assert [p.forces for p in _ours(processors)].count(True) == 1


def test_the_environment_turns_forcing_off(config, monkeypatch):
    monkeypatch.setenv(FORCING_ENV, "0")
    processors = build_logitsprocs(config("kv_consumer"), torch.device("cpu"), False, False, (ForcePrefillFirstToken,))
    copies = _ours(processors)
    assert copies and not any(p.forces for p in copies)


def test_the_v2_runner_gets_an_idle_copy(config):
    """vLLM's V2 runner builds it with its own signature: it loads (the engine starts) but does not force there, so
    the decode engine registers forces_first_token false."""
    v2 = pytest.importorskip("vllm.v1.worker.gpu.sample.logits_processor.loader")
    forcing_before = dict(first_token._forcing)
    req_states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=4, vocab_size=1024, all_token_ids=None,
                                 prompt_len=None, prefill_len=None, total_len=None)
    built = v2.build_custom_logits_processors(config("kv_consumer"), req_states, False, [PROCESSOR_FQCN])
    ours = [p for p in built if isinstance(p, ForcePrefillFirstToken)]
    assert ours and not any(p.forces for p in ours)
    assert first_token._forcing == forcing_before
    assert ours[0].add_request(0, _params(5)) is False
    logits = torch.zeros(1, 1024)
    assert ours[0].apply(logits, None).eq(0).all()
