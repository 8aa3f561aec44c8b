"""The one module that uses torch's private names (a leading underscore): each is wrapped or re-exported here with
why no public API does the job, so a torch upgrade that moves one breaks this file only. Checked on torch 2.13.0;
tests/test_code_shape.py fails if product code outside this file uses a private name of a library.

Where torch 2.13 has a public equivalent it is used instead (ProcessGroup.set_timeout, below).
"""
from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Iterable, Iterator, NamedTuple

import torch
from torch import nn

# No public path in torch 2.13 (torch.overrides has only TorchFunctionMode): a dispatch mode sees the c10d ops
# that FSDP2, ZeroRedundancyOptimizer and pipelining issue below the Python API.
from torch.utils._python_dispatch import TorchDispatchMode

# torch 2.13 has no public pytree module (torch.utils.pytree does not exist; only _pytree and _cxx_pytree):
# tree_leaves / tree_map walk the nested args, kwargs and outputs of a module call.
from torch.utils._pytree import tree_leaves, tree_map


def strided_shard(dim: int, split_factor: int):
    """DTensor's _StridedShard placement (torch 2.13 has no public name for it): a fused projection's parts, each
    split over the mesh on its own (executor.tensor_parallel's colwise style with parts > 1)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard(dim, split_factor=split_factor)


def tp_strided(t: torch.Tensor) -> bool:
    """Whether a DTensor holds a fused projection's parts split over the "tp" mesh dimension (strided_shard there;
    FSDP2's own strided placements over "dp", which DCP chunks correctly, are not this)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
    return any(isinstance(p, _StridedShard) and names[i] == "tp" for i, p in enumerate(getattr(t, "placements", ()))
               if i < len(names))

__all__ = ["tree_leaves", "tree_map", "TorchDispatchMode", "storage_id", "CPU_FLASH_ATTENTION",
           "CPU_FLASH_ATTENTION_BACKWARD", "persistent_buffers", "default_group_timeout", "set_group_timeout",
           "schedule_stages", "compute_action_strings", "own_parameters", "hf_init_weights", "module_view", "strided_shard",
           "tp_strided", "op_argument", "NO_KERNEL_OPS", "enable_micro_pipeline_tp"]

# The fused CPU flash-attention kernels (aten ops with private names; torch.nn.functional.scaled_dot_product_attention
# picks them on CPU). The profiler runs them on meta and gives FlopCounterMode a formula for them.
CPU_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# aten ops that launch no kernel although their schemas do not mark them views (torch 2.13): _unsafe_view (a
# reshape's result aliasing a fresh copy), detach, alias, lift_fresh, and allocation without initialisation
_aten = torch.ops.aten
NO_KERNEL_OPS = frozenset({_aten._unsafe_view, _aten.detach, _aten.alias, _aten.lift_fresh, _aten.empty,
                           _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided})


def enable_micro_pipeline_tp(group) -> None:
    """torch's async tensor parallelism (torch 2.13): symmetric memory for the tp group
    (torch.distributed._symmetric_memory.enable_symm_mem_for_group) and inductor's pass that fuses all-gather ->
    matmul and matmul -> reduce-scatter into micro-pipelined kernels (torch._inductor.config._micro_pipeline_tp),
    both private; the modules must then run compiled. CUDA only."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    enable_symm_mem_for_group(group.group_name)
    inductor_config._micro_pipeline_tp = True


def op_argument(func, name: str, args: tuple, kwargs: dict, default=None):
    """An aten op's argument by its schema name (positional or keyword), as a dispatch mode receives it: the
    OpOverload's _schema is the only record of the names (torch 2.13)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return kwargs.get(name, args[i] if i < len(args) else default)
    return default


def storage_id(t: torch.Tensor) -> int:
    """The address of the tensor's StorageImpl: shared by all views of one storage, distinct per storage, and valid
    on meta tensors, whose untyped_storage().data_ptr() is 0 for every storage (the public alternative)."""
    return t.untyped_storage()._cdata


def top_saved_tensor_hooks():
    """The (pack, unpack) pair of the innermost torch.autograd.graph.saved_tensors_hooks in force, or None: a
    context that pushes its own can then hand what it does not take to the one below (torch 2.13 keeps the stack
    in torch._C._autograd, with no public reader)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def checkpoint_hooks(hooks) -> bool:
    """Whether a (pack, unpack) pair is torch.utils.checkpoint's own (its forward or its recomputation): their
    functions are defined in that module (torch 2.13: _checkpoint_hook, _recomputation_hook)."""
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


def keys_to_ignore_unexpected(model: nn.Module) -> list[str]:
    """The regexes of checkpoint keys transformers' model class tells its loader to ignore when unexpected (GPT-2's
    old attn.bias masks): a private class attribute of PreTrainedModel (transformers 5.x), [] for other models."""
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def traceable_assert():
    """torch._assert: Python's assert as a function torch.fx can record (documented in torch.fx's tracing notes,
    underscored in torch 2.13)."""
    return torch._assert


def _unsharded_class(model: Any) -> Any:
    """`model` as its own class: FSDP2's fully_shard gives the module a class made on the fly, FSDP<Name> deriving
    from FSDPModule and the original (torch/distributed/fsdp/_fully_shard/_fully_shard.py), and transformers looks
    conversions up by class name. A shallow copy of the original class is made (FSDPModule's own copy protocol
    rebuilds the class); the model is left as it is."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return model
    view = object.__new__(next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)))
    view.__dict__.update(model.__dict__)
    return view


class StackedPiece(NamedTuple):
    """One tensor of a file that transformers stacks into a model tensor on load (MoE experts: one tensor per expert
    in the file, one (experts, ...) tensor in the model)."""
    target: str    # the model's name of the stacked tensor
    row: int       # its position along the stacked tensor's dimension 0 (the expert)
    part: int      # which of the tensors concatenated along dimension 1 (gate, up) it is
    parts: int     # how many are concatenated there (1: stacked only)


def checkpoint_key_renames(model: nn.Module, keys: Iterable[str]) \
        -> tuple[dict[str, str], dict[str, StackedPiece], list[str]]:
    """({key in a file: the model's name for it}, {key: the stacked tensor it is a piece of}, keys transformers
    would convert some other way) for the keys that transformers' loader renames or converts for this model's class
    (GPT-NeoX files name the head `embed_out`, the module is `lm_head`; legacy LayerNorm gamma/beta; Mixtral's and
    Qwen-MoE's experts saved one tensor per expert). The rules are its per-architecture conversion mapping
    (transformers/conversion_mapping.py get_model_conversion_mapping, core_model_loading.rename_source_key,
    transformers 5.x). Of its WeightConverters, those whose operations are MergeModulelist(dim=0) (stack the
    pieces' "*" index along dimension 0), optionally then Concatenate(dim=1) of the converter's source patterns in
    their order, are returned as pieces; others (quantised, interleaved, transposed weights) as keys to refuse.
    ({}, {}, []) for other models."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return {}, {}, []
    if not isinstance(model, PreTrainedModel):
        return {}, {}, []
    transforms = get_model_conversion_mapping(_unsharded_class(model))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renames, stacked, refused = {}, {}, []
    for key in keys:
        new, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            piece = _stacked_piece(key, new, pattern, converters)
            if piece is None:
                refused.append(key)
            else:
                stacked[key] = piece
        elif new != key:
            renames[key] = new
    return renames, stacked, refused


def _stacked_piece(key: str, target: str, pattern: str, converters: list) -> StackedPiece | None:
    """`key` as a piece of `target` where the converter that matched it only stacks (and concatenates) its
    pieces; None otherwise."""
    from transformers.core_model_loading import Concatenate, MergeModulelist
    converter = next(c for c in converters if pattern in c.source_patterns)
    ops = [(type(op), op.dim) for op in converter.operations]
    parts = len(converter.source_patterns)
    if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) or (len(ops) == 1 < parts):
        return None
    index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if index is None:
        return None
    return StackedPiece(target=target, row=int(index.group(1)), part=converter.source_patterns.index(pattern),
                        parts=parts)


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor this rank holds of `t`, the index along dimension 0 of its first row): FSDP2's shard of a
    DTensor, else `t` itself from row 0. A DTensor's offsets are what DCP reads them from (__create_chunk_list__,
    torch/distributed/tensor/_api.py; no public accessor in torch 2.13). ValueError for a shard split along another
    dimension (tensor parallelism): its rows are not whole."""
    if not hasattr(t, "to_local"):
        return t, 0
    chunk = getattr(t, "__create_chunk_list__")()[0]
    local = t.to_local()
    if any(chunk.offsets[1:]) or tuple(local.shape[1:]) != tuple(t.shape[1:]):
        raise ValueError("a tensor split along a dimension other than its first")
    return local, int(chunk.offsets[0])


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the module's own buffers that its state_dict holds: set, and not registered with
    persistent=False. nn.Module keeps that flag only in _non_persistent_buffers_set (torch/nn/modules/module.py)."""
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def default_group_timeout(device: torch.device) -> timedelta:
    """The timeout init_process_group was given. torch 2.13 exposes it only as the backend's Options._timeout
    (ProcessGroup._get_backend; distributed_c10d._set_pg_timeout reads the same backend)."""
    import torch.distributed as dist
    world = dist.group.WORLD
    assert world is not None, "init_process_group runs first: there is no timeout before it"
    return world._get_backend(device).options._timeout


def set_group_timeout(group, timeout: timedelta) -> None:
    """Give a subgroup the world's timeout: new_group and DeviceMesh's groups take torch's default instead.
    Public in torch 2.13 (ProcessGroup.set_timeout sets every backend of the group, as _set_pg_timeout did for
    gloo and NCCL); the default group already has it. Older torch (the project admits >= 2.6) may lack the public
    method: then distributed_c10d._set_pg_timeout, what torch 2.13's set_timeout replaces."""
    import torch.distributed as dist
    if group is None or group is dist.group.WORLD:
        return
    if hasattr(group, "set_timeout"):
        group.set_timeout(timeout)
    else:
        from torch.distributed import distributed_c10d as c10d
        c10d._set_pg_timeout(timeout, group)


def schedule_stages(schedule) -> list:
    """The PipelineStage objects a torch pipelining schedule runs on this rank: PipelineScheduleMulti keeps them in
    `_stages`, PipelineScheduleSingle its one stage in `_stage` (torch/distributed/pipelining/schedules.py);
    neither has a public accessor."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def compute_action_strings(pipeline_order, rank: int) -> list[str]:
    """The forward / backward / input-backward / weight-backward actions of `rank` in a schedule's pipeline_order,
    as torch prints them ("0F1", "1B0", "0I2", "0W2"), in order; communication and FSDP actions left out. The
    action kinds are the private enum _ComputationType of torch/distributed/pipelining/schedules.py."""
    from torch.distributed.pipelining import schedules as S
    compute = (S._ComputationType.FORWARD, S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_INPUT,
               S._ComputationType.BACKWARD_WEIGHT)
    return [str(a) for a in pipeline_order[rank] if a is not None and a.computation_type in compute]


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameter slots, writable: nn.Module keeps them in `_parameters`. Replacing an entry
    there (not setattr) swaps a parameter without running __setattr__'s checks, and keeps its place in
    named_parameters() order; no public API gives the slots of one module (named_parameters(recurse=False)
    reads them, cannot set them)."""
    return module._parameters


def hf_init_weights(model: nn.Module):
    """transformers' per-module initialisation of a PreTrainedModel (`_init_weights(module)`: what
    `post_init` applies to every module), or None for other models. It has no public per-module form."""
    fn = getattr(model, "_init_weights", None)
    return fn if callable(fn) else None


def module_view(module: nn.Module, **replace: nn.Module | None) -> nn.Module:
    """A shallow copy of `module` that shares its attributes and child modules but has its own child table, with
    the children named in `replace` swapped (a pipeline stage's view of a decoder holding only its layers).
    copy.copy shares the child table (`_modules`) itself, and setattr on the copy would write into the original's,
    so the copy is given its own before anything is replaced."""
    import copy
    view = copy.copy(module)
    view._modules = dict(module._modules)
    for name, child in replace.items():
        view._modules[name] = child
    return view


def pipelining_split_backward():
    """(stage_backward_input, stage_backward_weight): how torch's pipelining splits a stage's backward into I and W
    for the zero-bubble schedules (torch/distributed/pipelining/_backward.py); the profiler runs them on a unit to
    see which saved tensors that split keeps."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    return stage_backward_input, stage_backward_weight


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (None if it owns its storage): a linear saves weight.t(), whose _base is the
    parameter (torch 2.13; Tensor._base is documented only as an attribute of views)."""
    return getattr(t, "_base", None)


def storage_key(storage) -> int:
    """storage_id for an UntypedStorage object itself (its StorageImpl's address)."""
    return storage._cdata


def default_store():
    """The default process group's key-value store (torch 2.13 keeps its getter private: init_process_group builds
    the store and exposes no handle). executor.runtime's close meets the other ranks on it, outside gloo, before
    gloo's connections are torn down."""
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()


def meta_nonzero_all():
    """A context where nonzero (and one-argument where) on meta tensors returns every position instead of raising
    (torch.fx.experimental._config.meta_nonzero_assume_all_nonzero): a data-dependent branch of a forward run on
    meta for its shapes only (transformers' MoE experts pick their tokens with it)."""
    from torch.fx.experimental import _config
    return _config.patch(meta_nonzero_assume_all_nonzero=True)
