"""Runs several strategies inside one set of ranks (each spawn costs ~10 s here, so tests share them)."""
import datetime as dt

import torch
import torch.distributed as dist

from cost_models.schedule import format_order, generate
from cost_models.strategy import Strategy
from executor.train import TrainConfig, run_on_rank


def run_strategies(strategy_dicts: list[dict], cfg_dict: dict):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=60))
    try:
        cfg = TrainConfig.from_dict(cfg_dict)
        results = []
        for data in strategy_dicts:
            s = Strategy.from_dict(data)
            order = format_order(generate(s.schedule, s.pp, s.microbatches, s.v)) if s.n_stages > 1 else None
            results.append(run_on_rank(s, cfg, order).to_dict())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        return gathered if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def launch(nproc: int, strategies: list[Strategy], cfg: TrainConfig):
    """[strategy][rank] -> RankResult dict, through the same elastic launcher `planner run` uses."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="zeropipe-test",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1)
    per_rank = elastic_launch(config, run_strategies)([s.to_dict() for s in strategies], cfg.to_dict())[0]
    return [[per_rank[r][i] for r in range(nproc)] for i in range(len(strategies))]
