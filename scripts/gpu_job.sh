#!/usr/bin/env bash
# The GPU device job (issue #22): ONE command for both device calls; either call order works.
#
# Here, once:   bash scripts/device_tree.sh slim && python scripts/gpu_stage.py   (.device-stage/a and b)
# Call A:       run(command="bash scripts/gpu_job.sh", carry=[".device-stage/a"], timeout_s=600)
# Call B:       run(command="bash scripts/gpu_job.sh", carry=[".device-stage/b"], timeout_s=600)
# Then here:    bash scripts/device_tree.sh restore
#
# Each call copies the parts it carries into $STAGE (default /tmp/dspark-stage, kept on the machine between calls
# while it stays warm: 30 s idle) and checks them against parts.json (sha256). While parts are missing it writes
# $OUT/summary.json saying which, and exits 0. Once all are there (the second call; a machine recycled in between
# costs one extra call: send the missing part again), it assembles the GGUF, installs the wheels into $STAGE/site
# (pip --no-index --no-deps --target), unpacks the drafter and runs the job, scripts/gpu_job.py: per phase a time
# limit (sum < 600 s), $OUT/summary.json + $OUT/results.tar.gz rewritten after every phase, so a call killed at
# its limit still brings back every finished phase; at the end the trained drafter as bf16 shards <= 16 MiB.
#   profile  the target's SPS curve on CUDA                 measure  the shipped drafter: greedy identity vs plain
#   rebuild  features of the committed regeneration (tokens file)     regen  more at batch 256 from the staged queue
#   train    bf16, warm-started from the shipped drafter, with the time left          pack  drafter + logs into $OUT
# Environment: OUT (default ./gpu-out), STAGE, PYTHON (default python3), DEVICE (default cuda), JOB_SECONDS
# (default 540), JOB_SCALE (full | tiny: the CPU rehearsal's sizes), DSPARK_TRAIN_ARGS (extra `dspark train`
# flags, e.g. "--sequences-per-step 128"; they override configs/gpu-job.yaml).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-./gpu-out} STAGE=${STAGE:-/tmp/dspark-stage} PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$STAGE"
exec "$PYTHON" scripts/gpu_job.py
