"""Build hook: the wheel carries the shipped drafter as package data (``dspark_hf/drafters/<name>/``), so an installed
``dspark generate`` finds its default drafter (``dspark_hf.defaults.default_drafter``). Everything else is in
pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED_DRAFTERS = ["dspark-smollm2-135m-instruct"]  # folders of drafters/ that go into the wheel
# the weights (one file or <= 16 MB shards + their index), the config, the STS calibration and the training record
DRAFTER_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", "calibration.json", "training.json")


class BuildPyWithDrafters(build_py):
    def run(self):
        super().run()
        for name in SHIPPED_DRAFTERS:
            source = Path("drafters") / name
            if not source.is_dir():  # e.g. an sdist without drafters/: the wheel then has no default drafter
                continue
            target = Path(self.build_lib) / "dspark_hf" / "drafters" / name
            target.mkdir(parents=True, exist_ok=True)
            for pattern in DRAFTER_FILES:
                for file in source.glob(pattern):
                    shutil.copyfile(file, target / file.name)


setup(cmdclass={"build_py": BuildPyWithDrafters})
