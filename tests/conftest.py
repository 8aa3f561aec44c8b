import os

import pytest
import torch

# Two cores here: one thread per process keeps timings and multi-process tests from fighting over them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_profiles():
    """Real and meta profiles of the tiny zoo models, shared by tests that only read them."""
    from cost_models.model_profiler import profile_model
    from cost_models.models.source import resolve
    out = {}
    for name in ("gpt-tiny", "llama-tiny", "mlp-deep"):
        for meta in (False, True):
            out[name, meta] = profile_model(resolve(name), micro_batch_size=2, seq_len=16, dtype="fp32", meta=meta,
                                            warmup=1, repeats=3)
    return out
