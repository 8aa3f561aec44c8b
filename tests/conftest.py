import os

import pytest
import torch

# Two cores here: one thread per process keeps timings and multi-process tests from fighting over them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's ranks are CPU ranks over gloo, as CI has them: on a machine with GPUs, hide them from torch (before
# its first CUDA call) so the same assertions hold there; the GPU paths are checked by benchmarks/gpu_check.sh on a
# GPU machine.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_folder(tmp_path, monkeypatch):
    """Every test runs in its own empty folder: files a user left in the repository (the README's examples write
    profile.json there) never change what a CLI test sees, and tests never write into the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session", autouse=True)
def _own_checkpoint_key(tmp_path_factory):
    """Checkpoints are signed with a key from the user's config folder (executor.trust): tests make their own,
    never the real user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        mp.delenv("ZEROPIPE_CHECKPOINT_KEY", raising=False)
        yield


@pytest.fixture(scope="session")
def tiny_profiles():
    """Real and meta profiles of the tiny zoo models, shared by tests that only read them."""
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    out = {}
    for name in ("gpt-tiny", "llama-tiny", "mlp-deep"):
        for meta in (False, True):
            out[name, meta] = profile_model(resolve(name), micro_batch_size=2, seq_len=16, dtype="fp32", meta=meta,
                                            warmup=1, repeats=3)
    return out
