"""The compatibility contract with every vLLM release from the oldest supported to the newest
on PyPI: routes, parameters, worker methods and config fields the daemon and its extension
use, read out of each release's wheel (a few MB of it, by range requests; cached).

Needs PyPI: without it the lane fails saying it could not check, never passes."""

from __future__ import annotations

import random
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import vllm_contract as contract
from tests.support.lazy_wheel import read_members
from tests.support.range_server import serving
from vllm_reloader.engine import capabilities

CPU_BUILD = "0.32.0"
"""The release the real-engine tests run (its CPU build): the doctored wheels start from it."""


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60, follow_redirects=True) as client:
        yield client


@pytest.fixture(scope="module")
def wheels(http: httpx.Client) -> list[contract.Wheel]:
    try:
        found, missing = contract.wheels(http)
    except (httpx.HTTPError, OSError) as exc:
        pytest.fail(f"could not check the vLLM contract: {contract.INDEX} unreachable ({exc})")
    assert missing == [], "releases in range with no x86_64 wheel to read: the contract cannot check them"
    return found


def test_every_release_from_the_oldest_supported_to_the_newest_meets_the_contract(
    http: httpx.Client, wheels: list[contract.Wheel], capsys: pytest.CaptureFixture[str]
):
    releases = [w.release for w in wheels]
    assert releases[0] == ".".join(map(str, capabilities.OLDEST)) and CPU_BUILD in releases, releases
    problems, spent = [], []
    for wheel in wheels:
        sources, fetched = contract.sources_of(http, wheel)
        problems += contract.check(wheel.release, sources)
        spent.append(fetched)
    assert problems == []
    newest = capabilities.release(releases[-1])
    assert newest is not None and newest[:2] <= capabilities.NEWEST_TESTED, (
        f"vLLM {releases[-1]} passes the contract: raise NEWEST_TESTED and SUPPORTED to it"
    )
    with capsys.disabled():
        fetched = [f for f in spent if not f.cached]
        print(
            f"\nvLLM contract: {len(wheels)} releases ({releases[0]}..{releases[-1]}), "
            f"{sum(f.requests for f in fetched)} range requests, "
            f"{sum(f.bytes for f in fetched) / 1e6:.1f} MB read, {len(wheels) - len(fetched)} from the cache"
        )


NEWEST = "0.34.0"
"""The release with the KV-cache loan and VLLM_RELOAD_MODE: the doctorings of those start here."""
DOCTORINGS = {
    "route renamed": (
        CPU_BUILD,
        "vllm/entrypoints/rl/online/api_router.py",
        '@router.post("/pause")',
        '@router.post("/pause_generation")',
        "no POST /pause route",
    ),
    "query parameter renamed": (
        CPU_BUILD,
        "vllm/entrypoints/serve/dev/cache/api_router.py",
        "reset_running_requests",
        "reset_running",
        "takes no query parameter 'reset_running_requests'",
    ),
    "query parameter moved into the body": (
        CPU_BUILD,
        "vllm/entrypoints/rl/online/api_router.py",
        "mode: Annotated[PauseMode, Query()]",
        "mode: Annotated[PauseMode, Body(embed=True)]",
        "takes no query parameter 'mode'",
    ),
    "worker keyword renamed": (
        CPU_BUILD,
        "vllm/v1/worker/gpu_model_runner.py",
        "weights_path",
        "checkpoint_path",
        "reload_weights takes no weights_iterator/weights_path",
    ),
    "probe's keyword renamed": (
        CPU_BUILD,
        "vllm/v1/worker/gpu_model_runner.py",
        "        is_profile: bool = False,",
        "        profile: bool = False,",
        "_dummy_run takes no 'is_profile'",
    ),
    "probe's LoRA mapping renamed": (
        CPU_BUILD,
        "vllm/v1/worker/lora_model_runner_mixin.py",
        "    def _set_active_loras(",
        "    def _set_active_adapters(",
        "LoRAModelRunnerMixin._set_active_loras takes no leading",
    ),
    "pause mode dropped": (
        CPU_BUILD,
        "vllm/v1/engine/__init__.py",
        ', "keep"]',
        "]",
        "PauseMode has no 'keep'",
    ),
    "pause starts answering 503": (
        CPU_BUILD,
        "vllm/entrypoints/rl/online/api_router.py",
        "Pause generation requests to allow weight updates.",
        "Pause generation; new requests get HTTP 503 until /resume.",
        "answers new requests with 503",
    ),
    "config field renamed": (
        CPU_BUILD,
        "vllm/config/model.py",
        "    model_weights:",
        "    weights:",
        "model_weights",
    ),
    "loan refusal reworded": (
        NEWEST,
        "vllm/v1/worker/extensible_kv_cache.py",
        "Updating weights layer by layer needs about",
        "A layer-by-layer weight update needs about",
        "no error raised saying",
    ),
    "reload mode renamed": (
        NEWEST,
        "vllm/envs.py",
        '["layerwise", "direct"]',
        '["layerwise", "inplace"]',
        "VLLM_RELOAD_MODE",
    ),
}


@pytest.mark.parametrize("doctoring", DOCTORINGS)
def test_contract_fails_naming_what_moved_in_a_doctored_wheel(
    http: httpx.Client, wheels: list[contract.Wheel], tmp_path: Path, doctoring: str
):
    release, member, old, new, named = DOCTORINGS[doctoring]
    sources, _ = contract.sources_of(http, next(w for w in wheels if w.release == release))
    assert old in sources[member], f"{member} no longer has {old!r}: update this doctoring"
    doctored = {**sources, member: sources[member].replace(old, new)}
    wheel = tmp_path / f"vllm-{release}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        bulk = random.Random(0).randbytes(8 << 20)  # the compiled part, before the sources, as in a wheel
        archive.writestr("vllm/_C.abi3.so", bulk, zipfile.ZIP_STORED)
        for name, text in doctored.items():
            archive.writestr(name, text)
    with serving(wheel) as url:
        read, fetched = read_members(
            http, url, wheel.stat().st_size, "doctored", contract.WANTED, tmp_path / "cache", "t"
        )
    assert read == doctored and fetched.requests >= 1 and fetched.bytes < wheel.stat().st_size
    assert contract.check(release, sources) == []
    problems = contract.check(release, read)
    assert problems and all(release in p for p in problems)
    assert any(named in p for p in problems), problems


def test_contract_lists_post_releases_and_fails_a_release_with_no_wheel_to_read():
    def file(name: str) -> dict[str, object]:
        return {
            "filename": name,
            "url": f"https://files.example/{name}",
            "size": 1,
            "hashes": {"sha256": "0"},
        }

    names = [
        "vllm-0.27.0-cp38-abi3-manylinux_2_28_x86_64.whl",  # older than supported
        "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.32.0.post1-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.33.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl",  # a pre-release
        "vllm-0.35.0-cp38-abi3-manylinux_2_28_aarch64.whl",  # no x86_64 wheel: cannot be checked
        "vllm-0.35.0.tar.gz",
    ]
    index = httpx.MockTransport(lambda _: httpx.Response(200, json={"files": [file(n) for n in names]}))
    with httpx.Client(transport=index) as http:
        found, missing = contract.wheels(http)
    assert [w.release for w in found] == ["0.32.0", "0.32.0.post1"] and missing == ["0.35.0"]


def test_contract_covers_every_route_the_daemon_requires_with_what_it_sends():
    calls = {call.path: call for call in contract.daemon_calls()}
    assert set(capabilities.REQUIRED_ROUTES + capabilities.OPTIONAL_ROUTES) <= set(calls)
    assert calls["/pause"].params == ("mode",)
    assert calls["/wake_up"].params == ("tags",)
    assert calls["/collective_rpc"].body == ("method", "kwargs")
    assert set(calls["/v1/completions"].body) >= {"prompt", "max_tokens", "logprobs"}


def test_contract_reads_the_cache_without_asking_again(
    http: httpx.Client, wheels: list[contract.Wheel], tmp_path: Path
):
    real = next(w for w in wheels if w.release == CPU_BUILD)
    first, fetched = contract.sources_of(http, real, tmp_path)
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(500))) as offline:
        again, cached = contract.sources_of(offline, real, tmp_path)
    assert not fetched.cached and fetched.requests > 0
    assert cached.cached and cached.requests == 0 and again == first
