"""The extension's probe on a scripted model runner (torch only): what it reports for weights
that compute, overflow, flatten or hold NaN, and where it cannot run (the real engine: tests/e2e)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_reloader.extension.probe import probe

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
        (lambda r: setattr(r, "lora_config", object()), "LoRA is enabled"),
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
