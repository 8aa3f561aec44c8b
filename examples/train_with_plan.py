"""Train your own model with a zeropipe plan, under torchrun:

    torchrun --nproc-per-node 2 examples/train_with_plan.py                 # plans for the ranks it is given
    torchrun --nproc-per-node 4 examples/train_with_plan.py --plan plan.json

Without --plan, rank 0's view of the job is planned on the spot (a meta-device profile of the model, the
dgx-a100 preset standing in for the devices) and every rank plans the same way, so they agree.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from cost_models.models.gpt import GPT, GPTConfig
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from executor.api import apply_plan
from planner.plan import Plan
from planner.request import PlanRequest
from planner.search import plan as make_plan

CONFIG = GPTConfig(vocab_size=512, max_seq_len=128, dim=64, n_layers=4, n_heads=4)   # "your" model: gpt-tiny
SEQ, GLOBAL_BATCH = 32, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="plan.json from `planner plan` (default: plan here)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plan:
        the_plan = Plan.load(args.plan)
    else:
        profile = profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=SEQ, meta=True, dtype="fp32")
        the_plan = make_plan(profile, preset("dgx-a100"),
                             PlanRequest(gpus=world, global_batch_size=GLOBAL_BATCH, precision="fp32"))
    rt = apply_plan(the_plan, model_fn=lambda: GPT(CONFIG),
                    optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    s = the_plan.strategy
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)      # every rank makes the same global batch and takes its share
        x = torch.randint(0, CONFIG.vocab_size, (s.global_batch_size, SEQ), generator=gen)
        y = torch.randint(0, CONFIG.vocab_size, (s.global_batch_size, SEQ), generator=gen)
        loss = rt.step(*rt.rank_batch(x, y))   # its replica's sequences (and under CP its tokens of them)
        if loss is not None and rt.dp_rank == 0:
            print(f"rank {torch.distributed.get_rank()} step {step}: loss {float(loss):.4f} "
                  f"(dp={s.dp} pp={s.pp} ZeRO-{s.zero} {s.schedule})", flush=True)
    rt.close()   # waits for every rank, then ends the process group


if __name__ == "__main__":
    main()
