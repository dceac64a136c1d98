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
    (checkout / "model_cards" / defaults.DEFAULT_DRAFTER_NAME).mkdir(parents=True)
    (checkout / "model_cards" / defaults.DEFAULT_DRAFTER_NAME / "config.json").write_text("{}")
    monkeypatch.setattr(defaults, "REPO_ROOT", checkout)
    assert defaults.default_drafter() == checkout / "model_cards" / defaults.DEFAULT_DRAFTER_NAME
    monkeypatch.setattr(defaults, "REPO_ROOT", tmp_path / "site-packages")  # an installed wheel: no model_cards/
    assert defaults.default_drafter() == defaults.PACKAGED_DRAFTERS / defaults.DEFAULT_DRAFTER_NAME


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
