"""When each step-less version arrived: the record store's table, across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.records import open_records
from vllm_reloader.checkpoint import order
from vllm_reloader.sources import arrivals
from vllm_reloader.sources.arrivals import Arrivals


def stepless(name: str) -> order.Candidate:
    return order.Candidate(name, None, "fp-" + name)


def test_arrivals_leave_what_a_fresh_state_first_lists_unordered_and_place_what_comes_after(tmp_path):
    table = Arrivals(open_records(tmp_path))
    assert table.placed(stepless("there-before"), floor=5, first=True).arrival is None
    table.started()
    came = table.placed(stepless("final"), floor=5, first=False)
    later = table.placed(stepless("final-2"), floor=5, first=False)
    assert came.arrival == (5, 1) and later.arrival == (5, 2)
    assert (
        order.Candidate("step-5", 5, "x").key < came.key < later.key < order.Candidate("step-6", 6, "y").key
    )
    assert stepless("there-before").key < order.Candidate("step-1", 1, "z").key


def test_arrivals_are_remembered_across_a_restart_and_a_name_keeps_its_place(tmp_path):
    records = open_records(tmp_path)
    first = Arrivals(records)
    first.started()
    placed = first.placed(stepless("final"), floor=7, first=True)  # the state had none: fresh
    assert placed.arrival is None
    assert first.placed(stepless("after"), floor=7, first=False).arrival == (7, 1)
    records.close()
    again = Arrivals(open_records(tmp_path))
    assert not again.fresh, "a restart's first listing is not a new host's"
    assert again.placed(stepless("new-while-down"), floor=9, first=True).arrival == (9, 2)
    assert again.placed(stepless("after"), floor=100, first=False).arrival == (7, 1)
    assert again.of("after@0123456789abcdef") == (7, 1), "a placed download is its name's"


def test_arrivals_give_a_stepped_candidate_no_arrival(tmp_path):
    table = Arrivals(open_records(tmp_path))
    stepped = order.Candidate("step-3", 3, "fp")
    assert table.placed(stepped, floor=9, first=False) is stepped
    assert table.snapshot() == {}


@pytest.mark.parametrize("stored", ['"text"', "[1]", '[1, "2"]', "[true, 2]", "{}"])
def test_arrivals_read_an_odd_stored_row_as_none(tmp_path: Path, stored: str):
    records = open_records(tmp_path)
    records._db.execute("INSERT INTO facts VALUES (?, ?, ?)", (arrivals.KIND, "odd", stored))
    assert Arrivals(records).of("odd") is None


def test_arrivals_forget_a_name_its_source_no_longer_has_and_place_it_anew_when_back(tmp_path):
    records = open_records(tmp_path)
    table = Arrivals(records)
    table.started()
    assert table.placed(stepless("final"), floor=1, first=False).arrival == (1, 1)
    table.placed(stepless("other"), floor=1, first=False)
    table.forget("final")
    assert table.placed(stepless("final"), floor=4, first=False).arrival == (4, 3), "back: it arrived again"
    table.keep_only({"other"})
    assert sorted(records.all(arrivals.KIND)) == ["other"]
