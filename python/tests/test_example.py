"""python/examples/train_step.py runs (float64, 3 rollouts, 2 steps): the
loss goes down and the packed log-probs equal each call run alone."""

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("transformers")


def test_train_step_example():
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "train_step.py"),
         "--max-rollouts", "3", "--steps", "2", "--dtype", "float64"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    drifts = [float(x) for x in re.findall(r"alone, (?:before|after): +(\S+)", out)]
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(drifts) == 2 and len(losses) == 2, out
    assert max(drifts) <= 1e-9, out
    assert losses[1] < losses[0], out
