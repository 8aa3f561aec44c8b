"""executor.activations.ActivationMeter in one process: what it counts of views, batches and parameters."""
import torch
from torch import nn

from executor.activations import ActivationMeter


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_micro_batch_sliced_from_the_batch_counts_its_own_bytes():
    """The first linear saves its input, a slice of the step's batch: counted as the slice (2 x 8 floats), not as
    the batch's storage (16 x 8), which the training loop holds anyway; the ReLU saves its output, which the second
    linear saves as its input: one fresh storage of 2 x 16."""
    model, batch = _mlp(), torch.randn(16, 8)
    with ActivationMeter([model], batch=(batch,)) as meter:
        out = model(batch[4:6])
    assert meter.total == 2 * 8 * 4 + 2 * 16 * 4
    out.sum().backward()
    assert meter.total == 0 and meter.peak == 2 * 8 * 4 + 2 * 16 * 4


def test_without_the_batch_named_a_slice_counts_its_whole_storage():
    model, batch = _mlp(), torch.randn(16, 8)
    with ActivationMeter([model]) as meter:
        model(batch[4:6]).sum().backward()
    assert meter.peak == 16 * 8 * 4 + 2 * 16 * 4


def test_views_of_one_fresh_storage_count_once_and_parameters_not_at_all():
    """weight.t() (a view of a parameter) is left out; two saved views of one activation count its storage once."""
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with ActivationMeter([lin]) as meter:
        h = lin(x) * 2                     # mul by a constant saves nothing
        y = h[:, :2] * h[:, 2:]            # saves both halves: views of h's storage
    assert meter.total == 3 * 4 * 4 + 3 * 4 * 4     # x (saved by the linear) and h, once
    y.sum().backward()
    assert meter.total == 0
