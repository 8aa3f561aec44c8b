"""A schedule added to the registry runs for real: ZB-V (V placement, split backward) on 2 gloo ranks."""
import pytest

from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.strategy import Strategy
from executor.launch import RunFailed, run_many
from executor.train import TrainConfig, single_process_losses


def _strategy(model: str, *, schedule: str, pp: int, v: int, m: int) -> Strategy:
    units = tuple(u.name for u in profile_model(resolve(model), micro_batch_size=1, seq_len=16, meta=True,
                                                 dtype="fp32").units)
    k = pp * v
    cuts = [round(len(units) * (i + 1) / k) for i in range(k)]
    stages = tuple(units[a:b] for a, b in zip([0] + cuts[:-1], cuts))
    return Strategy(dp=1, pp=pp, zero=0, schedule=schedule, microbatches=m, micro_batch_size=8 // m, v=v,
                    stages=stages, precision="fp32", optimizer="adamw")


def _cfg(model: str) -> TrainConfig:
    return TrainConfig(model_source=model, seq_len=16, input_kind="tokens", steps=5, warmup=1, seed=3, lr=1e-2)


@pytest.mark.slow
def test_zbv_trains_like_one_process_on_two_ranks():
    s = _strategy("llama-tiny", schedule="zbv", pp=2, v=2, m=4)
    assert s.rank_stages(0) == (0, 3) and s.rank_stages(1) == (1, 2)   # the V
    reference = single_process_losses(s, _cfg("llama-tiny"))
    ranks = run_many(2, [s], _cfg("llama-tiny"))[0]
    for r in ranks:   # every rank learns the global loss; both hold a first or last stage here
        assert list(r.losses) == pytest.approx(reference, rel=1e-4)
    assert len(set(round(x, 6) for x in reference)) == 5   # it trains: no two steps repeat


@pytest.mark.slow
def test_zbv_refuses_a_tie_whose_stages_share_a_rank():
    s = _strategy("gpt-tiny", schedule="zbv", pp=2, v=2, m=4)   # tied embedding (stage 0) and head (stage 3)
    with pytest.raises(RunFailed, match=r"zbv puts stages \[0, 3\], which share a tied parameter, on one rank"):
        run_many(2, [s], _cfg("gpt-tiny"))
