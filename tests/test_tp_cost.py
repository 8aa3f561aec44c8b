"""The cost model prices tensor (+ sequence) parallelism: what the profiler records of the split, parameters,
TP collective bytes and activations per rank, and tp = 1 unchanged (issue 17, items 1 and 3)."""
import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

from cost_models.cost.comm import TP_OPS
from cost_models.cost.estimate import estimate, tp_bytes_per_step
from cost_models.cost.memory import korthikanti_layer_bytes, tp_saved_bytes
from cost_models.models.gpt import GPT, GPTConfig
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from cost_models.records.errors import ConfigError
from cost_models.records.strategy import Strategy

B, S, H, V, L = 2, 16, 64, 512, 4     # the tiny zoo models' shapes as profiled here (fp32: 4 bytes)
BSH = B * S * H * 4


@functools.lru_cache(maxsize=None)
def _meta(model: str, seq_len: int = S, dtype: str = "fp32"):
    return profile_model(resolve(model), micro_batch_size=B, seq_len=seq_len, dtype=dtype, meta=True)


def _strategy(prof, **kw) -> Strategy:
    names = tuple(u.name for u in prof.units)
    base = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=B, stages=(names,),
                precision="fp32")
    base.update(kw)
    return Strategy(**base)


def _two_stages(prof) -> tuple[tuple[str, ...], ...]:
    names = tuple(u.name for u in prof.units)
    return names[:3], names[3:]


# --- what the profile records -----------------------------------------------------------------------------------

def test_profile_records_the_plan_and_the_split_parameters():
    gpt, llama = _meta("gpt-tiny"), _meta("llama-tiny")
    assert gpt.tensor_parallel.plan == "zoo-gpt" and gpt.tensor_parallel.vocab_split   # tied, split as one
    assert llama.tensor_parallel.plan == "zoo-llama" and llama.tensor_parallel.vocab_split
    # GPT block: c_attn W+b and c_fc W+b split by columns, both c_proj weights by rows (their biases stay whole)
    assert gpt.unit("blocks.0").tp.split_params == 3 * H * H + 3 * H + H * H + 4 * H * H + 4 * H + 4 * H * H
    # the tied token embedding splits on the vocabulary, counted once (in embed); the position embedding stays whole
    assert gpt.unit("embed").tp.split_params == 0 and gpt.unit("embed").tp.vocab_params == V * H
    assert gpt.unit("head").tp.vocab_params == 0 and gpt.unit("head").tp.vocab_flops > 0
    # Llama block (4 heads, 2 kv heads of 16, ffn 176): every linear splits, the norms stay whole
    ffn, kv = 176, 2 * 16
    assert llama.unit("blocks.0").tp.split_params == 2 * H * H + 2 * kv * H + 3 * H * ffn
    assert llama.unit("embed").tp.vocab_params == llama.unit("head").tp.vocab_params == V * H
    assert _meta("mlp-deep").tensor_parallel.refusal and all(u.tp is None for u in _meta("mlp-deep").units)


def test_profile_attributes_every_saved_byte_of_a_block_to_a_role():
    gpt, llama = _meta("gpt-tiny").unit("blocks.0"), _meta("llama-tiny").unit("blocks.0")
    t = gpt.tp
    assert t.saved_split + t.saved_seq + t.saved_col_input + t.saved_core == gpt.saved_bytes
    assert t.saved_col_input == 2 * BSH                    # the inputs of c_attn and c_fc
    assert t.saved_seq == 2 * BSH + 4 * B * S * 4          # two LayerNorm inputs + their mean and rstd
    # SDPA's log-sum-exp: q, k and v are the region's, and its output is kept by c_proj too (the CPU flash kernel's
    # output is laid out so that transpose + reshape is a view), so selective recompute cannot drop it
    assert t.saved_core == B * 4 * S * 4
    assert t.row_calls == t.region_calls == 2 and t.row_bytes == t.region_bytes == 2 * BSH
    assert llama.tp.region_calls == 2 and llama.tp.region_bytes == 2 * BSH   # attention and feed_forward
    head = _meta("llama-tiny").unit("head").tp
    assert head.logit_bytes == B * S * V * 4 and head.head_in_bytes == BSH and head.vocab_flops > 0
    # the loss's log-probabilities after a vocabulary-split head: split too, where the vocabulary splits
    for model in ("gpt-tiny", "llama-tiny"):
        unit = _meta(model).unit("head")
        assert unit.tp.saved_logits == B * S * V * 4
        whole = tp_saved_bytes(unit.saved_bytes, unit.tp, tp=2, sp=False, selective=False)
        assert whole - tp_saved_bytes(unit.saved_bytes, unit.tp, tp=2, sp=False, selective=False,
                                      vocab=True) == B * S * V * 4 / 2


# --- parameters per rank ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_param_bytes_per_rank_are_the_split_arithmetic(model, tp):
    prof = _meta(model)
    total = prof.total_params
    split = sum(u.tp.split_params for u in prof.units)
    vocab = sum(u.tp.vocab_params for u in prof.units)
    assert vocab == (V * H if model == "gpt-tiny" else 2 * V * H)   # the GPT's tied weight counted once
    per_rank = total - (split + vocab) * (1 - 1 / tp)
    est = estimate(_strategy(prof, tp=tp), prof, preset("dgx-h100"))
    assert len(est.memory_per_rank) == tp
    assert all(m.parameters == 4 * per_rank for m in est.memory_per_rank)
    z3 = estimate(_strategy(prof, tp=tp, dp=2, zero=3), prof, preset("dgx-h100"))
    assert z3.memory_per_rank[0].parameters == int(4 * per_rank / 2)   # ZeRO-3 then divides the rank's share
    assert z3.stages[0].params == per_rank


# --- TP collective bytes per step -------------------------------------------------------------------------------

def _hand_count(model: str, sp: bool, m: int, recompute: bool = False) -> dict[str, float]:
    """Collectives per micro-batch in units of b x s x h as executor/tensor_parallel.py places
    torch's styles (comm.py's table), times m micro-batches; forward ones twice under full recompute. Under SP
    each backward also all-reduces the norms' weight gradients (2L + 1 norms: LayerNorm weight and bias, RMSNorm
    weight)."""
    loss = 3 / H   # loss parallelism: 3 all-reduces of one value per token (b x s), once per micro-batch
    r = 2 if recompute else 1
    if model == "gpt-tiny":   # the tied vocabulary split as one; the sequence split entered at blocks.0 (sp_input),
        # so the embedding's output is all-reduced whole and the first block's input gradient all-gathered
        counts = ({"all_reduce": r * (2 * L + 1) + 2 * L + 1 + loss} if not sp else
                  {"all_gather": r * (2 * L + 1) + 2 * L + 1, "reduce_scatter": r * 2 * L + 2 * L + 1,
                   "all_reduce": r + loss})
    else:                     # split embedding and head; one input all-reduce per attention and MLP region
        counts = ({"all_reduce": r * (2 * L + 1) + 2 * L + 1 + loss} if not sp else
                  {"all_gather": r * (2 * L + 1) + 2 * L + 1, "reduce_scatter": r * (2 * L + 1) + 2 * L + 1,
                   "all_reduce": loss})
    out = {f"tp_{op}": m * counts.get(op, 0) * BSH for op in TP_OPS}
    if sp:
        out["tp_all_reduce"] += m * (2 * L + 1) * (2 if model == "gpt-tiny" else 1) * H * 4
    return out


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_tp_bytes_per_step_equal_the_hand_count(model, sp):
    prof = _meta(model)
    s = _strategy(prof, tp=2, sp=sp, microbatches=3)
    assert tp_bytes_per_step(s, prof) == _hand_count(model, sp, 3)
    est = estimate(s, prof, preset("dgx-h100"))
    assert est.comm.tp_collectives == {k.removeprefix("tp_"): v for k, v in _hand_count(model, sp, 3).items()}
    assert est.comm.tp_bytes_per_rank == sum(_hand_count(model, sp, 3).values()) and est.comm.tp_link == "intra-node"
    assert est.breakdown.tp_comm_s > 0
    # bf16 activations halve the buffers; tp = 4 moves the same full buffers
    half = tp_bytes_per_step(dataclasses.replace(s, precision="bf16-mixed"), prof)
    assert half == {k: v / 2 for k, v in _hand_count(model, sp, 3).items()}
    assert tp_bytes_per_step(dataclasses.replace(s, tp=4), prof) == _hand_count(model, sp, 3)


HF_LLAMA = ("hf:llama?num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=512&max_position_embeddings=64")


@pytest.mark.parametrize("sp", [False, True])
def test_hf_llama_enters_sp_at_its_first_layer_and_keeps_the_embedding_whole(sp):
    """transformers' Llama under SP: the vocabulary-split embedding's output is all-reduced whole (the model makes its
    rotary tables and mask from it), the first decoder layer's input is sliced to the sequence shard (its gradient
    all-gathered in backward); inside the layers and at the head as the zoo Llama."""
    pytest.importorskip("transformers")
    prof = _meta(HF_LLAMA)
    embed, first = prof.units[0].tp, prof.units[1].tp
    assert (embed.whole_embed_calls, embed.whole_embed_bytes, embed.embed_calls) == (1, BSH, 0)
    assert (first.input_calls, first.input_bytes) == (1, BSH)
    loss = 3 / H
    counts = ({"all_reduce": 2 * L + 1 + 2 * L + 1 + loss} if not sp else
              {"all_gather": 2 * (2 * L + 1), "reduce_scatter": 4 * L + 1, "all_reduce": 1 + loss})
    want = {f"tp_{op}": 3 * counts.get(op, 0) * BSH for op in TP_OPS}
    if sp:
        want["tp_all_reduce"] += 3 * (2 * L + 1) * H * 4   # the RMSNorm weights' gradients
    assert tp_bytes_per_step(_strategy(prof, tp=2, sp=sp, microbatches=3), prof) == pytest.approx(want)


def test_tp_bytes_follow_the_pipeline_rank_and_full_recompute():
    prof = _meta("gpt-tiny")
    s = _strategy(prof, tp=2, pp=2, stages=_two_stages(prof), microbatches=2, recompute=(True, False))
    first, second = tp_bytes_per_step(s, prof, pp_rank=0), tp_bytes_per_step(s, prof, pp_rank=1)
    # stage 0 holds embed + 2 blocks, recomputed: forward all-reduces (the embedding's and 2 per block) twice;
    # stage 1 the other 2 blocks + head: the head input's gradient and the loss's statistics too
    assert first["tp_all_reduce"] == 2 * (2 * (1 + 2 * 2) + 2 * 2) * BSH
    assert second["tp_all_reduce"] == pytest.approx(2 * (2 * 2 + 2 * 2 + 1 + 3 / H) * BSH)


# --- tp = 1 unchanged -------------------------------------------------------------------------------------------

# Estimates of the code before tensor parallelism was priced (meta profiles: deterministic), dgx-h100 x 2 nodes,
# updated only for changes that are not tensor parallelism's: the data-parallel entries for the ring's per-step
# latency (issue 18: comm.collective_time, NCCL's tuning.cc step latencies) and the recompute entry for the working
# set that no longer counts the recomputed unit's input twice (issue 18: measured by executor.activations), and
# dp4z0's memory for autocast's bf16 weight copies (2 bytes x 241,024 parameters: bf16-mixed on GPUs runs torch's
# mixed precision, memory.autocast_copy_bytes), and the int64 bytes the fp32 profile's units save per micro-batch
# (embed's 256 token ids + 128 position ids, head's 256 target ids) that a bf16 plan no longer halves
# (memory.saved_at): 320 bytes per micro-batch held, 384 on pp2dp2z2's first stage (two in flight of embed's);
# dp16z3's step for InfiniBand at 0.92 of line rate, as NCCL's maintainers measure it (presets.NET_EFFICIENCY);
# pp2rec's and pp2dp2z2's steps for the all-reduce of gpt-tiny's tied embedding across the two pipeline ranks
# (estimate._tied_sync: +24.2 us each), pp2dp2z2's also for its stages' FSDP gathers inside the schedule
# (estimate._stage_gather); all four steps for compute priced by kind of work on GPUs (cost.kernels: gpt-tiny's
# hundreds of kernels at a microsecond's gap each outweigh its FLOPs); dp4z0's step for the compute that NCCL's
# all-reduce slows while it hides (comm.overlapped_exposure).
_BEFORE = {
    ("gpt-tiny", "dp4z0"): (0.00034717936426470974, 1077903810 + 2 * 241_024 + 320),
    ("gpt-tiny", "dp16z3"): (0.0027671419401381603, 1074588354 + 320),
    ("gpt-tiny", "pp2dp2z2"): (0.0005370358211934926, 1075697536 + 384),
    ("gpt-tiny", "pp2rec"): (0.0005801759727369252, 1076075520),
}


def _before_strategies(prof) -> dict[str, Strategy]:
    names = tuple(u.name for u in prof.units)
    half = len(names) // 2
    base = dict(schedule="1f1b", micro_batch_size=2)
    return {
        "dp4z0": Strategy(dp=4, pp=1, zero=0, microbatches=2, stages=(names,), **base),
        "dp16z3": Strategy(dp=16, pp=1, zero=3, microbatches=2, stages=(names,), **base),
        "pp2dp2z2": Strategy(dp=2, pp=2, zero=2, microbatches=4, stages=(names[:half], names[half:]), **base),
        "pp2rec": Strategy(dp=1, pp=2, zero=0, microbatches=4, stages=(names[:half], names[half:]),
                           recompute=(True, False), **base),
    }


def test_tp1_estimates_are_unchanged():
    prof = _meta("gpt-tiny")
    bare = dataclasses.replace(prof, tensor_parallel=None,
                               units=tuple(dataclasses.replace(u, tp=None) for u in prof.units))
    cluster = preset("dgx-h100", nodes=2)
    for name, s in _before_strategies(prof).items():
        est = estimate(s, prof, cluster)
        assert (est.step_time_s, est.peak_memory_bytes) == _BEFORE["gpt-tiny", name]
        assert est.to_dict() == estimate(s, bare, cluster).to_dict()   # the TP fields change nothing at tp = 1
        assert est.comm.tp_collectives == {} and est.comm.tp_link == "none"


# --- mesh, links and memory entries -----------------------------------------------------------------------------

def test_memory_entries_follow_the_mesh_and_dp_groups_span_nodes_by_tp():
    prof = _meta("llama-tiny")
    cluster = preset("dgx-h100", nodes=2)
    s = _strategy(prof, tp=2, dp=2, pp=2, zero=1, stages=_two_stages(prof), microbatches=2)
    est = estimate(s, prof, cluster)
    assert len(est.memory_per_rank) == s.world_size == 8
    for m in est.memory_per_rank:
        assert m.stages == (s.coords(m.rank)[0],)
        assert m == dataclasses.replace(est.memory_per_rank[m.rank ^ 1], rank=m.rank)   # tp peers hold the same
    assert len(estimate(s, prof, cluster, compact=True).memory_per_rank) == 2
    assert estimate(_strategy(prof, tp=2, dp=4), prof, cluster).comm.dp_link == "intra-node"   # 8 ranks: a node
    assert estimate(_strategy(prof, tp=4, dp=4), prof, cluster).comm.dp_link == "inter-node"


# --- activations by role ----------------------------------------------------------------------------------------

def test_activations_per_rank_follow_the_roles():
    prof = _meta("gpt-tiny")
    block = prof.unit("blocks.0")
    t = block.tp
    rest = block.saved_bytes - t.saved_split - t.saved_seq - t.saved_col_input - t.saved_core
    assert rest == 0
    assert tp_saved_bytes(block.saved_bytes, t, tp=2, sp=False, selective=False) == (
        t.saved_col_input + t.saved_seq + (t.saved_split + t.saved_core) / 2)
    assert tp_saved_bytes(block.saved_bytes, t, tp=2, sp=True, selective=True) == (
        t.saved_col_input + (t.saved_seq + t.saved_split) / 2)
    assert tp_saved_bytes(block.saved_bytes, t, tp=1, sp=False, selective=False) == block.saved_bytes

    def act(**kw):
        return estimate(_strategy(prof, microbatches=1, **kw), prof, preset("dgx-h100")).stages[0].activation_bytes
    units = prof.units
    for kw in (dict(tp=2), dict(tp=2, sp=True), dict(tp=2, sp=True, selective=True), dict(tp=4, selective=True)):
        want = sum(tp_saved_bytes(u.saved_bytes, u.tp, tp=kw["tp"], sp=kw.get("sp", False),
                                  selective=kw.get("selective", False), vocab=True) for u in units)
        assert act(**kw) == want
    assert act(tp=2, sp=True, selective=True) < act(tp=2, sp=True) < act(tp=2) < act()
    # selective recompute adds the attention core's forward to the backward
    sel = estimate(_strategy(prof, selective=True), prof, preset("dgx-h100"))
    plain = estimate(_strategy(prof), prof, preset("dgx-h100"))
    assert sel.stages[0].bwd_s > plain.stages[0].bwd_s and sel.stages[0].fwd_s == plain.stages[0].fwd_s


# --- Korthikanti et al. 2022, Table 2 ---------------------------------------------------------------------------

class UnfusedAttention(nn.Module):
    """GPT-2 attention as Korthikanti et al. 2022 count it: unfused QK^T, softmax, dropout over the probabilities,
    attention over V, dropout after the output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.dim, self.head_dim = cfg.dim, cfg.dim // cfg.n_heads
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)
        self.attn_drop, self.resid_drop = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        causal = torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).split(self.dim, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        probs = self.attn_drop(scores.masked_fill(~self.causal[:s, :s], float("-inf")).softmax(-1))
        return self.resid_drop(self.c_proj((probs @ v).transpose(1, 2).reshape(b, s, -1)))


def unfused_gpt() -> nn.Module:
    """A zoo GPT (so the zoo-gpt plan applies) with dropout and the unfused attention of the paper's block."""
    cfg = GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2, n_heads=4, dropout=0.1)
    model = GPT(cfg)
    for block in model.blocks:
        block.attn = UnfusedAttention(cfg)
    model.init_weights()
    return model


def _dropout_mask_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of the mask torch's dropout saves for backward on the meta device (as profiled)."""
    sizes: list[int] = []
    x = torch.ones(8, dtype=dtype, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.element_size()) or t, lambda t: t):
        torch.nn.functional.dropout(x, 0.5, training=True)
    return min(sizes)


def test_measured_saved_bytes_match_korthikanti_table_2():
    s_len, a, h = 32, 4, 64            # head size 16 != s, so the s x s tensors are told apart from q, k, v
    prof = profile_model(resolve("tests.test_tp_cost:unfused_gpt"), micro_batch_size=B, seq_len=s_len,
                         dtype="bf16", meta=True)   # 16-bit activations, as the paper counts
    block = prof.unit("blocks.0")
    sbh = s_len * B * h
    # The paper counts 1-byte dropout masks (Megatron's fused CUDA kernel); off CUDA torch's dropout keeps its mask
    # in the activation dtype (input * noise): (m - 1) more bytes for each of the two sbh masks after the
    # projections (a "10" term part, split by t under SP) and for the as^2b mask over the probabilities (the core)
    extra = _dropout_mask_bytes(torch.bfloat16) - 1

    def paper(t=1, sp=False, selective=False):
        masks = extra * (2 * sbh / (t if sp else 1) + (0 if selective else a * s_len * s_len * B / t))
        return korthikanti_layer_bytes(s=s_len, b=B, h=h, a=a, t=t, sp=sp, selective=selective) + masks
    assert block.saved_bytes == pytest.approx(paper(t=1), rel=0.10)
    assert korthikanti_layer_bytes(s=s_len, b=B, h=h, a=a) == sbh * (34 + 5 * a * s_len / h)

    def ours(**kw):
        return tp_saved_bytes(block.saved_bytes, block.tp, **kw)
    assert ours(tp=2, sp=False, selective=False) == pytest.approx(paper(t=2), rel=0.10)
    assert ours(tp=2, sp=False, selective=True) == pytest.approx(paper(t=2, selective=True), rel=0.10)
    # Under SP torch's DTensor keeps the all-gathered input of each column-split linear (2 x 2sbh bytes at t = 1)
    # where Megatron keeps the sequence shard and gathers it again in backward: sbh(4 - 4/t) more than Table 2.
    gathered = 4 * sbh * (1 - 1 / 2)
    assert ours(tp=2, sp=True, selective=False) == pytest.approx(paper(t=2, sp=True) + gathered, rel=0.10)
    assert ours(tp=2, sp=True, selective=True) == pytest.approx(paper(t=2, sp=True, selective=True) + gathered,
                                                                rel=0.10)


# --- real mode, measured times, validation ----------------------------------------------------------------------

def test_real_profile_records_the_same_split_and_measured_times_divide_the_per_sample_work():
    from cost_models.cost.compute import tp_unit_times
    from cost_models.records.profile import Timing
    from tests.clusters import cpu_cluster
    real = profile_model(resolve("gpt-tiny"), micro_batch_size=B, seq_len=S, dtype="fp32", warmup=0, repeats=1)
    assert [u.tp for u in real.units] == [u.tp for u in _meta("gpt-tiny").units]
    cpu = cpu_cluster(ranks=2, threads=real.threads, cores=2)
    split = real.unit("blocks.1").tp.split_flops / real.unit("blocks.1").fwd_flops
    assert split == 1.0   # every counted FLOP of a block is in its split linears and attention
    # the pricing on fixed timings (measured ones are noise-ordered on a shared machine): the affine fit's fixed
    # part (per call) stays whole and only the per-sample work of the split share is divided by tp
    flat = dataclasses.replace(real, in_model_factor=1.0)
    for t1, t2, expected in ((1.2e-3, 2e-3, 0.4e-3 + 1.6e-3 / 2),    # 0.8 ms a sample, 0.4 ms per call
                             (2.2e-3, 2e-3, 2e-3)):                  # one sample timed above two: flat, none to divide
        timed = lambda t: Timing(median_s=t, min_s=t, max_s=t, repeats=1)   # noqa: E731
        u = dataclasses.replace(real.unit("blocks.1"), fwd_time=timed(t2), fwd_time_one=timed(t1))
        fwd, _, _ = tp_unit_times(u, flat, cpu, micro_batch_size=B, precision="fp32", ranks_running=2, tp=2,
                                  vocab=False)
        assert fwd == pytest.approx(expected)


def test_a_profile_whose_roles_exceed_its_saved_bytes_is_refused():
    from cost_models.records.errors import FileFormatError
    from cost_models.records.validate import validate_model
    prof = _meta("gpt-tiny")
    validate_model(prof, "profile.json")
    u = prof.units[1]
    bad = dataclasses.replace(u, tp=dataclasses.replace(u.tp, saved_split=u.saved_bytes + 1))
    with pytest.raises(FileFormatError, match=r"model\.units\[1\]\.tp\.saved_split"):
        validate_model(dataclasses.replace(prof, units=(prof.units[0], bad, *prof.units[2:])), "profile.json")


# --- SP saving the shard (Megatron-LM's; executor.sp_shard) ---------------------------------------------------------

def test_saving_the_shard_keeps_a_tp_th_of_each_gathered_input_and_gathers_it_again_in_backward():
    from cost_models.cost.comm import tp_unit_traffic
    prof = _meta("gpt-tiny")
    block, head = prof.unit("blocks.0"), prof.unit("head")
    kept = {shard: tp_saved_bytes(block.saved_bytes, block.tp, tp=4, sp=True, selective=False, save_shard=shard)
            for shard in (False, True)}
    assert kept[False] - kept[True] == pytest.approx(2 * BSH * (1 - 1 / 4))   # c_attn's and c_fc's inputs
    # a head that splits on the vocabulary keeps its input's shard; one that does not is a replicated region
    split, whole = (tp_saved_bytes(head.saved_bytes, head.tp, tp=4, sp=True, selective=False, vocab=v,
                                   save_shard=True) for v in (True, False))
    assert whole - tp_saved_bytes(head.saved_bytes, head.tp, tp=4, sp=True, selective=False) == 0
    assert tp_saved_bytes(head.saved_bytes, head.tp, tp=4, sp=True, selective=False, vocab=True) - split == \
        pytest.approx(BSH * (1 - 1 / 4))
    # no SP, nothing to keep: the flag changes nothing
    assert tp_saved_bytes(block.saved_bytes, block.tp, tp=4, sp=False, selective=False, save_shard=True) == \
        tp_saved_bytes(block.saved_bytes, block.tp, tp=4, sp=False, selective=False)
    # backward: one more all-gather of each region's input (2 per block), and of the split head's input
    ag = 2 * TP_OPS.index("all_gather")
    for unit, vocab, extra in ((block, 0, (2, 2 * BSH)), (head, V, (1, BSH)), (head, 0, (0, 0))):
        plain, saving = (tp_unit_traffic(unit.tp, sp=True, vocab=vocab, save_shard=s)[1] for s in (False, True))
        assert (saving[ag] - plain[ag], saving[ag + 1] - plain[ag + 1]) == extra


def test_a_fully_recomputed_stage_does_not_save_shards():
    prof = _meta("gpt-tiny")
    per_step = {(shard, rec): tp_bytes_per_step(_strategy(prof, tp=2, sp=True, sp_save_shard=shard,
                                                          recompute=(rec,)), prof)["tp_all_gather"]
                for shard in (False, True) for rec in (False, True)}
    # 4 blocks x 2 regions + the head, 2 micro-batches: one more gather each without recompute, none with it
    assert per_step[True, False] - per_step[False, False] == 2 * (4 * 2 + 1) * BSH
    assert per_step[True, True] == per_step[False, True]


def test_the_planner_saves_shards_where_sequence_parallelism_alone_does_not_fit():
    from planner.request import PlanRequest
    from planner.search import plan
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=8, seq_len=64, meta=True, dtype="bf16")
    cluster = preset("dgx-h100")
    names = tuple(u.name for u in prof.units)
    peak = {shard: estimate(Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=8,
                                     stages=(names,), tp=4, sp=True, sp_save_shard=shard), prof, cluster
                            ).peak_memory_bytes for shard in (False, True)}
    assert peak[True] < peak[False]
    # a device between the two: TP4+SP fits only by saving shards (or by recomputing)
    small = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device,
                                                                    memory_bytes=(peak[True] + peak[False]) // 2))
    p = plan(prof, small, PlanRequest(gpus=4, global_batch_size=8, tp_degrees=(4,), micro_batch_sizes=(8,)))
    sp_plans = [a.strategy for a in p.alternatives if a.strategy.sp and a.fits] + (
        [p.strategy] if p.strategy.sp else [])
    assert sp_plans and all(s.sp_save_shard or s.recompute for s in sp_plans)
    assert any(s.sp_save_shard and not s.recompute and not s.selective for s in sp_plans)
    # where selective recompute fits too, the faster of the two is kept (here selective: saving shards costs a
    # gather per region, more than recomputing gpt-tiny's attention core)
    sel = estimate(Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=8,
                            stages=(names,), tp=4, sp=True, selective=True), prof, cluster)
    assert peak[True] < sel.peak_memory_bytes < peak[False]
    roomier = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, memory_bytes=(sel.peak_memory_bytes + peak[False]) // 2))
    p = plan(prof, roomier, PlanRequest(gpus=4, global_batch_size=8, tp_degrees=(4,), micro_batch_sizes=(8,)))
    kept = [a.strategy for a in p.alternatives if a.strategy.sp and a.fits] + ([p.strategy] if p.strategy.sp else [])
    assert [(s.selective, s.sp_save_shard) for s in kept] == [(True, False)]
    # a split backward (zero-bubble schedules) would unpack, hence gather, every saved shard twice: refused
    with pytest.raises(ConfigError, match="gather each input twice"):
        Strategy(dp=1, pp=2, zero=0, schedule="zb-interleaved", microbatches=4, micro_batch_size=2, v=2,
                 stages=(names[:2], names[2:3], names[3:5], names[5:]), tp=4, sp=True, sp_save_shard=True)


def test_under_async_tp_a_saved_shard_s_gather_stays_exposed_and_the_pair_is_not_run():
    """The gather of a saved shard runs when backward unpacks it, outside async TP's fused matmuls: saving shards
    adds the same seconds with async TP as without it. The executor does not run the pair (unchecked)."""
    prof = _meta("gpt-tiny", dtype="bf16")
    h100 = preset("dgx-h100")
    step = {(a, sh): estimate(_strategy(prof, tp=2, sp=True, async_tp=a, sp_save_shard=sh, precision="bf16-mixed"),
                              prof, h100).step_time_s for a in (False, True) for sh in (False, True)}
    assert step[True, True] - step[True, False] == pytest.approx(step[False, True] - step[False, False], rel=1e-9)
    assert step[False, True] > step[False, False]
    assert "not run" in _strategy(prof, tp=2, sp=True, async_tp=True, sp_save_shard=True).unsafe_reason()
    assert _strategy(prof, tp=2, sp=True, sp_save_shard=True).unsafe_reason() is None
