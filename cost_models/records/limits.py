"""The largest degrees, batch, node and micro-batch counts this planner accepts, and one check per concern.

Why caps: the cost model's work grows with these numbers (the estimate lists every rank's memory; the schedule
simulator walks every micro-batch of every stage), so a typo like `--dp 1000000000` would otherwise run for
minutes and exhaust memory instead of saying what is wrong. Each maximum sits far above any training run
reported to date, so a real configuration never meets one. Each check raises a one-line ConfigError.
"""
from __future__ import annotations

from cost_models.records.errors import ConfigError

# Devices (dp x pp, --gpus, nodes x devices per node). The largest clusters reported to train one model hold
# ~100k GPUs (xAI's Colossus, 100k H100 as announced in 2024; Llama 3 405B trained on 16k H100, Dubey et al.
# 2024, section 3.3); 2^17 leaves headroom. The full estimate lists one memory entry per rank, so this also
# bounds that list (its cost at the cap: benchmarks/results/measurements.md, "Planning limits").
MAX_GPUS = 2**17
# Nodes: a node holds at least one device, so no cluster within MAX_GPUS has more nodes than that (a preset's
# 8-GPU nodes reach MAX_GPUS at 16,384 nodes; with_nodes also checks the device count).
MAX_NODES = MAX_GPUS
# Sequences per optimizer step (dp x micro-batches x micro-batch size for a strategy, so it bounds the micro-batch
# size too). Llama 3 405B's largest batch was 16M tokens = 2,048 sequences of 8,192 (Dubey et al. 2024, section
# 3.4.1); GPT-3 175B's 3.2M tokens ~ 1,600 sequences of 2,048 (Brown et al. 2020, table 2.1). 2^22 = 4,194,304
# is three orders of magnitude above practice.
MAX_GLOBAL_BATCH = 2**22
# Micro-batches per pipeline per step. The simulator walks every action, m x pp x v of them (x2, x3 with B split
# into I and W; cost_models/records/schedule.py): 1,024 on a 128-stage pipeline (the deepest a 128-layer model
# allows) is ~260k actions, seconds for one estimate (measured: benchmarks/results/measurements.md, "Planning
# limits").
# More buys nothing real: the bubble (p-1)/m (Narayanan et al. 2021, section 2.2) is already below 1/8 at
# m = 1,024 for p = 128, and practice is far lower (Llama 3 405B: 16 stages, Dubey et al. 2024, section 3.3.2).
MAX_MICROBATCHES = 1024
# Tokens per sequence. Profiling allocates one micro-batch of it, and a run every rank's: 10^9 on a model without
# a length limit asked 16 GB of each rank. The longest published pre-training context is 128K tokens (Llama 3,
# Dubey et al. 2024, section 3.4.2); 2^22 = 4,194,304 is 32 times that.
MAX_SEQ_LEN = 2**22
# Parts of one fused projection a tensor-parallel rule splits separately (TPRule.parts: q, k, v are 3). A fused
# mixture of experts is the most there is: DeepSeek-V3 has 256 routed experts (DeepSeek-AI 2024, section 2.1.2);
# 1,024 is four times that. Each part is a slice the executor cuts: 10^9 parts ended in MemoryError after 128 s.
MAX_FUSED_PARTS = 1024


def _check_range(flag: str, value: int, maximum: int, hint: str) -> None:
    if value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")
    if value > maximum:
        raise ConfigError(f"{flag} {value} is above the {maximum:,} this planner supports; {hint}")


def check_gpus(gpus: int, flag: str = "--gpus") -> None:
    """Refuse a device count (`--gpus`, or dp x pp of a strategy) below 1 or above MAX_GPUS."""
    _check_range(flag, gpus, MAX_GPUS, "lower it (the largest clusters trained on today hold about 100,000 devices)")


def check_nodes(nodes: int, devices_per_node: int) -> None:
    """Refuse a node count below 1, or one above MAX_NODES or making more than MAX_GPUS devices."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    if nodes > MAX_NODES or nodes * devices_per_node > MAX_GPUS:
        raise ConfigError(f"--nodes {nodes} makes {nodes * devices_per_node:,} devices ({devices_per_node} per node), "
                          f"above the {MAX_GPUS:,} this planner supports; use at most "
                          f"{MAX_GPUS // max(1, devices_per_node):,} nodes")


def check_seq_len(seq_len: int, flag: str = "--seq-len") -> None:
    """Refuse a sequence length below 1 or above MAX_SEQ_LEN."""
    _check_range(flag, seq_len, MAX_SEQ_LEN, "lower it (the longest published training contexts are 128K tokens)")


def check_fused_parts(parts: int, flag: str = "parts") -> None:
    """Refuse a TP rule's fused parts below 1 or above MAX_FUSED_PARTS."""
    _check_range(flag, parts, MAX_FUSED_PARTS, "a fused projection has a few parts (q, k, v: 3)")


def check_global_batch(global_batch: int, flag: str = "--global-batch-size") -> None:
    """Refuse a global batch (sequences per step) below 1 or above MAX_GLOBAL_BATCH."""
    _check_range(flag, global_batch, MAX_GLOBAL_BATCH,
                 "lower it (the largest published runs use a few thousand sequences per step)")


def check_microbatches(microbatches: int, flag: str = "--microbatches") -> None:
    """Refuse a micro-batch count per pipeline below 1 or above MAX_MICROBATCHES."""
    _check_range(flag, microbatches, MAX_MICROBATCHES,
                 "use larger micro-batches (--micro-batch-size) to reach the same global batch")
