"""`planner export`: a checkpoint's model weights, as files other tools load.

    --hf DIR    a transformers folder (config.json + safetensors) that AutoModelForCausalLM.from_pretrained(DIR)
                loads; models from `hf:` references only
    -o FILE     one safetensors file of the full state dict under the model's own (canonical) names: each tensor
                once, a tied parameter under its first name; metadata {"zeropipe_source", "step"}; any model

The checkpoint is checked as a resume checks it (signed listing, every file's size and sha256), then only its
"model.*" entries are read, each as a full tensor in this one process (DCP reassembles whatever shards the run's
layout wrote); optimizer and RNG states are never read. The names and shapes must be exactly the model's, built
from the reference in the checkpoint's plan. The output appears whole or not at all: it is written into a
temporary sibling, then renamed into place.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cost_models.models.source import resolve
from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError, OutputError, OutputExistsError
from cost_models.records.fileio import check_writable
from cost_models.records.formatting import size
from executor import checkpoint
from executor import checkpoint_layout as layout
from executor.weights import safetensors_header

MODEL_PREFIX = "model."
DEFAULT_OUTPUT = Path("model.safetensors")
HF, SAFETENSORS = "hf", "safetensors"


@record
class ExportResult(Record):
    """What `planner export` wrote (its --json)."""

    checkpoint: str                     # the step folder read
    step: int
    source: str                         # the model reference of the checkpoint's plan
    format: str                         # "hf" | "safetensors"
    path: str                           # the folder (hf) or file written
    tensors: int                        # distinct tensors written (a tied parameter once)
    parameters: int                     # elements of the model's parameters (a tied one once)
    bytes: int                          # tensor bytes written
    dtype: str                          # the checkpoint's floating-point type, which the export keeps


def target_of(hf_dir: Path | None, output: Path | None) -> tuple[Path, str]:
    """(where to write, HF or SAFETENSORS) from the two options, of which at most one may be given."""
    if hf_dir is not None and output is not None:
        raise ConfigError("give --hf DIR (a transformers folder) or -o FILE (one safetensors file), not both")
    return (hf_dir, HF) if hf_dir is not None else (output or DEFAULT_OUTPUT, SAFETENSORS)


def occupied(target: Path) -> bool:
    """Writing `target` would replace something a user has: a file, or a folder with anything in it."""
    return (target.is_dir() and any(target.iterdir())) or (target.exists() and not target.is_dir())


def check_target(target: Path, fmt: str, overwrite: bool) -> None:
    """Refuse, before any work, an output that cannot be written or would replace a user's files unasked."""
    if fmt == HF and target.exists() and not target.is_dir():
        raise OutputError(f"{target} is a file; --hf names a folder to write the transformers files into")
    if fmt == SAFETENSORS:
        check_writable(target)          # a folder in its place, an unwritable parent
    check_writable(_sibling(target, "export"))
    if occupied(target) and not overwrite:
        what = "is a folder with files in it" if target.is_dir() else "already exists"
        raise OutputExistsError(f"{target} {what}; pass --force to replace it or name another "
                                f"{'folder' if fmt == HF else 'file'}")


def export(path: Path, *, hf_dir: Path | None, output: Path | None, overwrite: bool,
           trusted: bool = False) -> ExportResult:
    """The command: check the checkpoint, read its model tensors, check them against the model, write the output."""
    step_dir = layout.resolve(path)
    meta, _ = layout.read_verified(step_dir, trusted=trusted)   # the signature before anything else is read
    source = meta.plan.model.source
    target, fmt = target_of(hf_dir, output)
    if fmt == HF and not source.startswith("hf:"):
        raise ConfigError(f"checkpoint {step_dir} is of model {source}, not a transformers one (hf:...); export "
                          f"it with -o FILE.safetensors instead of --hf")
    check_target(target, fmt, overwrite)
    layout.verify(step_dir, meta)
    tensors = read_model_tensors(step_dir, trusted=trusted)
    dtype = checkpoint_dtype(tensors)
    model = resolve(source).build(device="cpu" if fmt == HF else "meta", dtype=dtype)
    tensors = matched(tensors, model, f"checkpoint {step_dir} (model {source})")
    labels = {"zeropipe_source": source, "step": str(meta.step)}
    if fmt != HF:   # save_pretrained writes a tie its own way (from_pretrained ties it again)
        tensors = with_aliases(tensors, model)
    publish(target, partial(save_hf, model, tensors) if fmt == HF else partial(save_safetensors, tensors,
                                                                                 metadata=labels))
    return ExportResult(checkpoint=str(step_dir), step=meta.step, source=source, format=fmt, path=str(target),
                        tensors=len(tensors), parameters=sum(p.numel() for p in model.parameters()),
                        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                        dtype=str(dtype).removeprefix("torch."))


def read_model_tensors(step_dir: Path, *, trusted: bool = False) -> dict[str, torch.Tensor]:
    """Every "model.*" entry of the checkpoint as one full tensor, keyed without the prefix (sizes and types from
    DCP's metadata, which is unpickled only from the bytes the signed listing vouches for)."""
    saved = checkpoint.verified_reader(step_dir, trusted=trusted).read_metadata().state_dict_metadata
    sd = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in saved.items()
          if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)}   # never a pickled object
    if not sd:
        raise layout.CheckpointError(f"checkpoint {step_dir} holds no model tensors (model.* entries); it was not "
                                     f"written by planner run")
    checkpoint.load(sd, step_dir, trusted=trusted)
    return {key[len(MODEL_PREFIX):]: value for key, value in sd.items()}


def checkpoint_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating-point type most of the checkpoint's elements have (the model's; a buffer may differ)."""
    counts: Counter[torch.dtype] = Counter()
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


def canonical_keys(model: nn.Module) -> dict[str, str]:
    """Every state_dict key -> the first key holding the same tensor (a tied parameter's aliases fold into it)."""
    first: dict[int, str] = {}
    return {key: first.setdefault(id(value), key) for key, value in model.state_dict(keep_vars=True).items()}


def matched(tensors: dict[str, torch.Tensor], model: nn.Module, what: str) -> dict[str, torch.Tensor]:
    """`tensors` under the model's canonical names, in the model's order, once each; refuses in one line a name
    the model lacks or needs, or another shape (an alias of a tied parameter is filled by the tie)."""
    keys = canonical_keys(model)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict(keep_vars=True).items()}
    wanted = list(dict.fromkeys(keys.values()))
    missing = [k for k in wanted if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in keys)
    if missing:
        raise layout.CheckpointError(f"{what} has no {MODEL_PREFIX}{missing[0]}{_more(missing)}, which the model "
                                     f"has; was it written for another model?")
    if unexpected:
        raise layout.CheckpointError(f"{what} holds {MODEL_PREFIX}{unexpected[0]}{_more(unexpected)}, which the "
                                     f"model does not have; was it written for another version of the model?")
    for key in wanted:
        if tuple(tensors[key].shape) != shapes[key]:
            raise layout.CheckpointError(f"{what} holds {MODEL_PREFIX}{key} of shape {list(tensors[key].shape)}, "
                                         f"the model's is {list(shapes[key])}; was it written for another config?")
    return {key: tensors[key] for key in wanted}


def with_aliases(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`tensors` with every key the model's own state_dict has, in its order: a tied parameter's aliases
    (nanoGPT's lm_head.weight, tied to transformer.wte.weight) as copies, since safetensors stores no shared
    tensors, so that a strict load_state_dict of the file succeeds."""
    return {key: tensors[first] if key == first else tensors[first].clone()
            for key, first in canonical_keys(model).items()}


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def save_hf(model: nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Load `tensors` into the built transformers `model` and save it as a folder from_pretrained loads."""
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)   # matched() checked the names: only tied aliases are missing
    # zeropipe builds hf models with the cache off (training); the exported model is for use, where it is on
    # (config and save_pretrained: a transformers model's attributes, typed Tensor | Module by nn.Module's stubs)
    model.config.use_cache = True  # type: ignore[union-attr]
    from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()                  # its "Writing model shards" bar: the CLI has its own status
    try:
        model.save_pretrained(str(folder))  # type: ignore[operator]  # safetensors: the default since transformers 4.35
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    for file in folder.glob("*.safetensors"):
        check_written(file)


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path, *, metadata: dict[str, str]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(file), metadata=metadata)
    except SafetensorError as exc:   # an I/O error its writer did report: one line through publish, not a traceback
        raise OSError(errno.EIO, str(exc), str(file)) from None
    check_written(file)


def check_written(file: Path) -> None:
    """OSError unless `file` is a whole safetensors file on disk: an export onto a full disk left a cut file and
    exited 0 (the reliability round's report), so the file is flushed (fsync reports what the kernel could not
    write) and its length checked against its own header (weights.safetensors_header: the data ends at the largest
    data offset)."""
    with open(file, "rb") as fh:
        os.fsync(fh.fileno())
    try:
        start, header = safetensors_header(str(file))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        whole = os.path.getsize(file) == start + end
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):   # a header cut short or not JSON
        whole = False
    if not whole:
        raise OSError(errno.ENOSPC, "the file was not written whole (is the disk full?)", str(file))


def _sibling(target: Path, what: str) -> Path:
    return target.parent / f".{target.name}.{what}-{os.getpid()}.tmp"


def publish(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` on a temporary sibling of `target`, then rename it into place: readers see the old output
    or the whole new one. A folder is renamed over only when empty, so an existing `target` (the caller allowed
    replacing it) is first moved aside, and put back if the swap fails."""
    tmp, old = _sibling(target, "export"), _sibling(target, "replaced")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _usual_mode(tmp)
        if target.is_dir():
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except OSError:
            if old.exists():
                os.replace(old, target)
            raise
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}; choose another place") from None
    finally:
        for leftover in (tmp, old):
            _remove(leftover)


def _usual_mode(path: Path) -> None:
    """Give written files the mode open() would (safetensors makes its files 0600, readable by their owner only)."""
    umask = os.umask(0)
    os.umask(umask)
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        os.chmod(file, 0o666 & ~umask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def summary_line(r: ExportResult) -> str:
    what = "a transformers folder" if r.format == HF else "a safetensors file"
    return (f"exported step {r.step} of {r.source} to {what}, {r.path}: {r.tensors} tensors, {r.parameters:,} "
            f"parameters, {size(r.bytes)} ({r.dtype})")
