"""Fixed per-call costs of the runtime pieces the executor uses, measured on this cluster's ranks.

Small models on CPU ranks spend as much time in per-call overhead as in arithmetic, so the cost model needs:
  * `pipeline_action_s`: one action (forward or backward) of torch.distributed.pipelining's single-stage schedules
    (GPipe, 1F1B), beyond its compute and its p2p: a 2-rank GPipe step over a tiny stage, minus the same stage's
    compute run plainly, divided by the actions, with every pair of ranks running at once;
  * `pipeline_runtime_action_s`, `pipeline_split_action_s`: the same for the multi-stage classes, which torch runs
    through its action-list runtime (a separate send or receive action per message, each waited on): 2-rank
    Interleaved1F1B and InterleavedZeroBubble (forward, input and weight backward) over two tiny stages per rank.
    They cost several times GPipe's per action: benchmarks/fidelity.py had shown the interleaved and zero-bubble
    candidates' time outside compute growing with their actions while the estimate charged GPipe's (measured:
    benchmarks/results/measurements.md, "Pipeline action overhead");
  * the same three with `_one` before `_s`: one pipeline over all ranks (more than 2), the other shape plans run;
  * `fsdp_unit_s`: one FSDP2 unit's forward + backward beyond its compute and the latency of its all-gather and
    reduce-scatter (which the alpha-beta fits already cost): fully_shard on K tiny layers against the same layers
    unsharded, per layer;
  * `optimizer_tensor_s`: AdamW's step per parameter tensor when tensors are small (memory bandwidth does not
    cover it);
  * `optimizer_dtensor_s`: the same per DTensor parameter (FSDP2's shards, tensor-parallel weights): every op of
    the update goes through DTensor's dispatch (sharding propagation in Python), an order of magnitude above the
    plain tensor's cost on CPU ranks (measured: benchmarks/results/measurements.md, "DTensor optimizer overhead").
Every rank takes part (the collectives need it); the values are medians over repeats, taken on rank 0.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WIDTH, LAYERS, MICRO, REPEATS = 32, 8, 8, 7


def _median_time(fn, repeats: int = REPEATS, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def optimizer_tensor_seconds(device: torch.device) -> float:
    params = [nn.Parameter(torch.randn(64, device=device)) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _median_time(opt.step) / len(params)


def optimizer_dtensor_seconds(device: torch.device) -> float:
    """AdamW's step per DTensor parameter, each sharded over all ranks as FSDP2 shards it (all ranks call this)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    params = [nn.Parameter(distribute_tensor(torch.randn(64 * mesh.size(), device=device), mesh, [Shard(0)]))
              for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _median_time(opt.step) / len(params)


def _plain_layers(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)


def fsdp_unit_seconds(device: torch.device, alpha_gather: float, alpha_reduce: float) -> float:
    """Per FSDP unit and micro-batch, beyond compute and collective latency (all ranks call this)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, WIDTH, device=device)
    plain = _plain_layers(device)
    t_plain = _median_time(lambda: plain(x).sum().backward())
    sharded = _plain_layers(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in sharded:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)

    def step():
        sharded(x).sum().backward()
        sharded.zero_grad(set_to_none=True)
    t_fsdp = _median_time(step)
    # ZeRO-3 per layer: a gather in forward, one in backward, a reduce-scatter; their latency is costed elsewhere
    return max(0.0, (t_fsdp - t_plain) / LAYERS - 2 * alpha_gather - alpha_reduce)


def pipeline_action_seconds(device: torch.device, group, in_group: bool, alpha_p2p: float,
                            torch_class: str = "ScheduleGPipe") -> float:
    """Per schedule action, beyond compute and p2p latency: the ranks of `group` (n of them) run `torch_class` as one
    pipeline over tiny Linear stages (one per rank for ScheduleGPipe; two per rank, stage s on rank s mod n, for the
    multi-stage classes, which torch runs through its action-list runtime); a rank in no group waits."""
    if not in_group:
        return 0.0
    from torch.distributed import pipelining

    rank, n = dist.get_rank(group=group), dist.get_world_size(group=group)
    cls = getattr(pipelining.schedules, torch_class)
    chunks = 1 if torch_class == "ScheduleGPipe" else 2
    layers = [nn.Linear(WIDTH, WIDTH).to(device) for _ in range(chunks)]
    x = torch.randn(MICRO * 2, WIDTH, device=device)
    t_plain = _median_time(lambda: [layer(x[:2]).sum().backward() for layer in layers]) * MICRO
    stages = [pipelining.PipelineStage(layer, rank + n * c, n * chunks, device, group=group,
                                       input_args=(torch.empty(2, WIDTH, device=device,
                                                               requires_grad=rank + n * c > 0),),
                                       output_args=(torch.empty(2, WIDTH, device=device, requires_grad=True),))
              for c, layer in enumerate(layers)]
    sched = cls(stages[0] if chunks == 1 else stages, n_microbatches=MICRO, loss_fn=lambda out, y: F.mse_loss(out, y))

    def step():
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=torch.zeros(MICRO * 2, WIDTH, device=device))
        else:
            sched.step()
    t_pipe = _median_time(step)
    # a rank's step: per micro-batch and stage chunk a forward and a backward (I and W when split); the other
    # ranks' first forwards and last backwards are on the critical path too (2 (n - 1) more). Messages a rank
    # sends: one per micro-batch each way with one chunk; with two (stages 0..2n-1 over the n ranks), three per
    # micro-batch; plus the fill's hops through the other ranks
    split = "ZeroBubble" in torch_class
    actions = (3 if split else 2) * chunks * MICRO + 2 * (n - 1)
    sends = (2 if chunks == 1 else 3) * MICRO + 2 * (n - 2)
    return max(0.0, (t_pipe - t_plain - sends * alpha_p2p) / actions)


# the schedule kinds probed: ComputeProbe field (as pairs; "_one" appended: one pipeline over all ranks), torch class
PIPELINE_KINDS = (("pipeline_action", "ScheduleGPipe"), ("pipeline_runtime_action", "ScheduleInterleaved1F1B"),
                  ("pipeline_split_action", "ScheduleInterleavedZeroBubble"))


def overhead_probe(device: torch.device, fits: dict[tuple[str, int], tuple[float, float]]) -> dict[str, float]:
    """Run every probe (collective on the world group). `fits`: (op, group size) -> (alpha, beta) measured."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    alpha = lambda op, n: fits.get((op, n), (0.0, 0.0))[0]  # noqa: E731
    out = {"optimizer_tensor_s": optimizer_tensor_seconds(device)}
    dist.barrier()
    out["optimizer_dtensor_s"] = optimizer_dtensor_seconds(device)
    dist.barrier()
    out["fsdp_unit_s"] = fsdp_unit_seconds(device, alpha("all_gather", world), alpha("reduce_scatter", world))
    dist.barrier()
    # Two shapes, the ends of what plans run: ranks 2i and 2i+1 form pair i and every pair runs the schedule at once
    # (world / 2 pipelines of 2 stages: PP2 x DP or TP); and one pipeline over all ranks. CPU ranks sharing cores
    # pay differently in the two (measured: benchmarks/results/measurements.md, "Pipeline action overhead"), and
    # the estimate interpolates between them by the plan's pipelines at once (sharing.action_seconds).
    pairs = [dist.new_group(ranks=[i, i + 1]) for i in range(0, world - 1, 2)]
    pair = pairs[rank // 2] if rank // 2 < len(pairs) else None
    for field, torch_class in PIPELINE_KINDS:
        out[field + "_s"] = pipeline_action_seconds(device, pair, pair is not None, alpha("send_recv", 2), torch_class)
        dist.barrier()
    for field, torch_class in PIPELINE_KINDS if world > 2 else ():   # with 2 ranks the pair is the one pipeline
        out[field + "_one_s"] = pipeline_action_seconds(device, dist.group.WORLD, True, alpha("send_recv", 2),
                                                        torch_class)
        dist.barrier()
    return out
