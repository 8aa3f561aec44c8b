"""executor.weights: pretrained weights (an HF folder, a planner run checkpoint) loaded into a rank's share of the
model, in place. Tests that need transformers (or safetensors) skip without it; the 2-rank FSDP2 test is slow."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from cost_models.records.errors import WeightsError
from cost_models.records.strategy import Strategy
from executor import checkpoint
from executor import checkpoint_layout as layout
from executor.weights import DCP, HF_INDEX, SAFETENSORS, WeightsLoaded, check_weights, load_weights
from tests.plans import GPT_TINY_UNITS, plan_for


def _gpt2(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    # 63 positions: the position table splits unevenly over 2 FSDP2 ranks (32 + 31 rows)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=63, bos_token_id=0, eos_token_id=0))


def _llama(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _moe(family: str, seed: int, experts: int = 3) -> nn.Module:
    """transformers' Mixtral or Qwen3-MoE, tiny: `experts` routed experts (3: FSDP2 splits them 2 + 1)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                 num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **sizes, intermediate_size=96, num_local_experts=experts))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **sizes, moe_intermediate_size=32, num_experts=experts, head_dim=16))


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _save_hf(model: nn.Module, folder: Path, sharded: bool) -> Path:
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if sharded else {}))
    assert (folder / HF_INDEX).is_file() == sharded
    return folder


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded-index"])
@pytest.mark.parametrize("family", MODELS)
def test_an_hf_folder_fills_a_differently_seeded_copy(tmp_path, family, sharded):
    saved = MODELS[family](seed=0)
    folder = _save_hf(saved, tmp_path / "hf", sharded)
    model = MODELS[family](seed=1)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    before = {n: b.clone() for n, b in buffers.items()}
    assert not any(torch.equal(params[n], p) for n, p in saved.named_parameters() if p.dim() == 2)
    loaded = load_weights(params, buffers, folder)
    # GPT-2's file has no lm_head.weight (tied to transformer.wte.weight, the canonical name): nothing missing
    assert loaded == WeightsLoaded(format=SAFETENSORS, source=str(folder), tensors=len(params),
                                   bytes_read=_nbytes(params.values()))
    for name, p in saved.named_parameters():
        assert torch.equal(params[name], p), name
    assert all(torch.equal(buffers[n], before[n]) for n in buffers)   # Llama's rotary tables: not in the file, kept
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():   # eval: GPT-2's dropout
        assert torch.equal(model.eval()(ids).logits, saved.eval()(ids).logits)


def test_a_bf16_file_loads_into_fp32_parameters_and_reads_half_the_bytes(tmp_path):
    saved = _gpt2(seed=0).to(torch.bfloat16)
    folder = _save_hf(saved, tmp_path / "hf", sharded=True)
    model = _gpt2(seed=1)
    params = dict(model.named_parameters())
    loaded = load_weights(params, {}, folder)
    assert loaded.bytes_read == _nbytes(params.values()) // 2
    for name, p in saved.named_parameters():
        assert params[name].dtype == torch.float32 and torch.equal(params[name], p.float()), name


def test_a_folder_saved_from_the_base_model_loads_without_its_prefix(tmp_path):
    """The hub's GPT-2 was saved from GPT2Model: "h.0.attn.c_attn.weight" for "transformer.h.0.attn.c_attn.weight"."""
    saved = _gpt2(seed=0)
    saved.transformer.save_pretrained(tmp_path / "base")
    assert "h.0.attn.c_attn.weight" in _file_tensors(tmp_path / "base")
    model = _gpt2(seed=1)
    params = dict(model.named_parameters())
    assert load_weights(params, {}, tmp_path / "base").tensors == len(params)
    assert all(torch.equal(params[n], p) for n, p in saved.named_parameters())


def test_keys_transformers_renames_on_load_are_read_under_the_model_s_names(tmp_path):
    """Pythia's files (GPT-NeoX) name the head `embed_out`; transformers' GPTNeoXForCausalLM calls it `lm_head` and
    renames the key on load: --init-from does the same, in the launcher's check and on every rank."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, vocab_size=128)
    torch.manual_seed(0)
    saved = transformers.GPTNeoXForCausalLM(config)
    (tmp_path / "pythia").mkdir()
    tensors = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in saved.state_dict().items()}
    safetensors_torch.save_file(tensors, str(tmp_path / "pythia" / "model.safetensors"))
    torch.manual_seed(1)
    model = transformers.GPTNeoXForCausalLM(config)
    assert check_weights(model, tmp_path / "pythia") == ()
    params = dict(model.named_parameters())
    with pytest.raises(WeightsError, match=r"has no weights for lm_head.weight"):
        load_weights(params, {}, tmp_path / "pythia")   # without the model, no class to take the rules from
    assert load_weights(params, {}, tmp_path / "pythia", model=model).tensors == len(params)
    assert all(torch.equal(params[n], p) for n, p in saved.named_parameters())
    config.save_pretrained(tmp_path / "pythia")
    reference = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "pythia")
    assert torch.equal(reference.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_saved_one_tensor_per_expert_are_stacked_as_transformers_stacks_them(tmp_path, family):
    """save_pretrained writes a mixture of experts' stacked experts back one tensor per expert (Mixtral's w1/w3/w2,
    Qwen3-MoE's gate/up/down_proj): --init-from reads them into the stacked tensors, gate before up, as
    from_pretrained does; an expert missing from the folder, or a model with more experts, is one line."""
    saved = _moe(family, seed=0)
    saved.save_pretrained(tmp_path / "hf")
    assert not any("gate_up_proj" in k for k in _file_tensors(tmp_path / "hf"))
    reference = type(saved).from_pretrained(tmp_path / "hf")
    model = _moe(family, seed=1)
    params = dict(model.named_parameters())
    assert not torch.equal(params["model.layers.0.mlp.experts.gate_up_proj"],
                           saved.model.layers[0].mlp.experts.gate_up_proj)
    assert check_weights(model, tmp_path / "hf") == ()
    loaded = load_weights(params, {}, tmp_path / "hf", model=model)
    assert all(torch.equal(params[n], p) for n, p in reference.named_parameters())
    stacked = [n for n in params if n.endswith(("gate_up_proj", "down_proj"))]
    # each layer's two stacked tensors are read as 3 experts x (gate, up, down)
    assert loaded.tensors == len(params) - len(stacked) + 9 * len(stacked) // 2
    with pytest.raises(WeightsError, match=r"was it saved from another configuration of the model\?$"):
        check_weights(_moe(family, seed=1, experts=4), tmp_path / "hf")
    files = _file_tensors(tmp_path / "hf")
    gone = next(k for k in files if ".experts.2." in k and "layers.1." in k)
    del files[gone]
    (tmp_path / "cut").mkdir()
    pytest.importorskip("safetensors.torch").save_file(files, str(tmp_path / "cut" / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"gate_up_proj stacks 3 experts x 2 tensor\(s\); the folder has 5 "
                                           r"matching tensors, not 6|down_proj stacks 3 experts x 1 tensor\(s\); the "
                                           r"folder has 2 matching tensors, not 3"):
        load_weights(params, {}, tmp_path / "cut", model=model)


class _Net(nn.Module):
    def __init__(self, hidden: int = 6, layers: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(4 if i == 0 else hidden, hidden) for i in range(layers)])
        self.norm = nn.BatchNorm1d(hidden)           # persistent buffers: running_mean, running_var, num_batches
        self.register_buffer("scratch", torch.full((3,), 7.0), persistent=False)


def _save_net(net: nn.Module, folder: Path, drop: tuple[str, ...] = ()) -> Path:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder.mkdir()
    safetensors_torch.save_file({k: v for k, v in net.state_dict().items() if k not in drop},
                                str(folder / "model.safetensors"))
    return folder


def test_persistent_buffers_load_when_the_file_has_them_and_keep_their_values_otherwise(tmp_path):
    torch.manual_seed(0)
    saved = _Net()
    saved.norm.running_mean.fill_(0.5)
    saved.norm.num_batches_tracked.fill_(9)
    folder = _save_net(saved, tmp_path / "w", drop=("norm.running_var",))
    torch.manual_seed(1)
    net = _Net()
    buffers = dict(net.named_buffers())
    loaded = load_weights(dict(net.named_parameters()), buffers, folder)
    assert loaded.tensors == 4 + 2       # 2 Linear + 2 BatchNorm parameters, running_mean and num_batches_tracked
    assert torch.equal(net.norm.running_mean, torch.full((6,), 0.5)) and int(net.norm.num_batches_tracked) == 9
    assert torch.equal(net.norm.running_var, torch.ones(6)) and torch.equal(net.scratch, torch.full((3,), 7.0))
    assert all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in net.named_parameters())


def _error(params, buffers, folder) -> str:
    with pytest.raises(WeightsError) as exc:
        load_weights(params, buffers, folder)
    message = str(exc.value)
    assert "\n" not in message
    return message


NEEDS = ("an HF folder (config.json with model.safetensors, or model.safetensors.index.json and its shards) or a "
         "planner run checkpoint (a --checkpoint-dir folder or one of its step-NNNNNNNN folders)")


def test_what_does_not_fit_is_refused_in_one_line(tmp_path):
    small = _save_net(_Net(), tmp_path / "small", drop=("body.0.bias",))
    deep = _Net(layers=3)
    assert _error(dict(deep.named_parameters()), {}, small) == (
        f"--init-from {small} has no weights for body.0.bias (nor for 4 more of the 8 parameters this model has "
        f"here); was it saved from another model?")
    wide = _Net(hidden=8)
    assert _error(dict(wide.named_parameters()), {}, _save_net(_Net(), tmp_path / "narrow")) == (
        f"--init-from {tmp_path / 'narrow'}: body.0.weight has shape (6, 4) there, the model's is (8, 4); was it "
        f"saved from another configuration of the model?")
    params = dict(_Net().named_parameters())
    (tmp_path / "empty").mkdir()
    assert _error(params, {}, tmp_path / "empty") == f"--init-from {tmp_path / 'empty'} holds no weights; it must be " \
                                                     f"{NEEDS}"
    assert _error(params, {}, tmp_path / "nowhere") == f"--init-from {tmp_path / 'nowhere'} does not exist; it must " \
                                                       f"be {NEEDS}"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"pickle")
    assert "holds only PyTorch .bin weights" in _error(params, {}, tmp_path / "bin")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes((small / "model.safetensors").read_bytes()[:-40])
    assert _error(params, {}, tmp_path / "cut").startswith(
        f"--init-from {tmp_path / 'cut'}: model.safetensors is not a readable safetensors file (")
    (tmp_path / "small" / HF_INDEX).write_text('{"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}}')
    assert _error(params, {}, small) == (f"--init-from {small}: {HF_INDEX} names model-2.safetensors (and 0 more "
                                         f"shards) that the folder does not hold; copy the whole folder")


def test_the_whole_model_is_checked_before_any_rank_starts(tmp_path):
    """check_weights (the launcher's, and apply_plan's, before ranks build anything): a deeper model's file into a
    shallower model is refused for the tensors nothing takes, or with allow_extra named in a warning; integers into
    floats are refused; the hub GPT-2's base-model names and a float dtype into another load."""
    deep = _save_net(_Net(layers=3), tmp_path / "deep")
    with torch.device("meta"):
        shallow, net = _Net(layers=2), _Net()
    with pytest.raises(WeightsError) as exc:
        check_weights(shallow, deep)
    assert str(exc.value) == (f"--init-from {deep} holds 2 tensor(s) this model has no place for (body.2.bias, "
                              f"body.2.weight); was it saved from another configuration? (--allow-extra loads the "
                              f"rest anyway)")
    assert check_weights(shallow, deep, allow_extra=True) == (
        f"--init-from {deep}: 2 tensor(s) left unread, the model has no place for them (body.2.bias, body.2.weight)",)
    saved = _Net()
    state = {k: (v.to(torch.int64) if k == "body.0.weight" else v.to(torch.bfloat16) if v.is_floating_point()
                 else v) for k, v in saved.state_dict().items()}
    safetensors_torch = pytest.importorskip("safetensors.torch")
    (tmp_path / "ints").mkdir()
    safetensors_torch.save_file(state, str(tmp_path / "ints" / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"body.0.weight is int64 there, the model's is float32"):
        check_weights(net, tmp_path / "ints")
    with pytest.raises(WeightsError, match=r"body.0.weight is int64 there"):   # each rank's load refuses it too
        load_weights(dict(_Net().named_parameters()), {}, tmp_path / "ints")
    state["body.0.weight"] = saved.body[0].weight.detach().to(torch.bfloat16)
    safetensors_torch.save_file(state, str(tmp_path / "ints" / "model.safetensors"))
    assert check_weights(net, tmp_path / "ints") == ()


@pytest.fixture(scope="module")
def plan():
    """A plan to list in checkpoints' meta (load_weights reads only the model's tensors of a checkpoint)."""
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    profile = profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    return plan_for(Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=1,
                             stages=(GPT_TINY_UNITS,)), profile)


def _meta_fields(plan, world_size: int) -> dict:
    return {"samples_seen": 8, "seed": 0, "lr": 1e-3, "loss": 1.0, "world_size": world_size, "plan": plan,
            "torch_version": torch.__version__}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_planner_checkpoint_gives_its_model_tensors_only_and_must_be_signed(tmp_path, plan):
    """A checkpoint as planner run writes it (model, optimizer and RNG keys; signed listing), made in one process."""
    torch.manual_seed(0)
    saved = _Net()
    opt = torch.optim.AdamW(saved.parameters())
    checkpoint.init_optimizer_state(opt, list(saved.parameters()))
    persistent = {n: b for n, b in saved.named_buffers() if n in saved.state_dict()}
    sd = checkpoint.state_dict(dict(saved.named_parameters()), persistent, opt, rng_rank=0)
    assert any(k.startswith("optim.") for k in sd) and any(k.startswith("rng.") for k in sd)
    tmp = layout.incomplete_dir(tmp_path / "ck", 3)
    tmp.mkdir(parents=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    step = layout.commit(tmp_path / "ck", 3, _meta_fields(plan, 1), [])
    torch.manual_seed(1)
    net = _Net()
    params = dict(net.named_parameters())
    loaded = load_weights(params, dict(net.named_buffers()), tmp_path / "ck")   # the folder: its latest step
    assert loaded == WeightsLoaded(format=DCP, source=str(step), tensors=7,
                                   bytes_read=_nbytes(saved.state_dict().values()))
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in net.state_dict().items())
    deeper = dict(_Net(layers=2).named_parameters())
    assert _error(deeper, {}, step) == (f"--init-from {step} has no weights for body.1.weight (nor for 1 more of the "
                                        f"6 parameters this model has here); was it saved from another model?")
    (step / layout.SIG_NAME).unlink()
    with pytest.raises(layout.CheckpointError, match="is not signed .* pass --trust-checkpoint"):
        load_weights(params, {}, step)
    assert load_weights(params, {}, step, trusted=True).tensors == 4


# ---- 2 ranks, FSDP2 --------------------------------------------------------------------------------------------

class _CountingReads:
    """executor.weights' two file readers (_read_into: whole rows straight into the tensor; _read_rows: through a
    buffer), counting the bytes every positioned read returns (the reader looks them up in its module when it
    reads, so patching the module's attributes reaches it)."""

    originals: dict = {}
    read: list[int] = []

    @staticmethod
    def into(*args):
        nbytes = _CountingReads.originals["_read_into"](*args)
        _CountingReads.read.append(nbytes)
        return nbytes

    @staticmethod
    def rows(*args):
        tensor, nbytes = _CountingReads.originals["_read_rows"](*args)
        _CountingReads.read.append(nbytes)
        return tensor, nbytes

    @classmethod
    def patch(cls, module) -> None:
        cls.originals = {"_read_into": module._read_into, "_read_rows": module._read_rows}
        module._read_into, module._read_rows = cls.into, cls.rows

    @classmethod
    def unpatch(cls, module) -> None:
        module._read_into, module._read_rows = cls.originals["_read_into"], cls.originals["_read_rows"]


def _sharded(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _rank_loads_its_shard(rank: int, tmp: Path, meta_fields: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from executor import weights
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        _CountingReads.patch(weights)
        for family in MODELS:
            _check_hf_shard(rank, _sharded(MODELS[family](seed=1), mesh), tmp / family, _file_tensors(tmp / family))
        moe = _moe("mixtral", seed=0)   # experts stacked from one tensor per expert, 2 + 1 over the ranks
        whole = dict(type(moe).from_pretrained(tmp / "mixtral").named_parameters())
        _check_hf_shard(rank, _sharded(_moe("mixtral", seed=1), mesh), tmp / "mixtral", whole)
        _CountingReads.unpatch(weights)
        model = _sharded(_gpt2(seed=1), mesh)
        params = dict(model.named_parameters())
        load_weights(params, {}, tmp / "gpt2")
        sd = checkpoint.state_dict(params, {}, torch.optim.SGD(model.parameters()), rng_rank=rank)
        checkpoint.save(sd, tmp / "ck", 1, meta_fields)
        again = _sharded(_gpt2(seed=2), mesh)
        params = dict(again.named_parameters())
        loaded = load_weights(params, {}, tmp / "ck")
        assert loaded.bytes_read == _nbytes(p.to_local() for p in params.values())   # its own chunks, written by it
        for name, p in model.named_parameters():
            assert torch.equal(params[name].to_local(), p.to_local()), name
    finally:
        dist.destroy_process_group()


def _check_hf_shard(rank: int, model: nn.Module, folder: Path, whole: dict[str, torch.Tensor]) -> None:
    """Each parameter's local shard is its rows of `whole` (the model's tensors, loaded in one process), and the
    rank reads those rows only."""
    params = dict(model.named_parameters())
    _CountingReads.read.clear()
    loaded = load_weights(params, {}, folder, model=model)
    for name, p in params.items():
        assert torch.equal(p.to_local(), torch.chunk(whole[name], 2, dim=0)[rank]), name   # FSDP2: Shard(0)
    mine = _nbytes(p.to_local() for p in params.values())
    assert loaded.bytes_read == sum(_CountingReads.read) == mine
    assert mine < 0.7 * _nbytes(whole[n] for n in params), (mine, folder.name)   # 3 experts split 2 + 1
    print(f"rank {rank} {folder.name}: read {mine} of {_nbytes(whole[n] for n in params)} bytes", flush=True)


@pytest.mark.slow
def test_each_fsdp2_rank_reads_only_its_shard(tmp_path, plan):
    """2 ranks on gloo, FSDP2 per layer then root: from an HF folder (GPT-2 single file, Llama sharded, Mixtral's
    experts one tensor per expert) each rank's local shard equals its rows of the model, and the bytes it reads are
    its shard's (counted at safetensors' get_slice); a checkpoint those ranks save loads back into the same layout and, in one process, whole."""
    import torch.multiprocessing as mp
    _save_hf(_gpt2(seed=0), tmp_path / "gpt2", sharded=False)
    _save_hf(_llama(seed=0), tmp_path / "llama", sharded=True)
    _moe("mixtral", seed=0).save_pretrained(tmp_path / "mixtral")
    mp.spawn(_rank_loads_its_shard, args=(tmp_path, _meta_fields(plan, 2)), nprocs=2)
    model = _gpt2(seed=3)
    params = dict(model.named_parameters())
    loaded = load_weights(params, {}, tmp_path / "ck")
    assert loaded.format == DCP and loaded.bytes_read == _nbytes(params.values())
    files = _file_tensors(tmp_path / "gpt2")
    assert all(torch.equal(p, files[n]) for n, p in params.items())


def test_buffers_the_model_does_not_save_and_keys_transformers_ignores_are_no_sign_of_another_model(tmp_path):
    """A file holding a non-persistent buffer (in another dtype: GPT-2's old bool attn masks) and keys the model
    class tells transformers to ignore loads; a key neither is still refused."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {**_Net().state_dict(), "scratch": torch.zeros(3, dtype=torch.bool), "h.0.attn.bias": torch.ones(2)}
    (tmp_path / "w").mkdir()
    safetensors_torch.save_file(state, str(tmp_path / "w" / "model.safetensors"))
    with torch.device("meta"):
        net = _Net()
    with pytest.raises(WeightsError, match=r"1 tensor\(s\) this model has no place for \(h.0.attn.bias\)"):
        check_weights(net, tmp_path / "w")
    net._keys_to_ignore_on_load_unexpected = [r"attn\.bias"]
    assert check_weights(net, tmp_path / "w") == ()
