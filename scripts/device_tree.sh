#!/usr/bin/env bash
# Leave the large tracked blobs out of a GPU device call, without committing their removal (issue #22).
# The device tool sends the working tree (tracked files present on disk + untracked files not ignored + carried
# paths, <= 64 MiB a call). `slim` removes from the working tree, through git's sparse checkout (the files stay
# tracked, flagged skip-worktree: `git status` stays clean and no commit can record their removal):
#   ablations/          the RNN / DFlash baselines (36.9 MiB)     docs/   plots and benchmark records (1.6 MiB)
#   drafters/*/*.safetensors  the shipped drafter's weights (20.1 MiB; gpu_stage.py stages them for call A)
#   bash scripts/device_tree.sh slim      # before the two device calls
#   bash scripts/device_tree.sh restore   # after them: every file back from git (git sparse-checkout disable)
#   bash scripts/device_tree.sh size      # MiB that would travel now (as gpu_stage.py and the device count)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
case "${1:-size}" in
    slim)
        git sparse-checkout set --no-cone '/*' '!/ablations/' '!/docs/' '!/drafters/*/*.safetensors' 2>/dev/null ;;
    restore)
        git sparse-checkout disable ;;
    size) ;;
    *) echo "usage: $0 slim|restore|size" >&2; exit 2 ;;
esac
git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r sh -c 'for f; do [ -f "$f" ] && stat -c %s "$f"; done; true' _ \
    | awk '{s += $1} END {printf "working tree that travels: %.2f MiB\n", s / 1048576}'
