"""Tensor (+ sequence) parallelism on a rank's modules, from the plan data of cost_models.records.tensor_parallel.

torchtitan's order (models/llama3/infra/parallelize.py: apply_tp, then activation checkpointing, then FSDP2) is
kept by executor.runtime; this module does the first step and the selective recompute of the second. Each plan
style becomes one of torch's ParallelStyles (torch.distributed.tensor.parallel), with the layouts torchtitan's
apply_tp gives them: Megatron-LM's column / row splits (Shoeybi et al. 2019, section 3) and, under sequence
parallelism, Shard(1) activations between the split regions (Korthikanti et al. 2022, section 4.2.2):

    style      no SP                                          SP
    colwise    ColwiseParallel (parts=3: strided, local out)  the same (its input arrives gathered)
    rowwise    RowwiseParallel, output Replicate (all-reduce) output Shard(1) (reduce-scatter)
    embedding  RowwiseParallel, input Replicate               output Shard(1) (Replicate in a plan with sp_input)
    head       ColwiseParallel, output Replicate (gathered)   input Shard(1)
               (loss parallel: output Shard(-1), a DTensor; the cross-entropy under loss_context)
    norm       replicated (plain parameters)                  SequenceParallel
    head_norm  SequenceParallel over the heads (dim 2)           the same
    region     its input one Replicate DTensor                its input Shard(1) -> Replicate (all-gather)
    sp_entry   nothing                                        PrepareModuleOutput Replicate -> Shard(1) (a slice)
    sp_input   nothing                                        PrepareModuleInput Replicate -> Shard(1) (a slice)

colwise and rowwise also split transformers' Conv1D (GPT-2), whose weight is nn.Linear's transposed (_split_linear).
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from cost_models.models.tp_shape import custom_shape, tp_shape
from cost_models.records.errors import ConfigError
from cost_models.records.tensor_parallel import (CUSTOM, SPLIT_STYLES, TPRule, TPShape, enters_late, rules_for,
                                                 style_of, vocab_divides)
from cost_models.torch_compat.torch_private import TorchDispatchMode, storage_id, strided_shard, tree_leaves
from executor import sp_shard
from executor.activations import checkpointed

# The last name part of the modules holding the attention core (zoo Llama, zoo GPT, transformers' Llama family):
# what selective recompute checkpoints.
ATTENTION_NAMES = ("attention", "attn", "self_attn")


def model_shape(model: nn.Module, rules: tuple[TPRule, ...] = ()) -> TPShape:
    """The model's TPShape: under `rules` (a custom plan recorded in the profile: TPShape.rules, checked against
    this model again) or its family's built-in plan."""
    return custom_shape(model, rules, f"{CUSTOM}recorded rules") if rules else tp_shape(model)


def check_tp(meta_model: nn.Module, tp: int, *, sp: bool, seq_len: int, rules: tuple[TPRule, ...] = (),
             pp: int = 1) -> None:
    """One-line ConfigError when this model cannot be split `tp` ways (with SP over `seq_len` tokens, in `pp`
    pipeline stages)."""
    if tp == 1:
        return
    shape = model_shape(meta_model, rules)
    why = shape.tp_refusal(tp, sp=sp, seq_len=seq_len, pp=pp)
    if why and sp and not shape.tp_refusal(tp):
        raise ConfigError(f"tp={tp}: {why}; drop --sp")
    if why:
        raise ConfigError(f"tp={tp}: {why}; plan with --tp 1" if "tp=" not in why else f"{why}; plan another --tp")


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's projections): a linear whose weight is stored (in, out), nn.Linear's transposed."""
    if type(module).__name__ != "Conv1D":
        return False
    weight = getattr(module, "weight", None)   # not module.weight: nn.Module's stubs type that Tensor | Module
    return weight is not None and weight.dim() == 2


def _linear_placements(module: nn.Module, style: str, parts: int) -> dict:
    """Each parameter's placement over the tp mesh: colwise splits the output features (nn.Linear's weight dim 0,
    Conv1D's dim 1, and the bias), each of `parts` fused parts on its own (_StridedShard); rowwise splits the input
    features and keeps the bias whole (added once, after the reduction: Shoeybi et al. 2019, section 3)."""
    from torch.distributed.tensor import Replicate, Shard

    def split(dim: int):
        return strided_shard(dim, parts) if parts > 1 else Shard(dim)
    conv = _is_conv1d(module)
    if style == "colwise":
        return {"weight": split(1 if conv else 0), "bias": split(0)}
    return {"weight": Shard(0 if conv else 1), "bias": Replicate()}


def _split_linear(style: str, parts: int = 1, **layouts):
    """torch's ColwiseParallel / RowwiseParallel (`layouts`: their input/output layouts) for nn.Linear and for
    transformers' Conv1D, whose weight torch's styles would split on the wrong dimension (they take nn.Linear and
    nn.Embedding only). `parts` > 1: a fused projection (GPT's c_attn holds q, k and v), each part split on its own,
    so the rank's output columns are its heads of q, then of k, then of v, and the model's chunk(3) / split of the
    local output gives its q, k and v; that output stays local (a redistribute to Shard(-1) would move data to make
    the columns contiguous, which nothing needs)."""
    from functools import partial

    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def local_output(mod, outputs, device_mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    # the base class is chosen at run time, which mypy cannot check
    class SplitLinear(ColwiseParallel if style == "colwise" else RowwiseParallel):  # type: ignore[misc]
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
                raise ValueError(f"{style} splits nn.Linear or Conv1D modules, not {type(module).__name__}")
            if style == "rowwise":
                self.desired_input_layouts = (Shard(-1),)
            out = (local_output if parts > 1 else
                   partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
            return distribute_module(module, device_mesh, self._partition,
                                     partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                     out)

        def _partition(self, name, module, device_mesh):
            placements = _linear_placements(module, style, parts)
            for pname, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param, device_mesh, [placements[pname]], src_data_rank=self.src_data_rank)
                module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

    return SplitLinear(**layouts)


def _region_input(*, sp: bool, local: bool):
    """The region style: its input made one DTensor for the whole region, replicated (all-gathered from the sequence
    shards under SP; `local`: handed on as a plain tensor, for a region without split linears). Without SP, one
    DTensor for all the region's split linears (not one per linear) sums their partial input gradients first, so
    backward all-reduces once per region, as Megatron-LM's f operator does (Shoeybi et al. 2019, figure 3). The
    input is the first positional argument, else `hidden_states` or the first tensor keyword (transformers'
    attention is called with keywords only), which PrepareModuleInput's fixed layouts cannot follow."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def prepared(x, mesh):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(1) if sp else Replicate(),), run_check=False)
        # under SP saving shards (sp_shard) it arrives gathered: a redistribute to where it is would all-reduce
        # its gradient in backward (DTensor sends a gradient back to its input's placement), not reduce-scatter it
        x = x.redistribute(mesh, (Replicate(),)) if sp and x.placements != (Replicate(),) else x
        return x.to_local() if local else x

    class RegionInput(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def hook(mod, args, kwargs):
                return sp_shard.with_input(args, kwargs, lambda x: prepared(x, device_mesh))
            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module
    return RegionInput()


def torch_style(rule: TPRule, *, sp: bool, holds_split: bool, loss_parallel: bool = False, late_entry: bool = False,
                save_shard: bool = False):
    """torch's ParallelStyle for one plan rule (None: the module stays as it is). `holds_split`: the module has
    split submodules (a region feeding them takes a DTensor; a replicated region such as a tied head a tensor).
    `loss_parallel`: the vocabulary-split head's logits stay split (a DTensor, Shard(-1)), for a cross-entropy
    taken under loss_context (no all-gather of the logits). `late_entry`: the plan enters the sequence split at an
    sp_input, so the embedding's output stays whole under SP. `save_shard`: under SP the head's input arrives
    gathered (executor.sp_shard), so its style takes it as it is."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)
    seq = Shard(1)
    head_in = seq if sp and not save_shard else Replicate()
    if rule.style == "colwise":
        return _split_linear("colwise", rule.parts)
    if rule.style == "rowwise":
        return _split_linear("rowwise", output_layouts=seq if sp else Replicate())
    if rule.style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp and not late_entry else Replicate())
    if rule.style == "head" and loss_parallel:
        return ColwiseParallel(input_layouts=head_in, output_layouts=Shard(-1), use_local_output=False)
    if rule.style == "head":
        # The logits are gathered, so every tp rank computes the whole loss (counted once per replica by the
        # training loop): a user's loss function takes a plain tensor.
        return ColwiseParallel(input_layouts=head_in, output_layouts=Replicate())
    if rule.style == "region" and (sp or holds_split):
        return _region_input(sp=sp, local=not holds_split)
    if rule.style == "head_norm":
        # its input (batch, seq, heads, head_dim) holds the rank's heads, the column-split projection's local
        # output: taken as Shard(2) of the whole, its replicated weight's gradient is a partial sum, all-reduced
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sp:
        return None
    if rule.style == "norm":
        return SequenceParallel()
    if rule.style == "sp_entry":
        return PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
    if rule.style == "sp_input":
        # the layer's hidden states, its first positional argument (transformers 5's LlamaModel passes them so;
        # the rotary tables and the mask come as keywords, whole)
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True)
    raise ValueError(f"unknown tensor-parallel style {rule.style!r}")


def parallelize(model: nn.Module, held: list[nn.Module], tp_mesh, *, sp: bool, rules: tuple[TPRule, ...] = (),
                loss_parallel: bool = False, save_shard: bool = False) -> bool:
    """Split the modules this rank holds (`held`: the model, or its pipeline stages) over `tp_mesh` as the model's
    plan says (`rules`: a custom plan's, recorded in the profile); module names are the full model's, so every
    pipeline rank splits its stages as one process would. `loss_parallel`: the loss is the built-in cross-entropy,
    so a vocabulary-split head may keep its logits split. Returns whether it does on this rank (then forward and
    backward run under loss_context). `save_shard` (with `sp`): the gathered inputs of regions with split linears
    and of a vocabulary-split head are saved as their sequence shard (executor.sp_shard)."""
    from torch.distributed.tensor.parallel import parallelize_module
    tp = tp_mesh.size()
    shape = model_shape(model, rules)
    if shape.refusal:
        raise ConfigError(f"tp={tp}: {shape.refusal}; plan with --tp 1")
    rules = rules_for(shape.tp_plan, vocab_split=vocab_divides(shape, tp))
    if sp and shape.tp_plan.sp_pipelines and not any(m is model for m in held):
        raise ConfigError(f"tp={tp} with sequence parallelism: {shape.tp_plan.sp_pipelines}; drop --sp or use --pp 1")
    late = enters_late(rules)
    held_ids = {id(sub) for m in held for sub in m.modules()}
    named = [(n, m) for n, m in model.named_modules() if id(m) in held_ids]
    split = {n for n, _ in named if (r := style_of(n, rules)) is not None and r.style in SPLIT_STYLES}
    plan, gathered = {}, []
    for name, module in named:
        rule = style_of(name, rules) if name else None
        if rule is None:
            continue
        holds_split = any(s.startswith(name + ".") for s in split)
        style = torch_style(rule, sp=sp, holds_split=holds_split, loss_parallel=loss_parallel, late_entry=late,
                            save_shard=save_shard)
        if style is not None:
            plan[name] = style
        if sp and save_shard and ((rule.style == "region" and holds_split) or rule.style == "head"):
            gathered.append(module)
    if plan:
        ties = _tied_slots(named)
        # every rank built the same full parameters (one seed, or one draw per module), so each takes its own slice
        # (src_data_rank=None) instead of receiving it from tp rank 0
        parallelize_module(model, tp_mesh, plan, src_data_rank=None)
        _tie_again(ties)
    for module in gathered:
        sp_shard.install(module, tp_mesh)
    _localize_widths(named, shape.tp_plan.local_widths, tp)
    for m in held:
        for param in m.parameters():
            if hasattr(param, "device_mesh"):
                param.register_post_accumulate_grad_hook(_grad_placed_as_param)
    return loss_parallel and any(r.style == "head" for n, _ in named if (r := style_of(n, rules)))


def _tied_slots(named: list[tuple[str, nn.Module]]) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) slots of each parameter held in more than one (a GPT's token embedding and head)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in named:
        for attr, param in module.named_parameters(recurse=False):
            slots.setdefault(id(param), []).append((module, attr))
    return [s for s in slots.values() if len(s) > 1]


def _tie_again(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every slot of a tied parameter at the first slot's parameter again: parallelize_module replaces each
    module's parameter with its own DTensor, which would untie them. A vocabulary-split embedding and head hold
    the same layout (Shard(0) of the (vocab, dim) weight, Megatron's tied split), so one DTensor serves both."""
    for slots in ties:
        first = getattr(*slots[0])
        for module, attr in slots[1:]:
            other = getattr(module, attr)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ConfigError(f"a tied parameter would be split two ways ({getattr(first, 'placements', 'whole')} "
                                  f"and {getattr(other, 'placements', 'whole')}); plan with --tp 1")
            setattr(module, attr, first)


def enable_async_tp(parts: list[nn.Module], tp_mesh, device: torch.device) -> None:
    """Async TP (Strategy.tp_label): symmetric memory over the tp group and each unit's modules compiled with
    inductor's micro-pipelining pass, as torchtitan applies it (after TP and activation checkpointing, before
    FSDP2). CUDA only: on CPU ranks a one-line refusal. Unchecked here (no GPU in CI)."""
    if device.type != "cuda":
        raise ConfigError("--async-tp fuses sequence parallelism's collectives with their matmuls through CUDA "
                          "symmetric memory; these ranks are not on GPUs: drop --async-tp")
    from cost_models.torch_compat.torch_private import enable_micro_pipeline_tp
    enable_micro_pipeline_tp(tp_mesh.get_group())
    for part in parts:
        part.compile()


def loss_context(sharded_logits: bool):
    """Where the logits stay split on the vocabulary, torch's loss_parallel (torch.distributed.tensor.parallel):
    the cross-entropy's softmax statistics are all-reduced over tp instead of the logits gathered (torchtitan's
    train_context wraps forward and backward in it, around the pipeline schedule's step too)."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel() if sharded_logits else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_context (a replicated DTensor) as a plain tensor; a plain tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _localize_widths(named: list[tuple[str, nn.Module]], widths: tuple[str, ...], tp: int) -> None:
    """Divide by tp the attributes holding a split projection's full width (TPPlan.local_widths), so the module's
    forward cuts the rank's local output (GPT-2's attention: c_attn's output split at split_size)."""
    for entry in widths:
        pattern, _, attr = entry.rpartition(".")
        for name, module in named:
            if fnmatch.fnmatchcase(name, pattern):
                setattr(module, attr, getattr(module, attr) // tp)


def _grad_placed_as_param(param: nn.Parameter) -> None:
    """A split parameter's gradient in the parameter's own placement. DTensor's embedding backward returns the
    vocabulary-split weight's gradient replicated (measured, torch 2.13): a rank would hold all of it, and the
    manual dp all-reduce and ZeRO-1's local shards would see the wrong slice. Replicate -> Shard is a local slice."""
    grad = param.grad
    # DTensors past the hasattr test; torch.Tensor's stubs (Parameter's too) know no placements or device_mesh
    if hasattr(grad, "placements") and grad.placements != param.placements:  # type: ignore[union-attr, attr-defined]
        param.grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[union-attr, attr-defined]


def _core_checkpointed():
    """A function mode that runs scaled_dot_product_attention under torch.utils.checkpoint: the attention core
    (Korthikanti et al. 2022, section 5: QK^T, softmax, dropout, attention over V) keeps only its inputs q, k and v
    and is recomputed in backward; the kernel's output and softmax statistics are not kept. This is exactly the
    profiler's "core" role (cost_models.profiling.tp_watch: what SDPA saves beyond q, k and v), so the estimate's
    selective term and the run measure the same thing. With a fused kernel there is no s x s matrix to drop (the
    5as/h term is 0), only the output; a math-path or unfused attention drops the scores too. A policy-based
    selective checkpoint of the whole attention module kept more than no checkpointing at all (measured:
    it caches op outputs autograd would not have saved), hence the kernel alone."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode


    class CoreCheckpointed(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
                return checkpointed(func, *args, **kwargs)
            return func(*args, **kwargs)
    return CoreCheckpointed


def selective_recompute(model: nn.Module, held: list[nn.Module], skip: set[int]) -> int:
    """Run the attention modules of the held modules (not inside a fully recomputed one: ids in `skip`) with their
    attention kernel checkpointed (_core_checkpointed). Returns how many modules it wrapped."""
    held_ids = {id(sub) for m in held for sub in m.modules()}
    mode = _core_checkpointed()
    count = 0
    for name, module in model.named_modules():
        if id(module) not in held_ids or id(module) in skip or name.rpartition(".")[2] not in ATTENTION_NAMES:
            continue
        forward = module.forward

        def forward_selective(*args, _forward=forward, **kwargs):
            with mode():
                return _forward(*args, **kwargs)
        module.forward = forward_selective
        count += 1
    return count


def sequence_sharded_io(stage_io: list, tp: int) -> list:
    """Stage example tensors under SP: an activation crossing a stage boundary is the rank's sequence shard
    (b, s/tp, h); the first stage's input (tokens) and the last stage's output (gathered logits) stay whole."""
    def shard(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() < 2:
            return t
        shape = (t.shape[0], t.shape[1] // tp, *t.shape[2:])
        return torch.empty(shape, dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
    last = len(stage_io) - 1
    return [(tuple(shard(t) for t in ins) if sid > 0 else ins, tuple(shard(t) for t in outs) if sid < last else outs)
            for sid, (ins, outs) in enumerate(stage_io)]


def layer_kept_bytes(model: nn.Module, layer: nn.Module, example: torch.Tensor) -> int:
    """Activation bytes one layer keeps for backward on this rank, measured in a real forward of the whole model on
    `example` (collective under tensor parallelism: every tp rank must call it): the layer's input plus every
    storage its forward made that is still alive when the model's forward has returned (held by autograd's saved
    tensors or by a checkpoint's cache), by storage, parameters and the layer's output (the next layer's input)
    left out. Unlike a saved_tensors_hooks count (cost_models.profiling.counting) this sees inside checkpointed
    regions, so full and selective recompute can be compared with Korthikanti et al. 2022, Table 2 (per layer, at t
    ranks: sbh(10 + 24/t + 5as/(ht)), with SP sbh(34/t + 5as/(ht)), with SP and selective recompute 34sbh/t, in 2-byte
    units)."""
    import gc
    made = _Allocations()
    ends: dict[str, torch.Tensor] = {}

    def enter(module, args):
        ends["input"] = _local(args[0])
        made.__enter__()

    def leave(module, args, output):
        made.__exit__(None, None, None)
        ends["output"] = _local(output)
    hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        out = model(example)
        gc.collect()
        skip = {storage_id(_local(p)) for p in model.parameters()} | {storage_id(ends["output"])}
        alive = {ref.cdata: nbytes for ref, nbytes in made.storages if not ref.expired() and ref.cdata not in skip}
        alive[storage_id(ends["input"])] = ends["input"].untyped_storage().nbytes()
        del out
    finally:
        for h in hooks:
            h.remove()
    return sum(alive.values())


class _Allocations(TorchDispatchMode):
    """Weak references to the storage of every tensor the ops run inside make (a DTensor op is left to DTensor,
    so its local ops come through here)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing.reductions import StorageWeakRef
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.storages.append((StorageWeakRef(storage), storage.nbytes()))
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a view of its storage), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
