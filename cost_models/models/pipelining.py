"""Which models the executor can cut into pipeline stages, and why not when it cannot.

A stage must compute exactly what the model's own forward computes, so pipelines are offered only where that is
known to hold:
  * "chain": the forward is a chain of its unit modules, one tensor from each unit to the next and nothing else
    (the zoo's UnitChain; factories whose forward is unit after unit). Checked with torch.fx symbolic tracing,
    every unit module a leaf, so no tensor runs (meta models too): any op between units (a scaled embedding, a
    position table, a residual across units), a skip input, a unit run twice or out of order, or a forward fx
    cannot trace means not a chain;
  * "hf-decoder": a transformers causal LM (any family: llama, gemma, phi, gpt2, gpt_neox, opt, ...) with the
    units the profiler derives for it: an embedding unit, one unit per decoder layer, a head unit (DecoderLayout,
    read off the model, no per-family table); executor/hf_stages.py runs the model's own forward over each
    stage's layers ("hf-llama" / "hf-gpt2" in profiles written before: the same stages);
  * "traced": not a chain, but its fx graph (units as leaves) runs every unit once, in order, reads one input (and
    its targets, for a model computing its own loss) and returns one value (or its (logits, loss)): executor/traced_stages.py cuts that graph at the stage boundaries, each stage running the
    model's own operations between its units and passing on every value a later stage needs (what
    torch.distributed.pipelining's tracer does with split points, on the graph this check already has);
  * otherwise "no: <reason>": the planner offers only pp = 1 and says why (planner/search.py, planner/manual.py).
"""
from __future__ import annotations

import dis
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn

from cost_models.models.losses import TARGETS, takes_targets
from cost_models.records.profile import PIPELINE_KINDS
from cost_models.torch_compat.torch_private import traceable_assert, tree_leaves

Units = Sequence[tuple[str, tuple[str, ...]]]

CHAIN, HF_DECODER, TRACED = "chain", "hf-decoder", "traced"
assert {CHAIN, HF_DECODER, TRACED} <= set(PIPELINE_KINDS)


def pipeline_support(model: nn.Module, units: Units) -> str:
    """"chain", "hf-decoder", "traced", or "no: <one line a user understands>" (module doc). `units` are the
    profile's (name, module names) in order. Never raises: anything unexpected is a "no" saying what."""
    try:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return _hf_support(model, units)
        return _chain_support(model, units)
    except Exception as exc:   # a user's model can fail in any way; the answer is still one line
        return f"no: checking its forward failed ({_one_line(exc)})"


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- transformers decoders ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DecoderLayout:
    """Where a transformers causal LM's pieces are, read off the model and its profile units (no per-family table):
    the decoder is the module holding the layer list (LlamaModel, GPT2Model, OPTDecoder), and its forward takes
    `inputs_embeds` in place of token ids; the root (the *ForCausalLM) calls it, then its head."""

    decoder: str                 # path of the decoder module: "model", "transformer", "model.decoder"
    layers: str                  # its nn.ModuleList of decoder layers: "layers", "h"
    embed: tuple[str, ...]       # the decoder's children that run before the layers (the embedding unit)
    post: tuple[str, ...]        # the decoder's children that run after them (the final norm)
    head: tuple[str, ...]        # the root's children that run after the decoder (lm_head, embed_out)


def decoder_layout(model: nn.Module, units: Units) -> DecoderLayout | str:
    """The model's DecoderLayout, or why the units do not describe one (a phrase): an embedding unit of decoder
    children, one unit per layer in order (the whole list), and a head unit of the decoder's children after the
    layers and the root's own."""
    if len(units) < 3:
        return f"it has {len(units)} units; a decoder needs an embedding unit, its layers and a head unit"
    (first, embed), *blocks, (last, head) = units
    list_path, _, index = blocks[0][1][0].rpartition(".")
    decoder, _, layers = list_path.rpartition(".")
    if not decoder or index != "0":
        return f"unit {blocks[0][0]} is not the first of a decoder's layer list"
    for i, (name, mods) in enumerate(blocks):
        if mods != (f"{list_path}.{i}",):
            return f"unit {name} holds {'+'.join(mods)}, not {list_path}.{i}"
    n_layers = len(model.get_submodule(list_path))   # type: ignore[arg-type]  # not a ModuleList: a "no" (TypeError)
    if n_layers != len(blocks):
        return f"its units hold {len(blocks)} of the {n_layers} layers of {list_path}"
    inside = tuple(m.removeprefix(decoder + ".") for m in embed)
    if any("." in m or not mod.startswith(decoder + ".") for m, mod in zip(inside, embed)):
        return f"unit {first} holds {'+'.join(embed)}, not modules of {decoder}"
    post = tuple(m.removeprefix(decoder + ".") for m in head if m.startswith(decoder + "."))
    root = tuple(m for m in head if not m.startswith(decoder + "."))
    if any("." in m for m in post + root) or any(decoder.split(".")[0] == m for m in root):
        return f"unit {last} holds {'+'.join(head)}, not modules of {decoder} or of the model itself"
    for path in ("", decoder):
        if "inputs_embeds" not in inspect.signature(model.get_submodule(path).forward).parameters:
            return f"the forward of {path or type(model).__name__} takes no inputs_embeds"
    return DecoderLayout(decoder=decoder, layers=layers, embed=inside, post=post, head=root)


def _hf_support(model: nn.Module, units: Units) -> str:
    layout = decoder_layout(model, units)
    if isinstance(layout, str):
        return (f"no: {layout}; transformers models are pipelined at an embedding unit, one unit per decoder layer "
                "and a head unit (the profiler's default units)")
    return HF_DECODER


# --- unit chains (torch.fx) ---------------------------------------------------------------------------------------

class _UnitLeaves(fx.Tracer):
    """Traces the model's own code, but not into its unit modules: each unit module is one call_module node. An
    `assert` on the input's shape (`assert t <= self.block_size`) is traced as a torch._assert node, not refused as
    control flow (to_bool)."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def to_bool(self, obj: fx.Proxy) -> bool:
        """fx asks this when a traced value is used as a bool. In an `assert` statement (the calling frame's next
        instructions: a jump if true, then loading AssertionError) it records torch._assert and lets the trace go
        on; fx's own trace_asserts reads Python 3.10's opcode names, which 3.11 renamed (POP_JUMP_FORWARD_IF_TRUE)."""
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame and frame.f_back else None   # to_bool <- Proxy.__bool__ <- user code
        if caller is not None:
            code = list(dis.get_instructions(caller.f_code))
            at = next((i for i, ins in enumerate(code) if ins.offset >= caller.f_lasti), len(code) - 1)
            jump, after = code[at], code[at + 1] if at + 1 < len(code) else None
            if ("JUMP" in jump.opname and "IF_TRUE" in jump.opname and after is not None
                    and (after.opname == "LOAD_ASSERTION_ERROR" or after.argval == "AssertionError")):
                self.create_proxy("call_function", traceable_assert(), (obj, "assertion in the model's forward"), {})
                return True
        return super().to_bool(obj)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _chain_support(model: nn.Module, units: Units) -> str:
    if not units:
        return "no: the profile has no units"
    module_unit = {m: name for name, mods in units for m in mods}
    try:
        graph = _UnitLeaves(set(module_unit)).trace(model)
    except Exception as exc:
        return f"no: torch.fx cannot trace its forward ({_one_line(exc)})"
    order = [name for name, _ in units]
    grouped = next((f"unit {name} is several modules ({'+'.join(mods)})" for name, mods in units if len(mods) != 1),
                   None)
    verdict = grouped or _chain_verdict(model, graph, order, module_unit)
    if verdict is None:
        return CHAIN
    blocker = _traced_blocker(model, graph, units, module_unit)
    return TRACED if blocker is None else f"no: {blocker if grouped else verdict}"


def trace_units(model: nn.Module, unit_modules: Sequence[str]) -> fx.Graph:
    """The model's forward as an fx graph with every unit module one call_module node (executor.traced_stages cuts
    it into stages)."""
    return _UnitLeaves(set(unit_modules)).trace(model)


def traced_edges(model: nn.Module, units: Units, inputs: Sequence[Any]) -> list[tuple[int, int, int]]:
    """(src unit, dst unit, bytes) of every value executor.traced_stages hands between stages, from the traced
    graph run on `inputs` (meta tensors suffice): a value whose latest unit ancestor is unit p (0 where it depends on
    the input alone: it is made on the first stage) and whose users reach unit q > p crosses every cut after units
    p..q-1, as the stage rule places it (a stage runs an operation once it has all its inputs). So work between
    units (a scaled residual, a position table added) is counted as what actually travels, not as nothing."""
    module_unit = {m: i for i, (_, mods) in enumerate(units) for m in mods}
    graph = trace_units(model, list(module_unit))
    sizes = _node_bytes(model, graph, inputs)
    last_unit: dict[fx.Node, int] = {}
    for n in graph.nodes:
        own = module_unit.get(str(n.target), -1) if n.op == "call_module" else -1
        last_unit[n] = max([own, *(last_unit[i] for i in n.all_input_nodes)], default=-1)
    edges: dict[tuple[int, int], int] = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "output") or not n.users:
            continue
        src = max(last_unit[n], 0)
        dst = max(len(units) - 1 if u.op == "output" else last_unit[u] for u in n.users)
        if dst > src and sizes.get(n):
            edges[src, dst] = edges.get((src, dst), 0) + sizes[n]
    return [(a, b, nbytes) for (a, b), nbytes in sorted(edges.items())]


def _node_bytes(model: nn.Module, graph: fx.Graph, inputs: Sequence[Any]) -> dict[fx.Node, int]:
    """The bytes of the tensors each node of `graph` makes, from running it (torch.fx.Interpreter) on `inputs`."""
    sizes: dict[fx.Node, int] = {}

    class _Sizes(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            sizes[n] = sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))
            return value
    with torch.no_grad():
        _Sizes(fx.GraphModule(model, graph)).run(*inputs)
    return sizes


def _traced_blocker(model: nn.Module, graph: fx.Graph, units: Units, module_unit: dict[str, str]) -> str | None:
    """Why the traced graph cannot be cut into stages at unit boundaries (executor.traced_stages), or None: every
    unit module runs once, a unit's modules one after another, the units in order; the forward reads one input and
    returns one value (a model that computes its own loss: its input and targets, and what it returns with the
    loss in it, losses.takes_targets); modules it calls outside the units hold no parameters (a stage could not say
    whose they are)."""
    nodes = list(graph.nodes)
    ran = [str(n.target) for n in nodes if n.op == "call_module" and str(n.target) in module_unit]
    if sorted(ran) != sorted(module_unit) or len(set(ran)) != len(ran):
        return "its unit modules do not each run once"
    in_order = [u for i, u in enumerate(module_unit[m] for m in ran) if i == 0 or module_unit[ran[i - 1]] != u]
    if in_order != [name for name, _ in units]:
        return "its units do not run one after another, in order"
    own = takes_targets(model)
    output = next(n for n in nodes if n.op == "output")
    if not own and not isinstance(output.args[0], fx.Node):
        return "its forward returns several values"
    read = [str(n.target) for n in nodes if n.op == "placeholder" and n.users]
    if len(read) != 1 and not (own and len(read) == 2 and read[1] == TARGETS):
        return "its forward reads more than one input"
    for n in nodes:
        if n.op == "call_module" and str(n.target) not in module_unit:
            if any(True for _ in model.get_submodule(str(n.target)).parameters()):
                return f"its forward calls `self.{n.target}`, which holds parameters, outside every unit"
    return None


def _chain_verdict(model: nn.Module, graph: fx.Graph, order: list[str], module_unit: dict[str, str]) -> str | None:
    """Why `graph` is not placeholder -> unit 0 -> unit 1 -> ... -> output, or None when it is."""
    nodes = list(graph.nodes)
    calls = [n for n in nodes if n.op == "call_module" and n.target in module_unit]
    for n in calls:
        n.meta["unit_name"] = module_unit[str(n.target)]
    ran = [n.meta["unit_name"] for n in calls]
    for name in order:
        if ran.count(name) != 1:
            return f"unit {name} runs {ran.count(name)} times in its forward, not once"
    if ran != order:
        return f"its forward runs the units in the order {', '.join(ran)}"
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        return "its forward takes no input"
    prev = placeholders[0]
    for node in calls + [next(n for n in nodes if n.op == "output")]:
        why = _input_verdict(model, nodes, node, prev)
        if why:
            return why
        prev = node
    stray = next((n for n in nodes if n.op not in ("placeholder", "output") and n not in calls), None)
    return _op_verdict(nodes, stray) if stray is not None else None


def _input_verdict(model: nn.Module, nodes: list[fx.Node], node: fx.Node, prev: fx.Node) -> str | None:
    """A unit (or the output) must take `prev`, the previous unit's output (the model's first input for unit 0),
    as its first argument, and nothing else but the unit's own defaults."""
    unit = node.meta.get("unit_name")
    main = node.args[0] if node.args else None
    if unit is None and not isinstance(main, fx.Node):
        return f"its forward returns a {type(main).__name__}, not the output of unit {prev.meta.get('unit_name')} alone"
    for other in ([main] if isinstance(main, fx.Node) else []) + node.all_input_nodes:
        if other is not prev:
            if _is_op(other):
                return _op_verdict(nodes, other)
            also = "" if other is main else "also "
            return (f"unit {unit} {also}takes {_source(other)} (a skip connection across units)" if unit else
                    f"its forward returns {_source(other)}")
    if main is not prev:
        return f"unit {unit} is called without {_source(prev)}"
    return _extra_constants(model, node, unit) if unit else None


def _extra_constants(model: nn.Module, node: fx.Node, unit: str) -> str | None:
    """A constant the forward passes to a unit is harmless only where it is that argument's own default (a
    stage calls the unit with its input alone)."""
    if len(node.args) < 2 and not node.kwargs:
        return None
    signature = inspect.signature(model.get_submodule(str(node.target)).forward)
    try:
        bound = signature.bind(None, *node.args[1:], **node.kwargs)
    except TypeError:
        return f"unit {unit} is called with more arguments than its forward takes"
    for arg, value in list(bound.arguments.items())[1:]:
        default = signature.parameters[arg].default
        if default is inspect.Parameter.empty or not _same(default, value):
            return f"unit {unit} is called with {arg}={value!r}, not its default"
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:   # e.g. comparing tensors
        return False


def _is_op(node: fx.Node) -> bool:
    """Computation outside the units: anything but the model's inputs and the unit calls."""
    return node.op != "placeholder" and "unit_name" not in node.meta


def _source(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"the model's input `{node.target}`"
    return f"the output of unit {node.meta['unit_name']}"


def _op_label(node: fx.Node) -> str:
    if node.op == "call_function":
        return f"`{getattr(node.target, '__name__', str(node.target))}`"
    if node.op == "call_method":
        return f"`{node.target}`"
    if node.op == "get_attr":
        return f"`self.{node.target}` (an attribute read outside every unit)"
    return f"`self.{node.target}` (a module outside every unit)"


def _op_verdict(nodes: list[fx.Node], op: fx.Node) -> str:
    """'its forward does `mul` between units A and B', placed by the unit calls around `op` in the graph."""
    at = nodes.index(op)
    before = [n.meta["unit_name"] for n in nodes[:at] if "unit_name" in n.meta]
    after = [n.meta["unit_name"] for n in nodes[at + 1:] if "unit_name" in n.meta]
    where = (f"between units {before[-1]} and {after[0]}" if before and after else
             f"after unit {before[-1]}" if before else f"before unit {after[0]}" if after else "outside every unit")
    return f"its forward does {_op_label(op)} {where}"
