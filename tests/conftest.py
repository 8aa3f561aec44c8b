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

# The modules with the most rank launches, longest first. Under `-n 2 --dist loadscope` each module runs whole on one
# worker and xdist hands modules out in collection order (its reordering by test count is switched off below), so
# the long ones start first and the two workers finish together (longest-first scheduling); the rest keep their
# order after these.
LONGEST_FIRST = ("test_hf_executor", "test_moe", "test_tensor_parallel", "test_checkpoint", "test_bad_inputs",
                 "test_executor", "test_fault_matrix", "test_fidelity_smoke", "test_pipelining", "test_search_bounds",
                 "test_profiler", "test_data", "test_context_parallel", "test_cluster_probe", "test_own_model",
                 "test_cli_profile", "test_zoo_params", "test_checkpoint_trust", "test_plan", "test_verify")


def pytest_configure(config):
    # pytest-xdist >= 3.6 sorts modules by test count otherwise (unless asked for on the command line)
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1][:-3], len(place)))


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
