"""The tensor-parallel plans as data: every rule names real modules of the right kind, the dimensions that decide
which tp a model admits, and the (pp, dp, tp) mesh's rank arithmetic."""
import fnmatch

import pytest
import torch
from torch import nn

from cost_models.models.source import resolve
from cost_models.models.tp_shape import tp_shape
from cost_models.records.errors import ConfigError
from cost_models.records.strategy import Strategy
from cost_models.records.tensor_parallel import LINEAR_KINDS, PLANS, STYLE_KINDS, rules_for, style_of, vocab_divides

HF_LLAMA = ("hf:{kind}?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
            "&intermediate_size=128&vocab_size=256&max_position_embeddings=64")
HF_GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=128&n_positions=64&bos_token_id=0&eos_token_id=0"


def _meta(ref: str) -> nn.Module:
    return resolve(ref).build(device="meta", dtype=torch.float32)


def _models():
    yield "gpt-tiny", "zoo-gpt"
    yield "llama-tiny", "zoo-llama"
    if pytest.importorskip("transformers"):
        for kind in ("llama", "mistral", "qwen2"):
            yield HF_LLAMA.format(kind=kind), "hf-llama"
        yield HF_GPT2, "hf-gpt2"


@pytest.mark.parametrize("ref, plan", list(_models()))
def test_every_rule_names_modules_of_its_kind(ref, plan):
    model = _meta(ref)
    shape = tp_shape(model)
    assert shape.plan == plan
    names = dict(model.named_modules())
    for rule in PLANS[plan].rules:
        matched = [n for n in names if fnmatch.fnmatchcase(n, rule.pattern)]
        assert matched, f"{rule.pattern} matches no module of {ref}"
        # the module type each style splits (nn.Linear, transformers' Conv1D, nn.Embedding; None: any module)
        kinds = STYLE_KINDS[rule.style]
        assert kinds is None or all(type(names[n]).__name__ in kinds for n in matched), rule
        # norms: torch's or a model's own (LlamaRMSNorm)
        assert rule.style != "norm" or all(type(names[n]).__name__.endswith("Norm") for n in matched), rule
    # every linear inside a block is split one way or the other: a block left whole would compute twice
    block_linears = [n for n, m in names.items() if type(m).__name__ in LINEAR_KINDS
                     and any(f".{b}." in f".{n}" for b in ("blocks", "layers", "h"))]
    assert block_linears and all(style_of(n, PLANS[plan].rules).style in ("colwise", "rowwise") for n in block_linears)
    # the fused q, k, v projections split per part
    assert all(style_of(n, PLANS[plan].rules).parts == 3 for n in names if n.endswith("c_attn"))


def test_dimensions_decide_the_tp_a_model_admits():
    gpt, llama = tp_shape(_meta("gpt-tiny")), tp_shape(_meta("llama-tiny"))
    assert (gpt.heads, gpt.kv_heads, gpt.ffn, gpt.hidden, gpt.vocab_split) == (4, 4, 256, 64, True)
    assert (llama.heads, llama.kv_heads, llama.ffn, llama.hidden, llama.vocab_split) == (4, 2, 176, 64, True)
    assert gpt.tp_refusal(4) is None and gpt.tp_refusal(8) == "tp=8 does not divide the 4 attention heads"
    assert llama.tp_refusal(2) is None and llama.tp_refusal(4) == "tp=4 does not divide the 2 key/value heads"
    assert llama.tp_refusal(2, sp=True, seq_len=31) == "sequence parallelism needs tp=2 to divide the sequence length 31"
    # the zoo GPT splits its tied vocabulary as one weight; 512 does not divide 3 ways: both stay whole
    assert vocab_divides(gpt, 2) and vocab_divides(llama, 2) and not vocab_divides(gpt, 3)
    assert {r.style for r in rules_for(PLANS["zoo-gpt"], vocab_split=False)}.isdisjoint({"embedding", "head"})
    llama_rules = rules_for(PLANS["zoo-llama"], vocab_split=False)
    assert style_of("embed.tok_embeddings", llama_rules).style == "sp_entry"
    assert style_of("head.output", llama_rules).style == "region"


def test_models_without_a_plan_say_why():
    shape = tp_shape(_meta("mlp-deep"))
    assert shape.refusal == ("no tensor-parallel plan for DeepMLP (the zoo's Llama, GPT and MoETransformer and "
                             "transformers' llama, mistral, qwen2, mixtral, qwen3_moe and gpt2 models have one; planner "
                             "profile --tp-plan module:function gives one)")
    assert shape.tp_refusal(2) == shape.refusal and shape.tp_refusal(1) is None


def test_sequence_parallelism_of_transformers_models():
    """The Llama family enters the sequence split at the first decoder layer's input (after the model has made its
    rotary tables and mask for the whole sequence): SP is offered at pp = 1 and refused in one line with pipeline
    stages, which recompute them from their input. GPT-2 adds position embeddings there: refused."""
    pytest.importorskip("transformers")
    llama, gpt2 = tp_shape(_meta(HF_LLAMA.format(kind="llama"))), tp_shape(_meta(HF_GPT2))
    assert llama.tp_refusal(2, sp=True, seq_len=64) is None and PLANS["hf-llama"].sp == ""
    why = llama.tp_refusal(2, sp=True, seq_len=64, pp=2)
    assert why.startswith("sequence parallelism is not offered for transformers' Llama-family models with pipeline")
    assert "\n" not in why and llama.tp_refusal(2, pp=2) is None
    assert style_of("model.layers.0", PLANS["hf-llama"].rules).style == "sp_input"
    assert style_of("model.layers.1", PLANS["hf-llama"].rules) is None
    # a tied vocabulary leaves the embedding without a rule (not an sp_entry: the split starts at layer 0)
    tied = rules_for(PLANS["hf-llama"], vocab_split=False)
    assert style_of("model.embed_tokens", tied) is None and style_of("lm_head", tied).style == "region"
    assert gpt2.tp_refusal(2) is None
    assert gpt2.tp_refusal(2, sp=True, seq_len=64).startswith("sequence parallelism is not offered for transformers'")


def test_hf_gpt2_splits_its_conv1d_projections_and_keeps_the_tied_vocabulary_whole():
    pytest.importorskip("transformers")
    from cost_models.profiling.model_profiler import profile_model
    shape = tp_shape(_meta(HF_GPT2))
    assert (shape.plan, shape.heads, shape.kv_heads, shape.ffn, shape.hidden, shape.vocab_split) == \
        ("hf-gpt2", 4, 4, 256, 64, False)
    assert tp_shape(_meta(HF_GPT2 + "&n_inner=96")).ffn == 96
    assert shape.tp_refusal(4) is None and shape.tp_refusal(8) == "tp=8 does not divide the 4 attention heads"
    # the profiler's per-unit attribution finds the split Conv1D parameters (named like nn.Linear's): in each block
    # ln_1 (w, b), c_attn (w, b), attn.c_proj (w, b: whole, added after the reduction), ln_2, c_fc, mlp.c_proj
    prof = profile_model(resolve(HF_GPT2), micro_batch_size=1, seq_len=16, meta=True)
    block = prof.unit("transformer.h.0")
    assert block.tp.param_split == (0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0)
    assert block.tp.split_params == (64 * 192 + 192) + 64 * 64 + (64 * 256 + 256) + 256 * 64
    assert block.tp.row_calls == 2 and block.tp.region_calls == 2
    # the tied head and embedding stay whole: nothing there splits on the vocabulary
    assert all(u.tp.vocab_params == 0 and not any(u.tp.param_split) for u in (prof.unit("embed"), prof.unit("head")))


def _strategy(**kw) -> Strategy:
    base = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=1, stages=(("u0", "u1"),))
    return Strategy(**{**base, **kw})


def test_mesh_puts_tp_innermost():
    s = _strategy(dp=2, tp=2, pp=2, stages=(("u0",), ("u1",)), microbatches=4)
    assert s.world_size == 8
    assert [s.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                               (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert s.stage_ranks(1) == (4, 5, 6, 7)
    assert s.family == "hybrid+tp" and _strategy(tp=4).family == "tensor" and _strategy(dp=2, tp=2).family == "zero+tp"
    assert s.name == "PP2 1f1b x TP2 x DP2 ZeRO-0, 4x1"
    assert _strategy(dp=2, zero=3, tp=2, sp=True).name == "TP2+SP x ZeRO-3 dp=2, 2x1"
    assert _strategy(tp=2, selective=True).summary == ("2-way tensor parallel, 2 micro-batch(es) of 1, selective "
                                                       "recompute (attention core)")


@pytest.mark.parametrize("kw, message", [
    (dict(tp=3), "--tp must be a power of two, got 3"),
    (dict(sp=True), "--sp splits the sequence over the tensor-parallel group; it needs --tp 2 or more"),
    (dict(tp=0), "--tp must be >= 1, got 0"),
])
def test_bad_tensor_parallel_settings_are_one_line_errors(kw, message):
    with pytest.raises(ConfigError) as err:
        _strategy(**kw)   # a strategy checks its own shape when it is made: nothing wrong is ever passed on
    assert str(err.value) == message


@pytest.mark.parametrize("kw, message", [
    (dict(dp=1, zero=2), "ZeRO-2 shards over data parallel ranks; with --dp 1 use --zero 0"),
    (dict(microbatches=0), "--microbatches must be >= 1, got 0"),
    (dict(pp=2), "1 stages given for pp=2 x v=1 = 2"),
    (dict(recompute=(True, False)), "recompute has 2 entries for 1 stages"),
    (dict(schedule="no-such"), None),
])
def test_a_strategy_refuses_a_bad_shape_when_it_is_made(kw, message):
    with pytest.raises(ConfigError) as err:
        _strategy(**kw)
    assert message is None or str(err.value) == message
    assert "\n" not in str(err.value)


def test_rank_at_inverts_coords_on_the_pp_dp_tp_mesh():
    s = _strategy(dp=2, tp=2, pp=2, stages=(("u0",), ("u1",)))
    assert [s.rank_at(*s.coords(r)) for r in range(s.world_size)] == list(range(8))
    assert s.coords(5) == (1, 0, 1) and s.rank_at(1, 1, 0) == 6 and s.ranks_per_stage == 4


def test_old_plans_without_tp_load_as_tp1():
    d = _strategy(dp=2).to_dict()
    for key in ("tp", "sp", "selective"):
        d.pop(key)
    s = Strategy.from_dict(d)
    assert (s.tp, s.sp, s.selective, s.world_size) == (1, False, False, 2)
