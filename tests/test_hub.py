"""The Hub side (dspark_hf.hub.card): a drafter folder is a complete Hub repo, loadable by id offline.

Everything is tiny, CPU-only and offline. The Hugging Face cache is filled by huggingface_hub's own
``hf_hub_download`` (so blobs, snapshot symlinks and ``refs/main`` are exactly its layout) served by an
in-memory ``httpx2.MockTransport`` through the public ``set_client_factory``: huggingface_hub has no
API that adds local files to the cache, and no socket is ever opened. Loading then runs with
``HF_HUB_OFFLINE=1``.
"""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
import transformers
from conftest import tiny_llama
from huggingface_hub import ModelCard, scan_cache_dir
from huggingface_hub.utils import _http
from huggingface_hub.utils.sha import git_hash
from packaging.requirements import Requirement
from transformers import LlamaForCausalLM

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDrafter, SequentialTemperatureScaling
from dspark_hf.cli.main import main as cli_main
from dspark_hf.defaults import DEFAULT_TARGET_NAME
from dspark_hf.hub import card as hub
from dspark_hf.hub import push as hub_push
from dspark_hf.hub import sections as hub_sections

REPO_ID = "org/dspark-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
V, GAMMA = 64, 4
BENCH = {
    "tau": {"mt-bench": {"greedy": 3.21, "T=1": 2.87}, "humaneval": {"greedy": 4.02}},
    "speedup": {"mt-bench": 1.45, "humaneval": 1.83},
    "machine": "2-core x86-64 CPU, torch 2.13, fp32",
    "command": "dspark bench --suites mt-bench humaneval",
    "date": "2026-11-29",
}
TRAINING = {"steps": 1200, "minutes": 54.25,
            "config": {"target_tokens": 300000, "block_size": GAMMA, "init_from": "runs/first/final"},
            "validation": {"loss": 1.234, "tau": 2.75, "accept": [0.7, 0.5, 0.35, 0.2]},
            "curve": [{"positions": 20000, "step": 300, "greedy_tau": 2.5, "greedy_survival_1": 0.61},
                      {"positions": 100000, "step": 1500, "greedy_tau": 2.75, "greedy_survival_1": 0.7}]}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target() -> LlamaForCausalLM:
    return tiny_llama(V, 32, 4, max_position_embeddings=128)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target folder and a card folder (drafter + calibration + training record + card) for REPO_ID."""
    root = tmp_path_factory.mktemp("hub")
    target = tiny_target()
    target.save_pretrained(root / "target")
    config = DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=1, intermediate_size=64,
                                     sequential_rank=8, block_size=GAMMA, draft_vocab_size=48,
                                     target_name_or_path=DEFAULT_TARGET_NAME, mask_token_id=0)
    drafter = DSparkDrafter(config)
    drafter.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:48])
    g = torch.Generator().manual_seed(0)
    drafter.calibration = SequentialTemperatureScaling().fit(torch.rand(64, GAMMA, generator=g),
                                                             torch.randint(0, GAMMA + 1, (64,), generator=g))
    card_dir = root / "card"
    drafter.save_pretrained(card_dir)
    (card_dir / "training.json").write_text(json.dumps(TRAINING))
    (root / "bench.json").write_text(json.dumps(BENCH))
    cli_main(["card", str(card_dir), "--bench", str(root / "bench.json"), "--repo-id", REPO_ID])
    return root


def populate_hub_cache(folder: Path, repo_id: str, cache_dir: Path, commit: str = COMMIT) -> None:
    """Download every file of ``folder`` as ``repo_id`` at ``commit`` with ``hf_hub_download`` from an in-memory Hub.

    The fake answers ``/{repo_id}/resolve/{rev}/{file}`` like the Hub: ``X-Repo-Commit``, a git-blob
    ``ETag``, and for safetensors (LFS) ``X-Linked-Etag`` = sha256 and ``X-Linked-Size``.
    """
    prefix = f"/{repo_id}/resolve/"

    def serve(request):
        path = request.url.path
        file = folder / path[len(prefix):].split("/", 1)[1] if path.startswith(prefix) else None
        if file is None or not file.is_file():
            return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"})
        data = file.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_hash(data)}"', "Content-Length": str(len(data))}
        if file.suffix == ".safetensors":
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
        return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else data)

    previous = _http._GLOBAL_CLIENT_FACTORY  # no public getter; restored below
    fake_hub = httpx2.MockTransport(serve)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=fake_hub, follow_redirects=True))
    try:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            huggingface_hub.hf_hub_download(repo_id, file.relative_to(folder).as_posix(), cache_dir=cache_dir)
    finally:
        huggingface_hub.set_client_factory(previous)


@pytest.fixture(scope="module")
def hub_cache(saved):
    cache = saved / "hf-cache"
    populate_hub_cache(saved / "card", REPO_ID, cache)
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------- the folder
def test_card_folder_is_the_hub_repo(saved):
    card = saved / "card"
    files = {p.relative_to(card).as_posix() for p in card.rglob("*") if p.is_file()}
    assert {"README.md", "config.json", "model.safetensors", "calibration.json", "training.json",
            "configuration_dspark.py", "modeling_dspark.py", "heads.py", "custom_generate/generate.py",
            "custom_generate/requirements.txt"} <= files
    assert not {"kernels.py", "calibration.py"} & files  # the remote code is modeling/ only (torch + transformers)
    auto_map = json.loads((card / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkDrafter"}
    assert hub.card_repo_id(card) == REPO_ID
    ours, theirs = map(Requirement, (card / "custom_generate/requirements.txt").read_text().splitlines())
    assert ours.name == "dspark-hf" and dspark_hf.__version__ in ours.specifier
    # the transformers a Hub user installs with the card is one the routing accepts (this one among them)
    assert theirs.name == "transformers" and transformers.__version__ in theirs.specifier
    assert "5.23.0" not in theirs.specifier and "6.0.0" not in theirs.specifier
    hub_push.check_card_folder(card, REPO_ID)


def test_card_metadata_and_records(saved):
    card = ModelCard.load(saved / "card" / "README.md")
    data = card.data
    assert data.base_model == DEFAULT_TARGET_NAME
    assert data.library_name == "transformers"
    assert data.license == "apache-2.0"
    assert data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "dspark", "custom_generate"} <= set(data.tags)
    assert data.datasets == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    text = card.text
    assert f'custom_generate="{REPO_ID}"' in text and f'from_pretrained("{REPO_ID}")' in text
    assert "| mt-bench | 3.21 | 2.87 |" in text and "| humaneval | 4.02 | – |" in text  # τ: rows x settings
    assert "| humaneval | 1.83 |" in text and BENCH["machine"] in text and BENCH["command"] in text
    report = json.loads((saved / "card" / "calibration.json").read_text())["report"]
    assert 0 <= report["mean_ece_after"] < 1 and 0 <= report["mean_ece_before"] < 1  # so 3 decimals, by hand:
    assert f"{report['mean_ece_before']:.3f} before → {report['mean_ece_after']:.3f} after" in text
    assert "1200 optimizer steps in 54.25 minutes" in text and "| accept | 0.700 | 0.500 | 0.350 | 0.200 |" in text
    assert "Warm-started from `runs/first/final`" in text and "| 100,000 | 1500 | 2.75 | 0.700 |" in text
    assert "Not measured yet" not in text


def test_card_without_records_invents_nothing(saved):
    config = DSparkConfig.from_pretrained(saved / "card")
    text = hub.build_card(config, repo=REPO_ID).text
    sections = dict(re.findall(r"^## (\w[\w ]*)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    for name in ("Speed", "Confidence calibration", "Training"):
        assert hub_sections.NOT_MEASURED in sections[name], name
    assert not re.search(r"\d", sections["Speed"])
    partial = hub.build_card(config, repo=REPO_ID, bench={"tau": {"mt-bench": 3.0}}).text
    speed = partial.split("## Speed")[1].split("## ")[0]
    assert "| mt-bench | 3.00 |" in speed and hub_sections.NOT_MEASURED in speed and "machine not recorded" in speed


def test_card_says_what_batch_sizes_generate_takes(saved):
    """One prompt or a left-padded batch through generate, many through generate_concurrent: not "batch size 1"."""
    text = hub.build_card(DSparkConfig.from_pretrained(saved / "card"), repo=REPO_ID).text
    assert "Batch size 1" not in text
    assert 'needs transformers ≥ 5.24). One prompt or a left-padded batch (`tok.padding_side = "left"`), greedy or' in text
    limitations = text.split("## Limitations")[1].split("## ")[0]
    assert ('- `generate` takes one prompt or a left-padded batch (`tokenizer.padding_side = "left"`; each row decoded '
            "as if alone; a batch takes no streamer and no `return_dict_in_generate`), and "
            "`dspark_hf.generate_concurrent` serves a queue of prompts with at most R in flight;") in limitations


def test_metric_block_renders_any_flat_or_nested_record():
    assert hub_sections.metric_block("tau", 3.14159) == "**tau**: 3.14"
    assert hub_sections.metric_block("tau", {"a": 2.5, "b": 123.456}).splitlines()[2:] == ["| a | 2.50 |", "| b | 123.5 |"]
    nested = hub_sections.metric_block("tau", {"a": {"x": 1.0, "y": {"z": 2}}, "b": {"x": 3.0}})
    assert nested.splitlines()[0] == "|  | x | y/z |" and "| b | 3.00 | – |" in nested
    rows = hub_sections.metric_block("tps", [{"suite": "s1", "v": 1.5}, {"suite": "s2", "v": 2.5}])
    assert "| 2 | s2 | 2.50 |" in rows
    tables = hub_sections.metric_block("tau", {"greedy": {"d1": {"s": 3.0}}, "t1": {"d1": {"s": 2.0}}})
    assert tables.startswith("*greedy*") and "*t1*" in tables and "| d1 | 2.00 |" in tables


def test_dspark_bench_results_are_summarised():
    """A `dspark bench` result (benchmarks.json, schema 1): τ per setting, speedup per method x suite, machine."""
    result = {
        "schema_version": 1,
        "machine": {"cpu": "Some CPU", "cores": 2, "cuda": None, "torch": "2.13.0", "date": "2026-11-29",
                    "command": "dspark bench --out docs"},
        "settings": {"gamma": 7, "max_new_tokens": 128, "thresholds": [0.1]},
        "suites": {"code": {"n_prompts": 2, "ids": ["a", "b"]}},
        "tau": {"greedy": {"dspark": {"code": 3.4, "macro": 3.4}, "dflash": {"code": 3.0, "macro": 3.0}}},
        "tau_ratio_dspark_over_dflash": 1.13,
        "wall_clock": {"methods": ["plain", "dspark:scheduler"], "mismatches_total": 0, "mismatches": [],
                       "suites": {"code": {
                           "plain": {"median_tokens_per_s": 15.0, "median_speedup": 1.0, "per_prompt": [{"id": "a"}]},
                           "dspark:scheduler": {"median_tokens_per_s": 24.0, "median_speedup": 1.6, "per_prompt": []},
                       }}},
        "notes": [], "runtime_s": 100.0,
    }
    speed = hub_sections.speed_section(result)
    assert "*greedy*" in speed and "| dspark | 3.40 | 3.40 |" in speed and "| dflash | 3.00 | 3.00 |" in speed
    assert "| dspark:scheduler | 1.60 |" in speed and "| dspark:scheduler | 24.00 |" in speed
    assert "- cpu: Some CPU" in speed and "dspark bench --out docs" in speed and "Date: 2026-11-29" in speed
    assert "**greedy outputs that differ from plain generate**: 0" in speed and "| gamma | 7 |" in speed
    assert "per_prompt" not in speed and "runtime_s" not in speed and hub_sections.measured_on_cpu(result)
    compare = {"command": "python scripts/compare_generate.py --n 10", "modes": {
        "scheduler": {"median_speedup": 1.07, "median_tau": 1.5, "identical": 10, "prompts": 10, "runs": [{"id": "x"}]}}}
    speed = hub_sections.speed_section(result, compare)
    assert speed.index("dspark generate --compare") < speed.index("*greedy*")
    assert "| scheduler | 1.07 | 1.50 | 10 | 10 |" in speed and "compare_generate.py --n 10" in speed
    assert '"id"' not in speed and "| x |" not in speed


def test_card_rejects_a_target_that_is_not_a_hub_id(saved):
    config = DSparkConfig.from_pretrained(saved / "card", target_name_or_path="/local/smollm2")
    with pytest.raises(ValueError, match="not a Hub id"):
        hub.build_card(config, repo=REPO_ID)


# -------------------------------------------------------------------------------- load by id
def test_from_pretrained_by_repo_id_from_the_hf_cache(saved, hub_cache, offline):
    info = {repo.repo_id: repo for repo in scan_cache_dir(hub_cache).repos}
    revision = next(iter(info[REPO_ID].revisions))
    assert revision.commit_hash == COMMIT and revision.refs == {"main"}
    local = DSparkDrafter.from_pretrained(saved / "card")
    by_id = DSparkDrafter.from_pretrained(REPO_ID, cache_dir=hub_cache)
    for name, tensor in weights(local).items():
        torch.testing.assert_close(weights(by_id)[name], tensor, rtol=0, atol=0)
    assert by_id.calibration is not None and by_id.calibration.temperatures == local.calibration.temperatures


def _load_recipe(card_dir: Path):
    file = card_dir / "custom_generate" / "generate.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{abs(hash(str(card_dir)))}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_generate_reads_no_frames():
    """The recipe is self-contained: it finds its drafter from its arguments, its folder and DRAFTER_REPO, never from
    transformers' frames."""
    source = hub_sections.GENERATE_TEMPLATE.read_text()
    assert "_getframe" not in source and "f_locals" not in source and "inspect" not in source


def _greedy_case(saved):
    target = LlamaForCausalLM.from_pretrained(saved / "target").eval()
    target.config._name_or_path = DEFAULT_TARGET_NAME  # the drafter's target (else bind warns)
    ids = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(3))
    return target, ids, target.generate(ids, max_new_tokens=12, do_sample=False)


def test_custom_generate_in_a_drafter_folder_uses_that_folder(saved, hub_cache, offline):
    """Imported from the drafter's own folder, the recipe uses the folder (before DRAFTER_REPO)."""
    target, ids, plain = _greedy_case(saved)
    recipe = _load_recipe(saved / "card")
    assert recipe.DRAFTER_REPO == REPO_ID
    out = recipe.generate(target, ids, max_new_tokens=12, do_sample=False, dspark_verification="fixed",
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    (key, drafter), = recipe._drafters.items()
    assert key[0] == str(saved / "card")
    assert out.dspark_stats is drafter.last_stats and out.dspark_stats.rounds  # the call's own statistics


def test_custom_generate_elsewhere_uses_drafter_repo_and_hub_kwargs(saved, hub_cache, offline, tmp_path):
    """Away from a drafter folder (as transformers runs it, from its modules cache) the recipe loads DRAFTER_REPO
    with the call's Hub kwargs, which do not reach generate."""
    target, ids, plain = _greedy_case(saved)
    hub.write_custom_generate(tmp_path, repo_id=REPO_ID)
    recipe = _load_recipe(tmp_path)
    out = recipe.generate(target, ids, max_new_tokens=12, do_sample=False, cache_dir=str(hub_cache),
                          dspark_verification="fixed")
    assert torch.equal(out, plain)
    (key, drafter), = recipe._drafters.items()
    assert key == (REPO_ID, (("cache_dir", str(hub_cache)),)) and drafter.last_stats.rounds


def test_custom_generate_arguments_come_first(saved, tmp_path):
    """``assistant_model=`` wins over ``dspark_drafter=``, which wins over the folder and DRAFTER_REPO."""
    target, ids, plain = _greedy_case(saved)
    hub.write_custom_generate(tmp_path, repo_id="org/not-downloaded")
    recipe = _load_recipe(tmp_path)
    given = DSparkDrafter.from_pretrained(saved / "card").eval()
    out = recipe.generate(target, ids, max_new_tokens=12, do_sample=False, assistant_model=given,
                          dspark_drafter="org/not-downloaded-either", dspark_verification="fixed")
    assert torch.equal(out, plain) and given.last_stats.rounds and recipe._drafters == {}
    out = recipe.generate(target, ids, max_new_tokens=12, do_sample=False, dspark_drafter=str(saved / "card"),
                          dspark_verification="fixed")
    assert torch.equal(out, plain) and [k[0] for k in recipe._drafters] == [str(saved / "card")]


def test_custom_generate_without_a_location_asks_for_one(tmp_path):
    hub.write_custom_generate(tmp_path, repo_id=None)
    with pytest.raises(ValueError, match="dspark_drafter="):
        _load_recipe(tmp_path).generate(tiny_target(), torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)


FRESH = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from transformers import AutoModel, LlamaForCausalLM
    from safetensors.torch import load_file
    card, target_dir, repo_id = sys.argv[1:4]
    result = {}
    drafter = AutoModel.from_pretrained(card, trust_remote_code=True)
    saved = load_file(card + "/model.safetensors")
    state = drafter.state_dict()
    result["remote_class"] = type(drafter).__module__.startswith("transformers_modules") and type(drafter).__name__
    result["weights_equal"] = all(torch.equal(state[k], v) for k, v in saved.items())
    result["calibration"] = drafter.calibration is not None
    result["routed_by_remote_load"] = "dspark_hf" in sys.modules  # the remote model.py imports the installed package
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter, dspark_verification="fixed")
    result["assistant_model"] = torch.equal(out, plain) and len(drafter.last_stats.rounds) > 0
    for name, location in (("folder", card), ("repo_id", repo_id)):
        out = target.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=location,
                              trust_remote_code=True, dspark_verification="fixed")
        result[name] = torch.equal(out, plain)
    recipes = [m for n, m in sys.modules.items() if n.endswith("custom_generate.generate")]
    result["drafters"] = sorted(k[0] for m in recipes for k in m._drafters)
    result["rounds"] = [len(d.last_stats.rounds) for m in recipes for d in m._drafters.values()]
    print("RESULT " + json.dumps(result))
""")


def test_fresh_process_without_dspark_import(saved, hub_cache, tmp_path):
    """trust_remote_code loads the drafter, and both assistant_model= and custom_generate (by folder and by Hub id)
    decode token-identically to plain generate, in a process whose code never imports dspark_hf itself (the
    remote model.py imports the installed package, which routes the remote class). transformers runs the recipe from
    its modules cache, so both custom_generate calls load the card's DRAFTER_REPO."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "HF_MODULES_CACHE": str(tmp_path),
           "PYTHONPATH": str(Path(dspark_hf.__file__).resolve().parent.parent), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", FRESH, str(saved / "card"), str(saved / "target"), REPO_ID],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["remote_class"] == "DSparkDrafter" and result["weights_equal"] and result["calibration"]
    assert result["routed_by_remote_load"] is True
    assert result["assistant_model"] and result["folder"] and result["repo_id"]
    assert result["drafters"] == [REPO_ID, REPO_ID]  # one recipe copy per location, each loading DRAFTER_REPO
    assert all(r > 0 for r in result["rounds"])


# -------------------------------------------------------------------------------------- push
class FakeHfApi:
    calls: list = []

    def __init__(self, token=None, **kwargs):
        self.token = token

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", self.token, repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", self.token, kwargs["repo_id"], kwargs))
        return huggingface_hub.CommitInfo(commit_url=f"https://hf.co/{kwargs['repo_id']}/commit/1", commit_message="",
                                          commit_description="", oid="1" * 40)


@pytest.fixture
def fake_api(monkeypatch):
    FakeHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi.calls


def test_push_without_token_names_the_fix(saved, monkeypatch, fake_api):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(hub_push.HubTokenError, match=r"huggingface-cli login.*HF_TOKEN"):
        hub_push.push(saved / "card", REPO_ID)
    with pytest.raises(SystemExit, match="HF_TOKEN"):
        cli_main(["push", str(saved / "card"), "--repo-id", REPO_ID])
    assert fake_api == []


def test_push_uploads_the_folder(saved, monkeypatch, fake_api):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    cli_main(["push", str(saved / "card"), "--repo-id", REPO_ID, "--private"])
    (create, token, repo, kwargs), (upload, token2, repo2, up) = fake_api
    assert (create, token, repo) == ("create_repo", "hf_fake", REPO_ID)
    assert kwargs == {"private": True, "exist_ok": True, "repo_type": "model"}
    assert (upload, token2, repo2) == ("upload_folder", "hf_fake", REPO_ID)
    assert Path(up["folder_path"]) == saved / "card" and up["repo_type"] == "model" and up["delete_patterns"] == "*"


def test_push_refuses_a_card_written_for_another_repo(saved, monkeypatch, fake_api):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: pytest.fail("checked the token before the folder"))
    with pytest.raises(ValueError, match="dspark card .* --repo-id org/other"):
        hub_push.push(saved / "card", "org/other")
    assert fake_api == []


def test_sharded_drafter_counts_and_checks_like_one_file(tmp_path):
    """`dspark train` saves drafters as safetensors shards: the card's parameter count and the push check see them."""
    target = tiny_llama(V, 32, 2)
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=1, mask_token_id=0))
    drafter.save_pretrained(tmp_path / "one")
    drafter.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    n = sum(p.numel() for p in drafter.parameters())
    assert hub._count_params(tmp_path / "sharded") == hub._count_params(tmp_path / "one") == n
    with pytest.raises(FileNotFoundError) as missing:
        hub_push.check_card_folder(tmp_path / "sharded", REPO_ID)
    assert "README.md" in str(missing.value) and "model.safetensors" not in str(missing.value)  # weights found
