"""What a pipeline pays on CPU ranks that share cores: messages that wait for a core (estimate.send_delay, measured
by benchmarks/send_delay.py)."""
import pytest

from cost_models.estimate import SEND_DELAY_CAP_S, busy_ranks, estimate, send_delay
from cost_models.model_profiler import profile_model
from cost_models.models.source import resolve
from cost_models.presets import preset
from cost_models.schedule import simulate_schedule
from cost_models.strategy import Strategy
from tests.clusters import cpu_cluster


@pytest.fixture(scope="module")
def prof():
    return profile_model(resolve("mlp-deep"), micro_batch_size=2, seq_len=16, meta=True, dtype="fp32")


def _pipeline(prof, *, pp: int, dp: int = 1, m: int, schedule: str = "gpipe") -> Strategy:
    names = tuple(u.name for u in prof.units)
    cut = [round(i * len(names) / pp) for i in range(pp + 1)]
    return Strategy(dp=dp, pp=pp, zero=0, schedule=schedule, microbatches=m, micro_batch_size=2, v=1,
                    stages=tuple(names[cut[i]:cut[i + 1]] for i in range(pp)), precision="fp32")


def test_sends_wait_for_a_core_only_when_every_core_is_busy(prof):
    """4 ranks on 2 cores: a 4-stage pipeline of one micro-batch computes on one rank at a time (busy_ranks 1), so
    its sends leave at once; with 8 micro-batches 2.9 ranks compute at once and sends may wait SEND_DELAY_CAP_S.
    2 ranks on 2 cores never wait, nor do GPUs."""
    four = cpu_cluster(ranks=4, cores=2)
    one_mb, eight_mb = _pipeline(prof, pp=4, m=1), _pipeline(prof, pp=4, m=8)
    assert busy_ranks(one_mb) == pytest.approx(1.0) and busy_ranks(eight_mb) == pytest.approx(32 / 11)
    assert send_delay(one_mb, four) == 0.0 and send_delay(eight_mb, four) == SEND_DELAY_CAP_S
    assert send_delay(_pipeline(prof, pp=2, dp=2, m=4), four) == SEND_DELAY_CAP_S
    assert send_delay(_pipeline(prof, pp=2, m=8), cpu_cluster(ranks=2, cores=2)) == 0.0
    assert send_delay(eight_mb, preset("dgx-a100")) == 0.0
    # the estimate's step is that delayed simulation of its stages (plus the optimizer: no dp, no tie here)
    est = estimate(eight_mb, prof, four)
    costs = tuple(st.cost() for st in est.stages)
    delayed = simulate_schedule("gpipe", 4, 8, 1, costs, send_delay_s=SEND_DELAY_CAP_S)
    at_once = simulate_schedule("gpipe", 4, 8, 1, costs)
    assert delayed.makespan_s > at_once.makespan_s
    assert est.step_time_s == pytest.approx(delayed.makespan_s + est.breakdown.optimizer_s)
