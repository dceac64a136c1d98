"""The `dspark` command line: options every compute command shares."""

import pytest
import torch

from dspark_hf import bench, cli, demo


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("module", "name", "command"), [
    (cli, "cmd_generate", ["generate", "hi"]), (cli, "cmd_profile", ["profile"]),
    (bench, "cmd_bench", ["bench"]), (demo, "cmd_demo", ["demo"]), (cli, "cmd_calibrate", ["calibrate"]),
])
def test_threads_option_sets_torch_threads(module, name, command, monkeypatch, restore_threads):
    seen = []
    monkeypatch.setattr(module, name, lambda args: seen.append((args.threads, torch.get_num_threads())))
    torch.set_num_threads(2)
    cli.main([*command, "--threads", "1"])
    cli.main(command)  # the default is one thread, not one per core
    assert seen == [(1, 1), (cli.DEFAULT_THREADS, cli.DEFAULT_THREADS)] and cli.DEFAULT_THREADS == 1


def test_threads_must_be_positive(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_profile", lambda args: pytest.fail("must not run"))
    with pytest.raises(SystemExit):
        cli.main(["profile", "--threads", "0"])
    assert "--threads must be >= 1" in capsys.readouterr().err
