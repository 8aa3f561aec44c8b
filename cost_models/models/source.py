"""Resolve a `--model` reference into something that builds the module and its example input.

Three kinds of reference:
  * a zoo name (`gpt2-small`, `llama3-70b`, `gpt-tiny`, ...);
  * `package.module:factory` or `path/to/file.py:factory`: `factory()` returns an `nn.Module`; its example input
    comes from `--input package.module:function` (`function(batch_size, seq_len)`), else from the model's own
    `example_input(batch_size, seq_len)` method, else token ids when the model's first module is an nn.Embedding;
  * `hf:MODEL_TYPE[?key=value&...]` or `hf:path/to/config.json`: a transformers causal LM built from its config
    alone (never downloading weights); needs the `hf` extra.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from cost_models.models.mlp import MLPConfig
from cost_models.models.moe import shape_only_experts
from cost_models.models.zoo import ZOO, ZooEntry, build_zoo_model
from cost_models.records.errors import ModelSourceError
from cost_models.records.profile import InputSpec
from cost_models.torch_compat.torch_private import meta_nonzero_all

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model` reference: how to build the module and one micro-batch of input for it."""

    ref: str
    kind: str  # "zoo" | "factory" | "hf"
    name: str
    _build: Callable[[], nn.Module]
    _input: Callable[[nn.Module, int, int], tuple[torch.Tensor, ...]]
    max_seq_len: int | None = None
    _forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context to run the model's forward in (hf: models need one on the meta device, see _hf_source)."""
        return self._forward_context()

    def build(self, *, device: str | torch.device | None, dtype: torch.dtype, seed: int = 0) -> nn.Module:
        """Build the model on `device` ("meta" allocates nothing; None: wherever the caller's context puts new
        tensors) in `dtype`, after torch.manual_seed(seed): the model's own initialisation, reproducible."""
        torch.manual_seed(seed)
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = self._build()
        except ModelSourceError:
            raise
        except Exception as exc:  # a user's factory can raise anything; report it in one line
            raise ModelSourceError(f"building model '{self.ref}' failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise ModelSourceError(f"'{self.ref}' returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(dtype=dtype)

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse a sequence longer than the model takes (its positions table, its config's context)."""
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise ModelSourceError(f"{self.name} supports --seq-len up to {self.max_seq_len}, got {seq_len}")

    def example_input(self, model: nn.Module, batch_size: int, seq_len: int, device: str | torch.device) -> tuple[torch.Tensor, ...]:
        """One micro-batch of synthetic input, made on the CPU with a fixed seed and moved to `device`."""
        self.check_seq_len(seq_len)
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(1234)
        try:
            inputs = self._input(model, batch_size, seq_len)
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ModelSourceError(f"making the example input for '{self.ref}' failed: {type(exc).__name__}: {exc}") from None
        finally:
            torch.random.set_rng_state(gen_state)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelSourceError(f"the example input for '{self.ref}' must be a tensor or a tuple of tensors")
        return tuple(t.to(device) for t in inputs)


@contextlib.contextmanager
def meta_forward_context(model: nn.Module | None = None) -> Iterator[None]:
    """Context to run a forward on meta tensors. transformers (5.x) probes position_ids for packed sequences with a
    data-dependent branch, which cannot run on meta tensors; one sequence per row (synthetic batches, token-file
    windows) is never packed, so the probe's answer is known. Its MoE experts pick each expert's tokens with
    nonzero: on meta every position is taken (shapes stay right; the counts do not, which is why meta profiles
    refuse those blocks: models.moe.check_meta_routing); given the `model`, such experts return zeros of their
    input's shape instead (models.moe.shape_only_experts: for shapes only). Without transformers, a no-op."""
    from unittest import mock
    masking = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            stack.enter_context(mock.patch.object(masking, "find_packed_sequence_indices", lambda *a, **k: None))
            stack.enter_context(meta_nonzero_all())
        if model is not None:
            stack.enter_context(shape_only_experts(model))
        yield


def input_spec(inputs: tuple[torch.Tensor, ...], *, kind: str, vocab_size: int | None) -> InputSpec:
    first = inputs[0]
    return InputSpec(kind=kind, shape=tuple(first.shape), dtype=str(first.dtype).removeprefix("torch."), vocab_size=vocab_size)


def source_input_kind(source: ModelSource, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                      seq_len: int) -> tuple[str, int | None]:
    """What the model is fed, from its example input (a factory's ids are tokens as much as a zoo LM's):
    ('tokens', vocab) for integer (batch, seq_len) ids: an LM, trained with cross-entropy, 8 bytes an id (int64);
    ('features', None) for float (batch, seq_len, ...) sequences, like the zoo's MLP: seq_len positions a sample;
    ('custom', None) for anything else (an image, a vector): throughput counts samples, not positions."""
    if source.kind == "zoo" and source.ref in ZOO:   # a zoo-shaped entry outside ZOO reads as a factory's
        entry = ZOO[source.ref]
        return entry.input_kind, getattr(entry.config, "vocab_size", None)
    first = inputs[0]
    if not (first.dim() >= 2 and first.shape[1] == seq_len):
        return "custom", None     # no sequence axis: ids of one item each (a class, a user) are not tokens
    if not first.is_floating_point() and not first.is_complex() and first.dtype != torch.bool:
        emb = _first_embedding(model)
        return "tokens", emb.num_embeddings if emb is not None else None
    return "features", None


def resolve(ref: str, *, input_ref: str | None = None) -> ModelSource:
    """Turn a `--model` string into a ModelSource, or raise ModelSourceError with the fix in one line."""
    ref = ref.strip()
    if not ref:
        raise ModelSourceError("--model is empty; give a zoo name (see `planner models`), module:factory, or hf:TYPE")
    if ref in ZOO:
        if input_ref:
            raise ModelSourceError("--input applies to module:factory models only; zoo models make their own input")
        return zoo_source(ZOO[ref])
    if ref.startswith("hf:"):
        return _hf_source(ref)
    if ":" in ref:
        return _factory_source(ref, input_ref)
    close = [n for n in ZOO if ref.split("-")[0] in n]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ModelSourceError(f"unknown model '{ref}'{hint}; use a zoo name (see `planner models`), module:factory, or hf:TYPE")


# --- zoo --------------------------------------------------------------------------------------------------------

def zoo_source(entry: ZooEntry) -> ModelSource:
    """A zoo-shaped model from its entry: a named one of ZOO, or a configuration of its families (benchmarks
    build the published runs' GPT sizes so)."""
    def make_input(model: nn.Module, b: int, s: int) -> tuple[torch.Tensor, ...]:
        cfg = entry.config
        if entry.input_kind == "tokens":
            assert not isinstance(cfg, MLPConfig)   # the GPT and Llama families take tokens (ZooEntry.input_kind)
            return (torch.randint(0, cfg.vocab_size, (b, s)),)
        assert isinstance(cfg, MLPConfig)   # the one family fed features
        return (torch.randn(b, s, cfg.in_dim),)

    return ModelSource(ref=entry.name, kind="zoo", name=entry.name, _build=lambda: build_zoo_model(entry),
                       _input=make_input, max_seq_len=entry.max_seq_len)


# --- module:factory ---------------------------------------------------------------------------------------------

def load_attr(ref: str, what: str) -> Callable[..., Any]:
    mod_name, _, attr = ref.rpartition(":")
    if not mod_name or not attr:
        raise ModelSourceError(f"{what} '{ref}' must look like package.module:function or path/to/file.py:function")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise ModelSourceError(f"{what} '{ref}': no such file {path}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            # Like `python -m`, look in the current directory first so a user's own package is found.
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except ModelSourceError:
        raise
    except Exception as exc:
        raise ModelSourceError(f"{what} '{ref}': importing {mod_name} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSourceError(f"{what} '{ref}': {mod_name} has no callable '{attr}'")
    return fn


def _first_embedding(model: nn.Module) -> nn.Embedding | None:
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _factory_source(ref: str, input_ref: str | None) -> ModelSource:
    factory = load_attr(ref, "model factory")
    input_fn = load_attr(input_ref, "input function") if input_ref else None

    def make_input(model: nn.Module, b: int, s: int) -> tuple[torch.Tensor, ...]:
        if input_fn is not None:
            return input_fn(b, s)
        if callable(example_input := getattr(model, "example_input", None)):
            return example_input(b, s)
        emb = _first_embedding(model)
        if emb is not None:
            return (torch.randint(0, emb.num_embeddings, (b, s)),)
        raise ModelSourceError(f"cannot guess the input of '{ref}'; pass --input package.module:function "
                               "(function(batch_size, seq_len) -> tensor) or give the model an example_input method")

    return ModelSource(ref=ref, kind="factory", name=ref.rpartition(":")[2], _build=factory, _input=make_input)


# --- transformers configs ----------------------------------------------------------------------------------------

def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# Keywords transformers' AutoConfig.from_pretrained / for_model read as loading instructions, not config fields
# (PretrainedConfig.get_config_dict): an `hf:` override must never make it fetch, or run code from, anywhere.
# trust_remote_code would run the Python files of a folder's auto_map.
HF_LOADER_KEYS = frozenset({"trust_remote_code", "code_revision", "revision", "cache_dir", "force_download",
                            "resume_download", "proxies", "token", "use_auth_token", "local_files_only", "subfolder",
                            "return_unused_kwargs", "from_pipeline", "from_auto"})


# transformers' built-in attention implementations (AttentionInterface's defaults, transformers 5.x)
HF_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def _hf_overrides(query: str) -> dict[str, Any]:
    """`key=value&...` of an `hf:` reference: config fields only, one line refusing anything else."""
    overrides: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ModelSourceError(f"hf override '{item}' must be key=value (e.g. hf:gpt2?n_layer=4&n_embd=256)")
        if key in HF_LOADER_KEYS or key.startswith("_"):
            raise ModelSourceError(f"hf override '{key}' is a loading option, not a config field; hf: models are "
                                   "built from their config alone and never run code from a folder")
        overrides[key] = _parse_value(value)
    return overrides


def _check_causal(ref: str, config: Any) -> None:
    """hf: models train as causal LMs (next-token targets). An encoder-decoder (T5, BART) is refused; so is an
    encoder of the masked-LM families (BERT, RoBERTa, ...) unless its config says it is a decoder: transformers
    builds their causal-LM class from such a config without a causal mask, so every position would see the next
    tokens it is trained to predict (its loss falls, and it learns nothing a decoder would)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    kind = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelSourceError(f"{ref}: {kind} is an encoder-decoder (seq2seq) model; planner trains causal LMs only, "
                               f"so use a decoder family (llama, mistral, qwen2, gpt2, ...)")
    # besides the masked-LM families, causal-LM classes that attend both ways unless configured as decoders
    # (BertGenerationDecoder) or always (XLNet's permutation LM)
    if (kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES or kind in ("bert-generation", "xlnet")) and not getattr(
            config, "is_decoder", False):
        raise ModelSourceError(f"{ref}: {kind} is an encoder (a masked LM): trained on next-token targets it would see "
                               f"the tokens it predicts; masked-LM training is not supported. Add ?is_decoder=true "
                               f"to train it as a causal decoder, or use a decoder family (llama, gpt2, ...)")


def _hf_source(ref: str) -> ModelSource:
    body = ref[len("hf:"):]
    target, _, query = body.partition("?")
    overrides = _hf_overrides(query)
    # how attention is computed is a loading option of from_config, not a config field; SDPA unless the reference
    # says otherwise (families without SDPA support, or soft-capped attention, need "eager"); only transformers'
    # built-in kernels: any other value names a kernel repository it would download and run
    attention = str(overrides.pop("attn_implementation", "sdpa"))
    if attention not in HF_ATTENTION:
        raise ModelSourceError(f"{ref}: attn_implementation={attention} is not one of {', '.join(HF_ATTENTION)}; hf: "
                               f"models never fetch or run code from elsewhere")
    try:
        import transformers
    except ImportError:
        raise ModelSourceError("hf: models need transformers; install the extra: pip install 'zeropipe[hf]'") from None

    def load_config():
        cfg_path = Path(target)
        try:
            if target.endswith(".json") or cfg_path.is_dir():
                cfg_dir = cfg_path.parent if target.endswith(".json") else cfg_path
                if not (cfg_dir / "config.json").is_file():
                    raise ModelSourceError(f"{ref}: no config.json at {cfg_dir}")
                cfg = transformers.AutoConfig.from_pretrained(str(cfg_dir), local_files_only=True, **overrides)
            else:
                cfg = transformers.AutoConfig.for_model(target, **overrides)
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ModelSourceError(f"{ref}: transformers cannot make a config: {type(exc).__name__}: {exc}") from None
        cfg.use_cache = False
        return cfg

    config = load_config()
    _check_causal(ref, config)

    # MoE experts as their own per-expert loop ("eager"): transformers 5 otherwise picks grouped_mm, whose kernels
    # take bf16 operands only (fp32 CPU ranks fail), and records it on the shared config; 4.x has no such option
    experts = {"experts_implementation": "eager"} if int(transformers.__version__.split(".")[0]) >= 5 else {}

    def build() -> nn.Module:
        with contextlib.redirect_stdout(sys.stderr):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention, **experts)

    def make_input(model: nn.Module, b: int, s: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, int(config.vocab_size), (b, s)),)

    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return ModelSource(ref=ref, kind="hf", name=getattr(config, "model_type", target), _build=build,
                       _input=make_input, max_seq_len=max_pos, _forward_context=meta_forward_context)
