"""Mixture-of-experts models: the zoo's sizes against the published ones, the dropless expert block, the profile's
record of the routed experts, expert parallelism's costs and its place in the search."""
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cost_models.cost.estimate import estimate, tp_traffic_per_step
from cost_models.cost.moe import (DEFAULT_IMBALANCE, all_to_all_time, deal_windows, ep_work, imbalance,
                                  peak_imbalance)
from cost_models.models.moe import active_params, total_params
from cost_models.models.source import resolve
from cost_models.models.zoo import ZOO, build_zoo_model
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from executor.routing import measure_routing
from planner.manual import executor_refuses
from planner.request import PlanRequest
from planner.search import plan, search

# (total, active) parameters as published: Mixtral 8x7B 46.7B / 12.9B (Jiang et al. 2024, section 2); Qwen3-30B-A3B
# 30.5B / 3.3B (Qwen3 Technical Report, table 2); DeepSeek-V3 671B / 37B (DeepSeek-V3 Technical Report, abstract)
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "deepseek-v3": (671e9, 37e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_zoo_moe_sizes_match_the_published_totals_and_active_counts(name):
    cfg = ZOO[name].config
    with torch.device("meta"):
        counted = sum(p.numel() for p in build_zoo_model(ZOO[name]).parameters())
    assert counted == total_params(cfg)
    total, active = PUBLISHED[name]
    assert abs(counted / total - 1) < 0.005
    # the published active counts are rounded to one decimal of a billion (37B: two significant digits)
    assert abs(active_params(cfg) / active - 1) < 0.02


def test_the_expert_block_is_dropless_and_equals_a_token_by_token_mixture():
    torch.manual_seed(0)
    model = build_zoo_model(ZOO["moe-tiny"])
    block = model.blocks[1].feed_forward
    x = torch.randn(24, 64)
    logits, weights, index = block.gate(x)
    got = block.experts(x, index, weights)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = F.linear(x[t], block.experts.gate_up_proj[e]).chunk(2)
            want[t] += weights[t, j] * F.linear(F.silu(gate) * up, block.experts.down_proj[e])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(weights.sum(-1).round(decimals=5), torch.ones(24))


@pytest.fixture(scope="module")
def moe_profiles():
    return {meta: profile_model(resolve("moe-tiny"), micro_batch_size=2, seq_len=16, dtype="fp32", meta=meta,
                                warmup=1, repeats=2) for meta in (True, False)}


def test_the_profile_records_each_units_routed_experts(moe_profiles):
    for meta, prof in moe_profiles.items():
        cfg = ZOO["moe-tiny"].config
        assert [u.name for u in prof.moe_units] == ["blocks.1", "blocks.2", "blocks.3"]
        assert prof.unit("blocks.0").moe is None and prof.experts == 8
        m = prof.unit("blocks.2").moe
        tokens = 2 * 16
        assert (m.experts, m.top_k, m.hidden, m.tokens) == (8, 2, 64, tokens)
        assert m.expert_params == 8 * 3 * 64 * cfg.expert_dim and m.expert_tensors == 2
        assert m.router_params == 8 * 64 and m.shared_expert_params == 3 * 64 * cfg.expert_dim
        assert m.routed_fwd_flops == 2 * tokens * 2 * 3 * 64 * cfg.expert_dim
        assert m.routed_bwd_flops == 2 * m.routed_fwd_flops
        # the counted forward holds the routed experts' products as executed: every token-expert pair once
        assert m.routed_fwd_flops < prof.unit("blocks.2").fwd_flops
        assert 0 < m.routed_saved_bytes < prof.unit("blocks.2").saved_bytes
        # with weights that need no gradient (as expert parallelism calls the experts), the weighted product keeps
        # its weight alone, not the expert_dim-wide activation it scales, nor the index that gathered the weights
        assert m.routed_saved_bytes - m.routed_unweighted_bytes == tokens * 2 * (cfg.expert_dim * 4 + 8)
        if meta:
            assert m.expert_load == ()
        else:   # every token-expert pair of the profile's forward, counted once
            assert sum(m.expert_load) == tokens * 2 and len(m.expert_load) == 8


def test_a_block_with_a_router_and_experts_but_no_declaration_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="num_experts.*top_k"):
        profile_model(resolve("tests.custom_models:undeclared_moe"), micro_batch_size=2, seq_len=8, dtype="fp32",
                      meta=True)


def _strategy(prof, **kw) -> Strategy:
    fields = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=2,
                  stages=(tuple(u.name for u in prof.units),), precision="fp32")
    fields.update(kw)
    return Strategy(**fields)


def test_bad_expert_parallel_degrees_are_one_line_errors(moe_profiles, tiny_profiles):
    prof, cluster = moe_profiles[True], preset("dgx-h100")
    with pytest.raises(ConfigError, match="must divide --dp"):
        _strategy(prof, dp=2, ep=4)
    with pytest.raises(ConfigError, match="does not divide the 8 routed experts"):
        estimate(_strategy(prof, dp=3, ep=3), prof, cluster)
    dense = tiny_profiles["llama-tiny", True]
    with pytest.raises(ConfigError, match="no mixture-of-experts blocks"):
        estimate(_strategy(dense, dp=2, ep=2), dense, cluster)
    assert executor_refuses(_strategy(prof, dp=2, ep=2), prof) is None
    halves = (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    assert executor_refuses(_strategy(prof, dp=2, ep=2, pp=2, microbatches=2, stages=halves), prof) is None
    nested = _strategy(prof, dp=4, ep=2, pp=2, zero=2, microbatches=2, stages=halves)
    assert executor_refuses(nested, prof) is None
    zero_bubble = _strategy(prof, dp=2, ep=2, pp=2, microbatches=2, stages=halves, schedule="zb-interleaved")
    assert executor_refuses(zero_bubble, prof) is None
    assert executor_refuses(_strategy(prof, dp=2, ep=2, zero=1), prof) is None
    assert executor_refuses(_strategy(prof, dp=2, ep=2, zero=1, distributed_optimizer=True), prof) is None


def test_expert_parallelism_moves_the_dispatched_tokens_and_splits_the_experts(moe_profiles):
    prof, cluster = moe_profiles[True], preset("dgx-h100")
    m, moe_units = prof.unit("blocks.1").moe, len(prof.moe_units)
    one = estimate(_strategy(prof, dp=4, microbatches=3), prof, cluster)
    two = estimate(_strategy(prof, dp=4, microbatches=3, ep=2), prof, cluster)
    assert one.comm.ep_bytes_per_rank == 0 and one.breakdown.ep_comm_s == 0
    # per block and micro-batch: dispatch and combine, forward and backward, of tokens x top_k x hidden x 4 bytes,
    # and each forward's counts (one int64 per expert)
    per = m.tokens * m.top_k * m.hidden * 4
    assert two.comm.ep_bytes_per_rank == pytest.approx(3 * moe_units * (4 * per + 8 * m.experts))
    assert two.comm.ep_link == "intra-node" and two.breakdown.ep_comm_s > 0
    experts = sum(u.moe.expert_params for u in prof.moe_units)
    assert one.stages[0].params - two.stages[0].params == experts // 2
    assert two.stages[0].expert_params == experts // 2
    # ZeRO-0: every rank holds its experts' fp32 weights, gradients and Adam moments (16 B per parameter)
    states = lambda e: sum(x.parameters + x.gradients + x.optimizer_states for x in e.memory_per_rank[:1])
    assert states(one) - states(two) == pytest.approx(experts // 2 * 16, rel=1e-6)
    # data-parallel gradients: the dense ones over 4 ranks, the experts' over the 2 holding the same experts
    assert two.comm.dp_bytes_per_rank < one.comm.dp_bytes_per_rank


def test_the_report_timeline_marks_each_blocks_all_to_alls(moe_profiles):
    """A stage's all-to-alls split into the forward's (dispatch and combine, after the counts) and the rest: the
    backward's, and under full recompute the forward's once more, so recomputing adds exactly the forward's. The
    report's timeline marks each F and B block's share at its end, titled with its seconds, and says so."""
    from cost_models.records.formatting import duration
    from planner.report import render_html
    from tests.plans import plan_for
    prof, cluster = moe_profiles[True], preset("dgx-h100")
    halves = (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    s = _strategy(prof, dp=2, ep=2, pp=2, microbatches=2, stages=halves)
    plain, again = (estimate(dataclasses.replace(s, recompute=r), prof, cluster)
                    for r in ((False, False), (True, True)))
    for st, re_st in zip(plain.stages, again.stages):
        # the forward's: the counts' all-to-all, then dispatch and combine; the backward's: dispatch and combine
        assert st.ep_comm_s - st.ep_fwd_s < st.ep_fwd_s < st.ep_comm_s
        assert re_st.ep_fwd_s == pytest.approx(st.ep_fwd_s, rel=1e-12)
        assert re_st.ep_comm_s - st.ep_comm_s == pytest.approx(st.ep_fwd_s, rel=1e-9)
    page = render_html(plan_for(s, prof, cluster=cluster))
    marks = page.count('class="a2a"')
    assert marks == 2 * 2 * 2   # an F and a B per micro-batch on each of the 2 stages
    assert f"expert-parallel all-to-alls of 0F0: {duration(plain.stages[0].ep_fwd_s)}" in page
    assert "The darker end of a block is its expert-parallel all-to-alls." in page
    dense = render_html(plan_for(dataclasses.replace(s, ep=1), prof, cluster=cluster))
    assert 'class="a2a"' not in dense and "darker end" not in dense


def test_imbalance_comes_from_the_measured_load_or_the_stated_default(moe_profiles):
    real, meta = moe_profiles[False], moe_profiles[True]
    u = real.unit("blocks.1").moe
    load = u.expert_load
    half = [sum(load[:4]), sum(load[4:])]
    assert imbalance(real, u, 2) == pytest.approx(max(half) / (sum(half) / 2))
    assert imbalance(real, u, 1) == 1.0
    assert imbalance(meta, meta.unit("blocks.1").moe, 4) == DEFAULT_IMBALANCE
    assert imbalance(dataclasses.replace(real, moe_imbalance=1.7), u, 8) == 1.7


def test_activations_are_priced_at_the_worst_micro_batchs_load_dealt_as_the_run_deals_windows(moe_profiles):
    """With a load per window (--data), the windows are dealt into replicas and micro-batches in the run's order
    (executor.runtime.rank_batch), an EP group's micro-batch is what its ep replicas route together, and the
    activations' load is the busiest rank's in the worst of them; time stays at the whole's."""
    real = moe_profiles[False]
    # 8 windows, 2 experts: rank 0 holds expert 0. dp 4 x 2 micro-batches of 1: a step's 8 windows go 2 per replica
    assert deal_windows(8, ep=2, dp=4, micro_batch_size=1, microbatches=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert deal_windows(16, ep=2, dp=2, micro_batch_size=2, microbatches=1) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                                 [8, 9, 10, 11], [12, 13, 14, 15]]
    assert deal_windows(6, ep=2, dp=4, micro_batch_size=1, microbatches=2) == [[0, 1], [2, 3], [4, 5]]   # < a step
    assert deal_windows(1, ep=2, dp=2, micro_batch_size=1, microbatches=1) == [[0]]
    windows = ((3, 1), (1, 3), (2, 2), (2, 2), (4, 0), (0, 4), (2, 2), (2, 2))
    u = dataclasses.replace(real.unit("blocks.1").moe, experts=2, window_load=windows,
                            expert_load=tuple(map(sum, zip(*windows))))
    assert imbalance(real, u, 2) == 1.0   # 16 and 16 over the whole
    # micro-batches [0, 2]: (5, 3) -> 5 / 4; [1, 3]: (3, 5); [4, 6]: (6, 2) -> 1.5; [5, 7]: (2, 6)
    assert peak_imbalance(real, u, ep=2, dp=4, micro_batch_size=1, microbatches=2) == 1.5
    # dp 2 x one micro-batch of 2: [0, 1, 2, 3] routes (8, 8), [4, 5, 6, 7] too
    assert peak_imbalance(real, u, ep=2, dp=2, micro_batch_size=2, microbatches=1) == 1.0
    assert peak_imbalance(real, u, ep=1, dp=4, micro_batch_size=1, microbatches=2) == 1.0
    assert peak_imbalance(dataclasses.replace(real, moe_imbalance=1.7), u, ep=2, dp=4, micro_batch_size=1,
                          microbatches=2) == 1.7
    # the estimate keeps the routed experts' saved bytes at that load, and its time at the whole's
    profile = dataclasses.replace(real, units=tuple(dataclasses.replace(x, moe=u) if x.name == "blocks.1" else x
                                                    for x in real.units))
    s = Strategy(dp=4, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=1, precision="fp32",
                 stages=(tuple(x.name for x in real.units),),
                 ep=2)
    est = estimate(s, profile, preset("dgx-h100"))
    whole = dataclasses.replace(u, window_load=())   # the load over the whole: even
    flat = estimate(s, dataclasses.replace(profile, units=tuple(dataclasses.replace(x, moe=whole) if x.moe == u else x
                                                                 for x in profile.units)), preset("dgx-h100"))
    # the other blocks' measured loads are below 1.5 (one profile's tokens, no windows): at their whole load
    assert (est.ep_load, est.ep_peak_load, flat.ep_peak_load) == (flat.ep_load, 1.5, flat.ep_load) < (1.5,)
    assert est.step_time_s == flat.step_time_s
    extra = est.memory_per_rank[0].activations - flat.memory_per_rank[0].activations
    # 0.5 over the even load of what grows with the rows received (the experts' bytes, called as EP calls them,
    # and two int64 indices per row), at one of the profile's two sequences per micro-batch
    received = u.blocks * u.tokens * u.top_k
    assert extra == pytest.approx(0.5 * (u.routed_unweighted_bytes + 2 * 8 * received) / real.micro_batch_size,
                                  rel=1e-9)


def test_routed_products_run_ep_times_taller_on_the_busiest_rank(moe_profiles):
    """A meta profile's routed experts run as one batch of E products per matrix (an even routing); under EP4 at
    load 1.5 the busiest rank runs E/4 of them on 4 x 1.5 times the rows: 1.5 times the FLOPs."""
    u = moe_profiles[True].unit("blocks.1")
    r = u.moe.tokens * u.moe.top_k // u.moe.experts
    routed = lambda w: sum(g.flops for g in w.gemms if r in (g.m, g.k) and g.batch == 8)
    for work, want in ((u.fwd_work, u.moe.routed_fwd_flops), (u.bwd_work, u.moe.routed_bwd_flops)):
        shaped = ep_work(work, u.moe, ep=4, load=1.5)
        assert routed(work) == want
        assert shaped.gemm_flops - work.gemm_flops == pytest.approx(want * 0.5)
        assert sorted(g.batch for g in shaped.gemms if r * 6 in (g.m, g.k)) == [2] * len(
            [g for g in work.gemms if g.batch == 8])


def test_all_to_all_crosses_nodes_at_the_network_rate():
    c = preset("dgx-h100", nodes=2)
    size = 64e6
    inside = all_to_all_time(c, size, 8, ranks_per_node=None)
    assert inside == pytest.approx(c.intra_node.alpha_s + 7 / 8 * size / c.intra_node.bandwidth_Bps)
    across = all_to_all_time(c, size, 16, ranks_per_node=8)
    assert across == pytest.approx(c.inter_node.alpha_s + max(7 / 16 * size / c.intra_node.bandwidth_Bps,
                                                               8 / 16 * size / c.inter_node.bandwidth_Bps))


def test_pruned_search_finds_the_exhaustive_searchs_best_with_expert_parallelism(moe_profiles):
    prof, cluster = moe_profiles[True], preset("dgx-h100")
    req = PlanRequest(global_batch_size=16, gpus=8, precision="bf16-mixed")
    pruned = search(prof, cluster, req)
    every = search(prof, cluster, dataclasses.replace(req, prune=False))
    assert {c.strategy.ep for c in every.feasible} == {1, 2, 4, 8}
    assert pruned.feasible[0].estimate.step_time_s == pytest.approx(every.feasible[0].estimate.step_time_s)


def test_planning_a_large_moe_model_chooses_expert_parallelism_and_says_why():
    prof = profile_model(resolve("mixtral-8x7b"), micro_batch_size=1, seq_len=4096, meta=True, dtype="bf16")
    p = plan(prof, preset("dgx-h100", nodes=16), PlanRequest(global_batch_size=512))
    assert p.prediction.fits
    lines = "\n".join(p.rationale.lines)
    # every degree searched is accounted for, the chosen one with what its all-to-alls move, the others with the
    # component that made them lose
    chosen = p.strategy.ep
    assert (f"split {chosen} ways (" if chosen > 1 else "no expert parallelism chosen") in lines
    assert all(f"best ep={ep}: " in lines for ep in (1, 2, 4, 8) if ep != chosen)
    assert "most of it" in lines
    dense = plan(profile_model(resolve("llama-tiny"), micro_batch_size=2, seq_len=16, meta=True, dtype="bf16"),
                 preset("dgx-h100"), PlanRequest(global_batch_size=16))
    assert dense.strategy.ep == 1 and "expert" not in "\n".join(dense.rationale.lines)


_HF_TINY = "hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=256&num_experts_per_tok=2"
HF_MOE = {   # transformers' MoE families, tiny configs: (query, routed experts, shared expert parameters)
    "mixtral": (f"{_HF_TINY}&intermediate_size=128&num_key_value_heads=2&num_local_experts=4", 4, 0),
    "qwen3_moe": (f"{_HF_TINY}&moe_intermediate_size=32&num_key_value_heads=2&num_experts=8&head_dim=16", 8, 0),
    "olmoe": (f"{_HF_TINY}&intermediate_size=32&num_key_value_heads=4&num_experts=8", 8, 0),
    "deepseek_v3": (f"{_HF_TINY}&intermediate_size=128&moe_intermediate_size=32&first_k_dense_replace=1"
                    "&num_key_value_heads=4&n_routed_experts=8&n_group=1&topk_group=1&n_shared_experts=1&q_lora_rank=32"
                    "&kv_lora_rank=16&qk_rope_head_dim=8&qk_nope_head_dim=8&v_head_dim=8", 8, 3 * 64 * 32),
}


@pytest.mark.parametrize("family", sorted(HF_MOE))
def test_transformers_moe_blocks_are_recognised_by_their_shape(family):
    query, experts, shared = HF_MOE[family]
    prof = profile_model(resolve(f"hf:{family}?{query}"), micro_batch_size=2, seq_len=8, dtype="fp32", warmup=0,
                         repeats=1)
    moe = [u.moe for u in prof.moe_units]
    assert moe and all(m.experts == experts and m.top_k == 2 and m.hidden == 64 for m in moe)
    assert all(m.shared_expert_params == shared and sum(m.expert_load) == 2 * 8 * 2 for m in moe)
    assert all(m.routed_fwd_flops == 2 * 16 * 2 * m.expert_params // experts for m in moe)
    # transformers' experts weight their hidden-wide output: without the weights' gradient, that row is not kept
    assert [m.routed_saved_bytes - m.routed_unweighted_bytes for m in moe] == [16 * 2 * 64 * 4] * len(moe)


# transformers' MoE decoders run under expert parallelism: vocabulary 128 (the token file's ids), several experts
HF_RUN = {"mixtral": f"hf:mixtral?{HF_MOE['mixtral'][0].replace('vocab_size=256', 'vocab_size=128')}",
          "qwen3_moe": f"hf:qwen3_moe?{HF_MOE['qwen3_moe'][0].replace('vocab_size=256', 'vocab_size=128')}"}


# per world size, (dp, pp, ep, ZeRO stage, distributed optimizer, tp) of each run: the issue's layouts (EP2; EP2 x
# DP2 under ZeRO-2 and 3; EP2 x PP2 1F1B) and EP2 x TP2 (attention split, Qwen3's per-head q/k norms replicated with
# their gradients all-reduced, MoE blocks whole) for both models; Mixtral also each under ZeRO-1 and EP2 x DP2 under
# the distributed optimizer. pp 2 cuts the units in halves, under ZeRO-1 after the embedding (a stage without
# experts)
EP_PLANS = {2: ((2, 1, 2, 0, False, 1), (2, 1, 2, 1, False, 1)),
            4: ((4, 1, 2, 1, False, 1), (4, 1, 2, 1, True, 1), (4, 1, 2, 2, False, 1), (4, 1, 2, 3, False, 1),
                (2, 2, 2, 0, False, 1), (2, 2, 2, 1, False, 1), (2, 1, 2, 3, False, 2))}
ISSUE_LAYOUTS = {(2, 1, 2, 0, False), (4, 1, 2, 2, False), (4, 1, 2, 3, False), (2, 2, 2, 0, False)}   # every model
# and counted at step 0 (no training step has moved the routing from the weights a profile's --data routes): EP2,
# ZeRO-3's nested expert group, 1F1B's micro-batches in flight, and TP
AT_STEP_0 = {(2, 1, 2, 0, False, 1), (4, 1, 2, 3, False, 1), (2, 2, 2, 0, False, 1), (2, 1, 2, 3, False, 2)}


@pytest.fixture(scope="module")
def hf_moe_runs(tmp_path_factory, moe_profiles):
    """Both transformers MoE models under EP_PLANS, one launch per world size (each spawns ranks that import
    transformers): {(name, ranks): (profile, cfg, strategies, results)}. Saved with save_pretrained (one tensor per
    expert, which --init-from stacks as transformers does), trained on a token file of one global batch (every
    step routes the windows a profile's --data routes). The AT_STEP_0 layouts also run their counted step first,
    keyed ("step 0", name, ranks). The 4-rank launch also runs moe-tiny under the zero-bubble schedules
    (_zero_bubble), keyed ("moe-tiny", 4)."""
    from executor.train import TrainConfig
    from tests.shared_launch import run_shared
    from tests.test_hf_executor import GLOBAL, SEQ, _saved, _tokens
    root = tmp_path_factory.mktemp("hf-moe")
    setups = {}
    for name, ref in sorted(HF_RUN.items()):
        prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=SEQ, meta=False, dtype="fp32", warmup=0,
                             repeats=1)
        # lr 3e-3: a larger step moves routers' near-ties, so one float rounding (an all-reduce's order) can send a
        # token to another expert, a discrete change no tolerance covers
        setups[name] = prof, TrainConfig(
            model_source=ref, seq_len=SEQ, input_kind="tokens", steps=5, warmup=1, seed=3, lr=3e-3,
            unit_modules=tuple(u.modules for u in prof.units), data=_tokens(root / f"{name}.bin", GLOBAL * (SEQ + 1)),
            init_from=_saved(ref, root / name))
    out = {}
    for ranks, plans in sorted(EP_PLANS.items()):
        jobs = []
        for name, (prof, cfg) in setups.items():
            names = tuple(u.name for u in prof.units)
            halves = (names[:len(names) // 2], names[len(names) // 2:])
            layouts = [p for p in plans if name == "mixtral" or p[:5] in ISSUE_LAYOUTS or p[5] > 1]
            jobs.append((name, prof, cfg, [
                Strategy(dp=dp, pp=pp, zero=z, schedule="1f1b", microbatches=2, micro_batch_size=GLOBAL // dp // 2,
                         stages=(names,) if pp == 1 else (names[:1], names[1:]) if z == 1 else halves,
                         precision="fp32", ep=ep, distributed_optimizer=d, tp=tp)
                for dp, pp, ep, z, d, tp in layouts]))
            jobs.append((("step 0", name, ranks), prof, dataclasses.replace(cfg, steps=0, warmup=0),
                         [st for st, layout in zip(jobs[-1][3], layouts) if layout in AT_STEP_0]))
        if ranks == 4:
            tiny = moe_profiles[True]
            jobs.append(("moe-tiny", tiny, _moe_tiny_cfg(tiny), _zero_bubble(tiny)))
        results = run_shared(ranks, [(name, cfg, strategies, None) for name, _, cfg, strategies in jobs])
        out.update({name if isinstance(name, tuple) else (name, ranks): (prof, cfg, strategies, results[name])
                    for name, prof, cfg, strategies in jobs})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", sorted(EP_PLANS))
@pytest.mark.parametrize("name", sorted(HF_RUN))
def test_hf_moe_models_train_under_expert_parallelism_like_one_process(name, ranks, hf_moe_runs):
    """Step 0's loss is the saved model's own, and five AdamW steps under EP (EP_PLANS: ZeRO 0-3, and pp 2 under
    1F1B with EP inside each stage) are one process's; all-to-all bytes as predicted, and under ZeRO-1 the optimizer
    states all ranks hold together."""
    from executor.train import single_process_losses
    from executor.launch import peak_routed_load, routed_load
    from tests.test_hf_executor import GLOBAL, SEQ, _own_step0_loss
    prof, cfg, strategies, results = hf_moe_runs[name, ranks]
    one = Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=GLOBAL,
                   stages=(tuple(u.name for u in prof.units),), precision="fp32")
    reference = single_process_losses(one, cfg)
    assert len({round(x, 6) for x in reference}) == 5
    own = _own_step0_loss(cfg)
    for s, rank_results in zip(strategies, results):
        losses = [list(r.losses) for r in rank_results if r.losses][0]
        assert losses[0] == pytest.approx(own, rel=1e-5), s.name
        assert losses == pytest.approx(reference, rel=1e-4), s.name
        # the token all-to-alls: dispatch and combine, forward and backward, of every routed pair, plus each
        # forward's counts; the mean over ranks, as every pair leaves one rank once each way
        est = estimate(s, dataclasses.replace(prof, micro_batch_size=1), preset("dgx-h100"))
        measured = sum(r.comm_bytes.get("all_to_all", 0) for r in rank_results) / ranks
        assert measured == pytest.approx(est.comm.ep_bytes_per_rank, rel=1e-9), s.name
        # the routed rows each rank's experts were sent: every token x top-2 once per block (each tp rank of a
        # replica routes the same tokens), spread over the ranks holding that block's experts
        rows: dict[str, int] = {}
        for r in rank_results:
            for block, n in r.expert_rows.items():
                rows[block] = rows.get(block, 0) + n
        assert len(rows) == len(prof.moe_units) and set(rows.values()) == {GLOBAL * SEQ * 2 * s.tp}, s.name
        assert est.ep_load == max(imbalance(prof, u.moe, s.ep) for u in prof.moe_units) >= 1.0
        if s.tp > 1:   # and the attention's tensor-parallel collectives (the MoE blocks run whole: none there),
            # Qwen3's q/k norms' gradient all-reduces among them: as many calls as predicted
            measured_tp = {k: v for k, v in rank_results[0].comm_bytes.items() if k.startswith("tp_")}
            predicted_tp = tp_traffic_per_step(s, prof)
            assert set(measured_tp) == {k for k, (_, v) in predicted_tp.items() if v}, s.name
            assert measured_tp == pytest.approx({k: predicted_tp[k][1] for k in measured_tp}, rel=0.05), s.name
            assert {k: rank_results[0].comm_calls[k] for k in measured_tp} == {
                k: predicted_tp[k][0] for k in measured_tp}, s.name
        if s.zero == 1:   # ZeRO-1's states (either kind): the dense parameters' split over dp, the experts' over
            # dp / ep
            held = sum(r.optimizer_state_bytes for r in rank_results)
            assert held == pytest.approx(sum(m.optimizer_states for m in est.memory_per_rank), rel=1e-9), s.name
    # counted at step 0: the busiest EP rank's load in its worst micro-batch is the estimate's at the routing of the
    # same windows through the same weights (planner profile --init-from --data), dealt into this plan's
    # micro-batches, and each stage's busiest rank holds the activations priced at it (the experts' and the
    # dispatch's, each block at its own worst micro-batch, which another block's may not share: measured 0.6-3.0%
    # under)
    routed = measure_routing(prof, init_from=Path(cfg.init_from), data=Path(cfg.data), windows=GLOBAL)
    _, _, strategies, results = hf_moe_runs["step 0", name, ranks]
    assert len(strategies) == {("mixtral", 2): 1, ("mixtral", 4): 3, ("qwen3_moe", 2): 1, ("qwen3_moe", 4): 3}[
        name, ranks]
    for s, rank_results in zip(strategies, results):
        est = estimate(s, routed, preset("dgx-h100"))
        assert est.ep_peak_load == pytest.approx(peak_routed_load(rank_results), rel=1e-9) and \
            est.ep_peak_load > routed_load(rank_results), s.name
        for pp_rank in range(s.pp):
            stage = [r for r in rank_results if r.pp_rank == pp_rank]
            held = max(r.activation_bytes for r in stage)
            predicted = {est.memory_per_rank[r.rank].activations for r in stage}
            assert len(predicted) == 1 and held == pytest.approx(*predicted, rel=0.05), (
                s.name, pp_rank, [(r.rank, r.activation_bytes) for r in stage], predicted)


def test_moe_models_split_their_attention_over_tp_and_refuse_sequence_parallelism_in_one_line(moe_profiles):
    """The MoE families' tensor-parallel plans split attention (and dense MLPs) only: the MoE blocks are priced and
    run whole on every tp rank, so sequence parallelism (their input would arrive split) is refused."""
    from tests.plans import plan_for
    prof = moe_profiles[True]
    assert prof.tensor_parallel.plan == "zoo-moe" and prof.tensor_parallel.ffn == ZOO["moe-tiny"].config.ffn_dim
    assert prof.unit("blocks.0").tp.split_flops > prof.unit("blocks.1").tp.split_flops > 0
    assert plan_for(_strategy(prof, dp=2, ep=2, tp=2), prof).strategy.tp == 2
    with pytest.raises(ConfigError) as info:
        plan_for(_strategy(prof, dp=2, ep=2, tp=2, sp=True), prof)
    assert str(info.value).endswith(
        "sequence parallelism is not offered for mixture-of-experts models: their MoE blocks run whole on each "
        "tensor-parallel rank")


def test_profile_measures_the_routers_load_on_the_users_tokens_through_the_users_weights(tmp_path):
    """`planner profile --init-from DIR --data FILE` records each MoE unit's load per expert from the file's first
    windows through the saved weights: the counts transformers' own router logits give for the same tokens (top-2
    of each layer's logits), and the plan's rationale prices expert parallelism at that load and says so."""
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from cli import app
    from tests.test_hf_executor import _saved, _tokens
    ref = HF_RUN["mixtral"]
    saved, data = _saved(ref, tmp_path / "w"), _tokens(tmp_path / "t.bin")
    args = ["profile", "-m", ref, "-b", "2", "-s", "16", "--cluster", "none", "--warmup", "0", "--repeats", "1"]
    res = CliRunner().invoke(app, [*args, "--init-from", saved, "--data", data, "--routing-windows", "24",
                                   "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "routing: load per expert measured on 24 windows of" in res.output
    prof = ProfileFile.load(tmp_path / "p.json").model
    model = AutoModelForCausalLM.from_pretrained(saved)
    tokens = torch.from_numpy(np.fromfile(data, dtype=np.uint16).astype(np.int64))
    windows = torch.stack([tokens[i * 17:i * 17 + 16] for i in range(24)])
    with torch.no_grad():
        logits = model(windows, output_router_logits=True).router_logits
    want = [tuple(torch.bincount(layer.topk(2, dim=-1).indices.reshape(-1), minlength=4).tolist()) for layer in logits]
    assert [u.moe.expert_load for u in prof.moe_units] == want
    assert prof.routing == f"24 windows of {data} through the weights in {saved}"
    plan = CliRunner().invoke(app, ["plan", str(tmp_path / "p.json"), "--cluster", "dgx-h100", "--nodes", "1",
                                    "-B", "16", "--ep", "2", "--json", "-o", "-"])
    assert plan.exit_code == 0, plan.output
    load = max(imbalance(prof, u.moe, 2) for u in prof.moe_units)
    planned = json.loads(plan.output)
    winner = Strategy.from_dict(planned["strategy"])
    peak = estimate(winner, prof, preset("dgx-h100")).ep_peak_load
    assert f"the busiest EP rank routes x{load:.2f} the mean, x{peak:.2f} in its worst micro-batch (its activations " \
        f"are priced there), measured on 24 windows of" in json.dumps(planned["rationale"])
    # the load per window: transformers' counts window by window, which sum to the whole's
    assert [u.moe.window_load for u in prof.moe_units] == [
        tuple(tuple(torch.bincount(layer.topk(2, dim=-1).indices[w * 16:(w + 1) * 16].reshape(-1),
                                   minlength=4).tolist()) for w in range(24)) for layer in logits]
    # the two options go together, and only with MoE blocks: one line each, exit 2
    alone = CliRunner().invoke(app, [*args, "--data", data, "-o", "-"])
    assert alone.exit_code == 2 and alone.output.strip().splitlines() == [
        "error: --init-from and --data go together in planner profile: the router's load per expert means something "
        "only with trained weights on real tokens; give both, or neither"]
    dense = CliRunner().invoke(app, ["profile", "-m", "llama-tiny", "-b", "2", "-s", "16", "--cluster", "none",
                                     "--meta", "--init-from", saved, "--data", data, "-o", "-"])
    assert dense.exit_code == 2 and dense.output.strip().splitlines()[-1] == (
        "error: --data measures the router's load per expert, and llama-tiny has no mixture-of-experts blocks; "
        "drop --init-from and --data")


def test_per_head_norms_are_planned_with_their_gradient_all_reduce_and_mla_is_refused():
    """MLA (the zoo's DeepSeek-V3) would need its low-rank projections' gradients summed over the tp ranks: its TP
    shape is a one-line refusal, so the planner keeps it at tp = 1. Per-head q/k norms (Qwen3-MoE, zoo and
    transformers') are planned: replicated, run on the rank's heads, their gradients all-reduced over tp in every
    micro-batch's backward (measured against this in test_hf_moe_models_train_under_expert_parallelism_...)."""
    from cost_models.cost.comm import norm_grad_traffic
    from cost_models.models.tp_shape import custom_shape, tp_shape
    from cost_models.records.tensor_parallel import PLANS
    shape = tp_shape(resolve("deepseek-v3").build(device="meta", dtype=torch.float32))
    assert shape.refusal.startswith("multi-head latent attention") and shape.tp_refusal(2) == shape.refusal
    assert tp_shape(resolve("mixtral-8x7b").build(device="meta", dtype=torch.float32)).plan == "zoo-moe"
    for ref, plan in (("qwen3-30b-a3b", "zoo-moe"), (f"hf:qwen3_moe?{HF_MOE['qwen3_moe'][0]}", "hf-moe")):
        prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=16, meta=ref.startswith("qwen3"),
                             dtype="fp32", warmup=0, repeats=1)
        assert prof.tensor_parallel.plan == plan and prof.tensor_parallel.tp_refusal(2) is None, ref
        layer = next(u for u in prof.units if u.moe is not None)
        head_dim = 128 if ref == "qwen3-30b-a3b" else 16
        assert (layer.tp.head_norm_tensors, layer.tp.head_norm_params) == (2, 2 * head_dim), ref
        # one all-reduce per norm weight, SP or not (the block's other norms only under SP)
        assert norm_grad_traffic(layer.tp, 4, sp=False) == (2, 2 * head_dim * 4, 0, 0, 0, 0)
    # the same rules in a custom --tp-plan pass its checks: a head norm may sit in a region (attention)
    qwen = resolve("qwen3-30b-a3b").build(device="meta", dtype=torch.float32)
    attention = tuple(r for r in PLANS["zoo-moe"].rules if r.pattern.split(".")[2:3] == ["attention"])
    assert [r.style for r in attention] == ["head_norm", "head_norm", "region", "colwise", "colwise", "colwise",
                                            "rowwise"]
    assert custom_shape(qwen, attention, "custom: tests").hidden == 2048


def _moe_tiny_cfg(prof):
    from executor.train import TrainConfig
    return TrainConfig(model_source="moe-tiny", seq_len=16, input_kind="tokens", steps=5, warmup=0, seed=3, lr=3e-3,
                       unit_modules=tuple(u.modules for u in prof.units))


def _moe_tiny_like_one_process(strategies: list[Strategy], prof, runs: list) -> None:
    """moe-tiny's `runs` of `strategies` (one launch): five steps are one process's, all-to-all bytes as
    predicted."""
    from executor.train import single_process_losses
    reference = single_process_losses(_strategy(prof, micro_batch_size=8), _moe_tiny_cfg(prof))
    assert len({round(x, 6) for x in reference}) == 5
    for s, results in zip(strategies, runs, strict=True):
        losses = [list(r.losses) for r in results if r.losses][0]
        assert losses == pytest.approx(reference, rel=1e-4), s.name
        measured = sum(r.comm_bytes.get("all_to_all", 0) for r in results) / len(results)
        est = estimate(s, prof, preset("dgx-h100"))   # its micro-batch from the profile's
        assert measured == pytest.approx(est.comm.ep_bytes_per_rank, rel=1e-9), s.name


@pytest.mark.slow
def test_pipeline_stages_shard_experts_over_the_ranks_holding_them_like_one_process(moe_profiles):
    """EP2 x DP4 x PP2 (8 ranks, the smallest world where dp > ep in a pipeline) under ZeRO-3: each stage's experts
    an FSDP2 group of the two ranks holding them, nested in the stage's over dp. In the same launch
    EP2 x TP2 x PP2 under ZeRO-1: EP groups at each tensor-parallel rank, the MoE blocks whole on both."""
    from executor.launch import run_many
    prof = moe_profiles[True]
    halves = (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    common = dict(ep=2, pp=2, microbatches=2, stages=halves)
    strategies = [_strategy(prof, dp=4, zero=3, micro_batch_size=1, **common),
                  _strategy(prof, dp=2, tp=2, zero=1, micro_batch_size=2, **common)]
    _moe_tiny_like_one_process(strategies, prof, run_many(8, strategies, _moe_tiny_cfg(prof)))


@pytest.mark.slow
def test_zero_bubble_schedules_split_the_backward_of_expert_parallel_stages_like_one_process(hf_moe_runs):
    """EP2 x DP2 x PP2 under the split-backward schedules (_zero_bubble; run in hf_moe_runs' 4-rank launch). The
    all-to-alls' gradients run in the input-gradient pass, the experts' weight gradients later."""
    prof, _, strategies, results = hf_moe_runs["moe-tiny", 4]
    _moe_tiny_like_one_process(strategies, prof, results)


def _zero_bubble(prof) -> list[Strategy]:
    """zb-interleaved under ZeRO-1 and ZBV (two chunks per rank) under ZeRO-2, EP2 x DP2 x PP2."""
    halves = (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    quarters = (("embed", "blocks.0"), ("blocks.1",), ("blocks.2",), ("blocks.3", "head"))
    common = dict(dp=2, ep=2, pp=2, microbatches=4, micro_batch_size=1)
    return [_strategy(prof, zero=1, schedule="zb-interleaved", stages=halves, **common),
            _strategy(prof, zero=2, schedule="zbv", v=2, stages=quarters, **common)]


@pytest.fixture(scope="module")
def ep_checkpoint(tmp_path_factory):
    """HF Mixtral (tiny, saved with save_pretrained) on a token file under EP2 x DP2 ZeRO-3, each expert sharded
    by FSDP2 over the two ranks holding it; 3 steps, a checkpoint after step 3 with its full state dumped."""
    from executor.launch import RunConfig, launch
    from executor.testing_hooks import DUMP_STATE_ENV
    from tests.plans import plan_for
    from tests.test_hf_executor import GLOBAL, SEQ, _saved, _tokens
    root = tmp_path_factory.mktemp("ep-ck")
    ref = HF_RUN["mixtral"]
    prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=SEQ, meta=False, dtype="fp32", warmup=0,
                         repeats=1)
    common = dict(init_from=_saved(ref, root / "saved"), data=_tokens(root / "tokens.bin"), seed=3, lr=3e-3)
    plan = plan_for(_ep_strategy(prof, zero=3), prof)
    os.environ[DUMP_STATE_ENV] = str(root)
    try:
        run = launch(plan, RunConfig(steps=3, warmup=0, checkpoint_dir=str(root / "ck"), **common))
    finally:
        del os.environ[DUMP_STATE_ENV]
    assert GLOBAL == 8
    return root, prof, common, run


def _ep_strategy(prof, *, zero: int, ep: int = 2) -> Strategy:
    return Strategy(dp=4, pp=1, zero=zero, schedule="1f1b", microbatches=1, micro_batch_size=2,
                    stages=(tuple(u.name for u in prof.units),), precision="fp32", ep=ep)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_under_another_layout_and_exports_the_models_own(
        ep_checkpoint, tmp_path, monkeypatch):
    """The checkpoint holds every expert once, whole (E rows), whatever ranks held them: it resumes under EP2 x TP2
    ZeRO-1 and in one process without expert parallelism, both continuing the run's losses, and `planner export
    --hf` writes transformers' own layout, which from_pretrained loads with the trained weights."""
    from transformers import AutoModelForCausalLM

    from executor import export as exporting
    from executor.launch import RunConfig, launch
    from executor.testing_hooks import DUMP_STATE_ENV
    from executor.train import TrainConfig, single_process_losses
    from tests.plans import plan_for
    from tests.test_checkpoint import _merged
    from tests.test_hf_executor import SEQ
    from executor.launch import peak_routed_load, routed_load
    root, prof, common, run_a = ep_checkpoint
    ck = root / "ck" / "step-00000003"
    assert run_a.checkpoints == (str(ck),)
    # run.json sets the measured routing load beside the one the plan priced, over the step and in its worst
    # micro-batch
    load, peak = (m for m in run_a.measures if m.unit == "x")
    assert load.predicted == max(imbalance(prof, u.moe, 2) for u in prof.moe_units)
    assert load.measured == routed_load(list(run_a.ranks)) >= 1.0
    assert peak.measured == peak_routed_load(list(run_a.ranks)) >= load.measured
    monkeypatch.setenv(DUMP_STATE_ENV, str(tmp_path))
    # EP2 x TP2 under ZeRO-1: the experts plain on each rank of a tp pair, their states in a ZeroRedundancyOptimizer
    # pair over tensor-parallel stand-ins; it saves again at its last step
    two = dataclasses.replace(_ep_strategy(prof, zero=1), dp=2, tp=2, micro_batch_size=4)
    run_b = launch(plan_for(two, prof), RunConfig(steps=5, warmup=0, resume=str(root / "ck"), data=common["data"],
                                                  checkpoint_dir=str(tmp_path / "ck2")))
    assert run_b.start_step == 3 and run_b.checkpoints == (str(tmp_path / "ck2" / "step-00000005"),)

    at_save, loaded = _merged(root, "saved-step3"), _merged(tmp_path, "loaded")
    assert set(at_save) == set(loaded)
    for key in at_save:
        assert torch.equal(at_save[key], loaded[key]), key
    experts = [k for k in at_save if k.startswith("model.") and ".experts." in k]
    assert experts and all(at_save[k].shape[0] == 4 for k in experts)   # the config's 4 experts, whole
    assert {k for k in at_save if k.startswith("optim.") and k.endswith(".exp_avg")} == {
        f"optim.{k.removeprefix('model.')}.exp_avg" for k in at_save if k.startswith("model.")}

    one = Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=8,
                   stages=(tuple(u.name for u in prof.units),), precision="fp32")
    cfg = TrainConfig(model_source=HF_RUN["mixtral"], seq_len=SEQ, input_kind="tokens", steps=5, warmup=0,
                      seed=3, lr=3e-3, unit_modules=tuple(u.modules for u in prof.units), data=common["data"])
    fresh = single_process_losses(one, dataclasses.replace(cfg, init_from=common["init_from"]))
    resumed = single_process_losses(one, dataclasses.replace(cfg, start_step=3, resume_from=str(ck)))
    assert list(run_a.losses) == pytest.approx(fresh[:3], rel=1e-4)
    assert list(run_b.losses) == pytest.approx(resumed, rel=1e-4)
    assert resumed == pytest.approx(fresh[3:], rel=1e-4)

    result = exporting.export(ck, hf_dir=tmp_path / "hf", output=None, overwrite=False)
    assert result.format == "hf" and result.step == 3
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key, value in exported.items():
        assert torch.equal(value, at_save[f"model.{key}"]), key


def test_pruned_search_keeps_the_optimum_of_an_moe_model_on_a_probed_gpu_cluster():
    """On a GPU cluster with a compute probe the bound prices EP units as the estimate does (a profile's own
    unit times are no bound where EP reshapes the expert products: one pruned the optimum, 0.134 s for 0.128 s,
    when a meta profile ran its experts one product each)."""
    from cost_models.records.cluster import ComputeProbe
    prof = profile_model(resolve("tests.custom_models:qwen3_moe_4_layers"), micro_batch_size=1, seq_len=4096,
                         meta=True, dtype="bf16")
    probe = ComputeProbe(dtype="bf16", matmul_n=4096, ranks=8, threads_per_rank=1, flops_per_rank=5e14,
                         flops_alone=5e14)
    cluster = dataclasses.replace(preset("dgx-h100"), compute=probe)
    req = PlanRequest(global_batch_size=16, gpus=8, precision="bf16-mixed", top_k=1)
    pruned, every = search(prof, cluster, req), search(prof, cluster, dataclasses.replace(req, prune=False))
    assert pruned.feasible[0].estimate.step_time_s == pytest.approx(every.feasible[0].estimate.step_time_s)
    assert {c.strategy.ep for c in every.feasible} >= {1, 2, 4, 8}


def test_expert_groups_that_do_not_tile_nodes_are_priced_and_bad_ep_requests_refused(moe_profiles):
    prof = moe_profiles[True]
    # 12 dp ranks, ep 2: the experts' group is 6 ranks, 4 of them on each of two 8-GPU nodes' stride-2 slots
    est = estimate(_strategy(prof, dp=12, ep=2, zero=0, micro_batch_size=1), prof, preset("dgx-h100", nodes=2))
    assert est.comm.dp_bytes_per_rank > 0 and est.breakdown.ep_comm_s > 0
    for ep, message in ((16, "does not divide the 8 routed experts"), (3, "must be powers of two")):
        with pytest.raises(ConfigError, match=message):
            plan(prof, preset("dgx-h100"), PlanRequest(global_batch_size=16, ep_degrees=(ep,)))
