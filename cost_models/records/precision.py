"""What a precision and an optimizer cost in bytes: per element by dtype, per parameter by training recipe.

Per parameter (parameter, gradient, optimizer state K) as the ZeRO paper splits them (Rajbhandari et al. 2020,
"ZeRO", sections 3.1 and 5; DeepSpeed's estimate_zero*_model_states_mem_needs names the same terms):
    bf16-mixed + Adam/AdamW: 2 B bf16 parameter + 2 B bf16 gradient + K = 12 B (4 B fp32 master + 4 B momentum
                             + 4 B variance)                                                  = 16 B
    fp32 + Adam/AdamW:       4 + 4 + K = 8 (momentum + variance)                              = 16 B
    bf16-mixed + SGD:        2 + 2 + K = 8 (4 B master + 4 B momentum)                         = 12 B
    fp32 + SGD (momentum):   4 + 4 + K = 4 (momentum)                                          = 12 B
cost_models.cost.memory prices ZeRO's division of these over data-parallel ranks.
"""
from __future__ import annotations

from typing import Literal

from cost_models.records.errors import ConfigError

Precision = Literal["fp32", "bf16-mixed"]
Optimizer = Literal["adamw", "adam", "sgd"]

# bytes per element of the dtypes a profile is taken in and ranks compute in (IEEE 754 binary32; bfloat16 and
# binary16 are 16-bit formats)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# bytes per parameter: (parameter, gradient, optimizer state K) by (precision, optimizer); see the module doc
BYTES_PER_PARAM: dict[tuple[str, str], tuple[int, int, int]] = {
    ("bf16-mixed", "adamw"): (2, 2, 12), ("bf16-mixed", "adam"): (2, 2, 12), ("bf16-mixed", "sgd"): (2, 2, 8),
    ("fp32", "adamw"): (4, 4, 8), ("fp32", "adam"): (4, 4, 8), ("fp32", "sgd"): (4, 4, 4),
}


def check_training(precision: str, optimizer: str) -> None:
    """The (precision, optimizer) pairs the cost model and the executor know (BYTES_PER_PARAM's keys)."""
    if (precision, optimizer) not in BYTES_PER_PARAM:
        raise ConfigError("--precision must be bf16-mixed or fp32 and --optimizer adamw, adam or sgd")
