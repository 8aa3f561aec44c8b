"""Training data for `planner run --data FILE`: a flat token file, memory-mapped, in an order anyone can reproduce.

Formats: nanoGPT's `.bin` (raw uint16 token ids, karpathy/nanoGPT data/*/prepare.py) and NumPy `.npy`
(uint16, uint32, int32 or int64), both read with numpy.memmap so a file larger than memory costs only the pages
a step touches.

Order, for sequence length s and global batch B:
    window i            = tokens[i*(s+1) : (i+1)*(s+1)]          (n = len(tokens) // (s+1) windows; the tail is unused)
    global step k       takes windows k*B .. k*B+B-1, each modulo n
    inputs, targets     = window[:-1], window[1:]
A data-parallel replica takes its contiguous B/dp slice of the step's rows, then micro-batches in order (the
executor's slicing, the same as for synthetic batches). The position is the step alone, so a run resumed at step k
reads exactly the windows an uninterrupted run would.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cost_models.records.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}
_ENDS = 1 << 20   # bytes of each end of a token file that identify it (data_identity)
_SCAN_CHUNK = 1 << 24   # tokens per slice when the launcher checks every id (bounded memory for any file size)


class TokenFile:
    """A token file opened for reading windows of `seq_len + 1` tokens."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path, self.seq_len = Path(path), seq_len
        self.tokens = _open(self.path)
        self.windows = len(self.tokens) // (seq_len + 1)
        if self.windows == 0:
            raise ConfigError(f"--data {self.path}: {len(self.tokens):,} tokens, shorter than one window of "
                              f"seq_len + 1 = {seq_len + 1}; use a longer file or a shorter --seq-len profile")

    def check_ids(self, vocab: int) -> None:
        """Every token id must be a row of the model's embedding: 0 <= id < vocab (one scan, chunked)."""
        for start in range(0, len(self.tokens), _SCAN_CHUNK):
            chunk = np.asarray(self.tokens[start:start + _SCAN_CHUNK])
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab:
                bad = high if high >= vocab else low
                where = start + int(np.argmax(chunk == bad))
                raise ConfigError(f"--data {self.path}: token {where:,} is {bad}, outside the model's vocabulary "
                                  f"0..{vocab - 1}; tokenize with the model's tokenizer")

    def batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of global step `step`: int64 tensors of shape (global_batch, seq_len)."""
        span = self.seq_len + 1
        rows = [(step * global_batch + j) % self.windows for j in range(global_batch)]
        windows = np.stack([np.asarray(self.tokens[i * span:(i + 1) * span], dtype=np.int64) for i in rows])
        data = torch.from_numpy(windows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _open(path: Path) -> np.ndarray:
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file")
    if path.suffix == ".bin":   # nanoGPT: raw little-endian uint16 ids
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"--data {path} is empty: it holds no tokens; write the tokenized data into it")
        if size % 2:
            raise ConfigError(f"--data {path}: {size:,} bytes is not a whole number of uint16 tokens "
                              f"(a .bin file holds nanoGPT's raw uint16 ids)")
        try:
            return np.memmap(path, dtype=np.uint16, mode="r")
        except (OSError, ValueError, OverflowError) as exc:   # past the address space (a 32-bit or capped one)
            raise ConfigError(f"--data {path}: cannot map its {size:,} bytes into memory ({exc}); split it into "
                              f"smaller files or raise the address-space limit (ulimit -v)") from None
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, OverflowError) as exc:
            raise ConfigError(f"--data {path}: not a NumPy array file ({exc})") from None
        if tokens.dtype.name not in DTYPES or tokens.ndim != 1:
            raise ConfigError(f"--data {path}: a {tokens.ndim}-d {tokens.dtype} array; a token file is 1-d "
                              f"{', '.join(DTYPES)}")
        return tokens
    raise ConfigError(f"--data {path}: unknown format '{path.suffix}'; use nanoGPT's uint16 .bin or a 1-d .npy")


def data_identity(path: str | Path) -> str:
    """What a checkpoint records of the --data file it was trained on, for --resume to check: its size and a sha256
    of its first and last MiB ("size 1,234 sha256 ab12..."). Cheap for any size; a file changed only in its middle
    would pass (its windows would still be read in the same order)."""
    import hashlib
    p = Path(path)
    try:
        size = p.stat().st_size
        h = hashlib.sha256()
        with p.open("rb") as fh:
            h.update(fh.read(_ENDS))
            fh.seek(max(0, size - _ENDS))
            h.update(fh.read(_ENDS))
    except OSError as exc:
        raise ConfigError(f"--data {p}: {exc.strerror or exc}") from None
    return f"size {size:,} sha256 {h.hexdigest()[:16]}"
