from typing import Any

import httpx
import pytest

from tests.support.fake_engine import REFUSED, FakeEngine, error, unreachable
from vllm_reloader.checkpoint.files import identity
from vllm_reloader.config import EngineConfig
from vllm_reloader.engine.client import EXTENSION_METHOD, RELOADING_PREFIX, EngineClient
from vllm_reloader.engine.serverinfo import ServerConfig
from vllm_reloader.engine.swap import Target, hot_swap
from vllm_reloader.errors import EngineCallFailed, EngineUnavailable, ReloadFailed

NEW = Target("step-2", "/root/step-2")
OLD = Target("step-1", "/root/step-1")


def swap(engine: FakeEngine, fallback: Target | None = OLD) -> tuple[dict[str, Any], list[str]]:
    failures: list[str] = []
    timings = hot_swap(
        engine.client(), NEW, fallback=fallback, on_resume_failed=lambda e: failures.append(str(e))
    )
    return timings, failures


def test_engine_swap_runs_the_sequence_in_order():
    engine = FakeEngine()
    timings, failures = swap(engine)
    assert engine.calls == [
        "/pause",
        "/update_weight_version",
        "reload:/root/step-2",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert engine.version == "step-2" and not engine.paused and not failures
    assert set(timings) == {"pause_ms", "reload_ms", "reset_ms", "resume_ms"}


def test_engine_swap_restores_last_good_and_resumes_when_reload_fails():
    engine = FakeEngine()
    engine.fail["reload:/root/step-2"] = error(500, "incomplete metadata")
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.restored and failed.value.engine_up
    assert "incomplete metadata" in str(failed.value)
    assert engine.loaded == "/root/step-1"
    assert engine.version == "step-1"
    assert engine.calls[-1] == "/resume" and not engine.paused


def test_engine_swap_marks_a_refused_load_as_the_engines_condition_and_restores():
    engine = FakeEngine()
    engine.fail["reload:/root/step-2"] = error(500, REFUSED)
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.refused and failed.value.restored and not failed.value.changed
    assert engine.loaded == "/root/step-1" and engine.version == "step-1" and not engine.paused


def test_engine_swap_takes_a_restore_refused_too_as_weights_no_rank_changed():
    engine = FakeEngine()
    engine.fail["reload:/root/step-2"] = error(500, REFUSED)
    engine.fail["reload:/root/step-1"] = error(500, REFUSED)
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.refused and failed.value.restored and "refused too" in str(failed.value)
    assert engine.version == "step-1" and not engine.paused, "marked as what it still holds"


@pytest.mark.parametrize(
    "message",
    [
        "RuntimeError: size mismatch for lm_head.weight",
        f"FileNotFoundError: /root/step-2/{REFUSED[14:110]} GiB.safetensors",  # a writer's file name
    ],
)
def test_engine_swap_does_not_call_another_failure_a_refusal(message: str):
    engine = FakeEngine()
    target = Target("step-2", "/root/step-2", {f"{REFUSED[14:110]} GiB.safetensors": (1, 2, 3, 4, 5)})
    engine.fail["reload:/root/step-2"] = error(500, message)
    with pytest.raises(ReloadFailed) as failed:
        hot_swap(engine.client(), target, fallback=OLD, on_resume_failed=lambda e: None)
    assert not failed.value.refused


def test_engine_swap_reports_unrestored_weights_when_restore_fails_too():
    engine = FakeEngine()
    engine.fail["reload:/root/step-2"] = error()
    engine.fail["reload:/root/step-1"] = error()
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert not failed.value.restored
    assert engine.version == RELOADING_PREFIX + "step-2"  # a restarted daemon will know
    assert not engine.paused


def test_engine_swap_resumes_when_version_update_fails():
    engine = FakeEngine()
    engine.fail["/update_weight_version"] = error(500)
    with pytest.raises(EngineCallFailed):
        swap(engine)
    assert not engine.paused and engine.calls[-1] == "/resume"


def test_engine_swap_reports_resume_failure_instead_of_hiding_it():
    engine = FakeEngine()
    engine.fail["/resume"] = error(500, "stuck")
    _, failures = swap(engine)
    assert failures and "stuck" in failures[0]


def test_engine_unreachable_is_translated():
    engine = FakeEngine()
    engine.fail["/weight_info"] = unreachable()
    with pytest.raises(EngineUnavailable) as failed:
        engine.client().weight_version()
    assert failed.value.endpoint == "/weight_info"
    assert isinstance(failed.value.__cause__, httpx.ConnectError)


def test_engine_error_status_is_translated_with_message():
    engine = FakeEngine()
    engine.fail["/pause"] = error(400, "bad mode")
    with pytest.raises(EngineCallFailed, match="HTTP 400: bad mode") as failed:
        engine.client().pause("keep")
    assert failed.value.status == 400


def test_engine_reads_startup_model_and_extension_from_server_info():
    engine = FakeEngine(startup="/models/a")
    assert engine.client().server_config() == ServerConfig("/models/a", sleep_mode=False, extension=False)
    engine.extension = engine.sleep_mode = True
    assert engine.client().server_config() == ServerConfig("/models/a", sleep_mode=True, extension=True)
    engine.reload_mode = "direct"
    assert engine.client().server_config().reload_mode == "direct"


def test_engine_reads_its_lora_rank_and_dtype_from_server_info():
    from vllm_reloader.engine.serverinfo import UNSAID, Lora

    engine = FakeEngine(startup="/models/a")
    assert engine.client().server_config().lora is UNSAID, "an older release: not said"
    engine.lora_config = None
    assert engine.client().server_config().lora is None, "started without --enable-lora"
    engine.lora_config = {"max_lora_rank": 8, "lora_dtype": "torch.bfloat16"}
    assert engine.client().server_config().lora == Lora(8, "BF16")
    engine.lora_config = {"max_lora_rank": 8, "lora_dtype": "auto"}
    assert engine.client().server_config().lora == Lora(8, None)


@pytest.mark.parametrize("extension", [False, True])
def test_engine_swap_loads_through_the_extension_only_when_told(extension: bool):
    engine = FakeEngine()
    engine.extension = extension
    timings = hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=print, extension=extension)
    assert engine.methods == ([EXTENSION_METHOD] if extension else ["reload_weights"])
    assert engine.loaded == NEW.path
    assert timings.get("load") == ({"loader": "extension", "bytes": 42} if extension else None)


def test_engine_restores_through_the_extension_when_the_new_load_fails():
    engine = FakeEngine()
    engine.extension = True
    engine.fail[f"reload:{NEW.path}"] = error(500, "shape mismatch")
    with pytest.raises(ReloadFailed, match="restored") as failed:
        hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=print, extension=True)
    assert failed.value.restored
    assert engine.methods == [EXTENSION_METHOD, EXTENSION_METHOD]
    assert engine.loaded == OLD.path and not engine.paused


def test_engine_swap_in_abort_mode_counts_the_requests_it_drops():
    engine = FakeEngine()
    timings = hot_swap(engine.client(pause_mode="abort"), NEW, fallback=OLD, on_resume_failed=print)
    assert timings["aborted_requests"] == 5  # running 3 + waiting 2, read just before /pause
    assert engine.calls[:3] == ["/metrics", "/load", "/pause"]
    assert "aborted_requests" not in swap(FakeEngine())[0], "keep mode drops nothing"


def test_engine_sleep_strategy_frees_the_kv_cache_around_the_reload():
    engine = FakeEngine()
    timings = hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=print, strategy="sleep")
    assert engine.calls == [
        "/pause",
        "/update_weight_version",
        "/sleep?level=2&mode=keep",  # keep: /sleep would abort the frozen requests otherwise
        "/wake_up?tags=weights",
        "reload:/root/step-2",
        "/wake_up?tags=kv_cache",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert engine.asleep == set() and not engine.paused and engine.version == "step-2"
    assert {"sleep_ms", "wake_ms"} <= set(timings)


def test_engine_sleep_strategy_wakes_everything_when_the_reload_fails():
    engine = FakeEngine()
    engine.fail["reload:/root/step-2"] = error(500, "shape mismatch")
    engine.fail["reload:/root/step-1"] = error(500, "and again")
    with pytest.raises(ReloadFailed):
        hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=print, strategy="sleep")
    assert engine.calls[-2:] == ["/wake_up?tags=weights,kv_cache", "/resume"]
    assert engine.asleep == set() and not engine.paused


def test_engine_reload_uses_a_connection_of_its_own():
    """vLLM closes the connection after a failed collective_rpc: the restore must not reuse it."""
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("connection"))
        return httpx.Response(200, json={"results": [{"loader": "extension"}]})

    client = EngineClient(EngineConfig(url="http://engine.test"), transport=httpx.MockTransport(handle))
    client.reload_weights("/root/step-2")
    client.reload_weights("/root/step-2", extension=True)
    assert seen == ["close", "close"]


@pytest.mark.parametrize("failing", ["/sleep", "/wake_up"])
def test_engine_sleep_strategy_restores_the_fallback_when_anything_after_sleeping_fails(failing: str):
    """Asleep at level 2 the weights are gone: resuming without a restore serves garbage."""
    engine = FakeEngine()
    woken = {"done": False}
    real = engine.handle

    def wake_fails_once(request: httpx.Request) -> httpx.Response:
        if request.url.path == failing and not woken["done"]:
            woken["done"] = True
            if failing == "/sleep":
                engine.asleep = {"weights", "kv_cache"}  # it slept, then the answer was lost
            return httpx.Response(500, json={"error": {"message": "out of memory"}})
        return real(request)

    engine.handle = wake_fails_once  # type: ignore[method-assign]
    with pytest.raises(ReloadFailed, match="out of memory; restored step-1") as failed:
        hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=print, strategy="sleep")
    assert failed.value.restored and not failed.value.changed
    assert engine.loaded == OLD.path and engine.version == "step-1"
    assert engine.asleep == set() and not engine.paused


def test_engine_swap_restores_when_the_files_changed_during_the_load(tmp_path):
    """vLLM's own loader reads by path: a file written meanwhile may have been read half old."""
    shard = tmp_path / "step-2" / "model.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 64)
    target = Target("step-2", str(shard.parent), {"model.safetensors": identity(shard.lstat())})
    engine = FakeEngine()
    engine.during_load = lambda path: shard.write_bytes(b"y" * 64) if path == target.path else None
    with pytest.raises(ReloadFailed, match="files changed during the reload") as failed:
        hot_swap(engine.client(), target, fallback=OLD, on_resume_failed=print)
    assert failed.value.restored and failed.value.changed
    assert engine.loaded == OLD.path and engine.version == "step-1" and not engine.paused


def test_engine_swap_does_not_claim_a_restore_of_a_fallback_that_changed(tmp_path):
    good = tmp_path / "step-1" / "model.safetensors"
    good.parent.mkdir()
    good.write_bytes(b"g" * 64)
    fallback = Target("step-1", str(good.parent), {"model.safetensors": identity(good.lstat())})
    good.write_bytes(b"h" * 64)  # rotated/rewritten by the trainer since it passed its canary
    engine = FakeEngine()
    engine.extension = True
    engine.fail["reload:/root/step-2"] = error(500, "shape mismatch")
    with pytest.raises(ReloadFailed, match="restoring step-1 failed too") as failed:
        hot_swap(engine.client(), NEW, fallback=fallback, on_resume_failed=print, extension=True)
    assert not failed.value.restored and not engine.paused


def test_engine_swap_resets_the_prefix_cache_even_with_requests_kept_through_the_pause():
    """vLLM refuses to reset while kept requests hold blocks: they are preempted (recomputed)."""
    engine = FakeEngine()
    engine.running = 3
    swap(engine)
    assert engine.preempted == 3 and engine.version == "step-2"


def test_engine_swap_treats_a_refused_prefix_cache_reset_as_a_failed_step():
    """New weights behind prefixes cached with the old ones: the old weights go back."""
    engine = FakeEngine()
    engine.cache_reset_refused = True
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert "could not reset its prefix cache" in str(failed.value)
    assert engine.loaded == "/root/step-1" and not engine.paused
    assert engine.version != "step-2"


def test_engine_reload_counts_every_ranks_answer():
    """Tensor parallelism: one report per rank; one without a load is a failed reload."""
    answers = [
        {"loader": "extension", "bytes": 10, "seconds": 1.5, "buffers_allocated": 3, "device": "cpu"},
        {"loader": "extension", "bytes": 12, "seconds": 2.0, "buffers_allocated": 3, "device": "cpu"},
    ]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"results": answers})

    client = EngineClient(EngineConfig(url="http://engine.test"), transport=httpx.MockTransport(handle))
    report = client.reload_weights("/root/step-2", extension=True)
    assert report is not None
    assert (report["bytes"], report["seconds"], report["workers"]) == (22, 2.0, 2)
    assert (report["rank_seconds"], report["rank_bytes"]) == ([1.5, 2.0], [10, 12])
    assert "buffers_allocated" not in report and "device" not in report, "one line, not every field"
    answers[1] = None  # type: ignore[call-overload]
    with pytest.raises(EngineCallFailed, match="rank 1 of 2 reported no load"):
        client.reload_weights("/root/step-2", extension=True)


def test_engine_swap_restores_when_one_rank_reports_no_load():
    engine = FakeEngine()
    engine.extension = True
    engine.ranks = 2
    engine.rank_fails = 1
    with pytest.raises(ReloadFailed, match="rank 1 of 2") as failed:
        hot_swap(engine.client(), NEW, fallback=OLD, on_resume_failed=lambda e: None, extension=True)
    assert failed.value.restored and engine.loaded == "/root/step-1" and not engine.paused
