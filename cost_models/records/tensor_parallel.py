"""Tensor-parallel plans as data: which modules of a model family split how over the tp group.

The styles are Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM", section 3): in each transformer block the first
linear of attention and of the MLP is split by columns (output features: attention heads, MLP width) and the second
by rows (input features), so a block needs one all-reduce of its output in forward and one of its input gradient in
backward per half. Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2) splits the norms and the residual stream along the sequence instead of
replicating them; the all-reduce becomes an all-gather before the column-split linear and a reduce-scatter after
the row-split one. The plans state what torchtitan's `parallelize_llama` (torchtitan/models/llama3/infra/
parallelize.py, apply_tp) and transformers' `base_model_tp_plan` (models/llama/configuration_llama.py) state, as
module-name patterns; executor/tensor_parallel.py turns them into torch's ParallelStyles, the cost model reads the
same rules (which parameters split, where the collectives are).

Styles:
    colwise   nn.Linear split on its output features (Shard(0) of the weight); `parts` > 1: a fused projection
              (GPT's c_attn holds q, k and v) whose parts are split each (the weight's _StridedShard(0, parts))
    rowwise   nn.Linear split on its input features; its output is all-reduced (reduce-scattered along the
              sequence under SP)
    embedding nn.Embedding split on the vocabulary; its output all-reduced (reduce-scattered under SP)
    head      the LM head: nn.Linear split on the vocabulary, its logits all-gathered
    norm      replicated; under SP it runs on the rank's sequence shard (torch's SequenceParallel)
    head_norm replicated, run on a (batch, seq, heads, head_dim) tensor split over heads (Qwen3's per-head q/k
              norms after the column-split q and k projections): its weight's gradient is a partial sum over the
              rank's heads, all-reduced over tp every backward (transformers' replicated_with_grad_allreduce)
    region    a module that runs the split linears (attention, MLP, a replicated tied head): under SP its input
              is all-gathered along the sequence first
    sp_entry  a module whose output enters the sequence-split region under SP (a local slice, no traffic): used
              where the embedding's output is not the split one (a tied or position-summed embedding)
    sp_input  a module whose (first positional) input enters the sequence-split region under SP (a local slice; the
              gradient all-gathered in backward): transformers' first decoder layer, so that the model's forward
              computes its rotary tables and causal mask from the whole embedding output before it. A plan with an
              sp_input keeps its embedding's output whole under SP (a vocabulary-split one all-reduces it as
              without SP; a whole one does nothing).
  local_width not a module but `<module pattern>.<attribute>`: an int attribute holding the full width at which the
              module's forward cuts a split projection's output (`a, b = self.up(x).split(self.width, -1)`); each
              rank divides it by tp, so the forward cuts its local output (TPPlan.local_widths; custom plans)
"""
from __future__ import annotations

import fnmatch
from typing import Literal, cast, get_args

from cost_models.records.base import Record, record

Style = Literal["colwise", "rowwise", "embedding", "head", "norm", "head_norm", "region", "sp_entry", "sp_input",
                "local_width"]
SPLIT_STYLES = ("colwise", "rowwise", "embedding", "head")   # styles whose parameters are divided by tp


@record
class TPRule(Record):
    pattern: str        # fnmatch pattern over module names (model.named_modules()), "*" matches one or more parts
    style: Style
    parts: int = 1      # colwise only: parts of a fused projection split separately (q, k, v -> 3)


# a module's kind each style applies to (executor/tensor_parallel.py places them): the split ones need a weight
# laid out as nn.Linear's (out, in), nn.Embedding's (vocab, dim) or transformers' Conv1D's (in, out)
LINEAR_KINDS = ("Linear", "Conv1D")


@record
class TPPlan(Record):
    name: str                   # "zoo-llama" | "zoo-gpt" | "hf-llama" | "hf-gpt2"
    rules: tuple[TPRule, ...]
    sp: str = ""                # "" when sequence parallelism is supported, else why not (one line)
    sp_pipelines: str = ""      # "" when SP also composes with pipelines (pp > 1), else why not (one line)
    source: str = ""            # where the plan's split comes from
    # "<module pattern>.<attribute>": an int attribute holding the full width of a split projection, which the
    # module's forward uses to cut the projection's output (GPT-2's attention: c_attn's output .split(split_size));
    # each rank divides it by tp, so the forward cuts its local q, k and v
    local_widths: tuple[str, ...] = ()


@record
class TPShape(Record):
    """What decides which tp a model admits, recorded in the profile: tp must divide every one of these."""

    plan: str                   # a name in PLANS, "custom: <module:function>" (rules below), or "no: <why>"
    heads: int = 0              # 0: not known (a custom plan on a model without a config)
    kv_heads: int = 0
    ffn: int = 0                # MLP width; a custom plan's: the gcd of its split widths
    hidden: int = 0
    vocab: int = 0
    vocab_split: bool = False   # the embedding / head split on the vocabulary (untied, or a zoo GPT)
    # a custom plan's rules (planner profile --tp-plan), recorded so that planning and runs need not import it
    rules: tuple[TPRule, ...] = ()

    @property
    def tp_plan(self) -> "TPPlan":
        """The plan itself: a built-in one, or the recorded custom rules."""
        if self.plan.startswith(CUSTOM):
            return TPPlan(name=self.plan, rules=tuple(r for r in self.rules if r.style != "local_width"),
                          sp=_CUSTOM_NO_SP, source=self.plan.removeprefix(CUSTOM),
                          local_widths=tuple(r.pattern for r in self.rules if r.style == "local_width"))
        return PLANS[self.plan]

    @property
    def refusal(self) -> str | None:
        """Why no tensor parallelism is offered for this model, or None."""
        if not self.plan:
            return "the profile predates tensor-parallel plans; re-run planner profile"
        return self.plan.removeprefix("no:").strip() if self.plan.startswith("no") else None

    def tp_refusal(self, tp: int, *, sp: bool = False, seq_len: int = 0, pp: int = 1) -> str | None:
        """Why this model cannot be split `tp` ways (with SP over `seq_len` tokens, in `pp` pipeline stages), or
        None."""
        if tp == 1:
            return None
        if self.refusal:
            return self.refusal
        ffn = "split widths' gcd" if self.plan.startswith(CUSTOM) else "MLP width"
        for what, n in (("attention heads", self.heads), ("key/value heads", self.kv_heads), (ffn, self.ffn),
                        ("hidden size", self.hidden)):
            if n % tp:
                return f"tp={tp} does not divide the {n} {what}"
        if sp and self.tp_plan.sp:
            return self.tp_plan.sp
        if sp and pp > 1 and self.tp_plan.sp_pipelines:
            return self.tp_plan.sp_pipelines
        if sp and seq_len % tp:
            return f"sequence parallelism needs tp={tp} to divide the sequence length {seq_len}"
        return None


def _block_rules(prefix: str, attn: str, mlp: str, norms: tuple[str, ...], col: tuple[str, ...], row: tuple[str, ...],
                 *, fused: int = 1) -> tuple[TPRule, ...]:
    rules = [TPRule(pattern=f"{prefix}.{n}", style="norm") for n in norms]
    rules += [TPRule(pattern=f"{prefix}.{m}", style="region") for m in (attn, mlp)]
    rules += [TPRule(pattern=f"{prefix}.{c}", style="colwise", parts=fused if c.endswith("c_attn") else 1) for c in col]
    rules += [TPRule(pattern=f"{prefix}.{r}", style="rowwise") for r in row]
    return tuple(rules)


def _head_norms(attention: str) -> tuple[TPRule, ...]:
    return tuple(TPRule(pattern=f"{attention}.{n}", style="head_norm") for n in ("q_norm", "k_norm"))


_TORCHTITAN = "torchtitan models/llama3/infra/parallelize.py apply_tp"
# transformers computes rotary tables (Llama) and the causal mask from the embedding's output before the decoder
# layers: with the sequence split there, they would cover only the rank's shard. The Llama family enters the split at
# the first decoder layer's input instead (sp_input); GPT-2 adds position embeddings whose sum would need the same.
_HF_GPT2_NO_SP = ("sequence parallelism is not offered for transformers' GPT-2: it adds position embeddings to the "
                  "token embedding's output, where the sequence would be split")
# a pipeline stage's input is the sequence shard under SP, and transformers' pipeline stages recompute the rotary
# tables and mask from it (executor's stage adapter): they would cover only the shard
_HF_NO_SP_PIPELINES = ("sequence parallelism is not offered for transformers' Llama-family models with pipeline "
                       "stages (pp > 1): each stage computes its rotary tables and causal mask from its input, the "
                       "rank's sequence shard")
_ZOO_LLAMA = (
    TPRule(pattern="embed.tok_embeddings", style="embedding"),
    *_block_rules("blocks.*", "attention", "feed_forward", ("attention_norm", "ffn_norm"),
                  ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
                  ("attention.wo", "feed_forward.w2")),
    TPRule(pattern="head.norm", style="norm"),
    TPRule(pattern="head.output", style="head"),
)
# the sequence split starts at the first decoder layer's input (sp_input), after LlamaModel.forward has made the
# rotary tables and the mask for the whole sequence (transformers 5: the layers take them as keywords)
_HF_LLAMA = (
    TPRule(pattern="model.embed_tokens", style="embedding"),
    TPRule(pattern="model.layers.0", style="sp_input"),
    *_block_rules("model.layers.*", "self_attn", "mlp", ("input_layernorm", "post_attention_layernorm"),
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj", "mlp.down_proj")),
    TPRule(pattern="model.norm", style="norm"),
    TPRule(pattern="lm_head", style="head"),
)
# a MoE block runs whole on the tp ranks, on their replicated input: under SP it would need its input gathered and
# its output sliced back, not built
_MOE_NO_SP = ("sequence parallelism is not offered for mixture-of-experts models: their MoE blocks run whole on each "
              "tensor-parallel rank")
PLANS: dict[str, TPPlan] = {p.name: p for p in [
    TPPlan(name="zoo-llama", source=_TORCHTITAN, rules=_ZOO_LLAMA),
    # The zoo GPT splits its token embedding and head on the vocabulary (Megatron's VocabParallelEmbedding and
    # the column-split output layer), tied or not: both split the (vocab, dim) weight on dim 0; the token
    # embedding's output is all-reduced before the position embedding is added, so the sequence split starts at
    # the first block's input (sp_input).
    TPPlan(name="zoo-gpt", source="Megatron-LM's GPT split (Shoeybi et al. 2019, section 3)", rules=(
        TPRule(pattern="embed.wte", style="embedding"),
        TPRule(pattern="blocks.0", style="sp_input"),
        *_block_rules("blocks.*", "attn", "mlp", ("ln_1", "ln_2"), ("attn.c_attn", "mlp.c_fc"),
                      ("attn.c_proj", "mlp.c_proj"), fused=3),
        TPRule(pattern="head.ln_f", style="norm"),
        TPRule(pattern="head.lm_head", style="head"),
    )),
    TPPlan(name="hf-llama", source="transformers LlamaConfig.base_model_tp_plan", rules=_HF_LLAMA,
           sp_pipelines=_HF_NO_SP_PIPELINES),
    # Mixture-of-experts decoders: attention (and any dense MLP) split as Megatron-LM splits them; the MoE blocks
    # (router, routed and shared experts) run whole on every tp rank, as cost_models.cost.moe prices them, their
    # experts split over the EP group instead. The Llama plans' rules: an MoE block has none of the dense MLP's
    # linears, so no rule splits it (its region rule applies only around split linears, or under SP, refused here).
    # Per-head q/k norms (Qwen3's) as transformers' Qwen3MoeConfig.base_model_tp_plan has them. Models with MLA
    # are refused (models.families).
    TPPlan(name="zoo-moe", source=f"{_TORCHTITAN}, attention and dense MLP only", sp=_MOE_NO_SP, rules=(
        *_head_norms("blocks.*.attention"), *_ZOO_LLAMA)),
    TPPlan(name="hf-moe", source="transformers LlamaConfig.base_model_tp_plan, attention and dense MLP only",
           sp=_MOE_NO_SP, rules=(*_head_norms("model.layers.*.self_attn"), *_HF_LLAMA)),
    # transformers' GPT-2: Megatron's GPT split on its Conv1D projections (weights stored (in, out)); the head is
    # tied to the token embedding, so both stay whole as in zoo-gpt. Its attention views q, k and v with -1 heads
    # (the local count follows the projection) but cuts c_attn's output at split_size, the full width.
    TPPlan(name="hf-gpt2", source="Megatron-LM's GPT split (Shoeybi et al. 2019, section 3) on transformers' GPT-2",
           rules=(
        *_block_rules("transformer.h.*", "attn", "mlp", ("ln_1", "ln_2"), ("attn.c_attn", "mlp.c_fc"),
                      ("attn.c_proj", "mlp.c_proj"), fused=3),
        TPRule(pattern="transformer.ln_f", style="norm"),
        TPRule(pattern="lm_head", style="region"),
    ), sp=_HF_GPT2_NO_SP, local_widths=("transformer.h.*.attn.split_size",)),
]}


def rules_for(plan: TPPlan, *, vocab_split: bool) -> tuple[TPRule, ...]:
    """The plan's rules for one model: a tied (or indivisible) vocabulary keeps the embedding and head whole (the
    embedding enters the sequence split, an sp_entry, unless the plan enters it later: then it has no rule)."""
    if vocab_split:
        return plan.rules
    demoted: dict[str, Style | None] = {"embedding": None if enters_late(plan.rules) else "sp_entry",
                                        "head": "region"}
    # the filter drops the rules demoted to None, so a rule rebuilt here has a style
    return tuple(TPRule(pattern=r.pattern, style=cast(Style, demoted[r.style])) if r.style in demoted else r
                 for r in plan.rules if demoted.get(r.style, r.style) is not None)


def enters_late(rules: tuple[TPRule, ...]) -> bool:
    """Whether the sequence split starts at a module's input (sp_input): the embedding's output then stays whole."""
    return any(r.style == "sp_input" for r in rules)


def style_of(name: str, rules: tuple[TPRule, ...]) -> TPRule | None:
    """The rule for module `name` (the first matching pattern), or None: the module is replicated."""
    for rule in rules:
        if rule.style != "local_width" and fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    return None


def vocab_divides(shape: TPShape, tp: int) -> bool:
    """Whether the embedding and head split on the vocabulary at this tp (else they stay whole)."""
    return shape.vocab_split and shape.vocab % tp == 0


# --- custom plans: planner profile --tp-plan module:function -----------------------------------------------------

CUSTOM = "custom: "
_CUSTOM_NO_SP = ("sequence parallelism is not offered for custom plans (--tp-plan): where the sequence may be split "
                 "depends on the model's forward")
# the module type each style splits (a custom rule naming another kind is refused); None: any module
STYLE_KINDS: dict[str, tuple[str, ...] | None] = {
    "colwise": LINEAR_KINDS, "rowwise": LINEAR_KINDS, "head": LINEAR_KINDS, "embedding": ("Embedding",),
    "norm": None, "head_norm": None, "region": None, "sp_entry": None, "sp_input": None, "local_width": None}
# what a custom plan may name: sp_input serves the built-in plans' sequence parallelism, which custom plans lack
CUSTOM_STYLES = tuple(s for s in get_args(Style) if s != "sp_input")


