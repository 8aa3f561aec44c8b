"""Alpha-beta communication costs (pure functions over a ClusterProfile).

Ring collectives over n ranks moving a full buffer of S bytes (the ring all-gather and reduce-scatter of Thakur,
Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1): n-1 steps,
each paying a latency; the ring all-reduce as reduce-scatter then all-gather, Patarasuk & Yuan 2009, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 69(2)):
    all-gather, reduce-scatter:  alpha + (n-2) * step + (n-1)/n * S * beta
    all-reduce:                  2 * (alpha + (n-2) * step + (n-1)/n * S * beta)   (reduce-scatter then all-gather)
    point-to-point:              alpha + S * beta
with beta = 1 / bandwidth of the link one rank drives, alpha = a collective's latency over two ranks (one step) and
step = each further ring step's latency (presets.RING_STEP_LATENCY_S by link kind). Across k nodes of g ranks the
bandwidth is costed hierarchically (below) and the latency as NCCL's flat ring: k-1 network steps, n-k NVLink ones. The step term is NCCL's own
cost model (src/graph/tuning.cc, ncclTopoTuneModel: a ring collective costs baseLat + nsteps x hwLat, nsteps = n-1
for all-gather / reduce-scatter, Ring/Simple hwLat 3.4 us per NVLink step, 5.7 us per PCIe step, 9.6 us per network
step), and what NCCL's maintainers say of measurements: "the latency of ring increases linearly with the
communicator size, and larger messages are less affected" (github.com/NVIDIA/nccl/issues/1712). It is what makes a
ZeRO-3 unit's gather over 1,000+ ranks latency-bound: on 128 dgx-h100 nodes a ring all-gather pays 127 network and
896 NVLink steps, ~4.3 ms per call, against ~2.4 ms of bandwidth for a llama3-8b layer's 0.44 GB
(benchmarks/zero3_scaling.py). Links of other kinds (a
probed gloo loopback) have no step term: their probed fits are used for the group sizes probed.
Byte conventions: `size_bytes` / S is always the full buffer (an all-reduce's tensor, an all-gather's output, a
reduce-scatter's input), as executor.measure.CommCounter counts collectives and estimate.CommVolume reports them;
what each rank sends on the wire is (n-1)/n x S for an all-gather or reduce-scatter and 2(n-1)/n x S for a ring
all-reduce (wire_bytes; nccl-tests doc/PERFORMANCE.md derives its "busbw" from the same factors). The ZeRO paper's
"2Psi per step" for data parallelism (Rajbhandari et al. 2020, section 7) is the wire count as n grows.
At scale, against published nccl-tests figures (presets' module doc, tests/test_comm.py: within 12%): the
hierarchical ring below gives all-gather's drop with node count (32 DGX H100 nodes, 2 GB: 179 GB/s busbw
predicted, ~200 measured, github.com/NVIDIA/nccl/issues/1218); an all-reduce across nodes is NCCL's tree where
that is faster (tree_all_reduce_time: 361 GB/s predicted, ~340 measured there; the ring's reduce-scatter +
all-gather gives 179, and gave 166 with InfiniBand at 0.8 of line rate; GPU clusters only, gloo has no tree).
A group that spans k nodes with g ranks on each is costed hierarchically, as NCCL's rings over NVLink and per-GPU
NICs behave: for all-gather, an inter-node all-gather of S/g among the k nodes on each of the g rails, then an
intra-node all-gather of S among g ranks (reduce-scatter in the opposite order; all-reduce = reduce-scatter +
all-gather, or the tree where faster). Where the cluster profile holds a probed fit for exactly this collective and
group size, the fit is used instead of the link formula (and no tree is priced beside it).

Tensor-parallel traffic (tp_unit_traffic): Megatron-LM's f and g operators (Shoeybi et al. 2019, section 3) put
one all-reduce of the b x s x h activations in forward after each row-split linear and one in backward before each
column-split one; sequence parallelism (Korthikanti et al. 2022, section 4.2.2) turns each into an all-gather plus a
reduce-scatter of the same full buffer. Counted as executor/tensor_parallel.py places torch's ParallelStyles:
                                  no SP                         SP
    rowwise output                fwd all-reduce                fwd reduce-scatter, bwd all-gather
    region with split linears     bwd all-reduce (its input)    fwd all-gather, bwd reduce-scatter
    replicated region input       -                             fwd all-gather
    sp_entry output               -                             bwd all-gather (the slice's gradient)
    sp_input input                -                             bwd all-gather (the slice's gradient)
    vocab-split embedding output  fwd all-reduce                fwd reduce-scatter, bwd all-gather
    vocab-split head              input: bwd all-reduce;        input: fwd all-gather, bwd reduce-scatter;
                                  loss: 3 all-reduces of one    loss: the same
                                  value per token
    norm weights (SP)             -                             bwd all-reduce of their gradients
    vocab-split embedding output  fwd all-reduce                fwd all-reduce (kept whole: a later sp_input
      in a plan with an sp_input                                  enters the sequence split)
    SP saving the shard           -                             region and vocab-split head inputs: bwd all-gather
A vocabulary that does not split leaves the embedding as an sp_entry (no rule where the plan has an sp_input) and the
head as a replicated region.
Without SP the executor makes a region's input one replicated DTensor for all its split linears, so their input
gradients are summed locally and all-reduced once per region, as Megatron's f operator does (torch's ColwiseParallel
alone would all-reduce per linear: Llama's wq, wk, wv three times).
"""
from __future__ import annotations

import math

import functools

from cost_models.records.cluster import ClusterProfile, LinkSpec
from cost_models.records.presets import RING_STEP_LATENCY_S
from cost_models.records.profile import TPUnit

TP_OPS = ("all_reduce", "all_gather", "reduce_scatter")
Traffic = tuple[float, float, float, float, float, float]   # (calls, bytes) of each op in TP_OPS


# Compute slows while NCCL runs beside it (its kernels take SMs and memory bandwidth): Lee et al. 2025,
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114),
# measured GPT and Llama training on A100 and H100: overlapped compute 18.9% slower on average (40% at most) than
# the same compute with no communication beside it. GPU clusters only: gloo's collectives run on CPU threads, and
# the CPU fidelity runs measure them as they are (benchmarks/results/fidelity.md).
OVERLAP_SLOWDOWN = 0.189


def overlapped_exposure(comm_s: float, compute_s: float) -> float:
    """Seconds a collective of `comm_s` adds to `compute_s` of work it runs beside, on a GPU.

    While they overlap the compute runs 1 + OVERLAP_SLOWDOWN times slower. A collective longer than the slowed
    compute exposes comm - compute; a shorter one delays the compute by the work it slowed, comm x s / (1 + s).
    The larger of the two: even a fully hidden gather costs about 16% of its time."""
    if comm_s <= 0:
        return 0.0
    return max(comm_s - compute_s, comm_s * OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN))


def ring_phase(link: LinkSpec, size_bytes: float, n: int) -> float:
    """alpha + (n-2) step + (n-1)/n * S / B: one ring all-gather or reduce-scatter of a full S-byte buffer over n
    ranks (module doc: n-1 ring steps, the first inside alpha)."""
    if n <= 1:
        return 0.0
    return (link.alpha_s + (n - 2) * RING_STEP_LATENCY_S.get(link.kind, 0.0)
            + (n - 1) / n * size_bytes / link.bandwidth_Bps)


def wire_bytes(op: str, size_bytes: float, n: int) -> float:
    """Bytes one rank sends on the wire for `op` on a full S-byte buffer over n ranks (ring algorithms, module doc):
    (n-1)/n S for an all-gather or reduce-scatter, 2(n-1)/n S for an all-reduce. A hierarchical split sends the same
    total: (g-1)/g S inside the node plus (k-1)/k S/g across nodes = (n-1)/n S for n = g k."""
    if n <= 1:
        return 0.0
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * size_bytes


def dp_wire_bytes(collectives: dict[str, float], n: int) -> float:
    """Wire bytes per rank of a step's data-parallel collectives given in the full-buffer convention
    (estimate.CommVolume.dp_collectives: op -> bytes) over a dp group of n ranks."""
    return sum(wire_bytes(op, size, n) for op, size in collectives.items())


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


def _phase(cluster: ClusterProfile, op: str, size_bytes: float, n: int, scope: str, back_to_back: bool = False) -> float:
    fit = cluster.fit(op, n, scope)
    if fit is not None:
        return fit.predict(size_bytes, back_to_back=back_to_back)
    link = cluster.inter_node if scope == "inter" and cluster.inter_node else cluster.intra_node
    return ring_phase(link, size_bytes, n)


def group_ranks_per_node(cluster: ClusterProfile, *, n: int, stride: int) -> int | None:
    """The ranks_per_node collective_time is given for a group of n data ranks `stride` apart on the mesh (pp, dp,
    tp) (a dp group: stride tp; an expert- or context-parallel group, n consecutive data ranks: stride tp; the
    experts' data-parallel group: stride ep x tp): a node holds devices_per_node / stride of them; None where the
    group fits in a node. The planner's data-parallel bound places a group so too (planner.search._dp_bound)."""
    per_node = max(1, cluster.devices_per_node // stride)
    return math.gcd(n, per_node) if n > per_node else None


def group_link(cluster: ClusterProfile, *, n: int, stride: int) -> str:
    """The link a group (group_ranks_per_node) spans: "none" for one rank, "intra-node" or "inter-node"."""
    return ("none" if n == 1 else "intra-node" if group_ranks_per_node(cluster, n=n, stride=stride) is None
            else "inter-node")


def collective_time(cluster: ClusterProfile, op: str, size_bytes: float, n: int, *,
                    ranks_per_node: int | None = None, back_to_back: bool = False, alone: bool = False) -> float:
    """Seconds for `op` in {all_gather, reduce_scatter, all_reduce, broadcast} over n ranks, S = full buffer bytes
    (a broadcast's tensor). `back_to_back`: one of a run of calls with no compute between them
    (CollectiveFit.predict). An all-reduce is priced as reduce-scatter + all-gather, from their probed fits where
    they exist, but with `alone` (one call while its ranks run nothing else, as the probe times them: the tied
    gradients' sync after the pipeline) by the probe's own all-reduce fit for the group where there is one. The
    ring of fits is kept for the data-parallel all-reduces, where the all-reduce fit scored worse against fidelity
    runs; for the tied gradient the all-reduce fit is the closer (measured: benchmarks/results/measurements.md,
    "Tied-gradient all-reduce")."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    if op == "broadcast":
        return _broadcast_time(cluster, size_bytes, n, ranks_per_node, back_to_back)
    if op == "all_reduce":
        fit = cluster.fit(op, n, "intra") if alone and _split(cluster, n, ranks_per_node)[1] == 1 else None
        if fit is not None:
            return fit.predict(size_bytes, back_to_back=back_to_back)
        ring = (collective_time(cluster, "reduce_scatter", size_bytes, n, ranks_per_node=ranks_per_node,
                                back_to_back=back_to_back)
                + collective_time(cluster, "all_gather", size_bytes, n, ranks_per_node=ranks_per_node,
                                  back_to_back=back_to_back))
        g, k = _split(cluster, n, ranks_per_node)
        # NCCL's tree (GPUs only: gloo has none), priced from the links: not where a probe measured the network
        probed = any(cluster.fit(op, k, "inter") is not None for op in ("reduce_scatter", "all_gather"))
        if k == 1 or cluster.inter_node is None or cluster.device.kind != "gpu" or probed:
            return ring
        return min(ring, tree_all_reduce_time(cluster, size_bytes, g, k))   # NCCL picks the faster (tuning.cc)
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {op}")
    g, k = _split(cluster, n, ranks_per_node)
    if k == 1:
        return _phase(cluster, op, size_bytes, g, "intra", back_to_back)
    # Hierarchical: each of the g rails moves S/g across k nodes; inside a node g ranks move S. Latency as NCCL's
    # flat ring counts it (module doc): n-1 steps, k-1 across nodes and n-k inside them, of which the intra phase
    # charged g-1; the other (k-1)(g-1) intra-node steps are added.
    extra = (k - 1) * (g - 1) * RING_STEP_LATENCY_S.get(cluster.intra_node.kind, 0.0)
    return (_phase(cluster, op, size_bytes / g, k, "inter", back_to_back)
            + _phase(cluster, op, size_bytes, g, "intra", back_to_back) + extra)


def _broadcast_time(cluster: ClusterProfile, size_bytes: float, n: int, ranks_per_node: int | None,
                    back_to_back: bool) -> float:
    """A broadcast of S bytes over n ranks: the probed fit where the cluster's probe measured one (gloo's costs
    far less than an all-gather of the same bytes: benchmarks/results/measurements.md, "Broadcast runs");
    otherwise NCCL's ring broadcast, which moves all S through every link in one pipelined chain of n-1 steps: an
    all-gather whose full buffer is S n/(n-1) (the same n-1 steps; nccl-tests doc/PERFORMANCE.md gives both the same
    bus bandwidth, busbw = S/t for a broadcast and (n-1)/n S/t for an all-gather)."""
    g, k = _split(cluster, n, ranks_per_node)
    # the probe's groups: inside a node, or one rank per node across nodes
    fit = cluster.fit("broadcast", n, "intra") if k == 1 else cluster.fit("broadcast", n, "inter") if g == 1 else None
    if fit is not None:
        return fit.predict(size_bytes, back_to_back=back_to_back)
    return collective_time(cluster, "all_gather", size_bytes * n / (n - 1), n, ranks_per_node=ranks_per_node,
                           back_to_back=back_to_back)


def tree_all_reduce_time(cluster: ClusterProfile, size_bytes: float, g: int, k: int) -> float:
    """An all-reduce of S bytes over k nodes of g ranks as NCCL's tree runs it across nodes: a reduce inside each
    node, a double binary tree over the nodes on each of the g rails, a broadcast inside the node, pipelined in
    chunks so the phases overlap and the slower one sets the pace.

    Bandwidth: inside a node each rank moves 2(g-1)/g S (the ring all-reduce's share); across nodes each NIC sends
    and receives 2 S/g whatever k is (in a double binary tree every node is interior in one tree, a leaf in the
    other: S/(2g) up and down as a leaf, 2 x S/(2g) up and down as an interior node). Latency: NCCL's tree term
    (src/graph/tuning.cc, ncclTopoTuneModel: baseLat + 2 ((ranks per node - 1) intra + log2(nodes) inter) hardware
    latencies), each step priced as the ring's (presets.RING_STEP_LATENCY_S). Checked against nccl-tests at scale
    in presets' module doc (tests/test_comm.py). collective_time uses it on GPU clusters only (gloo has no tree)
    and not where a probe fitted the network's phases."""
    intra, inter = cluster.intra_node, cluster.inter_node
    assert inter is not None, "a tree across nodes needs the cluster's inter_node link"
    levels = k.bit_length() - 1   # tuning.cc's log2i: floor(log2 k)
    steps = (2 * (g - 1) * RING_STEP_LATENCY_S.get(intra.kind, 0.0)
             + 2 * levels * RING_STEP_LATENCY_S.get(inter.kind, 0.0))
    moved = max(2 * (g - 1) / g * size_bytes / intra.bandwidth_Bps, 2 * size_bytes / g / inter.bandwidth_Bps)
    return inter.alpha_s + steps + moved


def _traffic(**ops: tuple[float, float]) -> Traffic:
    out = [0.0] * 6
    for op, (calls, size) in ops.items():
        i = 2 * TP_OPS.index(op)
        out[i], out[i + 1] = calls, size
    return tuple(out)  # type: ignore[return-value]


def _plus(*parts: tuple[float, float]) -> tuple[float, float]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


@functools.lru_cache(maxsize=4096)
def tp_unit_traffic(tu: TPUnit, *, sp: bool, vocab: int, save_shard: bool = False) -> tuple[Traffic, Traffic]:
    """(forward, backward) tensor-parallel collectives of one unit per micro-batch at the profile's dtype: calls and
    full-buffer bytes of each op in TP_OPS (the module doc's table). `vocab`: the vocabulary's size where it splits
    at this tp (0: it does not). The loss then runs on the vocabulary shards (loss parallelism, as `planner run`'s
    built-in cross-entropy does: executor/tensor_parallel.py loss_context): no logits all-gather, but three
    all-reduces of one value per token (torch's loss_parallel: the max, the sum of exponentials and the target's
    logit; counted: 3 x 64 tokens x 4 bytes per micro-batch at fp32). They are listed with the backward's
    collectives: once per micro-batch, as full recompute re-runs the head but not the loss after it.
    `save_shard` (under SP): each region's input, and a vocabulary-split head's, is gathered again in backward
    (Korthikanti et al. 2022, section 4.2.2: the shard is saved instead; executor.sp_shard)."""
    row = (tu.row_calls, tu.row_bytes)
    per_token = tu.logit_bytes / vocab if vocab else 0.0
    embed, logits = (tu.embed_calls, tu.embed_bytes), (3 * tu.head_calls, 3 * per_token)
    head_in = (tu.head_calls, tu.head_in_bytes)
    region, repl = (tu.region_calls, tu.region_bytes), (tu.repl_region_calls, tu.repl_region_bytes)
    entry = _plus((tu.entry_calls, tu.entry_bytes), (tu.input_calls, tu.input_bytes))   # sp_entry, sp_input slices
    whole = (tu.whole_embed_calls, tu.whole_embed_bytes) if vocab else (0, 0)
    if not sp:
        if not vocab:
            return _traffic(all_reduce=row), _traffic(all_reduce=region)
        return (_traffic(all_reduce=_plus(row, embed, whole)),
                _traffic(all_reduce=_plus(region, head_in, logits)))
    again = (_plus(region, head_in) if vocab else region) if save_shard else (0, 0)
    if vocab:
        return (_traffic(all_gather=_plus(region, repl, head_in), reduce_scatter=_plus(row, embed), all_reduce=whole),
                _traffic(all_gather=_plus(row, embed, entry, again), reduce_scatter=_plus(region, head_in),
                         all_reduce=logits))
    return (_traffic(all_gather=_plus(region, repl, head_in), reduce_scatter=row),
            _traffic(all_gather=_plus(row, entry, embed, again), reduce_scatter=region))


def norm_grad_traffic(tu: TPUnit, grad_bytes: int, *, sp: bool) -> Traffic:
    """Each micro-batch's backward all-reduces over tp the weight gradients of norms that run on part of the
    activations: under SP every norm's (each rank's is a partial sum over its sequence shard: Korthikanti et al.
    2022, section 4.2.2), and always the per-head q/k norms' (head_norm: over the rank's heads). torch's
    SequenceParallel, which runs both, issues one all-reduce per parameter tensor (counted with torch 2.13).
    Parameter-sized: it does not scale with the micro-batch."""
    tensors, params = tu.head_norm_tensors, tu.head_norm_params
    if sp:
        tensors, params = tensors + tu.norm_tensors, params + tu.norm_params
    return _traffic(all_reduce=(tensors, params * grad_bytes))


def linearized(cluster: ClusterProfile, op: str, n: int, ref_bytes: float) -> tuple[float, float]:
    """(seconds per call, seconds per byte) of `op` over n ranks (a TP group: adjacent ranks, inside a node when n
    divides the node), as the secant through ref_bytes and 2 ref_bytes: exact for the alpha-beta formulas above,
    so a unit's collectives cost calls x alpha + bytes x beta without a call per collective."""
    t1 = collective_time(cluster, op, ref_bytes, n)
    t2 = collective_time(cluster, op, 2 * ref_bytes, n)
    beta = (t2 - t1) / ref_bytes
    return max(0.0, t1 - beta * ref_bytes), beta
