"""The best model-FLOPs utilisation published for a GPU class, as a plausibility bound on predictions.

Each bound is a measured run's published throughput expressed in the estimate's own MFU convention (PaLM's model
FLOPs, Chowdhery et al. 2022 appendix B, over the datasheet's dense peak): the row's MFU as the estimate computes it
for the same model and layout, times published / predicted throughput (benchmarks/published_runs.py; the figures
are in benchmarks/results/published_runs.json). A prediction above the best that anyone has published for that
GPU and precision is more likely the cost model's optimism than a discovery, so the CLI and the report flag it.
Only 16-bit training has bounds: no large fp32 runs are published.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MFUBound:
    gpu: str          # the GPU class, found in the cluster's device name ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3")
    mfu: float
    source: str


BEST_PUBLISHED_MFU = (
    # torchtitan docs/performance.md: llama2-13b, FSDP2 over 64 A100 80GB, local batch 2 x 4096, no activation
    # checkpointing, 2,162 tokens/s/GPU (published_runs.json row T3)
    MFUBound(gpu="A100", mfu=0.60, source="torchtitan's llama2-13b on 64 A100s, 2,162 tokens/s/GPU"),
    # NVIDIA/Megatron-LM README H100 table: 462B GPT, TP8 x PP16 x DP48 on 6,144 H100s, 459.9 TFLOP/s/GPU in
    # Megatron-LM's FLOPs formula, which counts PaLM's model FLOPs (published_runs.json row H9)
    MFUBound(gpu="H100", mfu=0.465, source="Megatron-LM's 462B GPT on 6,144 H100s, 459.9 TFLOP/s/GPU"),
)


def mfu_bound(device_name: str, precision: str) -> MFUBound | None:
    """The published bound for this device and precision, or None (no bound: another GPU, fp32, CPU ranks)."""
    if precision != "bf16-mixed":
        return None
    return next((b for b in BEST_PUBLISHED_MFU if b.gpu in device_name), None)


def implausible_mfu(mfu: float | None, device_name: str, precision: str) -> str | None:
    """One line when a predicted MFU is above the best published for its GPU class and precision, else None."""
    bound = mfu_bound(device_name, precision)
    if mfu is None or bound is None or mfu <= bound.mfu:
        return None
    return (f"predicted MFU {mfu:.1%} is above the best published for {bound.gpu} in {precision} ({bound.mfu:.1%}: "
            f"{bound.source}): the prediction is likely optimistic")
