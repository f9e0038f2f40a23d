from vllm_reloader.engine.nodes import NodeState, first_short, node_states


def answer(rank: int, node_rank: int, problem: str | None = None) -> dict[str, object]:
    return {"rank": rank, "node_rank": node_rank, "host": f"h{node_rank}", "problem": problem}


def test_node_states_group_ranks_by_node_and_keep_the_first_problem():
    states = node_states([answer(0, 0), answer(1, 0), answer(2, 1, "no copy"), answer(3, 1, "other")])
    assert states == (NodeState("node 0 (h0)", (0, 1), None), NodeState("node 1 (h1)", (2, 3), "no copy"))
    assert first_short(states) == states[1]


def test_every_node_staged_means_no_short_node():
    assert first_short(node_states([answer(0, 0), answer(1, 1)])) is None


def test_a_rank_that_does_not_answer_as_the_extension_does_is_a_short_node_of_its_own():
    states = node_states([answer(0, 0), None])
    short = first_short(states)
    assert short is not None and short.node == "rank 1" and "no staged answer" in str(short.problem)
