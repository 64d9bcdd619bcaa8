"""bert_jax.pod.planning.cost: the stated model's arithmetic against cases computed by hand."""

import pytest

from bert_jax.pod.planning import cost

RING4 = cost.Interconnect(link_bw=100.0, wraparound=(True,), hop_latency=0.0)
TORUS = cost.Interconnect(link_bw=100.0, wraparound=(True, False), hop_latency=0.0)


def test_one_ring():
    # 4 chips on a ring with wraparound: 2 x 100 B/s per chip; 3/4 of 800 B each phase
    assert cost.collective_s("reduce-scatter", 200, 800, [(0, 4)], RING4) == pytest.approx(3.0)
    assert cost.collective_s("all-gather", 800, 800, [(0, 4)], RING4) == pytest.approx(3.0)
    assert cost.collective_s("all-reduce", 800, 800, [(0, 4)], RING4) == pytest.approx(6.0)
    slow = cost.Interconnect(link_bw=100.0, wraparound=(True,), hop_latency=0.1)
    assert cost.collective_s("all-reduce", 800, 800, [(0, 4)], slow) == pytest.approx(6.0 + 2 * 3 * 0.1)
    line = cost.Interconnect(link_bw=100.0, wraparound=(False,), hop_latency=0.0)  # no wraparound: half
    assert cost.collective_s("all-reduce", 800, 800, [(0, 4)], line) == pytest.approx(12.0)


def test_two_axes_rotated_parts():
    # 4 (ring, 200 B/s) x 2 (line, 100 B/s), 800 B in 2 parts of 400 B:
    # ring first: 3/4*400/200 + 1/8*400/100 = 1.5 + 0.5 = 2.0;
    # line first: 1/2*400/100 + 3/8*400/200 = 2.0 + 0.75 = 2.75 -> the slower part: 2.75
    assert cost.collective_s("all-gather", 800, 800, [(0, 4), (1, 2)], TORUS) == pytest.approx(2.75)
    assert cost.collective_s("all-reduce", 800, 800, [(0, 4), (1, 2)], TORUS) == pytest.approx(5.5)


def test_other_kinds_and_no_group():
    assert cost.collective_s("all-to-all", 800, 800, [(0, 4)], RING4) == pytest.approx(3 / 4 * 800 / 200)
    assert cost.collective_s("collective-permute", 800, 800, [(0, 2)], RING4) == pytest.approx(8.0)
    assert cost.collective_s("all-reduce", 800, 800, [], RING4) == 0.0  # a group of one chip
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_s("broadcast", 1, 1, [(0, 2)], RING4)


def test_spanned_axes():
    square = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert cost.spanned_axes(square) == [(0, 2), (1, 2)]
    assert cost.spanned_axes([(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]) == [(2, 4)]
    assert cost.spanned_axes([(3, 1, 0)]) == []
    # not a sub-grid: one ring of all members along the longest axis
    assert cost.spanned_axes([(0, 0), (1, 1), (2, 0)]) == [(0, 3)]


def test_step_time_overlap_and_rates():
    t = cost.step_time(1e12, 5e11, 0.9, peak_flops=1e12, hbm_bw=1e12, layers=3)
    assert (t.compute_s, t.memory_s, t.core_s) == pytest.approx((1.0, 0.5, 1.5))
    assert t.roofline_s == pytest.approx(1.0)
    assert t.no_overlap_s == pytest.approx(2.4)
    assert t.overlap_s == pytest.approx(1.5 + 0.3)  # max(1.5, 0.9) + 0.9/3
    comm_bound = cost.step_time(1e12, 0, 3.0, peak_flops=1e12, hbm_bw=1e12, layers=2)
    assert comm_bound.overlap_s == pytest.approx(3.0 + 1.5)
    half = cost.calibrated(t, 0.5)  # compute and memory at half the peaks; the collectives as they were
    assert (half.compute_s, half.memory_s, half.comm_s) == pytest.approx((2.0, 1.0, 0.9))
    assert half.overlap_s == pytest.approx(3.0 + 0.3)
    with pytest.raises(ValueError, match="achieved fraction"):
        cost.calibrated(t, 0.0)
    # The H100 measurement behind training.chips.ACHIEVED: 120.6 ms projected, 178.7 ms measured.
    from bert_jax.training import chips
    assert chips.ACHIEVED == pytest.approx(0.675, abs=5e-4)
    h100 = cost.step_time(59.84e12, 201.2e9, 0.0, peak_flops=chips.H100["peak_flops"],
                          hbm_bw=chips.H100["hbm_bw"], layers=24)
    assert h100.core_s == pytest.approx(0.1206, abs=5e-4)
    assert cost.calibrated(h100, chips.ACHIEVED).overlap_s == pytest.approx(0.1787, abs=1e-3)
    assert cost.mfu(4e11, 2.0, 1e12) == pytest.approx(0.2)
    assert cost.weak_scaling({32: 90.0, 8: 100.0, 256: 80.0}) == pytest.approx({8: 1.0, 32: 0.9, 256: 0.8})
    ttt = cost.time_to_train([{"steps": 900_000, "step_s": 0.1, "chips": 64},
                              {"steps": 100_000, "step_s": 0.4, "chips": 64}])
    assert ttt["wall_s"] == pytest.approx(130_000)
    assert ttt["chip_hours"] == pytest.approx(130_000 * 64 / 3600)


def test_slices_shapes_and_wraparound():
    from bert_jax.training import chips

    def s(name):
        sl = chips.parse_slice(name)
        return sl.chips, sl.dims, sl.wraparound, sl.topology_name

    assert s("v4-8") == (4, (2, 2, 1), (False, False, False), "v4:2x2x1")  # v4 names count TensorCores
    assert s("v4-32") == (16, (2, 2, 4), (False, False, False), "v4:2x2x4")  # not whole 4x4x4 cubes
    assert s("v4-128") == (64, (4, 4, 4), (True, True, True), "v4:4x4x4")
    assert s("v4-2048") == (1024, (8, 8, 16), (True, True, True), "v4:8x8x16")
    assert s("v5p-2048")[:2] == (1024, (8, 8, 16))
    assert s("v5e-16") == (16, (4, 4), (False, False), "v5e:4x4")  # v5e/v6e names count chips
    assert s("v5e-128")[2] == (False, True) and s("v6e-256")[2] == (True, True)  # rings on axes of 16
    assert s("v4:4x4x8")[:2] == (128, (4, 4, 8))
    with pytest.raises(ValueError, match="3 axes"):
        chips.parse_slice("v4:4x4")


def test_chip_figures_agree_across_sources():
    """Per-link bandwidth x links (the scaling book) = the Cloud pages' per-chip bidirectional ICI."""
    from bert_jax.training import chips

    links = {"v5p": 6, "v5e": 4, "v6e": 4}
    cloud_bidirectional = {"v5p": 1200e9, "v5e": 400e9, "v6e": 800e9}
    for name, n in links.items():
        assert n * 2 * chips.CHIPS[name].link_bw == pytest.approx(cloud_bidirectional[name])
