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
    region    a module that runs the split linears (attention, MLP, a replicated tied head): under SP its input
              is all-gathered along the sequence first
    sp_entry  a module whose output enters the sequence-split region under SP (a local slice, no traffic): used
              where the embedding's output is not the split one (a tied or position-summed embedding)
"""
from __future__ import annotations

import fnmatch
from typing import Literal

from cost_models.records import Record, record

Style = Literal["colwise", "rowwise", "embedding", "head", "norm", "region", "sp_entry"]
SPLIT_STYLES = ("colwise", "rowwise", "embedding", "head")   # styles whose parameters are divided by tp


@record
class TPRule(Record):
    pattern: str        # fnmatch pattern over module names (model.named_modules()), "*" matches one or more parts
    style: Style
    parts: int = 1      # colwise only: parts of a fused projection split separately (q, k, v -> 3)


@record
class TPPlan(Record):
    name: str                   # "zoo-llama" | "zoo-gpt" | "hf-llama"
    rules: tuple[TPRule, ...]
    sp: str = ""                # "" when sequence parallelism is supported, else why not (one line)
    source: str = ""            # where the plan's split comes from


@record
class TPShape(Record):
    """What decides which tp a model admits, recorded in the profile: tp must divide every one of these."""

    plan: str                   # a name in PLANS, or "no: <why>"
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0                # MLP width
    hidden: int = 0
    vocab: int = 0
    vocab_split: bool = False   # the embedding / head split on the vocabulary (not tied)

    @property
    def refusal(self) -> str | None:
        """Why no tensor parallelism is offered for this model, or None."""
        if not self.plan:
            return "the profile predates tensor-parallel plans; re-run planner profile"
        return self.plan.removeprefix("no:").strip() if self.plan.startswith("no") else None

    def tp_refusal(self, tp: int, *, sp: bool = False, seq_len: int = 0) -> str | None:
        """Why this model cannot be split `tp` ways (with SP over `seq_len` tokens), or None."""
        if tp == 1:
            return None
        if self.refusal:
            return self.refusal
        for what, n in (("attention heads", self.heads), ("key/value heads", self.kv_heads), ("MLP width", self.ffn),
                        ("hidden size", self.hidden)):
            if n % tp:
                return f"tp={tp} does not divide the {n} {what}"
        if sp and PLANS[self.plan].sp:
            return PLANS[self.plan].sp
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


_TORCHTITAN = "torchtitan models/llama3/infra/parallelize.py apply_tp"
PLANS: dict[str, TPPlan] = {p.name: p for p in [
    TPPlan(name="zoo-llama", source=_TORCHTITAN, rules=(
        TPRule(pattern="embed.tok_embeddings", style="embedding"),
        *_block_rules("blocks.*", "attention", "feed_forward", ("attention_norm", "ffn_norm"),
                      ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
                      ("attention.wo", "feed_forward.w2")),
        TPRule(pattern="head.norm", style="norm"),
        TPRule(pattern="head.output", style="head"),
    )),
    # GPT-2 ties its head to the token embedding: both stay whole (a split embedding and a split head would need
    # two layouts of one tensor); the sum of token and position embeddings enters the split region whole.
    TPPlan(name="zoo-gpt", source="Megatron-LM's GPT split (Shoeybi et al. 2019, section 3), tied embedding replicated",
           rules=(
        TPRule(pattern="embed", style="sp_entry"),
        *_block_rules("blocks.*", "attn", "mlp", ("ln_1", "ln_2"), ("attn.c_attn", "mlp.c_fc"),
                      ("attn.c_proj", "mlp.c_proj"), fused=3),
        TPRule(pattern="head.ln_f", style="norm"),
        TPRule(pattern="head.lm_head", style="region"),
    )),
    # transformers computes rotary tables and the causal mask from the embedding's output before the decoder
    # layers: with the sequence split there, they would cover only the rank's shard.
    TPPlan(name="hf-llama", source="transformers LlamaConfig.base_model_tp_plan", rules=(
        TPRule(pattern="model.embed_tokens", style="embedding"),
        *_block_rules("model.layers.*", "self_attn", "mlp", ("input_layernorm", "post_attention_layernorm"),
                      ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
                      ("self_attn.o_proj", "mlp.down_proj")),
        TPRule(pattern="model.norm", style="norm"),
        TPRule(pattern="lm_head", style="head"),
    ), sp="sequence parallelism is not offered for transformers models: their rotary tables and causal mask are "
          "computed from the embedding's output, before the layers where the sequence would be split"),
]}


def rules_for(plan: TPPlan, *, vocab_split: bool) -> tuple[TPRule, ...]:
    """The plan's rules for one model: a tied (or indivisible) vocabulary keeps the embedding and head whole."""
    if vocab_split:
        return plan.rules
    demoted = {"embedding": "sp_entry", "head": "region"}
    return tuple(TPRule(pattern=r.pattern, style=demoted[r.style]) if r.style in demoted else r for r in plan.rules)


def style_of(name: str, rules: tuple[TPRule, ...]) -> TPRule | None:
    """The rule for module `name` (the first matching pattern), or None: the module is replicated."""
    for rule in rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    return None


def tp_shape(model) -> TPShape:
    """Which plan fits this torch model and its dimensions (`planner profile` records it)."""
    from cost_models.models.gpt import GPT
    from cost_models.models.llama import Llama
    if isinstance(model, Llama):
        c = model.cfg
        return TPShape(plan="zoo-llama", heads=c.n_heads, kv_heads=c.n_kv_heads, ffn=c.ffn_dim, hidden=c.dim,
                       vocab=c.vocab_size, vocab_split=True)
    if isinstance(model, GPT):
        c = model.cfg
        return TPShape(plan="zoo-gpt", heads=c.n_heads, kv_heads=c.n_heads, ffn=4 * c.dim, hidden=c.dim,
                       vocab=c.vocab_size, vocab_split=not c.tie_embeddings)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in ("llama", "mistral", "qwen2"):
        tied = bool(getattr(config, "tie_word_embeddings", False))
        return TPShape(plan="hf-llama", heads=config.num_attention_heads,
                       kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                       ffn=config.intermediate_size, hidden=config.hidden_size, vocab=config.vocab_size,
                       vocab_split=not tied)
    if kind is not None:
        return TPShape(plan=f"no: no tensor-parallel plan for transformers' {kind} models yet (llama, mistral and "
                            "qwen2 have one)")
    return TPShape(plan=f"no: no tensor-parallel plan for {type(model).__name__} (the zoo's GPT and Llama and "
                        "transformers' Llama, Mistral and Qwen2 have one)")


def vocab_divides(shape: TPShape, tp: int) -> bool:
    """Whether the embedding and head split on the vocabulary at this tp (else they stay whole)."""
    return shape.vocab_split and shape.vocab % tp == 0
