"""The global positions of the tokens a forward sees.

A model sees its whole sequence, positions 0 .. s-1, except under context parallelism, where each rank holds two
chunks of every sequence (Llama 3's load-balanced split: Grattafiori et al. 2024, "The Llama 3 Herd of Models",
section 3.3.2) and its position-dependent parts (rotary tables, learned position embeddings) must use the tokens'
places in the whole sequence. The executor sets them for the span of a step (executor.context_parallel); the zoo's
models read them here. A process-wide value, not a thread-local one: autograd may recompute a checkpointed
forward on another thread (its device threads on GPUs), which must see the same positions.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_POSITIONS: torch.Tensor | None = None


def token_positions(seq_len: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The positions (shape (seq_len,), `dtype`) of a forward's `seq_len` tokens: 0 .. seq_len - 1 unless a step
    set others (sequence_positions), which every forward inside it sees. Made in `dtype` directly: a cast would be
    one more kernel in every attention's forward, which the profile counts."""
    pos = _POSITIONS
    if pos is None:
        return torch.arange(seq_len, device=device, dtype=dtype)
    if pos.numel() != seq_len:
        raise ValueError(f"a forward of {seq_len} tokens inside a step whose tokens are {pos.numel()}")
    return pos.to(device=device, dtype=dtype)


@contextlib.contextmanager
def sequence_positions(positions: torch.Tensor | None) -> Iterator[None]:
    """Forwards (and recomputed forwards) inside see `positions` as their tokens' places (None: their own)."""
    global _POSITIONS
    before, _POSITIONS = _POSITIONS, positions
    try:
        yield
    finally:
        _POSITIONS = before
