"""Schedule IR: builders, text form, in-flight counts and the static deadlock checker."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mplan.ir.schedule import (Action, Schedule, ScheduleError, build_schedule, check_schedule, gpipe,
                               interleaved_1f1b, interleaved_warmup, max_in_flight, max_in_flight_per_stage,
                               one_f_one_b)


def test_action_text_round_trips() -> None:
    for text in ("0F0", "12B7", "3SEND_F11", "1RECV_B0", "2GRAD_SYNC"):
        assert str(Action.parse(text)) == text
    assert Action.parse("3SEND_F12") == Action(kind="SEND_F", stage=3, microbatch=12)
    for bad in ("F0", "0X1", "0GRAD_SYNC1", "0F"):
        with pytest.raises(ScheduleError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(ScheduleError, match="GRAD_SYNC takes no microbatch"):
        Action(kind="GRAD_SYNC", stage=0, microbatch=1)


def test_one_f_one_b_orders_as_megatron() -> None:
    text = one_f_one_b(4, 6).render()
    assert text.splitlines() == [
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
        "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
        "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ]


def test_communication_is_lowered_where_stages_change_rank() -> None:
    s = one_f_one_b(2, 1, grad_sync=True)
    assert s.render(comm=True).splitlines() == [
        "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0GRAD_SYNC",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1GRAD_SYNC",
    ]
    assert Schedule.from_text(name="1f1b", pp=2, num_microbatches=1, lines=s.render(comm=True).splitlines()) == s


def test_interleaved_chunks_and_virtual_stage_numbering() -> None:
    s = interleaved_1f1b(2, 4, 2)
    assert s.num_stages == 4 and s.stages_of(1) == (1, 3)
    assert s.render().splitlines()[0] == "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"


def test_interleaved_needs_microbatches_a_multiple_of_pp() -> None:
    with pytest.raises(ScheduleError, match=r"num_microbatches=6 % pp=4 = 2"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="needs interleaved"):
        build_schedule("1f1b", 2, 2, vpp=2)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_builders_pass_the_checker_and_hold_the_expected_microbatches(pp: int, m: int) -> None:
    g, f = gpipe(pp, m, grad_sync=True), one_f_one_b(pp, m, grad_sync=True)
    check_schedule(g)
    check_schedule(f)
    for rank in range(pp):
        assert max_in_flight(g, rank) == m
        assert max_in_flight(f, rank) == min(pp - rank, m)


@pytest.mark.parametrize("pp, m, vpp", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3), (8, 16, 2)])
def test_interleaved_passes_and_holds_megatrons_warmup_plus_one(pp: int, m: int, vpp: int) -> None:
    s = interleaved_1f1b(pp, m, vpp, grad_sync=True)
    check_schedule(s)
    for rank in range(pp):
        warmup = interleaved_warmup(pp, m, vpp, rank)
        expected = m * vpp if warmup == m * vpp else warmup + 1
        assert max_in_flight(s, rank) == expected
    if m > pp:
        assert max_in_flight(s, 0) == (pp - 1) * 2 + (vpp - 1) * pp + 1


def test_per_stage_in_flight() -> None:
    assert max_in_flight_per_stage(one_f_one_b(4, 8)) == (4, 3, 2, 1)
    assert max_in_flight_per_stage(gpipe(3, 5)) == (5, 5, 5)
    assert max_in_flight_per_stage(interleaved_1f1b(2, 4, 2)) == (4, 3, 2, 1)  # the last stage runs F then B


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 6), groups=st.integers(1, 4), vpp=st.integers(1, 4))
def test_any_valid_interleaved_schedule_completes(pp: int, groups: int, vpp: int) -> None:
    check_schedule(interleaved_1f1b(pp, pp * groups, vpp, grad_sync=True))


def _broken(lines: list[str], pp: int = 2, m: int = 1) -> Schedule:
    return Schedule.from_text(name="broken", pp=pp, num_microbatches=m, lines=lines)


def test_checker_reports_a_deadlock_with_each_stuck_rank() -> None:
    s = _broken(["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError) as info:
        check_schedule(s)
    assert str(info.value) == ("schedule broken: deadlock: rank 0 at action #1 (0RECV_B0) waits for rank 1; "
                               "rank 1 at action #0 (1RECV_F0) waits for rank 0")


def test_checker_catches_a_hand_broken_1f1b() -> None:
    lines = one_f_one_b(2, 2).render(comm=True).splitlines()
    assert lines[1] == "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
    swapped = "rank 1: 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0"
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 \(1RECV_F1\): the next message from rank 0 is "
                                            r"activations for stage 1 microbatch 0: sends and receives are out of order"):
        check_schedule(_broken([lines[0], swapped], m=2))


@pytest.mark.parametrize("lines, m, message", [
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_B0"], 1, "rank 1 never runs 1B0"),
    (["0F0 0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1, r"action #1 \(0F0\): duplicate"),
    (["0F0 0SEND_F0 0RECV_B0 0B0 1F0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1, "stage 1 belongs to rank 1"),
    (["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1, r"\(0SEND_F0\): sends before computing 0F0"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"], 1, r"\(1F0\): no 1RECV_F0 before it"),
    (["0F0 0SEND_F0 0GRAD_SYNC 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1, "gradient sync before the last"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0 1SEND_B0"], 1, "which never receives it"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1B0 1F0 1SEND_B0"], 1, r"\(1B0\): backward before the forward"),
])
def test_checker_names_the_rank_and_action(lines: list[str], m: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check_schedule(_broken(lines, m=m))


def test_same_rank_order_is_checked_for_interleaved_chunks() -> None:
    # pp=1, vpp=2: stages 0 and 1 both on rank 0, no communication; stage 1's F before stage 0's is wrong.
    s = Schedule.from_text(name="local", pp=1, num_microbatches=1, num_virtual=2, lines=["1F0 0F0 1B0 0B0"])
    with pytest.raises(ScheduleError, match=r"\(1F0\): runs before 0F0 on the same rank"):
        check_schedule(s)


@pytest.mark.parametrize("name,pp,m,vpp", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                           ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 3), ("1f1b", 1, 5, 1)])
def test_in_flight_by_rank_counts_what_the_schedule_holds(name, pp, m, vpp) -> None:
    from mplan.ir.schedule import build_schedule, max_in_flight_by_rank

    schedule = build_schedule(name, pp, m, vpp)
    assert max_in_flight_by_rank(name, pp, m, vpp) == tuple(max_in_flight(schedule, r) for r in range(pp))
