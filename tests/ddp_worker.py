"""Run by ``accelerate launch`` from ``test_training.py``: ``python ddp_worker.py TARGET_DIR CONFIG_YAML...``.

Loads the saved tiny target and calls :func:`dspark_hf.training.train` in every process, as ``dspark train``
does after its data step, once per config (a later config with the same ``out_dir`` resumes the run).
"""

import sys

from transformers import AutoModelForCausalLM

from dspark_hf.training import TrainConfig, train

if __name__ == "__main__":
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    for config in sys.argv[2:]:
        train(target, TrainConfig.from_yaml(config), progress=False)
