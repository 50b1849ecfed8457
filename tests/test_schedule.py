"""Schedule IR: builders, text form, in-flight counts and the static deadlock checker."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mplan.ir.schedule import (SCHEDULES, Action, Schedule, ScheduleError, build_schedule, check_schedule, gpipe,
                               in_flight_counts, interleaved_1f1b, interleaved_warmup, max_in_flight,
                               max_in_flight_by_rank, max_in_flight_per_stage, one_f_one_b, zb_h1)

GOLDEN = Path(__file__).with_name("golden_schedules.txt")


def test_action_text_round_trips() -> None:
    for text in ("0F0", "12B7", "3SEND_F11", "1RECV_B0", "2GRAD_SYNC", "0I3", "2W5"):
        assert str(Action.parse(text)) == text
    assert Action.parse("3SEND_F12") == Action(kind="SEND_F", stage=3, microbatch=12)
    assert Action.parse("2W5") == Action(kind="W", stage=2, microbatch=5)
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
    with pytest.raises(ScheduleError, match="'zb-h1' has one stage per rank; vpp=2 needs interleaved"):
        build_schedule("zb-h1", 2, 2, vpp=2)


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
                                           ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 3), ("1f1b", 1, 5, 1),
                                           ("zb-h1", 4, 8, 1), ("zb-h1", 4, 2, 1), ("zb-h1", 8, 5, 1),
                                           ("zb-h1", 1, 3, 1)])
def test_in_flight_by_rank_counts_what_the_schedule_holds(name: str, pp: int, m: int, vpp: int) -> None:
    schedule = build_schedule(name, pp, m, vpp)
    assert max_in_flight_by_rank(name, pp, m, vpp) == tuple(max_in_flight(schedule, r) for r in range(pp))


# -- golden action lists ------------------------------------------------------------------------------
def _golden() -> dict[tuple[str, int], list[str]]:
    """Sections ``[name vpp=N]`` of tests/golden_schedules.txt, each its per-rank lines."""
    sections: dict[tuple[str, int], list[str]] = {}
    lines: list[str] = []
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("["):
            name, vpp = line.strip("[]").split(" vpp=")
            lines = sections.setdefault((name, int(vpp)), [])
        elif line.startswith("rank"):
            lines.append(line)
    return sections


def test_the_golden_file_covers_every_schedule() -> None:
    assert sorted(name for name, _ in _golden()) == sorted(SCHEDULES)


@pytest.mark.parametrize("name, vpp", sorted(_golden()))
def test_builders_write_the_golden_action_lists(name: str, vpp: int) -> None:
    golden = _golden()[(name, vpp)]
    built = build_schedule(name, 4, 8, vpp, grad_sync=True)
    assert built.render(comm=True).splitlines() == golden
    parsed = Schedule.from_text(name=name, pp=4, num_microbatches=8, num_virtual=vpp, lines=golden)
    assert parsed == built
    check_schedule(parsed)


def test_the_golden_1f1b_is_megatrons_warmup_steady_cooldown() -> None:
    """Rebuilt here from Megatron's description, independently of the builder: rank r runs pp-r-1
    forwards, then forward k+w with backward k, then the last backwards."""
    golden = _golden()[("1f1b", 1)]
    for r, line in enumerate(golden):
        w = 4 - r - 1
        expected = [f"{r}F{k}" for k in range(w)]
        for k in range(8 - w):
            expected += [f"{r}F{k + w}", f"{r}B{k}"]
        expected += [f"{r}B{k}" for k in range(8 - w, 8)]
        computes = [t for t in line.split(": ")[1].split() if Action.parse(t).kind in ("F", "B")]
        assert computes == expected


# -- zero bubble (ZB-H1) ------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, m", [(1, 3), (2, 1), (2, 4), (3, 7), (4, 3), (4, 8), (8, 8), (8, 20)])
def test_zb_h1_is_1f1b_with_each_backward_split_and_w_deferred_by_at_most_the_rank(pp: int, m: int) -> None:
    schedule = zb_h1(pp, m, grad_sync=True)
    check_schedule(schedule)
    as_1f1b = [" ".join(t.replace("I", "B") for t in line.split() if "W" not in t)
               for line in schedule.render().splitlines()]
    assert as_1f1b == one_f_one_b(pp, m).render().splitlines()
    for rank, acts in enumerate(schedule.actions):
        last_forward = max(i for i, a in enumerate(acts) if a.kind == "F")
        backward = [a for a in acts[:last_forward] if a.kind in ("I", "W")]
        for before, w in zip(backward, backward[1:]):
            if w.kind == "W":  # while forwards remain, W(k) runs right after I(k + rank)
                assert before == Action(kind="I", stage=rank, microbatch=w.microbatch + rank)
        assert max_in_flight(schedule, rank) == min(pp, m)  # never above 1F1B's peak (rank 0's)


def test_zb_h1_frees_activations_at_w_not_at_i() -> None:
    rank3 = zb_h1(4, 8).actions[3]
    computes = [str(a) for a in rank3 if a.kind in ("F", "I", "W")]
    assert computes[:9] == ["3F0", "3I0", "3F1", "3I1", "3F2", "3I2", "3F3", "3I3", "3W0"]
    assert in_flight_counts(rank3)[:9] == [1, 1, 2, 2, 3, 3, 4, 4, 3]
    assert max_in_flight_by_rank("zb-h1", 4, 8) == (4, 4, 4, 4)
    assert max_in_flight_per_stage(zb_h1(4, 8)) == (4, 4, 4, 4)


def test_checker_reports_a_deadlock_of_a_split_backward_with_both_ranks_and_their_waits() -> None:
    # rank 1 holds back the gradient of microbatch 0 until it has microbatch 1's activations, which
    # rank 0 sends only once that gradient has arrived
    s = _broken(["0F0 0SEND_F0 0RECV_B0 0I0 0W0 0F1 0SEND_F1 0RECV_B1 0I1 0W1",
                 "1RECV_F0 1F0 1I0 1RECV_F1 1SEND_B0 1F1 1I1 1SEND_B1 1W0 1W1"], m=2)
    with pytest.raises(ScheduleError) as info:
        check_schedule(s)
    assert str(info.value) == ("schedule broken: deadlock: rank 0 at action #2 (0RECV_B0) waits for rank 1; "
                               "rank 1 at action #3 (1RECV_F1) waits for rank 0")


@pytest.mark.parametrize("lines, message", [
    (["0F0 0SEND_F0 0RECV_B0 0W0 0I0", "1RECV_F0 1F0 1B0 1SEND_B0"],
     r"rank 0, action #3 \(0W0\): weight gradient before its input gradient 0I0"),
    (["0F0 0SEND_F0 0RECV_B0 0I0", "1RECV_F0 1F0 1B0 1SEND_B0"],
     r"rank 0, action #3 \(0I0\): rank 0 never runs 0W0"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1I0 1SEND_B0 1W0"],
     r"rank 1, action #3 \(1I0\): 1B0 \(action #2\) already runs this backward"),
    (["0F0 0SEND_F0 0RECV_B0 0B0 0W0", "1RECV_F0 1F0 1B0 1SEND_B0"],
     r"rank 0, action #4 \(0W0\): 0B0 \(action #3\) already runs this backward"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1W0 1SEND_B0"],
     r"rank 1, action #2 \(1W0\): no 1I0"),
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_B0 1I0 1W0"],
     r"rank 1, action #2 \(1SEND_B0\): sends before computing 1I0"),
    (["0F0 0SEND_F0 0I0 0RECV_B0 0W0", "1RECV_F0 1F0 1I0 1SEND_B0 1W0"],
     r"rank 0, action #2 \(0I0\): no 0RECV_B0 before it"),
    (["0F0 0SEND_F0 0RECV_B0 0I0 0GRAD_SYNC 0W0", "1RECV_F0 1F0 1B0 1SEND_B0"],
     r"rank 0, action #4 \(0GRAD_SYNC\): gradient sync before the last weight gradient \(B or W\)"),
])
def test_checker_names_the_rank_and_action_of_a_misused_split_backward(lines: list[str], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check_schedule(_broken(lines))


def test_a_split_backward_waits_for_the_next_stages_input_gradient_on_the_same_rank() -> None:
    # pp=1, vpp=2: stage 0's I needs stage 1's I (the input gradient), not its W
    fine = Schedule.from_text(name="local", pp=1, num_microbatches=1, num_virtual=2, lines=["0F0 1F0 1I0 0I0 1W0 0W0"])
    check_schedule(fine)
    early = Schedule.from_text(name="local", pp=1, num_microbatches=1, num_virtual=2, lines=["0F0 1F0 0I0 1I0 1W0 0W0"])
    with pytest.raises(ScheduleError, match=r"\(0I0\): runs before 1I0 on the same rank"):
        check_schedule(early)
