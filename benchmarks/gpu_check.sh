#!/bin/bash
# The GPU paths end to end, on a machine with NVIDIA GPUs and zeropipe installed (CI has none; run it by hand):
# NVML + the collective probe (one GPU: no link to measure), a real-mode profile timed on the GPU, a plan, a
# `planner run` of it (NCCL, bf16-mixed as torch's mixed precision, CUDA memory) and of the same plan in fp32,
# the demo (CPU ranks: it leaves the GPUs alone) and the quick tests (they hide the GPUs, as CI has none).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default gpu-check/); every command's output lands in OUT_DIR/log.
# QUICK=1 stops after predicted against measured (no demo, no tests).
set -u
OUT=${1:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log") 2>&1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
MODEL=${MODEL:-gpt2-small}
B=${B:-8}
S=${S:-1024}
GLOBAL=${GLOBAL:-32}

step "machine"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")

step "planner profile-cluster ($GPUS GPUs)"
timeout 120 planner profile-cluster -o "$OUT/cluster.json" -f
step "planner profile $MODEL on the GPU"
timeout 150 planner profile --model "$MODEL" -b "$B" -s "$S" --dtype bf16 --cluster "$OUT/cluster.json" -o "$OUT/profile.json" -f | tail -8
python3 -c "import json; m=json.load(open('$OUT/profile.json'))['model']; print('profile device', m['device'], m.get('device_name'), 'in_model_factor', round(m['in_model_factor'], 3), 'mixed_factor', round(m.get('mixed_factor', 1), 3), 'transient MiB', {u['name']: round(u.get('transient_bytes', 0) / 2**20) for u in m['units'][:2] + m['units'][-1:]})"
step "planner plan -B $GLOBAL --gpus $GPUS"
timeout 90 planner plan "$OUT/profile.json" -B "$GLOBAL" --gpus "$GPUS" -o "$OUT/plan.json" -f --no-report | tail -25
step "planner run plan.json (bf16-mixed)"
timeout 120 planner run "$OUT/plan.json" --steps 10 -o "$OUT/run.json"
step "the same plan in fp32 (planner estimate -o, then run)"
python3 - "$OUT" <<'PY'
import json, subprocess, sys
out = sys.argv[1]
s = json.load(open(f"{out}/plan.json"))["strategy"]
cmd = ["planner", "estimate", f"{out}/profile.json", "--dp", str(s["dp"]), "--pp", str(s["pp"]), "--tp", str(s["tp"]),
       "--zero", str(s["zero"]), "-m", str(s["microbatches"]), "-b", str(s["micro_batch_size"]), "--precision", "fp32",
       "--schedule", s["schedule"], "--v", str(s["v"]), "--cluster", f"{out}/cluster.json", "-o", f"{out}/plan32.json", "-f"]
rec = s.get("recompute") or []
cmd += ["--recompute", "selective" if s.get("selective") else "full" if rec and all(rec) else
        ",".join(str(i) for i, r in enumerate(rec) if r) or "none"] + (["--sp"] if s.get("sp") else [])
print(" ".join(cmd)); subprocess.run(cmd, check=False)
PY
timeout 120 planner run "$OUT/plan32.json" --steps 10 -o "$OUT/run32.json"
step "predicted against measured"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("run.json", "run32.json"):
    try:
        r = json.load(open(f"{out}/{name}"))
    except (OSError, ValueError) as exc:
        print(name, "missing:", exc); continue
    print(f"{name}: {r['strategy_summary']} backend {r['backend']}: step {r['predicted_step_time_s']*1e3:.1f} ms predicted, "
          f"{r['step_time_s']['median_s']*1e3:.1f} measured (min {r['step_time_s']['min_s']*1e3:.1f}, max {r['step_time_s']['max_s']*1e3:.1f})")
    for m in r["measures"]:
        unit = 1e3 if m["unit"] == "s" else 2**-20
        print(f"  {m['quantity']:<40} predicted {m['predicted']*unit:12.1f}  measured {m['measured']*unit:12.1f}  {'ms' if m['unit']=='s' else 'MiB'}")
PY
if [ "${QUICK:-0}" = 1 ]; then step "done (QUICK=1)"; exit 0; fi
step "planner demo (CPU ranks)"
(cd "$(mktemp -d)" && timeout 120 planner demo | tail -30)
step "quick tests (GPUs hidden)"
(cd "$ROOT" && timeout 150 python3 -m pytest -q -m "not slow" -p no:cacheprovider | tail -8)
step "mixed-precision test on gloo ranks"
(cd "$ROOT" && timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_mixed_precision.py | tail -4)
step "done"
