"""Per-GPU memory of published mixture-of-experts training layouts against what zeropipe predicts for them.

Each row is a run its source measured, with the layout the source states (Qwen3-30B-A3B, the zoo's
qwen3-30b-a3b, whose 30.53B parameters equal the published total):
  * NVIDIA-NeMo/Megatron-Bridge @ 067f987d, skills/nemo-mbridge-perf-moe-hardware-configs/SKILL.md L112-126
    ("Qwen3 30B-A3B on 16 H100"): TP1 PP1 CP1 EP16, distributed optimizer, no recompute, sequence 4096, MBS 1,
    GBS 1024, BF16 with fp32 main parameters, gradients and Adam moments: "Rank-0 peak allocated memory:
    62.166 GiB";
  * NousResearch/torchtitan PR #19 (torchtitan/distributed/deepep/README.md, strong-scaling table; configuration
    qwen3_30b_a3b_with_deepep.toml): FSDP over every GPU, EP8, full activation checkpointing, local batch 8 of
    4096 tokens, B200: 167.93 / 138.75 / 124.58 / 117.50 / 114.78 GiB on 8 / 16 / 32 / 64 / 128 GPUs (torchtitan's
    logged memory: peak reserved);
  * mlc-ai/pith-train issue #79 (a torchtitan run): FSDP8 EP1, BF16, sequence 8192, MBS 8, GBS 64, selective
    activation checkpointing, 8 B200s: "141.79 GiB peak memory per GPU".
What each source leaves open is chosen as stated in the row's `chosen` (zeropipe's nearest switch: its selective
recompute drops the attention core, torchtitan's selective checkpointing saves chosen ops). The sources measure
allocated (Megatron) or reserved (torchtitan: the caching allocator's pool, above what is allocated) peaks; the
estimate predicts allocated bytes with a fixed per-process overhead, so reserved rows are expected above it. B200
runs are priced on the dgx-h100 preset scaled to their GPU count: memory does not depend on the GPU's speed, and
`fits` is read against the measured GPU's capacity here.

Predictions only, no timing: nothing depends on this machine or its load. Prints the table (predicted, published,
ratio, and the prediction's breakdown) and writes results/moe_memory.json and .md.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2 ** 30


@dataclass(frozen=True, kw_only=True)
class Row:
    id: str
    source: str
    metric: str                # what the source measured
    gpus: int
    seq_len: int
    dp: int
    ep: int
    zero: int
    microbatches: int
    micro_batch_size: int
    recompute: str = "none"    # none | selective | full
    distributed_optimizer: bool = False
    published_gib: float
    capacity_gib: float
    chosen: str = ""


MB = "Megatron-Bridge 067f987d skills/nemo-mbridge-perf-moe-hardware-configs/SKILL.md L112-126"
TT = "NousResearch/torchtitan PR #19, torchtitan/distributed/deepep/README.md (strong scaling)"
PITH = "mlc-ai/pith-train issue #79"
ROWS = [
    Row(id="megatron-bridge-ep16-h100x16", source=MB, metric="rank-0 peak allocated", gpus=16, seq_len=4096,
        dp=16, ep=16, zero=1, distributed_optimizer=True, microbatches=64, micro_batch_size=1,
        published_gib=62.166, capacity_gib=80.0,
        chosen="Megatron's distributed optimizer as zeropipe's ZeRO-1 dist-opt (fp32 master weights and Adam "
               "sharded over dp; the experts' over their group of 1)"),
    *[Row(id=f"torchtitan-fsdp-ep8-b200x{n}", source=TT, metric="peak reserved (torchtitan's memory log)", gpus=n,
          seq_len=4096, dp=n, ep=8, zero=3, microbatches=1, micro_batch_size=8, recompute="full",
          published_gib=gib, capacity_gib=178.0, chosen="FSDP as ZeRO-3; full checkpointing as full recompute")
      for n, gib in ((8, 167.93), (16, 138.75), (32, 124.58), (64, 117.50), (128, 114.78))],
    Row(id="pith-train-fsdp8-ep1-b200x8", source=PITH, metric="peak (torchtitan run: reserved)", gpus=8,
        seq_len=8192, dp=8, ep=1, zero=3, microbatches=1, micro_batch_size=8, recompute="selective",
        published_gib=141.79, capacity_gib=178.0,
        chosen="selective activation checkpointing as zeropipe's selective recompute (the attention core)"),
]


def _predict(row: Row, profiles: dict):
    from cost_models.cost.estimate import estimate
    from cost_models.records.presets import preset
    from cost_models.records.strategy import Strategy
    prof = profiles[row.seq_len]
    units = tuple(u.name for u in prof.units)
    s = Strategy(dp=row.dp, pp=1, zero=row.zero, schedule="1f1b", microbatches=row.microbatches,
                 micro_batch_size=row.micro_batch_size, stages=(units,), recompute=(row.recompute == "full",),
                 selective=row.recompute == "selective", precision="bf16-mixed", optimizer="adamw",
                 distributed_optimizer=row.distributed_optimizer, ep=row.ep)
    return s, estimate(s, prof, preset("dgx-h100", nodes=max(1, row.gpus // 8)), compact=True)


def main() -> None:
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    profiles = {seq: profile_model(resolve("qwen3-30b-a3b"), micro_batch_size=1, seq_len=seq, meta=True,
                                   dtype="bf16") for seq in sorted({r.seq_len for r in ROWS})}
    out = []
    print(f"{'row':<30} {'published GiB':>13} {'predicted GiB':>13} {'ratio':>6}  states / activations / buffers "
          f"GiB  (metric)")
    for row in ROWS:
        s, est = _predict(row, profiles)
        m = max(est.memory_per_rank, key=lambda x: x.total_bytes)
        predicted = m.total_bytes / GIB
        parts = {"states": (m.parameters + m.gradients + m.optimizer_states) / GIB,
                 "activations": m.activations / GIB, "buffers": m.buffers / GIB, "overhead": m.overhead / GIB}
        out.append({**dataclasses.asdict(row), "strategy": s.name, "predicted_gib": round(predicted, 2),
                    "ratio": round(predicted / row.published_gib, 3), "parts_gib": {k: round(v, 2) for k, v in
                                                                                    parts.items()},
                    "fits": predicted <= row.capacity_gib})
        print(f"{row.id:<30} {row.published_gib:>13.2f} {predicted:>13.2f} {predicted / row.published_gib:>6.2f}  "
              f"{parts['states']:.1f} / {parts['activations']:.1f} / {parts['buffers']:.1f}  ({row.metric})")
    RESULTS.mkdir(exist_ok=True)
    record = {"schema_version": 1, "kind": "zeropipe.benchmark.moe_memory", "model": "qwen3-30b-a3b",
              "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rows": out}
    (RESULTS / "moe_memory.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# Published MoE layouts: per-GPU memory, published vs predicted (qwen3-30b-a3b)", "",
             "| row | strategy | published GiB | predicted GiB | ratio | states / activations / buffers GiB | metric |",
             "|---|---|---|---|---|---|---|"]
    for r in out:
        p = r["parts_gib"]
        lines.append(f"| {r['id']} | {r['strategy']} | {r['published_gib']:.2f} | {r['predicted_gib']:.2f} | "
                     f"{r['ratio']:.2f} | {p['states']} / {p['activations']} / {p['buffers']} | {r['metric']} |")
    lines += ["", "Sources and the choices made for what they leave open: benchmarks/moe_memory.py's module doc."]
    (RESULTS / "moe_memory.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'moe_memory.json'} and .md")


if __name__ == "__main__":
    main()
