"""Re-plan a running job for another number of GPUs: the same profile, model, global batch, precision and
optimizer as the plan its checkpoint was saved under, searched again for the new device count. (The checkpoint is
read by the caller; `planner run NEW_PLAN --resume DIR` then reshards the training state into the new layout.)"""
from __future__ import annotations

from pathlib import Path

from cost_models.profiling.cluster_source import check_cluster_args
from cost_models.records.errors import ConfigError
from cost_models.records.files import ProfileFile
from planner.manual import at_length
from planner.plan import Plan, check_plan, profile_digest
from planner.request import PlanRequest
from planner.search import ProgressFn, plan


def replan(old: Plan, *, gpus: int, profile_path: str | None = None, cluster: str | None = None,
           nodes: int | None = None, top_k: int = 5, time_limit_s: float | None = None, command: str = "",
           on_progress: ProgressFn | None = None) -> Plan:
    """The plan for `gpus` devices that continues `old`'s training. The profile is `profile_path` if given, else
    the one `old` was made from, which must be unchanged (its sha256 is in the plan); the cluster is `cluster` (a
    preset or file) if given, else `old`'s, scaled to `nodes`."""
    try:   # the checkpoint's listing was verified, not the plan inside it: a bad one is refused here
        check_plan(old)
    except ConfigError as exc:
        raise ConfigError(f"the checkpoint's plan: {exc}") from None
    explicit = profile_path is not None
    path = profile_path or old.provenance.profile_path
    if not path:
        raise ConfigError("the checkpoint's plan does not record the profile it was made from; pass --profile PROFILE")
    if not Path(path).is_file():
        raise ConfigError(f"the profile the plan was made from, {path}, is not there; pass --profile PROFILE")
    if not explicit and old.provenance.profile_digest and profile_digest(path) != old.provenance.profile_digest:
        raise ConfigError(f"{path} changed since the plan was made (its sha256 differs); pass --profile {path} to "
                          f"plan with it as it is now")
    pf = ProfileFile.load(path)
    if pf.model.source != old.model.source:
        raise ConfigError(f"{path} profiles {pf.model.source}, the checkpoint trains {old.model.source}; pass the "
                          f"profile of that model")
    pf = at_length(pf, old.model.seq_len)   # a plan made with --seq-len: the profile seen at its length again
    if cluster:
        from cost_models.profiling.cluster_source import resolve_cluster
        target = resolve_cluster(cluster, nodes=nodes)
        if target is None:
            raise ConfigError("--cluster none leaves nothing to plan for; name a preset or a cluster file")
    else:
        check_cluster_args("the plan's", nodes=nodes, ranks=None)   # --nodes 0 is an error, not "default"
        target = old.cluster.with_nodes(nodes) if nodes is not None else old.cluster
    # any ep: a checkpoint holds whole expert tensors (executor.expert_parallel.whole_expert)
    request = PlanRequest(gpus=gpus, global_batch_size=old.global_batch_size, top_k=top_k, time_limit_s=time_limit_s,
                          precision=old.strategy.precision, optimizer=old.strategy.optimizer)
    return plan(pf.model, target, request, profile_path=str(path), command=command, on_progress=on_progress)
