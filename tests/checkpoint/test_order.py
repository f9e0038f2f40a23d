from vllm_reloader.checkpoint.order import (
    NOTHING,
    Candidate,
    Serving,
    natural_key,
    order_key,
    placed_name,
    split_placed,
    to_try,
)


def cands(*items: tuple[str, int | None]) -> dict[str, Candidate]:
    return {name: Candidate(name, step, f"fp-{name}") for name, step in items}


def test_policy_orders_names_naturally():
    names = ["step-10", "step-9", "step-100", "step-1"]
    assert sorted(names, key=natural_key) == ["step-1", "step-9", "step-10", "step-100"]


def test_policy_orders_by_step_before_name():
    assert order_key("a", 2) > order_key("z", 1)
    assert order_key("a", 1) > order_key("z", None)


def test_policy_tries_only_newer_than_serving_newest_first():
    candidates = cands(("step-1", 1), ("step-2", 2), ("step-3", 3), ("step-4", 4))
    chosen = to_try(candidates, serving=Serving(order_key("step-2", 2)), rejected={})
    assert [c.name for c in chosen] == ["step-4", "step-3"]


def test_policy_never_moves_backwards():
    candidates = cands(("step-1", 1), ("step-2", 2))
    assert to_try(candidates, serving=Serving(order_key("step-2", 2)), rejected={}) == []


def test_policy_coalesces_to_newest_when_several_are_ready():
    candidates = cands(*[(f"step-{i}", i) for i in range(1, 11)])
    assert to_try(candidates, serving=Serving(order_key("step-1", 1)), rejected={})[0].name == "step-10"


def test_policy_skips_rejected_until_manifest_changes():
    candidates = cands(("step-2", 2), ("step-3", 3))
    assert [c.name for c in to_try(candidates, serving=NOTHING, rejected={"step-3": {"fp-step-3"}})] == [
        "step-2"
    ]
    changed = {**candidates, "step-3": Candidate("step-3", 3, "new-fingerprint")}
    assert to_try(changed, serving=NOTHING, rejected={"step-3": {"fp-step-3"}})[0].name == "step-3"


def test_policy_treats_everything_as_newer_than_an_outside_startup_model():
    candidates = cands(("a", None), ("b", 5))
    assert [c.name for c in to_try(candidates, serving=NOTHING, rejected={})] == ["b", "a"]


def test_policy_sorts_digits_of_other_scripts_as_letters_without_failing():
    bold_nine = "\N{MATHEMATICAL BOLD DIGIT NINE}"  # isdigit(), and int() refuses it
    names = ["step-²", "step-٣", "step-3", "step-10", f"step-{bold_nine}"]
    ordered = sorted(names, key=natural_key)
    assert ordered.index("step-3") < ordered.index("step-10"), "ASCII digits still compare as numbers"
    assert {"step-²", "step-٣", f"step-{bold_nine}"} <= set(ordered)


def test_policy_takes_the_serving_names_new_content_as_newer_whatever_its_step():
    serving = Serving(order_key("latest", 5), "latest", "fp-v1")
    same_step = {"latest": Candidate("latest", 5, "fp-v2")}
    assert [c.name for c in to_try(same_step, serving=serving, rejected={})] == ["latest"]
    no_step = {"latest": Candidate("latest", None, "fp-v2")}
    assert [c.name for c in to_try(no_step, serving=serving, rejected={})] == ["latest"]
    unchanged = {"latest": Candidate("latest", 5, "fp-v1")}
    assert to_try(unchanged, serving=serving, rejected={}) == [], "its own content is not newer"
    other = {"older": Candidate("older", 4, "fp-x")}
    assert to_try(other, serving=serving, rejected={}) == [], "another name still orders by step"


def test_policy_orders_and_rejects_a_placed_download_by_its_name():
    placed = placed_name("step-5", "ab" * 32)
    assert placed == "step-5@" + "ab" * 8 and split_placed(placed) == ("step-5", "ab" * 8)
    serving = Serving(order_key("step-5", 5), "step-5@" + "cd" * 8, "cd" * 32)
    rewrite = {placed: Candidate(placed, 5, "ab" * 32)}
    assert [c.name for c in to_try(rewrite, serving=serving, rejected={})] == [placed]
    assert to_try(rewrite, serving=serving, rejected={"step-5": {"ab" * 32}}) == []
    assert split_placed("step-5@not-hex") == ("step-5@not-hex", "")


def test_policy_never_takes_a_content_that_served_before_as_newer():
    """`latest` v1 then v2 served: v1's copy (still in the cache) is older, not a rewrite, so
    the two never load in turn."""
    v1, v2 = placed_name("latest", "a1" * 32), placed_name("latest", "b2" * 32)
    serving = Serving(order_key("latest", 5), v2, "b2" * 32, frozenset({"a1" * 32}))
    both = {v1: Candidate(v1, 5, "a1" * 32), v2: Candidate(v2, 5, "b2" * 32)}
    assert to_try(both, serving=serving, rejected={}) == []
    v3 = placed_name("latest", "c3" * 32)
    assert [
        c.name for c in to_try({**both, v3: Candidate(v3, 5, "c3" * 32)}, serving=serving, rejected={})
    ] == [v3]


def test_policy_remembers_every_rejected_content_of_a_name():
    a, b = placed_name("step-5", "aa" * 32), placed_name("step-5", "bb" * 32)
    candidates = {a: Candidate(a, 5, "aa" * 32), b: Candidate(b, 5, "bb" * 32)}
    assert (
        to_try(
            candidates, serving=Serving(order_key("step-4", 4)), rejected={"step-5": {"aa" * 32, "bb" * 32}}
        )
        == []
    )


def test_order_puts_a_stepless_arrival_after_its_floor_and_before_a_higher_step():
    serving = Serving(order_key("step-5", 5))
    came = Candidate("final", None, "a", arrival=(5, 1))
    lower = Candidate("final-old", None, "b", arrival=(3, 2))
    assert serving.replaced_by(came)
    assert not serving.replaced_by(lower), "it arrived when step 3 was the highest: older than step 5"
    assert not serving.replaced_by(Candidate("before", None, "c")), "no arrival: before every step"
    ordered = to_try(
        {c.name: c for c in (came, Candidate("step-6", 6, "d"), Candidate("step-4", 4, "e"))},
        serving=serving,
        rejected={},
    )
    assert [c.name for c in ordered] == ["step-6", "final"]
