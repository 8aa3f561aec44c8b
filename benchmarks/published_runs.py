"""Published, measured large-scale training runs against what zeropipe predicts for the same model, layout and GPUs.

Each row is a run its source measured on real GPUs, with the parallel layout the source states: Narayanan et al.
2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, Table 1,
layouts from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh), torchtitan's docs/performance.md (FSDP2 on 64 A100s)
and the NVIDIA/Megatron-LM README's H100 table ("Training Speed and Scalability"). For each row the model is
profiled in meta mode (exact counts, no weights), the stated layout estimated on the matching preset scaled to the
row's GPUs, and the prediction converted into the source's unit with the source's own FLOPs formula:
  * Narayanan et al. 2021, eq. 3 (recomputation included): 96 l h^2 (1 + s/6h + V/16lh) FLOPs per token;
  * Megatron-LM's num_floating_point_operations (megatron/training/training.py) for a GPT with a 4h MLP and no
    recomputation: 72 l h^2 (1 + s/6h + V/12lh) FLOPs per token;
  * torchtitan publishes tokens/s per GPU.
Where the source leaves a choice open (the H100 table: micro-batch, optimizer sharding, sequence parallelism,
recompute, schedule), the row says what was chosen. Nothing is fitted per row: the comparison grounds the cost
model, it does not tune it.

Predictions only, no timing: the figures do not depend on this machine or its load. Prints the table (predicted,
published, ratio, fits, peak memory, and the step's breakdown) and writes results/published_runs.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TOLERANCE = 0.15   # the acceptance band: within 15% of the published throughput


@dataclass(frozen=True, kw_only=True)
class Row:
    id: str
    source: str
    model: str                 # a zoo name, or "gpt:l,h,a,V,s,tied" for the papers' GPT shapes
    preset: str
    gpus: int
    tp: int
    pp: int
    v: int
    dp: int
    micro_batch: int
    microbatches: int
    seq: int
    zero: int
    sp: bool
    recompute: str             # none | selective | full
    distributed_optimizer: bool = False   # ZeRO-1 as Megatron-LM's (Strategy.distributed_optimizer)
    async_tp: bool = False                # TP collectives behind their matmuls (Strategy.async_tp)
    sp_save_shard: bool = False           # SP saving the shard, as Megatron-LM (Strategy.sp_save_shard)
    published: float
    unit: str                  # "TFLOP/s/GPU (Narayanan eq. 3)" | "TFLOP/s/GPU (Megatron-LM)" | "tokens/s/GPU"
    chosen: str = ""           # what the source leaves open and this row chose
    attention: str = "fused"   # the GPT's attention (cost_models.models.gpt.GPTConfig.attention)
    dropout: float = 0.0       # the GPT's dropout (hidden and attention)

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.v > 1 else "1f1b"


_N = "Narayanan et al. 2021, Table 1"
_NU = "TFLOP/s/GPU (Narayanan eq. 3)"
_T = "torchtitan docs/performance.md"
_M = "Megatron-LM README, H100 table"
_MU = "TFLOP/s/GPU (Megatron-LM)"
_MCHOSEN = ("micro-batch 1, sequence parallelism with TP, no recompute, 1F1B, dropout 0.1 (Megatron-LM's default); "
            "its distributed optimizer with overlapped gathers and reduce-scatters as zeropipe runs it: ZeRO-1 "
            "dist-opt without a pipeline, ZeRO-2 with one (FSDP2 stages gathered once, reduce-scattered once); its "
            "--tp-comm-overlap as torch's async TP; sequence parallelism saving the shard, as Megatron-LM does")


def _gpt(l: int, h: int, a: int, vocab: int, seq: int, tied: bool) -> str:
    return f"gpt:{l},{h},{a},{vocab},{seq},{int(tied)}"


def _narayanan(id_: str, l: int, h: int, a: int, gpus: int, tp: int, pp: int, v: int, dp: int, mbs: int, m: int,
               published: float) -> Row:
    return Row(id=id_, source=_N, model=_gpt(l, h, a, 51200, 2048, True), preset="dgx-a100", gpus=gpus, tp=tp, pp=pp,
               v=v, dp=dp, micro_batch=mbs, microbatches=m, seq=2048, zero=0, sp=False, recompute="full",
               published=published, unit=_NU, attention="unfused", dropout=0.1)


def _megatron_h100(id_: str, l: int, h: int, a: int, gpus: int, tp: int, pp: int, batch: int,
                   published: float) -> Row:
    dp = gpus // (tp * pp)
    return Row(id=id_, source=_M, model=_gpt(l, h, a, 131072, 4096, False), preset="dgx-h100", gpus=gpus, tp=tp,
               pp=pp, v=1, dp=dp, micro_batch=1, microbatches=batch // dp, seq=4096,
               zero=0 if dp == 1 else 1 if pp == 1 else 2, distributed_optimizer=dp > 1 and pp == 1, async_tp=tp > 1,
               sp=tp > 1, sp_save_shard=tp > 1, recompute="none", published=published, unit=_MU, chosen=_MCHOSEN, dropout=0.1)


def _torchtitan(id_: str, model: str, seq: int, local_batch: int, recompute: str, published: float) -> Row:
    return Row(id=id_, source=_T, model=model, preset="dgx-a100", gpus=64, tp=1, pp=1, v=1, dp=64,
               micro_batch=local_batch, microbatches=1, seq=seq, zero=3, sp=False, recompute=recompute,
               published=published, unit="tokens/s/GPU")


ROWS = (
    _narayanan("N1", 24, 2304, 24, 32, 1, 1, 1, 32, 16, 1, 137),
    _narayanan("N3", 36, 4096, 32, 128, 4, 1, 1, 32, 16, 1, 142),
    _narayanan("N5", 48, 8192, 64, 512, 8, 2, 1, 32, 4, 12, 138),
    _narayanan("N6", 60, 10240, 80, 1024, 8, 4, 3, 32, 2, 28, 140),
    _narayanan("N8", 96, 16384, 128, 1920, 8, 16, 2, 15, 1, 144, 155),
    _narayanan("N10", 128, 25600, 160, 3072, 8, 64, 1, 6, 1, 512, 163),
    _torchtitan("T1", "llama3-8b", 8192, 1, "selective", 2973),
    _torchtitan("T2", "llama3-70b", 8192, 1, "full", 331),
    _torchtitan("T3", "llama2-13b", 4096, 2, "none", 2162),
    _megatron_h100("H1", 24, 2048, 16, 48, 1, 1, 192, 408.8),
    _megatron_h100("H4", 48, 7168, 56, 384, 8, 1, 192, 459.6),
    _megatron_h100("H5", 84, 8192, 64, 768, 8, 2, 384, 419.7),
    _megatron_h100("H9", 112, 18432, 144, 6144, 8, 16, 3072, 459.9),
)


def flops_per_token(row: Row) -> float:
    """The source's own FLOPs per token (module doc); torchtitan's unit needs none."""
    l, h, _, vocab, seq, _ = (int(x) for x in row.model.removeprefix("gpt:").split(","))
    if row.unit == _NU:
        return 96 * l * h * h * (1 + seq / (6 * h) + vocab / (16 * l * h))
    return 72 * l * h * h * (1 + seq / (6 * h) + vocab / (12 * l * h))


def _source(row: Row):
    from cost_models.models.gpt import GPTConfig
    from cost_models.models.source import resolve, zoo_source
    from cost_models.models.zoo import ZooEntry
    if not row.model.startswith("gpt:"):
        return resolve(row.model)
    l, h, a, vocab, seq, tied = (int(x) for x in row.model.removeprefix("gpt:").split(","))
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=h, n_layers=l, n_heads=a, tie_embeddings=bool(tied),
                    attention=row.attention, dropout=row.dropout)
    return zoo_source(ZooEntry(name=f"gpt-{l}l-{h}h", family="gpt", description="published run's GPT", config=cfg))


def predict(row: Row, profiles: dict) -> dict:
    """The row's layout estimated on its preset: the prediction in the source's unit and the step's breakdown."""
    from cost_models.cost.estimate import estimate
    from cost_models.profiling.model_profiler import profile_model
    from cost_models.records.presets import preset
    from planner.manual import StrategyRequest, build_strategy
    key = (row.model, row.micro_batch, row.seq, row.attention, row.dropout)
    if key not in profiles:
        profiles[key] = profile_model(_source(row), micro_batch_size=row.micro_batch, seq_len=row.seq,
                                      meta=True, dtype="bf16")
    profile = profiles[key]
    cluster = preset(row.preset, nodes=row.gpus // 8)
    strategy = build_strategy(profile, cluster, StrategyRequest(
        dp=row.dp, pp=row.pp, tp=row.tp, v=row.v, zero=row.zero, sp=row.sp, schedule=row.schedule,
        microbatches=row.microbatches, micro_batch_size=row.micro_batch, recompute=row.recompute,
        distributed_optimizer=row.distributed_optimizer, async_tp=row.async_tp, sp_save_shard=row.sp_save_shard))
    est = estimate(strategy, profile, cluster, compact=True)
    tokens_per_gpu = est.tokens_per_s / row.gpus
    predicted = tokens_per_gpu if row.unit == "tokens/s/GPU" else tokens_per_gpu * flops_per_token(row) / 1e12
    b = est.breakdown
    return dict(id=row.id, source=row.source, model=row.model, unit=row.unit, chosen=row.chosen,
                layout=f"{strategy.name} on {row.gpus} GPUs ({row.preset})", published=row.published,
                predicted=predicted, ratio=predicted / row.published, fits=est.fits,
                peak_gib=max(m.total_bytes for m in est.memory_per_rank) / 2**30,
                capacity_gib=est.capacity_bytes / 2**30, step_s=est.step_time_s, mfu=est.mfu,
                breakdown=dict(compute_s=b.compute_s, tp_comm_s=b.tp_comm_s, bubble_s=b.bubble_s, p2p_s=b.p2p_s,
                               dp_comm_s=b.dp_comm_s, optimizer_s=b.optimizer_s))


def planned(row: Row, profiles: dict) -> dict:
    """`planner plan` for the row's model, GPUs and global batch on its preset: the layout it picks and its predicted
    step, beside the published layout's (acceptance: at least as fast; the plan's rationale says why)."""
    from cost_models.records.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan
    profile = profiles[(row.model, row.micro_batch, row.seq, row.attention, row.dropout)]
    t0 = time.perf_counter()
    p = plan(profile, preset(row.preset, nodes=row.gpus // 8),
             PlanRequest(gpus=row.gpus, global_batch_size=row.dp * row.microbatches * row.micro_batch))
    return dict(layout=p.strategy.name, step_s=p.prediction.step_time_s, fits=p.prediction.fits,
                seconds=time.perf_counter() - t0)


SCALE_GPUS = 1000   # the rows where sharded data parallelism over every GPU is the question (issue's item 4)


def sharded_everywhere(row: Row, profiles: dict) -> dict | None:
    """The fastest fitting ZeRO-3 over every GPU for a 1,000+ GPU row (TP 1-8 inside the node, SP with TP, the
    global batch as one micro-batch per rank, full recompute): the layout the planner chose for such rows while
    hidden collectives cost nothing; the table shows what the overlap's compute slowdown adds to it."""
    if row.gpus < SCALE_GPUS:
        return None
    best = None
    batch = row.dp * row.microbatches * row.micro_batch
    for tp in (1, 2, 4, 8):
        dp = row.gpus // tp
        if batch % dp:
            continue
        alt = dataclasses.replace(row, tp=tp, pp=1, v=1, dp=dp, micro_batch=batch // dp, microbatches=1, zero=3,
                                  sp=tp > 1, recompute="full", distributed_optimizer=False, async_tp=False,
                                  sp_save_shard=False)
        r = predict(alt, profiles)
        if r["fits"] and (best is None or r["step_s"] < best["step_s"]):
            best = r
    return best


def _sharded_table(results: list[dict]) -> list[str]:
    lines = ["| id | layout | predicted step s | compute s | exposed DP comm s | planner's layout step s |",
             "|" + "---|" * 6]
    for r in results:
        z = r.get("sharded")
        if z:
            lines.append(f"| {r['id']} | {z['layout']} | {z['step_s']:.2f} | {z['breakdown']['compute_s']:.2f} | "
                         f"{z['breakdown']['dp_comm_s']:.2f} | {r['planned']['step_s']:.2f} |")
    return lines


def _plan_table(results: list[dict]) -> list[str]:
    lines = ["| id | planner's layout | predicted step s | published layout's predicted step s | planning s |",
             "|" + "---|" * 5]
    for r in results:
        q = r["planned"]
        lines.append(f"| {r['id']} | {q['layout']} | {q['step_s']:.2f} | {r['step_s']:.2f} | {q['seconds']:.1f} |")
    return lines


def _table(results: list[dict]) -> list[str]:
    head = ("| id | layout | published | predicted | ratio | fits (peak / capacity GiB) | step s = compute "
            "(TP comm) + bubble + p2p + DP comm + optimizer |")
    lines = [head, "|" + "---|" * 7]
    for r in results:
        b = r["breakdown"]
        lines.append(f"| {r['id']} | {r['layout']} | {r['published']:,.1f} {r['unit']} | {r['predicted']:,.1f} | "
                     f"{r['ratio']:.2f} | {'yes' if r['fits'] else 'NO'} ({r['peak_gib']:.1f} / "
                     f"{r['capacity_gib']:.1f}) | {r['step_s']:.2f} = {b['compute_s']:.2f} ({b['tp_comm_s']:.2f}) + "
                     f"{b['bubble_s']:.2f} + {b['p2p_s']:.2f} + {b['dp_comm_s']:.2f} + {b['optimizer_s']:.3f} |")
    return lines


def _summary(results: list[dict]) -> str:
    within = [r for r in results if abs(r["ratio"] - 1) <= TOLERANCE]
    fitting = [r for r in results if r["fits"]]
    ratios = sorted(r["ratio"] for r in results)
    return (f"{len(within)} of {len(results)} within {TOLERANCE:.0%} of published; {len(fitting)} of "
            f"{len(results)} predicted to fit (every source ran its layout); ratios {ratios[0]:.2f} to "
            f"{ratios[-1]:.2f}, median {ratios[len(ratios) // 2]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("-o", "--output", default=str(RESULTS / "published_runs.json"))
    ap.add_argument("--plan", action="store_true", help="also plan each row's model, GPUs and batch (minutes)")
    args = ap.parse_args()
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = [r for r in ROWS if not wanted or r.id in wanted]
    profiles: dict = {}
    results = []
    for row in rows:
        t0 = time.perf_counter()
        results.append(predict(row, profiles))
        if args.plan:
            results[-1]["planned"] = planned(row, profiles)
            results[-1]["sharded"] = sharded_everywhere(row, profiles)
        print(f"{row.id}: {results[-1]['predicted']:,.1f} predicted, {row.published:,.1f} published "
              f"({results[-1]['ratio']:.2f}) in {time.perf_counter() - t0:.1f} s", flush=True)
    lines = _table(results)
    if args.plan:
        lines += ["", "`planner plan` for the same model, GPUs and global batch:", ""] + _plan_table(results)
        lines += ["", "ZeRO-3 over every GPU for the rows on 1,000+ GPUs (the best such layout that fits):", ""]
        lines += _sharded_table(results)
    print("\n".join(lines))
    print(_summary(results))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(when=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                   summary=_summary(results), rows=results), indent=1) + "\n")
    chosen = sorted({r["chosen"] for r in results if r["chosen"]})
    out.with_suffix(".md").write_text("# Published runs: predicted against published\n\n"
                                      + "Written by `benchmarks/published_runs.py` (its docstring gives the sources "
                                      "and formulas).\n\n" + "\n".join(lines) + "\n\n" + _summary(results) + "\n\n"
                                      + "".join(f"Chosen where the source is silent: {c}.\n" for c in chosen))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
