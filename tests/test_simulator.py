"""Schedule simulator: Megatron's bubble formulas exactly, in-flight counts, p2p and grad-sync overlap."""
from __future__ import annotations

import pytest

from mplan.cost_models.simulator import PipelineCosts, simulate, uniform_bubble_fraction
from mplan.ir.schedule import (ScheduleError, Schedule, gpipe, interleaved_1f1b, max_in_flight,
                               max_in_flight_per_stage, one_f_one_b, zb_h1)

SIZES = [(2, 1), (2, 4), (3, 7), (4, 8), (4, 3), (8, 16), (8, 32)]


@pytest.mark.parametrize("pp, m", SIZES)
@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 1.0), (0.3, 1.1)])
def test_uniform_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(builder, pp: int, m: int, tf: float,
                                                                   tb: float) -> None:
    result = simulate(builder(pp, m), PipelineCosts.uniform(pp, forward_s=tf, backward_s=tb))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.bubble_ratio == pytest.approx((pp - 1) / m, abs=1e-12)
    assert result.pipeline_time_s == pytest.approx((m + pp - 1) * (tf + tb))
    assert result.compute_s == pytest.approx(m * (tf + tb))


@pytest.mark.parametrize("pp, m, vpp", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (8, 16, 2), (3, 6, 3), (4, 4, 2)])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 1.0)])
def test_interleaving_divides_the_bubble_by_vpp(pp: int, m: int, vpp: int, tf: float, tb: float) -> None:
    # Megatron (Narayanan et al. SC'21, sec. 2.2.2): bubble / ideal = (p-1)/(v m) with chunk times t/v.
    costs = PipelineCosts.uniform(pp * vpp, forward_s=tf / vpp, backward_s=tb / vpp)
    result = simulate(interleaved_1f1b(pp, m, vpp), costs)
    assert result.bubble_ratio == pytest.approx((pp - 1) / (vpp * m), abs=1e-12)
    assert result.bubble_fraction == pytest.approx(uniform_bubble_fraction(pp, m, vpp), abs=1e-12)
    plain = simulate(one_f_one_b(pp, m), PipelineCosts.uniform(pp, forward_s=tf, backward_s=tb))
    assert plain.bubble_ratio / result.bubble_ratio == pytest.approx(vpp)


@pytest.mark.parametrize("schedule", [gpipe(4, 6), one_f_one_b(4, 6), one_f_one_b(4, 2), interleaved_1f1b(4, 8, 2),
                                      interleaved_1f1b(2, 2, 3), zb_h1(4, 8), zb_h1(4, 3)],
                         ids=lambda s: f"{s.name}-{s.pp}-{s.num_microbatches}")
def test_in_flight_peaks_match_the_schedule_analysis(schedule: Schedule) -> None:
    costs = PipelineCosts.uniform(schedule.num_stages, forward_s=1.0, backward_s=2.0, p2p_s=0.1, weight_s=1.0)
    result = simulate(schedule, costs)
    assert result.stage_peak_in_flight == max_in_flight_per_stage(schedule)
    assert [r.peak_in_flight for r in result.ranks] == [max_in_flight(schedule, r) for r in range(schedule.pp)]
    if schedule.name == "gpipe":
        assert {r.peak_in_flight for r in result.ranks} == {schedule.num_microbatches}
    if schedule.name == "1f1b":
        assert [r.peak_in_flight for r in result.ranks] == [min(4 - r, schedule.num_microbatches) for r in range(4)]


def test_p2p_time_lies_on_the_critical_path() -> None:
    tf, tb, p2p = 1.0, 2.0, 0.25
    result = simulate(one_f_one_b(2, 1), PipelineCosts.uniform(2, forward_s=tf, backward_s=tb, p2p_s=p2p))
    assert result.step_time_s == pytest.approx(2 * tf + 2 * tb + 2 * p2p)
    assert result.comm_s == pytest.approx(p2p)  # rank 0 (the busiest, first on ties) sent one activation


def _longest_path_end(schedule: Schedule, tf: float, tb: float, p2p: float, tw: float = 0.0) -> float:
    """Independent reference: each compute starts at max(previous compute on its rank, its input's
    arrival); an I takes tb - tw, a W tw and waits only for its rank."""
    from functools import lru_cache

    order = {r: [a for a in acts if a.kind in ("F", "B", "I", "W")] for r, acts in enumerate(schedule.actions)}
    index = {(a.kind, a.stage, a.microbatch): (r, i) for r, acts in order.items() for i, a in enumerate(acts)}
    last = schedule.num_stages - 1

    @lru_cache(maxsize=None)
    def end(kind: str, stage: int, mb: int) -> float:
        rank, i = index[(kind, stage, mb)]
        start = 0.0
        if i > 0:
            prev = order[rank][i - 1]
            start = end(prev.kind, prev.stage, prev.microbatch)
        if kind == "F" and stage > 0:
            start = max(start, end("F", stage - 1, mb) + p2p)
        if kind in ("B", "I"):
            upstream = "I" if ("I", stage + 1, mb) in index else "B"
            start = max(start, end("F", stage, mb) if stage == last else end(upstream, stage + 1, mb) + p2p)
        return start + {"F": tf, "B": tb, "I": tb - tw, "W": tw}[kind]

    return max(end(a.kind, a.stage, a.microbatch) for acts in order.values() for a in acts)


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 8), gpipe(3, 5), one_f_one_b(8, 3), zb_h1(4, 8), zb_h1(8, 3)],
                         ids=lambda s: f"{s.name}-{s.pp}-{s.num_microbatches}")
def test_event_simulation_equals_the_longest_path(schedule: Schedule) -> None:
    tf, tb, p2p, tw = 1.0, 2.0, 0.25, 0.75
    costs = PipelineCosts.uniform(schedule.num_stages, forward_s=tf, backward_s=tb, p2p_s=p2p, weight_s=tw)
    result = simulate(schedule, costs)
    assert result.pipeline_time_s == pytest.approx(_longest_path_end(schedule, tf, tb, p2p, tw))
    free = PipelineCosts.uniform(schedule.num_stages, forward_s=tf, backward_s=tb, weight_s=tw)
    assert result.pipeline_time_s > simulate(schedule, free).pipeline_time_s  # transfers lie on the path


def test_grad_sync_overlaps_all_but_the_last_backward() -> None:
    tf, tb, sync, opt = 1.0, 2.0, 1.5, 0.5
    costs = PipelineCosts.uniform(2, forward_s=tf, backward_s=tb, grad_sync_s=sync, optimizer_s=opt)
    result = simulate(one_f_one_b(2, 4), costs)
    # rank 1 finishes its last B one backward earlier than rank 0 and syncs meanwhile: rank 0's sync is the tail.
    assert result.exposed_comm_s == pytest.approx(sync)
    assert result.step_time_s == pytest.approx(result.pipeline_time_s + sync + opt)
    assert result.ranks[1].grad_sync_end_s == pytest.approx(result.ranks[1].compute_end_s + sync)


def test_interleaved_hides_the_later_chunks_grad_sync() -> None:
    pp, m, vpp, sync = 2, 4, 2, 1.0
    costs = PipelineCosts.uniform(pp * vpp, forward_s=0.5, backward_s=1.0, grad_sync_s=sync)
    result = simulate(interleaved_1f1b(pp, m, vpp, grad_sync=True), costs)
    rank0 = result.ranks[0]
    assert rank0.grad_sync_s == pytest.approx(2 * sync)  # two chunks synced...
    assert result.exposed_comm_s == pytest.approx(sync)  # ...but chunk 1's hides behind chunk 0's backwards
    syncs = [e for e in result.timeline if e.stream == "comm" and e.rank == 0]
    assert [str(e.action) for e in syncs] == ["2GRAD_SYNC", "0GRAD_SYNC"]
    assert syncs[0].end_s < rank0.compute_end_s


def test_without_grad_sync_actions_a_rank_reduces_every_chunk_after_its_schedule() -> None:
    """Megatron-LM's DDP of the SC'21 runs reduces each model chunk once the schedule has returned:
    the same interleaved schedule without GRAD_SYNC actions exposes both chunks' syncs on rank 0,
    where with them chunk 1's hides behind chunk 0's backwards."""
    pp, m, vpp, sync = 2, 4, 2, 1.0
    costs = PipelineCosts.uniform(pp * vpp, forward_s=0.5, backward_s=1.0, grad_sync_s=sync)
    after = simulate(interleaved_1f1b(pp, m, vpp), costs)
    during = simulate(interleaved_1f1b(pp, m, vpp, grad_sync=True), costs)
    assert after.pipeline_time_s == pytest.approx(during.pipeline_time_s)
    for rank in after.ranks:
        syncs = [e for e in after.timeline if e.stream == "comm" and e.rank == rank.rank]
        assert min(e.start_s for e in syncs) == pytest.approx(rank.compute_end_s)
        assert rank.grad_sync_end_s == pytest.approx(rank.compute_end_s + 2 * sync)
    assert after.exposed_comm_s == pytest.approx(2 * sync) and during.exposed_comm_s == pytest.approx(sync)


def test_timeline_is_a_valid_gantt_chart() -> None:
    schedule = interleaved_1f1b(4, 8, 2)
    result = simulate(schedule, PipelineCosts.uniform(8, forward_s=1.0, backward_s=2.0, p2p_s=0.1))
    compute = [e for e in result.timeline if e.stream == "compute"]
    assert len(compute) == 2 * schedule.num_stages * schedule.num_microbatches
    for rank in range(schedule.pp):
        spans = sorted((e.start_s, e.end_s) for e in compute if e.rank == rank)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert sum(e - s for s, e in spans) == pytest.approx(result.ranks[rank].busy_s)
    # data dependencies hold in time: F of stage s+1 starts after F of stage s ends plus the hop
    ends = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in compute}
    for (kind, stage, mb), event in ends.items():
        if kind == "F" and stage > 0:
            assert event.start_s >= ends[("F", stage - 1, mb)].end_s + 0.1 - 1e-12


def test_non_uniform_stages_make_the_slowest_rank_critical() -> None:
    costs = PipelineCosts(forward_s=(1.0, 3.0, 1.0), backward_s=(2.0, 6.0, 2.0), p2p_s=(0.0, 0.0),
                          grad_sync_s=(0.0, 0.0, 0.0))
    result = simulate(one_f_one_b(3, 6), costs)
    assert result.critical_rank == 1
    assert result.compute_s == pytest.approx(6 * 9.0)


def test_broken_schedules_and_mismatched_costs_are_refused() -> None:
    broken = Schedule.from_text(name="broken", pp=2, num_microbatches=1,
                                lines=["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(broken, PipelineCosts.uniform(2, forward_s=1.0, backward_s=1.0))
    with pytest.raises(ValueError, match="costs cover 3 stages"):
        simulate(one_f_one_b(2, 2), PipelineCosts.uniform(3, forward_s=1.0, backward_s=1.0))
    with pytest.raises(ValueError, match="one entry per stage"):
        PipelineCosts(forward_s=(1.0,), backward_s=(1.0, 1.0), p2p_s=(), grad_sync_s=(0.0,))


# -- zero bubble (ZB-H1) ------------------------------------------------------------------------------
def test_zb_h1_bubble_at_4_ranks_8_microbatches_is_the_papers() -> None:
    """T_F = T_I = T_W = 1, free transfers: 1F1B idles (p-1)(T_F + T_I + T_W) = 9 on every rank,
    ZB-H1 (p-1)(T_F + T_I - T_W) = 3 (Qi et al., arXiv 2401.10241, sec. 3), on the same 24 s of work."""
    costs = PipelineCosts.uniform(4, forward_s=1.0, backward_s=2.0, weight_s=1.0)
    plain, zero_bubble = simulate(one_f_one_b(4, 8), costs), simulate(zb_h1(4, 8), costs)
    assert plain.compute_s == zero_bubble.compute_s == pytest.approx(8 * 3.0)
    assert plain.pipeline_time_s == pytest.approx(24.0 + 9.0)
    assert zero_bubble.pipeline_time_s == pytest.approx(24.0 + 3.0)
    assert plain.bubble_fraction == pytest.approx(9 / 33)
    assert zero_bubble.bubble_fraction == pytest.approx(3 / 27)
    assert [r.peak_in_flight for r in zero_bubble.ranks] == [4, 4, 4, 4]


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 7), (4, 4), (4, 8), (8, 16), (8, 9)])
@pytest.mark.parametrize("tf, ti, tw", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 0.5),
                                        (1.0, 1.0, 2.0), (0.5, 2.0, 1.0)])
def test_zb_h1_idles_p_minus_1_times_the_larger_of_f_plus_i_minus_w_f_and_i(pp: int, m: int, tf: float, ti: float,
                                                                          tw: float) -> None:
    """The uniform-stage law (m >= pp, free transfers) that planner/evaluate.py's closed form uses."""
    costs = PipelineCosts.uniform(pp, forward_s=tf, backward_s=ti + tw, weight_s=tw)
    result = simulate(zb_h1(pp, m), costs)
    idle = (pp - 1) * max(tf + ti - tw, tf, ti)
    assert result.pipeline_time_s == pytest.approx(m * (tf + ti + tw) + idle)
    plain = simulate(one_f_one_b(pp, m), costs)
    assert plain.pipeline_time_s - result.pipeline_time_s == pytest.approx((pp - 1) * (tf + ti + tw) - idle)
    assert result.bubble_fraction < plain.bubble_fraction


def test_i_and_w_take_the_backward_between_them() -> None:
    costs = PipelineCosts(forward_s=(1.0, 1.5, 1.0), backward_s=(2.0, 3.0, 2.5), weight_s=(0.5, 1.25, 1.0),
                          p2p_s=(0.1, 0.1), grad_sync_s=(0.0, 0.0, 0.0))
    split, whole = simulate(zb_h1(3, 5), costs), simulate(one_f_one_b(3, 5), costs)
    assert [r.busy_s for r in split.ranks] == pytest.approx([r.busy_s for r in whole.ranks])
    for event in split.timeline:
        stage, kind = event.action.stage, event.action.kind
        expected = {"F": costs.forward_s[stage], "I": costs.backward_s[stage] - costs.weight_s[stage],
                    "W": costs.weight_s[stage]}[kind]
        assert event.end_s - event.start_s == pytest.approx(expected)
    assert sorted({e.action.kind for e in split.timeline}) == ["F", "I", "W"]
    assert len(split.timeline) == 3 * 3 * 5


def test_zb_h1_grad_sync_starts_after_the_stages_last_w() -> None:
    costs = PipelineCosts.uniform(2, forward_s=1.0, backward_s=2.0, weight_s=1.0, grad_sync_s=0.5)
    result = simulate(zb_h1(2, 4, grad_sync=True), costs)
    for rank in range(2):
        last_w = max(e.end_s for e in result.timeline if e.rank == rank and e.action.kind == "W")
        (sync,) = [e for e in result.timeline if e.rank == rank and e.stream == "comm"]
        assert sync.start_s == pytest.approx(last_w) and sync.end_s == pytest.approx(last_w + 0.5)


def test_a_split_backward_needs_its_weight_share() -> None:
    with pytest.raises(ValueError, match=r"action 1I0 splits backward into I and W, but weight_s .* was not given"):
        simulate(zb_h1(2, 2), PipelineCosts.uniform(2, forward_s=1.0, backward_s=2.0))
    with pytest.raises(ValueError, match=r"weight_s\[1\] = 3.0 s is more than the whole backward_s\[1\] = 2.0 s"):
        PipelineCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(1.0, 3.0), p2p_s=(0.0,),
                      grad_sync_s=(0.0, 0.0))
    with pytest.raises(ValueError, match="one entry per stage"):
        PipelineCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(1.0,), p2p_s=(0.0,),
                      grad_sync_s=(0.0, 0.0))
    # schedules without I and W never read it
    assert simulate(one_f_one_b(2, 2), PipelineCosts.uniform(2, forward_s=1.0, backward_s=2.0)).pipeline_time_s == 9.0
