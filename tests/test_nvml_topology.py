"""GPU topology from NVML, against FakeNvml machines (no NVIDIA driver here) and against the real library."""
from cost_models.profiling.nvml_topology import detect_topology
from tests.fake_nvml import FakeNvml, dgx_h100, nvlink_pairs, pcie_box


def test_fake_dgx_h100_is_all_nvlink_through_nvswitch():
    fake = dgx_h100()
    topo, note = detect_topology(fake)
    assert note is None and fake.shutdown_called
    assert len(topo.gpus) == 8 and topo.nvswitch
    assert all(g.nvlinks == 18 and g.nvlink_version == 4 and g.pcie_gen == 5 for g in topo.gpus)
    assert topo.gpus[0].memory_bytes == 81_559 * 2**20 and topo.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert len(topo.pairs) == 28 and {p.kind for p in topo.pairs} == {"nvlink"}


def test_fake_pcie_only_box_reports_switches_and_sockets():
    topo, _ = detect_topology(pcie_box())
    kinds = {(p.a, p.b): p.kind for p in topo.pairs}
    assert not topo.nvswitch and all(g.nvlinks == 0 for g in topo.gpus)
    assert kinds[(0, 3)] == "pcie-switch" and kinds[(4, 7)] == "pcie-switch"
    assert kinds[(0, 4)] == "system" and kinds[(3, 7)] == "system"
    assert sum(1 for k in kinds.values() if k == "pcie-switch") == 12


def test_fake_direct_nvlink_bridges():
    topo, _ = detect_topology(nvlink_pairs())
    kinds = {(p.a, p.b): (p.kind, p.nvlinks) for p in topo.pairs}
    assert kinds[(0, 1)] == ("nvlink", 4) and kinds[(2, 3)] == ("nvlink", 4)
    assert kinds[(0, 2)] == ("pcie-hostbridge", 0)


def test_no_driver_gives_one_line_and_no_topology():
    topo, note = detect_topology(FakeNvml(name="x", count=0, memory=0, links={}, ancestor={}, fail_init=True))
    assert topo is None and "no NVIDIA driver" in note and "\n" not in note


def test_real_nvml_on_this_machine():
    # This machine has no NVIDIA driver: the real nvidia-ml-py must fail cleanly into the one-line note.
    import pynvml
    try:
        pynvml.nvmlInit()
        has_driver = True
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        has_driver = False
    topo, note = detect_topology()
    assert (topo is not None) == has_driver
    if not has_driver:
        assert note.startswith("no NVIDIA driver")
