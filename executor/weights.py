"""Pretrained weights into this rank's share of the model (`planner run --init-from DIR`, apply_plan(init_from=)).

`load_weights` fills, in place, the tensors a rank holds, keyed by canonical name (executor.stages: a parameter's
first name in the full model), from one of:
    an HF folder        config.json + model.safetensors, or model.safetensors.index.json + its shards (any folder of
                        .safetensors files: `planner export` writes model.safetensors for models that are not HF's)
    a planner checkpoint  a --checkpoint-dir folder (its latest step) or one step-NNNNNNNN folder; only its
                        "model.<name>" keys are read: it starts a training, it does not resume one (no optimizer
                        state, RNG or step)
Both go through torch.distributed.checkpoint (DCP): its load planner asks each tensor for the slice this rank holds
(an FSDP2 DTensor shard: the rows of its placement, uneven ones included; a plain tensor: all of it) and the storage
reader fills it with copy_, which casts (a bf16 file loads into fp32 parameters). Checked on torch 2.13:
- safetensors: DCP's HuggingFaceStorageReader indexes every *.safetensors file in the folder (headers only; it
  does not read the index, so the index is only checked here); PreadHFReader reads each slice with positioned
  reads (not safetensors' memory map, whose pages count in the rank's memory: see there), so a rank reads only its
  shard's rows of each tensor (tests/test_weights.py counts them: each of 2 FSDP2 ranks reads half).
- the checkpoint reader is executor.checkpoint's verified one (the signed listing, unless trusted, vouches for the
  `.metadata` pickle DCP loads); DCP's file reader reads each saved chunk whole and narrows it, so a rank reads
  every chunk its slice overlaps.
Ranks load independently (DCP's no_dist): the files are only read, so nothing needs agreeing on, and a rank whose
tensors do not fit fails alone, with one line, instead of waiting in a collective its peers left.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from cost_models.records.base import Record, record
from cost_models.records.errors import WeightsError
from cost_models.torch_compat.torch_private import (StackedPiece, checkpoint_key_renames, keys_to_ignore_unexpected,
                                                     local_rows)
from executor import checkpoint
from executor import checkpoint_layout as layout

SAFETENSORS = "safetensors"
DCP = "dcp"
HF_INDEX = "model.safetensors.index.json"
_WHAT_IT_NEEDS = (f"an HF folder (config.json with model.safetensors, or {HF_INDEX} and its shards) or a planner run "
                  f"checkpoint (a --checkpoint-dir folder or one of its step-NNNNNNNN folders)")


@record
class WeightsLoaded(Record):
    format: str        # SAFETENSORS or DCP
    source: str        # the folder read (for a --checkpoint-dir folder: its latest step)
    tensors: int       # tensors read: parameters and buffers (those the file lacks keep their values), a stacked
                       # tensor counted once per piece the file holds it in (MoE experts: one per expert and part)
    bytes_read: int    # bytes this rank read for them, in the file's dtype (see the module's note per format)


def load_weights(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], source: Path, *,
                 trusted: bool = False, model: torch.nn.Module | None = None) -> WeightsLoaded:
    """Fill this rank's `params` (every one must be in `source`) and those of its `buffers` that `source` has, in
    place, from `source`. `trusted` accepts a checkpoint this installation did not sign (executor.checkpoint).
    `model` (the whole model object the tensors belong to) lets an HF folder's keys be renamed as transformers
    renames them for its class and its experts stacked (_conversions)."""
    fmt, folder = weights_format(Path(source))
    reader, prefix = _reader(fmt, folder, trusted)
    saved = _saved_tensors(reader, folder)
    wanted = _wanted(params, buffers, saved, prefix, folder, *_conversions(model, saved, fmt, folder))
    planner = _RecordingPlanner()
    try:
        with warnings.catch_warnings():   # no_dist: DCP warns that it loads in one process, which is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(wanted, storage_reader=reader, planner=planner, no_dist=True)
    except dcp.CheckpointException as exc:
        raise WeightsError(f"loading weights from {folder} failed: {checkpoint.failure_text(exc)}") from None
    read = reader.bytes_read if isinstance(reader, PreadHFReader) else _bytes_read(planner)
    return WeightsLoaded(format=fmt, source=str(folder), tensors=len(wanted), bytes_read=read)


def weights_format(source: Path) -> tuple[str, Path]:
    """(format, folder to read) of `source`, or one line saying what it must contain."""
    if not source.is_dir():
        what = "is a file, not a folder" if source.exists() else "does not exist"
        raise WeightsError(f"--init-from {source} {what}; it must be {_WHAT_IT_NEEDS}")
    if (source / layout.META_NAME).is_file() or layout.complete_steps(source) or (source / ".metadata").is_file():
        return DCP, layout.resolve(source)
    if any(source.glob("*.safetensors")):
        _check_index(source)
        return SAFETENSORS, source
    if any(source.glob("pytorch_model*.bin")):
        raise WeightsError(f"--init-from {source} holds only PyTorch .bin weights (pickles, which are not loaded); "
                           f"save them as safetensors (save_pretrained(..., safe_serialization=True))")
    raise WeightsError(f"--init-from {source} holds no weights; it must be {_WHAT_IT_NEEDS}")


def _check_index(folder: Path) -> None:
    """Every shard a sharded HF folder's index names is there (DCP's reader indexes the files it finds)."""
    index = folder / HF_INDEX
    if not index.is_file():
        return
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise WeightsError(f"--init-from {folder}: {HF_INDEX} is not an HF index (a JSON object with a "
                           f"weight_map); save the model again with save_pretrained") from None
    absent = [s for s in shards if not (folder / s).is_file()]
    if absent:
        raise WeightsError(f"--init-from {folder}: {HF_INDEX} names {absent[0]} (and {len(absent) - 1} more shards) "
                           f"that the folder does not hold; copy the whole folder")


def _reader(fmt: str, folder: Path, trusted: bool) -> tuple[dcp.StorageReader, str]:
    """DCP storage reader for `folder` and the prefix its keys carry."""
    if fmt == DCP:
        return checkpoint.verified_reader(folder, trusted=trusted), "model."
    try:
        import safetensors  # noqa: F401   DCP's HF reader imports it only when it reads
    except ImportError:
        raise WeightsError(f"--init-from {folder}: reading safetensors needs the safetensors package (pip install "
                           f"safetensors; transformers installs it)") from None
    return PreadHFReader(str(folder)), ""


class PreadHFReader(dcp.HuggingFaceStorageReader):
    """DCP's HF reader (its metadata: which file holds each tensor, its shape and dtype), reading each slice with
    plain positioned reads instead of through safetensors' memory map. A mapped file's pages count in the rank's
    resident memory while it is open, so the mmap reader's peak held the rank's shard twice (measured:
    benchmarks/results/measurements.md, "Weight loading peak memory"). The layout
    read here is the safetensors format's (huggingface/safetensors, "Format": an 8-byte little-endian header length,
    a JSON header of {name: {dtype, shape, data_offsets}}, then the data, offsets relative to its start). The rows of
    dimension 0 a slice covers are read (FSDP2 shards dimension 0, so that is exactly the shard), then narrowed."""

    bytes_read = 0   # what read_data read from the files, in their dtype

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        from torch.futures import Future
        headers: dict[str, tuple[int, dict]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            path = str(info.relative_path)
            if path not in headers:
                headers[path] = safetensors_header(path)
            start, header = headers[path]
            entry = header[req.storage_index.fqn]
            at = start + entry["data_offsets"][0]
            target = planner.resolve_tensor(req).detach()
            if _whole_rows(tuple(info.shape), tuple(req.storage_offsets), tuple(req.lengths)) and \
                    target.dtype == info.dtype and target.is_contiguous() and target.device.type == "cpu":
                # straight into the parameter's memory: no buffer, so loading adds nothing to the rank's peak
                self.bytes_read += _read_into(path, at, tuple(info.shape), info.dtype, req.storage_offsets[0]
                                              if req.lengths else 0, target)
            else:
                tensor, nbytes = _read_rows(path, at, tuple(info.shape), info.dtype, tuple(req.storage_offsets),
                                            tuple(req.lengths))
                self.bytes_read += nbytes
                target.copy_(tensor)
            planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done


def safetensors_header(path: str) -> tuple[int, dict]:
    """(offset of the data, the JSON header) of a safetensors file."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return 8 + size, json.loads(fh.read(size))


def _whole_rows(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """The slice is a run of whole rows of dimension 0 (one contiguous range of the file)."""
    return all(o == 0 and n == d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:]))


def _read_into(path: str, data_at: int, shape: tuple[int, ...], dtype: torch.dtype, first_row: int,
               target: torch.Tensor) -> int:
    """Read whole rows of a stored tensor into `target` (contiguous, same dtype); the bytes read."""
    row = math.prod(shape[1:]) * dtype.itemsize
    # an ndarray has the buffer protocol; numpy's stubs declare it (__buffer__) only for Python 3.12 on
    view = (memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            if target.numel() else memoryview(b""))
    if len(view):
        with open(path, "rb") as fh:
            fh.seek(data_at + first_row * row)
            if fh.readinto(view) != len(view):
                raise WeightsError(f"--init-from: {path} ends inside a tensor; copy the file again")
    return len(view)


def _read_rows(path: str, data_at: int, shape: tuple[int, ...], dtype: torch.dtype, offsets: tuple[int, ...],
               lengths: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """The slice (offsets, lengths) of a row-major tensor stored at `data_at`, and the bytes read for it: its rows
    along dimension 0 read with one positioned read, the other dimensions narrowed in memory."""
    final = lengths
    if not shape:   # a 0-d tensor
        offsets, lengths, shape = (0,), (1,), (1,)
    row = math.prod(shape[1:]) * dtype.itemsize
    buf = bytearray(lengths[0] * row)
    if buf:
        with open(path, "rb") as fh:
            fh.seek(data_at + offsets[0] * row)
            if fh.readinto(buf) != len(buf):
                raise WeightsError(f"--init-from: {path} ends inside a tensor; copy the file again")
    rows = (torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)).view(lengths[0], *shape[1:])
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
    return rows[(slice(None), *rest)].reshape(final), len(buf)


def _saved_tensors(reader: dcp.StorageReader, folder: Path) -> dict:
    """{key: DCP's metadata of that tensor} in `folder`; a safetensors file whose header cannot be read is named in
    one line (safetensors says only what is wrong, not in which file)."""
    try:
        return reader.read_metadata().state_dict_metadata
    except Exception:
        if not isinstance(reader, dcp.HuggingFaceStorageReader):
            raise
        import safetensors
        for path in sorted(folder.glob("*.safetensors")):
            try:
                with safetensors.safe_open(str(path), framework="pt"):
                    pass
            except (safetensors.SafetensorError, OSError) as bad:
                raise WeightsError(f"--init-from {folder}: {path.name} is not a readable safetensors file ({bad}); "
                                   f"copy it again") from None
        raise


Stacks = Mapping[str, list[tuple[str, StackedPiece]]]   # {a stacked tensor's model name: its (file key, piece)s}


def _conversions(model: torch.nn.Module | None, saved: dict, fmt: str,
                 folder: Path) -> tuple[dict[str, str], Stacks]:
    """({key in an HF folder: the model's name for it}, the tensors read as pieces stacked into one) where
    transformers renames or stacks keys on load for this model's class (torch_private.checkpoint_key_renames:
    MoE experts saved one tensor per expert are read into the model's stacked experts); keys it would convert
    otherwise are refused in one line."""
    if model is None or fmt != SAFETENSORS:
        return {}, {}
    renames, stacked, refused = checkpoint_key_renames(model, saved)
    if refused:
        raise WeightsError(f"--init-from {folder}: {refused[0]} (and {len(refused) - 1} more) are tensors transformers "
                           f"converts on load in a way --init-from does not (only stacking and concatenating "
                           f"experts); start from the model's own initialisation")
    stacks: dict[str, list[tuple[str, StackedPiece]]] = {}
    for key, piece in sorted(stacked.items()):
        stacks.setdefault(piece.target, []).append((key, piece))
    return renames, stacks


def _wanted(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], saved: dict, prefix: str,
            folder: Path, renames: Mapping[str, str], stacks: Stacks) -> dict[str, torch.Tensor]:
    """The state dict DCP loads: this rank's tensors (detached aliases: DCP copies into them) under their keys in
    the file, a stacked tensor as views of the rows this rank holds, one per piece (_stack_views), after checking
    every parameter is there with its shape and kind of dtype (_matched)."""
    key_of, tensors = _matched(params, buffers, saved, prefix, folder, renames, stacks)
    wanted = {}
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: materialise the model (to_empty) before loading weights")
        key = key_of[name]
        if key in stacks:
            wanted.update(_stack_views(name, t.detach(), stacks[key], saved, folder))
        else:
            wanted[key] = t.detach()
    return wanted


def _stack_views(name: str, t: torch.Tensor, pieces: list[tuple[str, StackedPiece]], saved: dict,
                 folder: Path) -> dict[str, torch.Tensor]:
    """{file key: the view of `t` that piece fills} for the pieces of the rows (experts) this rank holds of `t`:
    row `row`, and of it the `part`-th run of dimension 1 (gate before up, in the converter's order)."""
    try:
        local, first = local_rows(t)
    except ValueError:
        raise WeightsError(f"--init-from {folder}: {name} is split along a dimension other than its experts here "
                           f"(tensor parallelism), which loading from one tensor per expert does not do; plan it "
                           f"without --tp") from None
    sizes = {p.part: int(saved[k].size[0]) for k, p in pieces if p.row == 0}
    starts = {j: sum(sizes[i] for i in range(j)) for j in sizes}
    views = {}
    for key, p in pieces:
        if 0 <= p.row - first < local.shape[0]:
            row = local[p.row - first]
            views[key] = row if p.parts == 1 else row.narrow(0, starts[p.part], sizes[p.part])
    return views


def _matched(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], saved: dict, prefix: str,
             folder: Path, renames: Mapping[str, str],
             stacks: Stacks) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """({name: its key in the file}, the tensors to fill: every parameter, and the buffers the file has), or one
    line naming the first parameter missing, of another shape, or of another kind of dtype (integers into floats
    or the reverse: DCP's copy_ would cast them without a word; one float dtype into another is a cast we want)."""
    key_of = _file_keys(list(params) + list(buffers), saved, prefix, renames, stacks)
    missing = [n for n in params if n not in key_of]
    if missing:
        raise WeightsError(f"--init-from {folder} has no weights for {missing[0]} (nor for {len(missing) - 1} more "
                           f"of the {len(params)} parameters this model has here); was it saved from another model?")
    tensors = {**params, **{n: b for n, b in buffers.items() if n in key_of}}
    for name, t in tensors.items():
        if key_of[name] in stacks:
            _check_stack(name, t, stacks[key_of[name]], saved, folder)
            continue
        stored = saved[key_of[name]]
        shape = getattr(stored, "size", None)   # DCP keeps non-tensor entries as bytes, without a size
        if shape is None or tuple(shape) != tuple(t.shape):
            raise WeightsError(f"--init-from {folder}: {name} has shape {_shape(shape)} there, the model's is "
                               f"{_shape(t.shape)}; was it saved from another configuration of the model?")
        _check_kind(name, stored.properties.dtype, t.dtype, folder)
    return key_of, tensors


def _check_kind(name: str, dtype: torch.dtype, want: torch.dtype, folder: Path) -> None:
    """One line where a stored tensor would be cast between integers and floats."""
    if dtype.is_floating_point != want.is_floating_point:
        raise WeightsError(f"--init-from {folder}: {name} is {str(dtype).removeprefix('torch.')} there, the "
                           f"model's is {str(want).removeprefix('torch.')}; it would be cast between integers "
                           f"and floats: was it saved from another model?")


def _check_stack(name: str, t: torch.Tensor, pieces: list[tuple[str, StackedPiece]], saved: dict,
                 folder: Path) -> None:
    """Every piece of stacked tensor `name` is in the file, once, and they tile its shape: one per row (expert) and
    part, the parts' first dimensions summing to its second."""
    parts = pieces[0][1].parts
    by = {(p.row, p.part): saved[k] for k, p in pieces}
    want = {(e, j) for e in range(t.shape[0]) for j in range(parts)}
    if set(by) != want or len(by) != len(pieces):
        raise WeightsError(f"--init-from {folder}: {name} stacks {t.shape[0]} experts x {parts} tensor(s); the "
                           f"folder has {len(by)} matching tensors, not {len(want)} (one per expert and part): was "
                           f"it saved from another configuration of the model?")
    for e in range(t.shape[0]):
        shapes = [tuple(by[e, j].size) for j in range(parts)]
        tiled = (shapes[0] if parts == 1 else
                 (sum(s[0] for s in shapes), *shapes[0][1:]) if len({s[1:] for s in shapes}) == 1 else None)
        if tiled != tuple(t.shape[1:]):
            raise WeightsError(f"--init-from {folder}: {name}'s expert {e} has shape(s) "
                               f"{', '.join(map(_shape, shapes))} there; the model's expert is {_shape(t.shape[1:])}:"
                               f" was it saved from another configuration of the model?")
        for j in range(parts):
            _check_kind(name, by[e, j].properties.dtype, t.dtype, folder)


def check_weights(model: torch.nn.Module, source: Path, *, trusted: bool = False,
                  allow_extra: bool = False) -> tuple[str, ...]:
    """Before any rank starts: `source` against the whole (meta) model, as every rank's load will check its share
    (_matched), and the file's model tensors that no name of the model (aliases and buffers included) takes:
    refused in one line (a 3-layer model's weights into a 2-layer configuration), or with `allow_extra` returned
    as a warning naming the first few. Reads headers and metadata only."""
    from executor.stages import canonical_names
    fmt, folder = weights_format(Path(source))
    reader, prefix = _reader(fmt, folder, trusted)
    saved = _saved_tensors(reader, folder)
    renames, stacks = _conversions(model, saved, fmt, folder)
    canon = canonical_names(model)
    params = {c: p for n, p in model.named_parameters(remove_duplicate=False) if (c := canon[n]) == n}
    every_buffer = dict(model.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))   # what ranks load (state_maps); others stay as built
    _matched(params, {n: b for n, b in every_buffer.items() if n in persistent}, saved, prefix, folder, renames,
             stacks)
    named = set(_file_keys(list(canon) + list(every_buffer), saved, prefix, renames, stacks).values())
    taken = named | {k for target in named & set(stacks) for k, _ in stacks[target]}
    # what transformers itself ignores in such files (GPT-2's old attn.bias masks): not a sign of another model
    ignored = [re.compile(p) for p in keys_to_ignore_unexpected(model)]
    extra = sorted(k for k in saved if k.startswith(prefix) and k not in taken
                   and not any(p.search(k) for p in ignored))
    if not extra:
        return ()
    first = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
    if not allow_extra:
        raise WeightsError(f"--init-from {folder} holds {len(extra)} tensor(s) this model has no place for ({first});"
                           f" was it saved from another configuration? (--allow-extra loads the rest anyway)")
    return (f"--init-from {folder}: {len(extra)} tensor(s) left unread, the model has no place for them ({first})",)


def _file_keys(names: list[str], saved: dict, prefix: str = "", renames: Mapping[str, str] | None = None,
               stacks: Stacks | None = None) -> dict[str, str]:
    """{canonical name: its key in the file} for the names the file has, a key read under the name `renames` gives
    it, a stacked tensor under its own name (a key of `stacks`). An HF folder saved from the base model (the hub's
    GPT-2: "h.0.attn.c_attn.weight" for GPT2LMHeadModel's "transformer.h.0.attn.c_attn.weight") lacks the first
    component of every name: that key is taken when the file has no key under that component at all."""
    named = {(renames or {}).get(k, k): k for k in saved} | {t: t for t in stacks or {}}
    heads = {k.split(".", 1)[0] for k in named}
    out = {}
    for name in names:
        head, _, tail = name.partition(".")
        if prefix + name in named:
            out[name] = named[prefix + name]
        elif not prefix and tail in named and head not in heads:
            out[name] = named[tail]
    return out


def _shape(shape) -> str:
    return "(not a tensor)" if shape is None else f"({', '.join(map(str, shape))})"


class _RecordingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, keeping this rank's read items so that the bytes they read can be counted."""

    items: tuple = ()

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.items = tuple(plan.items)
        return plan


def _bytes_read(planner: _RecordingPlanner) -> int:
    """Bytes DCP's file reader read for `planner`'s items: it reads the whole saved chunk each slice lies in."""
    assert planner.metadata is not None   # DCP sets it before it plans the reads
    saved = planner.metadata.state_dict_metadata
    total = 0
    for item in planner.items:
        entry = saved[item.storage_index.fqn]
        assert isinstance(entry, TensorStorageMetadata)   # the weights are tensors: no pickled objects to read
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(item.storage_index.offset))
        total += math.prod(chunk.sizes) * entry.properties.dtype.itemsize
    return total
