"""Alpha-beta communication costs (pure functions over a ClusterProfile).

Ring collectives over n ranks moving a full buffer of S bytes (bandwidth terms: the ring all-gather and
reduce-scatter of Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1); the ring all-reduce as reduce-scatter then all-gather, Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 69(2)); latency is one alpha per phase, not per ring step:
    all-gather, reduce-scatter:  alpha + (n-1)/n * S * beta
    all-reduce:                  2 * (alpha + (n-1)/n * S * beta)      (reduce-scatter then all-gather)
    point-to-point:              alpha + S * beta
with beta = 1 / bandwidth of the link one rank drives. A group that spans k nodes with g ranks on each is costed
hierarchically, as NCCL's rings over NVLink and per-GPU NICs behave: for all-gather, an inter-node all-gather of
S/g among the k nodes on each of the g rails, then an intra-node all-gather of S among g ranks (reduce-scatter in
the opposite order; all-reduce = reduce-scatter + all-gather). Where the cluster profile holds a probed fit for
exactly this collective and group size, the fit is used instead of the link formula.
"""
from __future__ import annotations

from cost_models.cluster import ClusterProfile, LinkSpec


def ring_phase(link: LinkSpec, size_bytes: float, n: int) -> float:
    """alpha + (n-1)/n * S / B: one ring all-gather or reduce-scatter of a full S-byte buffer over n ranks."""
    if n <= 1:
        return 0.0
    return link.alpha_s + (n - 1) / n * size_bytes / link.bandwidth_Bps


def p2p_time(cluster: ClusterProfile, size_bytes: float, *, crosses_nodes: bool) -> float:
    """alpha + S / B for one message between two ranks (a pipeline boundary)."""
    scope = "inter" if crosses_nodes else "intra"
    fit = cluster.fit("send_recv", 2, scope)
    if fit is not None:
        return fit.predict(size_bytes)
    link = cluster.inter_node if crosses_nodes and cluster.inter_node else cluster.intra_node
    return link.alpha_s + size_bytes / link.bandwidth_Bps


def _split(cluster: ClusterProfile, n: int, ranks_per_node: int | None) -> tuple[int, int]:
    """(g ranks per node, k nodes) of a group of n ranks laid out contiguously (or with ranks_per_node given)."""
    g = min(n, ranks_per_node or cluster.devices_per_node)
    if n % g:
        raise ValueError(f"a group of {n} ranks does not divide into nodes of {g}")
    return g, n // g


def _phase(cluster: ClusterProfile, op: str, size_bytes: float, n: int, scope: str) -> float:
    fit = cluster.fit(op, n, scope)
    if fit is not None:
        return fit.predict(size_bytes)
    link = cluster.inter_node if scope == "inter" and cluster.inter_node else cluster.intra_node
    return ring_phase(link, size_bytes, n)


def collective_time(cluster: ClusterProfile, op: str, size_bytes: float, n: int, *,
                    ranks_per_node: int | None = None) -> float:
    """Seconds for `op` in {all_gather, reduce_scatter, all_reduce} over n ranks, S = full buffer bytes."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    if op == "all_reduce":
        return (collective_time(cluster, "reduce_scatter", size_bytes, n, ranks_per_node=ranks_per_node)
                + collective_time(cluster, "all_gather", size_bytes, n, ranks_per_node=ranks_per_node))
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {op}")
    g, k = _split(cluster, n, ranks_per_node)
    if k == 1:
        return _phase(cluster, op, size_bytes, g, "intra")
    # Hierarchical: each of the g rails moves S/g across k nodes; inside a node g ranks move S.
    return _phase(cluster, op, size_bytes / g, k, "inter") + _phase(cluster, op, size_bytes, g, "intra")
