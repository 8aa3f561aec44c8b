"""Context parallelism: the load-balanced split of a sequence, its price (key/value gathers, the data view of the
profile), its place in the search, the refusals before any rank starts, and (slow) training under CP on 2 and 4
gloo ranks against one process, zoo Llama and a transformers Llama from save_pretrained with --init-from and --data."""
import dataclasses
import importlib.util

import pytest
import torch

from cost_models.cost.context_parallel import cp_refusal, cp_view
from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from executor.context_parallel import CPContext
from planner.request import PlanRequest
from planner.search import plan


def _strategy(units, **kw) -> Strategy:
    fields = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=2, stages=(units,),
                  precision="fp32")
    return Strategy(**{**fields, **kw})


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_holds_two_chunks_that_balance_causal_work_and_tile_the_sequence(cp):
    seq = 8 * cp
    tokens = torch.arange(seq).view(1, seq)
    parts = [CPContext(group=None, cp=cp, index=i, seq_len=seq) for i in range(cp)]
    held = [p.split(tokens)[0] for p in parts]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))   # every token once
    assert all(torch.equal(h, p.placed_positions) for h, p in zip(held, parts))   # rotary sees the global places
    # causal work: a token at position t attends t + 1 keys; every rank's sum is the same
    assert len({int((h + 1).sum()) for h in held}) == 1


def test_cp_prices_its_key_value_gathers_and_keeps_the_tokens_of_the_run(tiny_profiles):
    prof = tiny_profiles["llama-tiny", True]
    units = tuple(u.name for u in prof.units)
    cluster = preset("dgx-h100")
    one = estimate(_strategy(units, dp=2, zero=3), prof, cluster)
    two = estimate(_strategy(units, dp=2, zero=3, cp=2), prof, cluster)
    assert two.tokens_per_step == one.tokens_per_step
    # per micro-batch of 2 sequences, each block's keys and values over whole sequences are all-gathered in forward
    # and reduce-scattered in backward: twice the full buffer, as SDPA saw it in the profile (2 sequences)
    kv = sum(u.tp.core_kv_bytes for u in prof.units)
    assert kv > 0 and two.comm.cp_bytes_per_rank == pytest.approx(2 * 2 * kv)
    assert two.breakdown.cp_comm_s > 0 and one.comm.cp_bytes_per_rank == 0
    # the rank's half of the sequences' activations, plus the gathered keys and values beyond its own: (cp - 1) /
    # cp of the whole sequences', as many as the profile's 2
    act1, act2 = one.memory_per_rank[0].activations, two.memory_per_rank[0].activations
    assert act2 == pytest.approx(act1 / 2 + kv / 2, rel=0.02)


def test_the_data_view_is_the_profile_at_cp_times_the_sequences_of_a_cp_th_of_the_tokens(tiny_profiles):
    prof = tiny_profiles["llama-tiny", False]
    view = cp_view(prof, 2)
    assert (view.micro_batch_size, view.seq_len) == (2 * prof.micro_batch_size, prof.seq_len // 2)
    assert cp_view(prof, 2) is view and all(u.fwd_time_one is None for u in view.units)


def test_bad_context_parallel_requests_are_one_line_errors(tiny_profiles):
    prof = tiny_profiles["llama-tiny", True]   # 16 tokens
    units = tuple(u.name for u in prof.units)
    with pytest.raises(ConfigError, match="power of two"):
        _strategy(units, cp=3)
    assert "not a multiple of 32" in cp_refusal(prof, 16)
    with pytest.raises(ConfigError, match="not a multiple of 32"):
        estimate(_strategy(units, cp=16), prof, preset("dgx-h100"))
    mlp = tiny_profiles["mlp-deep", True]
    assert "records no attention kernel" in cp_refusal(dataclasses.replace(mlp, seq_len=16), 2)
    with pytest.raises(ConfigError, match="--cp 16: .*not a multiple of 32"):
        plan(prof, preset("dgx-h100"), PlanRequest(global_batch_size=8, cp_degrees=(1, 16)))


def test_planner_run_refuses_attention_it_cannot_split_before_any_rank_starts(tmp_path):
    """A sliding-window Mistral calls SDPA with a mask: one line, exit 2, from the launcher's meta forward."""
    from typer.testing import CliRunner

    from cli import app
    from tests.plans import plan_file
    ref = ("hf:mistral?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
           "&num_key_value_heads=2&vocab_size=128&max_position_embeddings=64&sliding_window=4")
    pytest.importorskip("transformers")
    prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=16, meta=True)
    units = tuple(u.name for u in prof.units)
    path = plan_file(tmp_path, _strategy(units, cp=2, micro_batch_size=1), prof)
    res = CliRunner().invoke(app, ["run", str(path), "-o", "-"])
    assert res.exit_code == 2, res.output
    assert "context parallelism splits causal attention without a mask; model.layers.0.self_attn calls " \
           "scaled_dot_product_attention with an attention mask" in res.output


def test_long_sequences_plan_context_parallelism_and_say_why():
    """llama3-8b at 131,072 tokens per sequence on 4 DGX H100 nodes: a plan that fits, with CP, and the numbers."""
    prof = profile_model(resolve("llama3-8b"), micro_batch_size=1, seq_len=131072, meta=True, dtype="bf16")
    p = plan(prof, preset("dgx-h100", nodes=4), PlanRequest(global_batch_size=32))
    assert p.prediction.fits and p.strategy.cp > 1
    lines = "\n".join(p.rationale.lines)
    assert f"each 131,072-token sequence split {p.strategy.cp} ways" in lines
    assert "at cp=1 with the same dp, pp, tp and micro-batches" in lines and "best cp=1:" in lines


def test_short_sequences_search_no_context_parallelism(tiny_profiles):
    prof = tiny_profiles["llama-tiny", True]
    p = plan(prof, preset("dgx-h100"), PlanRequest(global_batch_size=8))
    assert p.strategy.cp == 1 and not any("cp=" in line for line in p.rationale.lines)


HF_LLAMA = ("hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=128&max_position_embeddings=64")
# (dp, pp, tp, zero) x cp 2: the layouts; 2 ranks: CP2 alone
CP_PLANS = {2: ((1, 1, 1, 0),), 4: ((2, 1, 1, 3), (1, 1, 2, 0), (1, 2, 1, 0))}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """The zoo Llama and the HF Llama under CP_PLANS, one launch per world size (each spawns ranks that import
    torch and transformers): {(name, ranks): (profile, cfg, units, strategies, results)}."""
    from executor.train import TrainConfig
    from tests.shared_launch import run_shared
    from tests.test_hf_executor import GLOBAL, SEQ, _saved, _tokens
    root = tmp_path_factory.mktemp("cp")
    setups = {}
    for i, name in enumerate(["llama-tiny", HF_LLAMA]):
        hf = name.startswith("hf:")
        if hf and importlib.util.find_spec("transformers") is None:
            continue
        prof = profile_model(resolve(name), micro_batch_size=1, seq_len=SEQ, meta=True, dtype="fp32")
        setups[name] = prof, TrainConfig(
            model_source=name, seq_len=SEQ, input_kind="tokens", steps=5, warmup=1, seed=3, lr=1e-2,
            unit_modules=tuple(u.modules for u in prof.units), init_from=_saved(name, root / f"hf{i}") if hf else None,
            data=_tokens(root / f"tokens{i}.bin") if hf else None)
    out = {}
    for ranks, plans in sorted(CP_PLANS.items()):
        jobs = []
        for name, (prof, cfg) in setups.items():
            units = tuple(u.name for u in prof.units)
            half = (units[:len(units) // 2], units[len(units) // 2:])
            jobs.append((name, prof, cfg, units, [
                _strategy(units, stages=(units,) if pp == 1 else half, dp=dp, pp=pp, tp=tp, zero=zero, cp=2,
                          micro_batch_size=GLOBAL // dp // 2) for dp, pp, tp, zero in plans]))
        results = run_shared(ranks, [(name, cfg, strategies, None) for name, _, cfg, _, strategies in jobs])
        out.update({(name, ranks): (prof, cfg, units, strategies, results[name])
                    for name, prof, cfg, units, strategies in jobs})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", sorted(CP_PLANS))
@pytest.mark.parametrize("name", ["llama-tiny", HF_LLAMA])
def test_context_parallel_training_equals_one_process(name, ranks, cp_runs):
    """Five AdamW steps under CP2 (with ZeRO-3 over dp 2, TP2, PP2 1F1B on 4 ranks) equal one process; the HF
    Llama starts from save_pretrained's folder and reads a token file, and its step 0 is from_pretrained's own loss;
    the CP bytes are the prediction's and the activations within 10% of it."""
    from executor.train import single_process_losses
    from tests.test_hf_executor import GLOBAL, _own_step0_loss
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    prof, cfg, units, strategies, results = cp_runs[name, ranks]
    reference = single_process_losses(_strategy(units, microbatches=1, micro_batch_size=GLOBAL), cfg)
    own = _own_step0_loss(cfg) if name.startswith("hf:") else None
    for s, rank_results in zip(strategies, results):
        losses = [list(r.losses) for r in rank_results if r.losses][0]
        assert losses == pytest.approx(reference, rel=1e-4), s.name
        if own is not None:
            assert losses[0] == pytest.approx(own, rel=1e-5), s.name
        est = estimate(s, prof, preset("dgx-h100"))
        measured = sum(v for r in rank_results for k, v in r.comm_bytes.items() if k.startswith("cp_")) / ranks
        assert measured == pytest.approx(est.comm.cp_bytes_per_rank, rel=1e-9), s.name
        for r in rank_results:
            predicted = est.memory_per_rank[r.rank].activations
            assert r.activation_bytes == pytest.approx(predicted, rel=0.10), (s.name, r.rank)
