"""A profile at one sequence length seen at another (cost_models.cost.lengths): against a profile really taken at
the target length (meta mode counts FLOPs, bytes and products exactly), the same numbers and the same predictions;
measured times split by FLOPs; the refusals; `planner plan --seq-len` and replan on it."""
import dataclasses
import json

import pytest

from cost_models.cost.estimate import estimate
from cost_models.cost.lengths import BACKWARD_CORE, at_seq_len, length_line, length_refusal
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from cost_models.records.work import WorkCounts

HF_LLAMA = ("hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=128&max_position_embeddings=256")


def _meta(name: str, seq: int, batch: int = 1):
    return profile_model(resolve(name), micro_batch_size=batch, seq_len=seq, meta=True, dtype="bf16")


def _products(w: WorkCounts | None):
    return None if w is None else w.plus(WorkCounts()).gemms   # one entry per shape, sorted


def _assert_units_match(seen, true, *, hf: bool) -> None:
    for a, b in zip(seen.units, true.units, strict=True):
        assert (a.fwd_flops, a.bwd_flops, a.output_bytes) == (b.fwd_flops, b.bwd_flops, b.output_bytes), a.name
        # a few bytes of scalars (the loss) and the embedding's gradient table do not grow with the sequence
        assert a.saved_bytes == pytest.approx(b.saved_bytes, abs=16), a.name
        for pa, pb in ((a.fwd_work, b.fwd_work), (a.bwd_work, b.bwd_work)):
            assert _products(pa) == _products(pb), a.name
            assert pa.attention_flops == pb.attention_flops and pa.kernels == pb.kernels, a.name
        if a.name.startswith("layers") or ".layers." in a.name or "layers." in a.name:
            assert a.fwd_work.memory_bytes == pytest.approx(b.fwd_work.memory_bytes, rel=0.01), a.name
        assert a.tp.core_flops == b.tp.core_flops and a.tp.split_flops == b.tp.split_flops, a.name
        assert a.tp.core_kv_bytes == b.tp.core_kv_bytes, a.name
        # transformers' decoder saves some tensors that both the products and the attention core read, which the
        # profiler attributes to whichever saved it first at that length: their sum is what grows
        if hf:
            assert a.tp.saved_split + a.tp.saved_core == b.tp.saved_split + b.tp.saved_core, a.name
        else:
            assert (a.tp.saved_split, a.tp.saved_core) == (b.tp.saved_split, b.tp.saved_core), a.name
    assert seen.model_fwd_flops == true.model_fwd_flops
    assert seen.input.shape == true.input.shape and seen.seq_len == true.seq_len
    assert [e.bytes for e in seen.edges] == [e.bytes for e in true.edges]


@pytest.mark.parametrize("name, short, long, batch", [
    ("llama-tiny", 32, 128, 1),
    ("llama-tiny", 64, 128, 1),     # tokens == hidden: input and weight gradients share a shape
    ("llama-tiny", 16, 64, 2),      # two sequences per micro-batch
    ("gpt-tiny", 32, 128, 2),       # learned positions, tied head
    (HF_LLAMA, 32, 128, 1),
])
def test_a_profile_seen_at_another_length_counts_what_one_taken_there_counts(name, short, long, batch):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    seen = at_seq_len(_meta(name, short, batch), long)
    _assert_units_match(seen, _meta(name, long, batch), hf=name.startswith("hf:"))
    assert seen.profiled_seq_len == short
    assert f"profiled at {short:,} tokens per sequence and seen at {long:,}" in length_line(seen)


def test_the_predictions_at_the_long_length_are_the_long_profiles():
    short, long = _meta("llama-tiny", 32), _meta("llama-tiny", 128)
    seen = at_seq_len(short, 128)
    units = tuple(u.name for u in short.units)
    cluster = preset("dgx-h100")
    for kw in (dict(tp=2, sp=True), dict(cp=2, dp=2, zero=3), dict(pp=2, stages=(units[:3], units[3:]),
                                                                       microbatches=4)):
        fields = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=1, stages=(units,),
                      precision="bf16-mixed")
        s = Strategy(**{**fields, **kw})
        a, b = estimate(s, seen, cluster), estimate(s, long, cluster)
        assert a.step_time_s == pytest.approx(b.step_time_s, rel=0.01), kw
        assert a.peak_memory_bytes == pytest.approx(b.peak_memory_bytes, rel=0.01), kw
        assert a.memory_per_rank[0].activations == pytest.approx(b.memory_per_rank[0].activations, rel=0.01), kw
        # and the short profile's is not the same (at this size the H100's time is its kernels' launch gaps,
        # kernels.KERNEL_GAP_S, so the activations tell them apart)
        assert estimate(s, short, cluster).memory_per_rank[0].activations < 0.3 * b.memory_per_rank[0].activations


def _timed(seconds: float):
    from cost_models.records.profile import Timing
    return Timing(median_s=seconds, min_s=seconds, max_s=seconds, repeats=3)


def test_measured_times_grow_with_the_flops_and_a_calls_fixed_cost_stays(tiny_profiles):
    """The timings are set, not measured, so that noise cannot move the line: per unit a fixed part of 1 ms and
    2 ms per sample in forward (at 2 sequences, 5 ms; on one, 3 ms), 2 and 4 ms in backward, and on the last unit's
    forward a one-sample timing under half the profile's: the line through them starts below zero, which is noise,
    not a cost, so it is taken as no fixed part and the whole line grows."""
    from cost_models.cost.compute import affine_parts
    real = tiny_profiles["llama-tiny", False]   # 2 x 16 tokens, timed at 2 sequences and at 1
    noisy = len(real.units) - 1
    units = tuple(dataclasses.replace(u, fwd_time=_timed(5e-3), bwd_time=_timed(10e-3),
                                      fwd_time_one=_timed(2e-3 if i == noisy else 3e-3), bwd_time_one=_timed(6e-3))
                  for i, u in enumerate(real.units))
    real = dataclasses.replace(real, units=units)
    seen = at_seq_len(real, 64)
    r = 4
    for i, (a, u) in enumerate(zip(seen.units, real.units)):
        core = u.tp.core_flops
        fwd = (u.fwd_flops - core) * r + core * r * r
        bwd = (u.bwd_flops - BACKWARD_CORE * core) * r + BACKWARD_CORE * core * r * r
        assert a.fwd_flops == round(fwd) and a.bwd_flops == round(bwd)
        shares = (fwd / u.fwd_flops, bwd / u.bwd_flops) if u.fwd_flops else (r, r)   # no FLOPs: the embedding
        for (at, one), (at2, one2), share, set_fixed in zip(
                ((u.fwd_time, u.fwd_time_one), (u.bwd_time, u.bwd_time_one)),
                ((a.fwd_time, a.fwd_time_one), (a.bwd_time, a.bwd_time_one)), shares, (1e-3, 2e-3)):
            noise = i == noisy and at is u.fwd_time
            fixed, per_sample = affine_parts(at, one, 2, 1)
            assert fixed == pytest.approx(-1e-3 if noise else set_fixed)   # the line through the timings as set
            grows = share if noise else 1.0
            fixed2, per_sample2 = affine_parts(at2, one2, 2, 1)
            assert fixed2 == pytest.approx(fixed * grows, rel=1e-9, abs=1e-12), (u.name, at is u.fwd_time)
            assert per_sample2 == pytest.approx(per_sample * share, rel=1e-9, abs=1e-12), u.name
            assert at2.min_s == at2.median_s == at2.max_s
    assert any(u.tp.core_flops for u in real.units) and not real.units[0].fwd_flops   # both cases are here
    assert seen.in_model_factor == real.in_model_factor   # on CPUs a share of the time: it stays


def test_what_the_scaling_cannot_model_is_refused_in_one_line(tiny_profiles):
    mlp = tiny_profiles["mlp-deep", True]   # features along a sequence: every part linear
    assert length_refusal(mlp) is None and at_seq_len(mlp, 64).units[1].fwd_flops == 4 * mlp.units[1].fwd_flops
    custom = dataclasses.replace(mlp, input=dataclasses.replace(mlp.input, kind="custom"))
    assert "has no sequence axis" in length_refusal(custom)
    moe = profile_model(resolve("moe-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    with pytest.raises(ConfigError, match="routes tokens to experts"):
        at_seq_len(moe, 64)
    with pytest.raises(ConfigError, match="--seq-len"):
        at_seq_len(tiny_profiles["llama-tiny", True], 0)
    # attention not kept apart from the rest: a model without a tensor-parallel plan (its TPUnit is not recorded)
    nano = profile_model(resolve("tests.custom_models:make_nanogpt"), micro_batch_size=1, seq_len=8, meta=True)
    assert nano.units[1].tp is None and nano.units[1].fwd_work.attention_flops > 0
    with pytest.raises(ConfigError, match="does not record unit .* attention FLOPs apart"):
        at_seq_len(nano, 32)
    same = tiny_profiles["llama-tiny", True]
    assert at_seq_len(same, same.seq_len) is same and length_line(same) is None


def test_planner_plan_at_another_length_and_past_the_models_positions(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    runner = CliRunner()
    prof = tmp_path / "p.json"
    assert runner.invoke(app, ["profile", "-m", "llama-tiny", "--meta", "-b", "1", "-s", "32", "--cluster", "dgx-h100",
                               "-o", str(prof)]).exit_code == 0
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["plan", str(prof), "--cluster", "dgx-h100", "-B", "8", "--seq-len", "128", "-o", str(out),
                            "--no-report", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["model"]["seq_len"] == 128
    assert any("profiled at 32 tokens per sequence and seen at 128" in c
               for c in doc["provenance"]["profile_conditions"])
    r = runner.invoke(app, ["plan", str(prof), "--cluster", "dgx-h100", "-B", "8", "--seq-len", "256", "-o",
                            str(tmp_path / "x.json"), "--no-report"])
    assert r.exit_code == 2 and "llama-tiny supports --seq-len up to 128, got 256" in r.output
    # replan from the 32-token profile plans at the plan's 128 tokens again
    from planner.plan import Plan
    from planner.replan import replan
    again = replan(Plan.load(out), gpus=4, profile_path=str(prof), cluster="dgx-h100")
    assert again.model.seq_len == 128 and again.prediction.tokens_per_step == 8 * 128
    assert any("seen at 128" in c for c in again.provenance.profile_conditions)
