"""When each step-less version arrived: the record store's table, by source, across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.records import fill_disk, open_records
from vllm_reloader.checkpoint import order
from vllm_reloader.sources import arrivals
from vllm_reloader.sources.arrivals import Arrivals

ROOT = "/srv/checkpoints"


def stepless(name: str, fingerprint: str | None = None) -> order.Candidate:
    return order.Candidate(name, None, fingerprint if fingerprint is not None else "fp-" + name)


def place(table: Arrivals, *found: order.Candidate, floor: int, first: bool = False) -> list[object]:
    placed = table.place(ROOT, found, floor=floor, first=first)
    return [placed[c.name].arrival for c in found]


def test_arrivals_leave_what_a_fresh_source_first_lists_unordered_and_place_what_comes_after(tmp_path):
    table = Arrivals(open_records(tmp_path))
    assert place(table, stepless("there-before"), floor=5, first=True) == [None]
    table.started(ROOT)
    came, later = stepless("final"), stepless("final-2")
    assert place(table, came, floor=5) == [(5, 1)] and place(table, later, floor=5) == [(5, 2)]
    assert (
        order.Candidate("step-5", 5, "x").key
        < order.order_key("final", None, (5, 1))
        < order.order_key("final-2", None, (5, 2))
        < order.Candidate("step-6", 6, "y").key
    )
    assert stepless("there-before").key < order.Candidate("step-1", 1, "z").key


def test_arrivals_are_remembered_across_a_restart_and_the_same_bytes_keep_their_place(tmp_path):
    records = open_records(tmp_path)
    first = Arrivals(records)
    assert place(first, stepless("final"), floor=7, first=True) == [None]  # fresh: there before
    first.started(ROOT)
    assert place(first, stepless("after"), floor=7) == [(7, 1)]
    records.close()
    again = Arrivals(open_records(tmp_path))
    assert not again.fresh(ROOT), "a restart's first listing is not a new host's"
    assert place(again, stepless("new-while-down"), floor=9, first=True) == [(9, 2)]
    assert place(again, stepless("after"), floor=100) == [(7, 1)]
    assert place(again, stepless("final"), floor=100) == [None], "there before, still"
    assert again.of(ROOT, "after@0123456789abcdef") == (7, 1), "a placed download is its name's"
    assert again.fresh("s3://other/prefix"), "another source starts afresh"
    assert again.of("s3://other/prefix", "after") is None


def test_arrivals_a_name_written_again_with_other_bytes_arrives_again(tmp_path):
    """`save_model` writing `final` over itself after step-600 served: newer again."""
    table = Arrivals(open_records(tmp_path))
    table.started(ROOT)
    assert place(table, stepless("final", "a"), floor=500) == [(500, 1)]
    assert place(table, stepless("final", ""), floor=600) == [(500, 1)], "being written: its place kept"
    assert place(table, stepless("final", "b"), floor=600) == [(600, 2)]
    assert place(table, stepless("final", "b"), floor=700) == [(600, 2)]


def test_arrivals_take_one_floor_for_a_whole_look_whatever_its_order(tmp_path):
    table = Arrivals(open_records(tmp_path))
    table.started(ROOT)
    batch = [stepless("zeta"), order.Candidate("step-500", 500, "s"), stepless("alpha")]
    placed = table.place(ROOT, batch, floor=500, first=False)
    assert sorted(placed) == ["alpha", "zeta"], "a stepped one takes no arrival"
    assert {placed[n].arrival[0] for n in placed} == {500}  # type: ignore[index]


def test_arrivals_keep_nothing_a_full_disk_refused_and_place_it_again(tmp_path, monkeypatch):
    records = open_records(tmp_path)
    table = Arrivals(records)
    table.started(ROOT)
    full = fill_disk(records, monkeypatch, at_commit=True)
    assert place(table, stepless("final"), floor=3) == [(3, 1)]
    assert full.refused and table.of(ROOT, "final") is None, "not remembered: not written"
    monkeypatch.setattr(records, "_db", full.real)
    assert place(table, stepless("final"), floor=4) == [(4, 2)]
    assert Arrivals(records).of(ROOT, "final") == (4, 2)


@pytest.mark.parametrize(
    ("key", "stored"),
    [
        ('["/r", "odd"]', '"text"'),
        ('["/r", "odd"]', '{"arrival": [1]}'),
        ('["/r", "odd"]', '{"arrival": [true, 2]}'),
        ("odd", '{"arrival": [1, 2]}'),
        ('["/r"]', '{"arrival": [1, 2]}'),
    ],
)
def test_arrivals_read_an_odd_stored_row_as_none(tmp_path: Path, key: str, stored: str):
    records = open_records(tmp_path)
    records._db.execute("INSERT INTO facts VALUES (?, ?, ?)", (arrivals.KIND, key, stored))
    assert Arrivals(records).of("/r", "odd") is None


def test_arrivals_keep_a_trainers_directory_and_its_converted_output_apart(tmp_path):
    """Two contents under one base name, side by side in the root: each keeps its own place
    (one entry for both would be written again at every look, each time newer)."""
    table = Arrivals(open_records(tmp_path))
    table.started(ROOT)
    trainers, converted = stepless("final", "dcp"), stepless("final@0123456789abcdef", "hf")
    assert place(table, trainers, converted, floor=2) == [(2, 1), (2, 2)]
    assert place(table, trainers, converted, floor=3) == [(2, 1), (2, 2)]
