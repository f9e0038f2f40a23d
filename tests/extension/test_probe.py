"""The extension's probe on a scripted model runner (torch only): what it reports for weights
that compute, overflow, flatten or hold NaN, and where it cannot run (the real engine: tests/e2e)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_reloader.extension.probe import PROBE_LORA_ID, _self_only, probe, probe_adapter

VOCAB, HIDDEN = 32, 8


class Backend:
    """Like vLLM's CPU attention backend with no metadata (a warm-up): it leaves the output as
    allocated, here NaN."""

    def forward(self, layer: Any, query: torch.Tensor, *args: Any, output: torch.Tensor, **kw: Any) -> Any:
        return output


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.impl = Backend()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = torch.full_like(hidden, float("nan"))
        return self.impl.forward(self, hidden, hidden, hidden, None, None, output=output)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.attn = Attention()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class GPUModelRunner:
    """What `probe` uses of vLLM's GPUModelRunner (the one it was proven on: its name and
    module): `_dummy_run` reads its `input_ids` buffer."""

    __module__ = "vllm.v1.worker.gpu_model_runner"

    def __init__(self) -> None:
        self.model = Model()
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, enable_prompt_embeds=False)
        self.parallel_config = SimpleNamespace(data_parallel_size=1)
        self.lora_config: object = None
        self.max_num_tokens = 128
        self.input_ids = SimpleNamespace(gpu=torch.zeros(128, dtype=torch.int32))
        self.runs: list[dict[str, Any]] = []
        self.stage_output: object = None
        """What a pipeline stage before the last returns instead of hidden states."""

    def get_model(self) -> Model:
        return self.model

    def _dummy_run(self, num_tokens: int, is_profile: bool = False, skip_eplb: bool = False) -> Any:
        self.runs.append({"tokens": self.input_ids.gpu[:num_tokens].tolist(), "is_profile": is_profile})
        if self.stage_output is not None:
            return self.stage_output, None
        embedded = self.model.embed(self.input_ids.gpu[:num_tokens].long())
        hidden = embedded + self.model.attn(embedded)
        return hidden, hidden[-1:]


def probed(runner: GPUModelRunner, tokens: list[int] | None = None, scan: bool = False) -> dict[str, Any]:
    return probe(SimpleNamespace(model_runner=runner, rank=0), tokens, scan)


def test_probe_runs_the_given_tokens_eagerly_and_reports_finite_logits():
    runner = GPUModelRunner()
    report = probed(runner, [3, 5, 7, 999])
    assert runner.runs == [{"tokens": [3, 5, 7], "is_profile": True}], "none outside the vocabulary"
    assert report["available"] and report["logits"] and report["finite"] and not report["flat"]
    assert 0 < report["max_abs"] < 100 and 0 < report["entropy"] <= torch.log(torch.tensor(VOCAB)).item()


def test_probe_quiets_attention_a_backend_leaves_undefined_and_only_for_the_pass():
    runner = GPUModelRunner()
    assert probed(runner, [1, 2, 3])["finite"], "the NaN the backend leaves is zeros for the pass"
    hidden = torch.ones(2, HIDDEN)
    assert torch.isnan(runner.model.attn(hidden)).all(), "the backend is itself again after it"
    runner.model.attn.impl = None  # a layer whose output the pass cannot set
    report = probed(runner, [1, 2, 3])
    assert report["available"] is False and "no attention layer" in report["why"]


def test_probe_draws_the_same_tokens_each_time_when_given_none():
    first, second = GPUModelRunner(), GPUModelRunner()
    probed(first), probed(second)
    assert first.runs == second.runs and len(first.runs[0]["tokens"]) == 16


def test_probe_finds_logits_an_exploding_lm_head_makes_infinite():
    runner = GPUModelRunner()
    with torch.no_grad():
        runner.model.lm_head.weight.copy_(torch.sign(runner.model.lm_head.weight) * 3e38)
    report = probed(runner, [1, 2, 3])
    assert report["logits"] and not report["finite"] and not report["flat"] and report["max_abs"] is None


def test_probe_finds_logits_that_are_flat():
    runner = GPUModelRunner()
    with torch.no_grad():
        runner.model.lm_head.weight.zero_()
    report = probed(runner, [1, 2, 3])
    assert report["finite"] and report["flat"]


def test_probe_scan_names_a_nan_no_token_reaches():
    runner = GPUModelRunner()
    with torch.no_grad():
        runner.model.embed.weight[VOCAB - 1, 0] = float("nan")  # an unused token's row
    report = probed(runner, [1, 2, 3], scan=True)
    assert report["finite"], "the forward pass never reads it"
    assert report["non_finite"] == "embed.weight"
    assert probed(GPUModelRunner(), [1], scan=True)["non_finite"] is None


def test_probe_reports_no_logits_on_a_pipeline_stage_before_the_last():
    runner = GPUModelRunner()
    runner.stage_output = {"hidden_states": torch.zeros(3, HIDDEN)}  # IntermediateTensors
    report = probed(runner, [1, 2, 3])
    assert report["available"] and report["logits"] is False


def test_probe_runs_only_on_the_runner_it_was_proven_on():
    """vLLM 0.34's rewritten runners have a `_dummy_run` of their own: not the one proven."""
    copied = {k: v for k, v in vars(GPUModelRunner).items() if k not in ("__dict__", "__weakref__")}
    rewritten = type("ModelRunner", (), {**copied, "__module__": "vllm.v1.worker.gpu.model_runner"})
    report = probed(rewritten(), [1, 2])
    assert report["available"] is False and "(ModelRunner)" in report["why"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda r: setattr(r, "lora_config", object()), "no _set_active_loras"),
        (lambda r: setattr(r.parallel_config, "data_parallel_size", 2), "data parallel"),
        (lambda r: setattr(r.parallel_config, "pipeline_parallel_size", 2), "pipeline parallel"),
        (lambda r: setattr(r.model, "mixer", type("MambaMixer2", (torch.nn.Module,), {})()), "hybrid"),
        (lambda r: setattr(r, "_dummy_run", None), "has no GPUModelRunner._dummy_run"),
        (lambda r: setattr(r, "_dummy_run", lambda n, **_: 1 / 0), "raised ZeroDivisionError"),
    ],
)
def test_probe_says_why_it_cannot_run_and_changes_nothing(change, why: str):
    runner = GPUModelRunner()
    change(runner)
    report = probed(runner, [1, 2])
    assert report["available"] is False and why in report["why"]


def test_probe_scan_reads_fp8_transposed_weights_and_buffers():
    """torch has no isfinite for float8_e4m3fn; fp8 layers keep their weights transposed
    (read in pieces, never copied whole); a buffer is read too."""
    runner = GPUModelRunner()
    runner.model.register_buffer("scale", torch.ones(4, 4, dtype=torch.float8_e4m3fn).t())
    assert probed(runner, [1], scan=True)["non_finite"] is None
    runner.model.scale[3, 0] = float("nan")
    assert probed(runner, [1], scan=True)["non_finite"] == "scale"
    runner = GPUModelRunner()
    runner.model.lm_head.weight = torch.nn.Parameter(torch.zeros(HIDDEN, VOCAB).t())
    runner.model.lm_head.weight.data[VOCAB - 1, 2] = float("inf")
    assert not runner.model.lm_head.weight.is_contiguous()
    assert probed(runner, [1], scan=True)["non_finite"] == "lm_head.weight"


ADAPTERS = {"/adapters/ok": 0.0, "/adapters/overflows": 3e38}
"""What each adapter path adds to the hidden states (a scripted LoRA delta)."""


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class LoraRunner(GPUModelRunner):
    """With `--enable-lora`: vLLM's own dummy-run LoRA setup registers warm-up adapters and
    removes every adapter after (`maybe_dummy_run_with_lora`, here as destructive)."""

    def __init__(self) -> None:
        super().__init__()
        self.lora_config = SimpleNamespace(max_loras=2, max_cpu_loras=3)
        self.adapters: dict[int, float] = {1: 0.0}  # a client's adapter, id 1
        self.active: tuple[int, ...] = ()

    def add_lora(self, request: LoRARequest) -> bool:
        if request.lora_int_id in self.adapters:  # vLLM's LRU cache: a known id is not read again
            return True
        self.adapters[request.lora_int_id] = ADAPTERS[request.lora_path]
        return True

    def list_loras(self) -> set[int]:
        return set(self.adapters)

    def remove_lora(self, lora_id: int) -> bool:
        return self.adapters.pop(lora_id, None) is not None

    def _set_active_loras(self, prompt: tuple[int, ...], tokens: tuple[int, ...], requests: set) -> None:
        assert {r.lora_int_id for r in requests} <= set(self.adapters)
        self.active = tokens

    @contextmanager
    def maybe_dummy_run_with_lora(self, config: object, scheduled: Any, sampled: Any, remove: bool = True):
        self.adapters = {i: 0.0 for i in range(1, 3)}  # warm-up adapters under the clients' ids
        yield
        self.adapters.clear()

    def _dummy_run(self, num_tokens: int, is_profile: bool = False, skip_eplb: bool = False) -> Any:
        import numpy as np

        with self.maybe_dummy_run_with_lora(self.lora_config, np.array([num_tokens]), np.array([1])):
            hidden, last = super()._dummy_run(num_tokens, is_profile, skip_eplb)
            delta = self.adapters.get(self.active[0], 0.0) if self.active else 0.0
            return hidden + delta, last


@pytest.fixture
def lora_module(monkeypatch):
    module = ModuleType("vllm.lora.request")
    module.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.lora.request", module)


def test_adapter_probe_finds_an_adapter_that_overflows_and_leaves_the_clients_adapters(lora_module):
    runner = LoraRunner()
    report = probe_adapter(SimpleNamespace(model_runner=runner, rank=0), "/adapters/overflows", [1, 2])
    assert report["available"] and report["logits"] and report["finite"] is False
    assert runner.active == (PROBE_LORA_ID, PROBE_LORA_ID), "every token of the pass ran the adapter"
    assert runner.adapters == {1: 0.0}, "the probe's adapter removed, the client's kept, no warm-up ones"
    assert "maybe_dummy_run_with_lora" not in vars(runner)
    good = probe_adapter(SimpleNamespace(model_runner=runner, rank=0), "/adapters/ok", [1, 2])
    assert good["finite"] and not good["flat"] and runner.adapters == {1: 0.0}


def test_base_probe_with_lora_enabled_runs_on_no_adapter_and_keeps_the_clients_adapters(lora_module):
    runner = LoraRunner()
    report = probed(runner, [1, 2, 3])
    assert report["available"] and report["finite"]
    assert runner.active == (0, 0, 0) and runner.adapters == {1: 0.0}


def test_adapter_probe_says_why_it_cannot_run(lora_module):
    assert (
        "not enabled"
        in probe_adapter(SimpleNamespace(model_runner=GPUModelRunner()), "/adapters/ok", [1])["why"]
    )
    runner = LoraRunner()
    refused = probe_adapter(SimpleNamespace(model_runner=runner), "/adapters/missing", [1])
    assert refused["available"] is False and "vLLM did not load it" in refused["why"]
    assert runner.adapters == {1: 0.0}


def test_attention_in_the_pass_is_each_tokens_own_value_with_its_score_folded_in():
    """Grouped-query heads as vLLM's backends get them ([tokens, heads, head size]): each
    query head answers its group's value; an overflowing key reaches the output as NaN."""
    layer = SimpleNamespace(num_heads=4, num_kv_heads=2)
    q, k, v = torch.randn(3, 4, 2), torch.randn(3, 2, 2), torch.randn(3, 2, 2)
    out = torch.full((3, 4, 2), float("nan"))
    _self_only(layer, q, k, v, None, None, output=out)
    assert torch.equal(out, v.repeat_interleave(2, dim=1))
    k[1, 0, 0] = float("inf")
    _self_only(layer, q, k, v, None, None, output=out)
    assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1, :2]).all()
    mla = torch.randn(3, 5), torch.randn(3, 1, 7)
    latent = _self_only(layer, q, *mla, None, None, output=torch.ones(3, 4, 2))
    assert not latent.any(), "inputs it cannot read (MLA's): zeros, as before"


def test_adapter_probe_never_judges_a_copy_a_probe_left_behind(lora_module):
    runner = LoraRunner()
    runner.adapters[PROBE_LORA_ID] = 0.0  # a probe that died half-way left a good version loaded
    report = probe_adapter(SimpleNamespace(model_runner=runner), "/adapters/overflows", [1])
    assert report["finite"] is False and runner.adapters == {1: 0.0}


def test_adapter_probe_runs_no_pass_unless_every_tensor_parallel_rank_loaded_it(lora_module, monkeypatch):
    """Another rank could not load it: a rank going on into the pass alone would wait for the
    others' collectives forever."""
    group = SimpleNamespace(world_size=2, cpu_group=object())
    state = ModuleType("vllm.distributed.parallel_state")
    state.get_tp_group = lambda: group  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    said: list[int] = []

    def all_reduce(flag: torch.Tensor, op: object, group: object) -> None:
        said.append(int(flag.item()))
        flag.fill_(0)  # the other rank's answer: it could not

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    runner = LoraRunner()
    report = probe_adapter(SimpleNamespace(model_runner=runner), "/adapters/ok", [1])
    assert said == [1] and report["available"] is False and "another rank" in report["why"]
    assert runner.runs == [] and runner.adapters == {1: 0.0}


def test_attention_in_the_pass_leaves_quantized_outputs_alone():
    layer = SimpleNamespace(num_heads=2, num_kv_heads=2)
    q = k = v = torch.randn(3, 2, 2)
    scaled = _self_only(layer, q, k, v, None, None, output=torch.ones(3, 2, 2), output_scale=torch.ones(1))
    assert not scaled.any(), "an output with scales (fused quantization): zeros, never unscaled values"
    fp8 = torch.ones(3, 2, 2).to(torch.float8_e4m3fn)
    assert not _self_only(layer, q.to(torch.float8_e4m3fn), k, v, output=fp8).float().any()
