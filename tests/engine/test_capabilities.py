import pytest

from vllm_reloader.engine.capabilities import (
    DEV_MODE_FIX,
    REQUIRED_ROUTES,
    SUPPORTED,
    Capabilities,
    pause_rejects,
    problem,
    release,
    untested,
)

ALL = frozenset(REQUIRED_ROUTES)


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("0.32.0", (0, 32, 0)),
        ("0.27.1+cpu", (0, 27, 1)),
        ("0.33.0rc1.dev12+g1234", (0, 33, 0)),
        ("1.0", (1, 0, 0)),
        ("unknown", None),
        (None, None),
    ],
)
def test_release_reads_the_numbers_of_a_vllm_version(version, parsed):
    assert release(version) == parsed


def test_an_engine_with_every_route_in_range_is_drivable():
    assert problem(Capabilities("0.32.0", ALL, dev_mode=True)) is None
    assert problem(Capabilities("0.27.1", ALL, dev_mode=True)) is None


def test_dev_mode_off_names_the_variable_to_set():
    why = problem(Capabilities("0.32.0", frozenset(), dev_mode=False))
    assert why is not None and "VLLM_SERVER_DEV_MODE=1" in why and DEV_MODE_FIX in why
    assert "\n" not in why


def test_a_missing_route_is_named_with_the_supported_range():
    why = problem(Capabilities("0.20.0", ALL - {"/collective_rpc"}, dev_mode=True))
    assert why is not None and "/collective_rpc" in why and SUPPORTED in why


def test_a_release_older_than_the_oldest_supported_is_refused_even_with_the_routes():
    why = problem(Capabilities("0.27.0", ALL, dev_mode=True))
    assert why is not None and "older" in why and SUPPORTED in why


def test_routes_unknown_without_openapi_are_not_held_against_the_engine():
    assert problem(Capabilities(None, None, dev_mode=True)) is None


def test_a_newer_release_is_untested_but_drivable():
    newer = Capabilities("0.35.0", ALL, dev_mode=True)
    assert untested(newer) and problem(newer) is None
    assert not untested(Capabilities("0.34.1", ALL, dev_mode=True))
    assert not untested(Capabilities(None, ALL, dev_mode=True))


def test_logged_capabilities_are_sorted_routes_and_the_version():
    assert Capabilities("0.32.0", frozenset({"/resume", "/pause"}), True).logged() == {
        "vllm_version": "0.32.0",
        "routes": ["/pause", "/resume"],
    }


def test_pauses_turn_new_requests_away_from_release_0_33_on():
    assert not pause_rejects(Capabilities("0.32.0", ALL, dev_mode=True))
    assert pause_rejects(Capabilities("0.33.0", ALL, dev_mode=True))
    assert pause_rejects(Capabilities("0.34.0rc1", ALL, dev_mode=True))
    assert not pause_rejects(Capabilities(None, ALL, dev_mode=True))


def test_a_refusal_is_vllms_whole_sentence_and_never_a_name_a_writer_chose():
    from vllm_reloader.engine.capabilities import refused

    sentence = (
        "Updating weights layer by layer needs about 3.10 GiB of free device memory, at least "
        "1.55 GiB for the largest layer alone, but only 0.80 GiB is free"
    )
    assert refused(f"/collective_rpc: HTTP 500: RuntimeError: {sentence}")
    assert not refused("of free device memory, at least")  # the phrase alone
    assert not refused(f"no such file /ckpt/{sentence}/model.safetensors", ("/ckpt/" + sentence,))
