"""Alpha-beta collective costs: the ring formulas exactly, hierarchical across nodes, probed fits preferred."""
import dataclasses

import pytest

from cost_models.cluster import CollectiveFit
from cost_models.comm import collective_time, p2p_time, ring_phase
from cost_models.presets import preset


def test_ring_formulas_inside_one_node():
    c = preset("dgx-h100")
    link, S = c.intra_node, 1e9
    ag = link.alpha_s + 7 / 8 * S / link.bandwidth_Bps
    assert collective_time(c, "all_gather", S, 8) == pytest.approx(ag)
    assert collective_time(c, "reduce_scatter", S, 8) == pytest.approx(ag)
    assert collective_time(c, "all_reduce", S, 8) == pytest.approx(2 * ag)
    assert collective_time(c, "all_gather", S, 1) == 0.0
    assert p2p_time(c, S, crosses_nodes=False) == pytest.approx(link.alpha_s + S / link.bandwidth_Bps)
    assert p2p_time(c, S, crosses_nodes=True) == pytest.approx(c.inter_node.alpha_s + S / c.inter_node.bandwidth_Bps)


def test_group_spanning_nodes_is_hierarchical():
    c = preset("dgx-h100", nodes=4)
    S = 4e9
    # 32 ranks = 4 nodes x 8: each rail all-gathers S/8 across 4 nodes, then 8 ranks all-gather S in the node.
    expected = ring_phase(c.inter_node, S / 8, 4) + ring_phase(c.intra_node, S, 8)
    assert collective_time(c, "all_gather", S, 32) == pytest.approx(expected)
    # Slower than the same group would be if NVLink spanned it all, faster than a flat ring over the NICs.
    assert ring_phase(c.intra_node, S, 32) < expected < ring_phase(c.inter_node, S, 32)
    assert collective_time(c, "all_reduce", S, 32) == pytest.approx(2 * expected)


def test_probed_fit_is_used_when_present():
    c = preset("l4-pcie")
    fit = CollectiveFit(op="all_gather", group_size=4, scope="intra", alpha_s=1e-3, beta_s_per_byte=2e-9, r2=0.99)
    c = dataclasses.replace(c, fits=(fit,))
    assert collective_time(c, "all_gather", 1e6, 4) == pytest.approx(1e-3 + 2e-9 * 1e6)
    # no fit for 8 ranks: the link formula
    assert collective_time(c, "all_gather", 1e6, 8) == pytest.approx(ring_phase(c.intra_node, 1e6, 8))
