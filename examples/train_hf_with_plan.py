"""Train an HF causal LM from a token file with a zeropipe plan, inside your own script, under torchrun:

    planner profile --model hf:path/to/folder -b 1 -s 128 --meta -o prof.json
    planner plan prof.json --cluster dgx-a100 --gpus 2 -B 8 --precision fp32 -o plan.json
    torchrun --nproc-per-node 2 examples/train_hf_with_plan.py --plan plan.json --model path/to/folder \\
        --data train.bin [--init-from path/to/folder]

Without --plan and --model it makes its own: a tiny Llama config, planned on the spot for the ranks it is given
(every rank plans the same way, so they agree), and, without --data, a token file of random ids in a temp folder.
The batches are planner run's (executor.data.TokenFile: step k reads windows k*B .. k*B+B-1; each data-parallel
replica takes its slice), so this script and `planner run --data` train on the same tokens.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from executor.api import apply_plan
from executor.data import TokenFile
from planner.plan import Plan
from planner.request import PlanRequest
from planner.search import plan as make_plan

TINY = ("hf:llama?num_hidden_layers=4&hidden_size=128&intermediate_size=256&num_attention_heads=4"
        "&num_key_value_heads=2&vocab_size=512")


def _plan(args, world: int) -> Plan:
    if args.plan:
        return Plan.load(args.plan)
    profile = profile_model(resolve(TINY), micro_batch_size=1, seq_len=64, meta=True, dtype="fp32")
    return make_plan(profile, preset("dgx-a100"), PlanRequest(gpus=world, global_batch_size=8, precision="fp32"))


def _data(args, vocab: int) -> str:
    if args.data:
        return args.data
    path = Path(tempfile.gettempdir()) / "zeropipe-example-tokens.bin"
    if int(os.environ.get("RANK", 0)) == 0 and not path.exists():
        ids = np.random.default_rng(0).integers(0, vocab, 200_000, dtype=np.uint16)
        tmp = path.with_suffix(".tmp")
        ids.tofile(tmp)
        os.replace(tmp, path)   # the other ranks never see half a file
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="plan.json from `planner plan` (default: plan a tiny Llama here)")
    ap.add_argument("--model", help="an HF folder (config.json); default: the plan's model")
    ap.add_argument("--data", help="token file (nanoGPT .bin or .npy); default: random ids in a temp file")
    ap.add_argument("--init-from", help="pretrained weights: an HF folder or a planner run checkpoint")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    the_plan = _plan(args, int(os.environ.get("WORLD_SIZE", 1)))
    source = resolve(f"hf:{args.model}" if args.model else the_plan.model.source)
    rt = apply_plan(the_plan, model_fn=lambda: source.build(device=None, dtype=torch.float32),
                    optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()),
                    init_from=args.init_from)
    vocab = rt.model.config.vocab_size
    path = _data(args, vocab)
    dist.barrier()   # rank 0 has written the example's token file
    tokens = TokenFile(path, the_plan.model.seq_len)
    s = the_plan.strategy
    for step in range(args.steps):
        x, y = tokens.batch(step, s.global_batch_size)
        loss = rt.step(*rt.rank_batch(x, y))   # its replica's sequences (and under CP its tokens of them)
        if loss is not None and rt.dp_rank == 0:
            print(f"rank {dist.get_rank()} step {step}: loss {float(loss):.4f} ({s.name})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
