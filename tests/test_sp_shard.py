"""executor.sp_shard's bookkeeping in one process, on torch's fake process group (FAKE: its collectives move no
data, so only what is saved, gathered and released is checked here; the values and bytes are checked on real gloo
ranks in tests/test_tensor_parallel.py): a region's three linears save one shard, backward gathers it once and lets
it go, a retained graph's second backward gathers again without the count going wrong, and a module whose own
forward is checkpointed saves nothing of its own."""
import pytest
import torch
import torch.distributed as dist
from torch import nn


class _Region(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(8, 8, bias=False) for _ in range(3))
        self.wo = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.wo(self.wq(x) * self.wk(x) + self.wv(x))


@pytest.fixture()
def fake_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _region(mesh, *, recompute: bool = False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from executor import sp_shard
    from executor.stages import recomputed
    from executor.tensor_parallel import _region_input
    m = _Region()
    col = {n: ColwiseParallel(use_local_output=False) for n in ("wq", "wk", "wv")}
    parallelize_module(m, mesh, {"": _region_input(sp=True, local=False), **col,
                                 "wo": RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1),
                                                       use_local_output=False)})
    sp_shard.install(m, mesh)
    if recompute:
        recomputed(m)
    return m


def _watch(monkeypatch) -> tuple[dict, list]:
    """Counts of saves, unpacks and gathers, and the shared shards made."""
    from executor import sp_shard
    stats, shared = {"saved": 0, "unpacked": 0, "gathers": 0}, []
    init, tensor, gathered = sp_shard._Saved.__init__, sp_shard._Saved.tensor, sp_shard._Shared.gathered_local

    def counted_init(self, sh, t, below):
        stats["saved"] += 1
        shared.append(sh)
        init(self, sh, t, below)

    def counted_tensor(self):
        stats["unpacked"] += 1
        return tensor(self)

    def counted_gather(self):
        stats["gathers"] += self.full is None
        return gathered(self)
    monkeypatch.setattr(sp_shard._Saved, "__init__", counted_init)
    monkeypatch.setattr(sp_shard._Saved, "tensor", counted_tensor)
    monkeypatch.setattr(sp_shard._Shared, "gathered_local", counted_gather)
    return stats, shared


def _input(mesh):
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(torch.randn(2, 4, 8), mesh, (Shard(1),), run_check=False).detach().requires_grad_()


def test_a_region_saves_one_shard_and_gathers_it_once_per_backward(fake_mesh, monkeypatch):
    from executor import sp_shard
    stats, shared = _watch(monkeypatch)
    loss = _region(fake_mesh)(_input(fake_mesh)).to_local().sum()
    assert stats == {"saved": 3, "unpacked": 0, "gathers": 0} and len({id(s) for s in shared}) == 1
    assert shared[0].full is None and not sp_shard._OPEN   # nothing gathered is held between forward and backward
    loss.backward(retain_graph=True)
    assert stats == {"saved": 3, "unpacked": 3, "gathers": 1} and shared[0].full is None and shared[0].waiting == 0
    loss.backward()   # a retained graph unpacks again: gathered again, the count stays at 0
    assert stats["unpacked"] == 6 and stats["gathers"] >= 2 and shared[0].waiting == 0


def test_a_module_whose_own_forward_is_checkpointed_saves_no_shard(fake_mesh, monkeypatch):
    stats, _ = _watch(monkeypatch)
    _region(fake_mesh, recompute=True)(_input(fake_mesh)).to_local().sum().backward()
    assert stats == {"saved": 0, "unpacked": 0, "gathers": 0}
