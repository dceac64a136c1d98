"""Stage what the GPU job needs and the GPU machine lacks, split over two device calls of <= 64 MiB each (issue #22).

Run here (a machine with pip and the repo's venv); writes the ignored folder ``.device-stage/``:

    a/  gguf.part1 (the target's GGUF, first part) and drafter.tar (the shipped drafter at HEAD)
    b/  gguf.part2, wheels.tar.xz (what the device lacks, see WHEELS), queue.jsonl.gz (the regeneration queue as
        token ids) and prompts.json (held-out chat prompts as token ids, for the measurements)
    each also parts.json: every part's name, call, size and sha256, plus the GGUF's sha256

Call A carries ``.device-stage/a``, call B ``.device-stage/b``; both run ``bash scripts/gpu_job.sh``
(docs/training.md, "GPU job"). The GGUF's split point is chosen so both calls have the same headroom under 64 MiB,
counting the working tree as the device counts it (tracked files present here, untracked files not ignored);
leave the large tracked blobs out first (``scripts/device_tree.sh slim``). Exits non-zero, naming the sizes, when
a call would not fit.

    python scripts/gpu_stage.py                        # wheels for the device's Python 3.12
    python scripts/gpu_stage.py --pythons 3.12,3.11    # also for a CPU rehearsal under Python 3.11

Wheels are repacked without compression inside one xz archive (transformers: 12.9 MiB as a wheel, ~3.7 MiB so):
the device's pip installs them as they are (a wheel's RECORD hashes its files, not the zip).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata as md
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 64.0
HEADROOM_MIB = 1.0  # kept free in each call (the device's own accounting may differ by a few files)
# what the GPU machine lacks, versions as in this venv. Its image has transformers 5.17 with huggingface_hub 1.33 and no
# gguf / datasets; transformers >= 5.24 needs huggingface_hub >= 2.4, which talks HTTP through httpx2 (httpcore2,
# truststore), none of them in the image (docs/training.md, "GPU job")
WHEELS = ("transformers", "huggingface_hub", "httpx2", "httpcore2", "truststore", "gguf", "datasets", "dill",
          "multiprocess")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
N_PROMPTS = 8  # held-out chat prompts for the device's measurements


def mib(n: int) -> float:
    return n / 2**20


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # Python >= 3.11 (the device has 3.12)


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree as the device sends it: tracked files present on disk, untracked not ignored."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum(p.stat().st_size for name in listed if name and (p := root / name.decode()).is_file())


def wheels_archive(out: Path, pythons: list[str]) -> None:
    """``pip download`` the WHEELS (this venv's versions) for each Python, repack stored, into one .tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        for python in pythons:
            platforms = [x for p in PLATFORMS for x in ("--platform", p)]
            specs = [f"{name}=={md.version(name)}" for name in WHEELS]
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", python, "--implementation", "cp", *platforms, "-d", tmp, *specs],
                           check=True)
        with tarfile.open(out, "w:xz", preset=9) as tar:
            for wheel in sorted(Path(tmp).glob("*.whl")):
                data = io.BytesIO()
                with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(data, "w", zipfile.ZIP_STORED) as dst:
                    for item in src.infolist():
                        dst.writestr(item, src.read(item), compress_type=zipfile.ZIP_STORED)
                info = tarfile.TarInfo(f"wheels/{wheel.name}")
                info.size = data.tell()
                data.seek(0)
                tar.addfile(info, data)


def queue_and_prompts(out_queue: Path, out_prompts: Path, queue_args: dict) -> tuple[int, int]:
    """The regeneration queue (:func:`~dspark_hf.sources.prompt_queue.sharegpt_queue` with ``queue_args``, minus the records
    the committed tokens file already holds) and :data:`N_PROMPTS` held-out chat prompts, as token ids."""
    from transformers import AutoTokenizer

    from dspark_hf.bench.settings import BenchSettings
    from dspark_hf.bench.suites import encode_suites, suite_texts
    from dspark_hf.runtime.targets import convert_default_target
    from dspark_hf.sources.prompt_queue import sharegpt_queue
    from dspark_hf.training.data import read_tokens

    tokenizer = AutoTokenizer.from_pretrained(convert_default_target())
    tokens_file = ROOT / "data" / "smollm2-135m-instruct-tokens.jsonl.gz"
    known = {row["record_id"] for rows in read_tokens(tokens_file).values() for row in rows}
    queue = [item for item in sharegpt_queue(tokenizer, **queue_args) if item[0] not in known]
    with gzip.open(out_queue, "wt") as f:
        for record_id, split, ids in queue:
            f.write(json.dumps({"record_id": record_id, "split": split, "prompt_ids": ids}) + "\n")
    encoded, _ = encode_suites(tokenizer, suite_texts(["chat"]), N_PROMPTS, BenchSettings.max_prompt_tokens)
    out_prompts.write_text(json.dumps([{"id": rid, "prompt_ids": ids} for rid, ids in encoded["chat"]]) + "\n")
    return len(queue), len(encoded["chat"])


def drafter_tar(out: Path) -> None:
    """The shipped drafter as committed (HEAD; read from git, so it works with the weights left out of the tree)."""
    from dspark_hf.defaults import DEFAULT_DRAFTER_NAME

    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "--prefix=drafter/", "-o", str(out),
                    f"HEAD:drafters/{DEFAULT_DRAFTER_NAME}", "--", "*.json", "*.safetensors"], check=True)
    with tarfile.open(out) as tar:
        if not any(name.endswith(".safetensors") for name in tar.getnames()):
            sys.exit(f"gpu_stage: no weights of drafters/{DEFAULT_DRAFTER_NAME} at HEAD")


def split_gguf(gguf: Path, first_bytes: int, out_a: Path, out_b: Path) -> None:
    with gguf.open("rb") as src:
        out_a.write_bytes(src.read(first_bytes))
        out_b.write_bytes(src.read())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / ".device-stage"))
    parser.add_argument("--pythons", default="3.12", help="Python versions to fetch wheels for (comma-separated)")
    parser.add_argument("--queue-args", type=json.loads, default={},
                        help='keyword arguments of sharegpt_queue as JSON, e.g. \'{"turns": "all"}\' where it has them')
    args = parser.parse_args(argv)
    from dspark_hf.defaults import default_target_gguf

    out = Path(args.out)
    a, b = out / "a", out / "b"
    for folder in (a, b):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
    drafter_tar(a / "drafter.tar")
    wheels_archive(b / "wheels.tar.xz", args.pythons.split(","))
    n_queue, n_prompts = queue_and_prompts(b / "queue.jsonl.gz", b / "prompts.json", args.queue_args)
    gguf = default_target_gguf()
    tree = tree_bytes()
    fixed_a = sum(p.stat().st_size for p in a.iterdir())
    fixed_b = sum(p.stat().st_size for p in b.iterdir())
    first = (gguf.stat().st_size + fixed_b - fixed_a) // 2  # the same headroom in both calls
    first = max(0, min(first, gguf.stat().st_size))
    split_gguf(gguf, first, a / "gguf.part1", b / "gguf.part2")
    parts = [{"name": p.name, "call": p.parent.name, "bytes": p.stat().st_size, "sha256": sha256(p)}
             for folder in (a, b) for p in sorted(folder.iterdir())]
    manifest = {"gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
                "wheels": {name: md.version(name) for name in WHEELS}, "queue_items": n_queue,
                "prompts": n_prompts, "parts": parts}
    for folder in (a, b):
        (folder / "parts.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sizes = {folder.name: tree + sum(p.stat().st_size for p in folder.iterdir()) for folder in (a, b)}
    print(json.dumps({"tree_mib": round(mib(tree), 2), **{f"call_{k}_mib": round(mib(v), 2) for k, v in sizes.items()},
                      "queue_items": n_queue, "prompts": n_prompts}))
    over = {k: round(mib(v), 2) for k, v in sizes.items() if mib(v) > LIMIT_MIB - HEADROOM_MIB}
    if over:
        sys.exit(f"gpu_stage: call(s) {over} MiB exceed {LIMIT_MIB - HEADROOM_MIB} MiB (tree {mib(tree):.2f} MiB): "
                 "leave the large blobs out first (scripts/device_tree.sh slim)")


if __name__ == "__main__":
    main()
