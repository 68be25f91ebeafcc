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


def test_ppo_step_example():
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "ppo_step.py"), "--dtype", "float64"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    multi, single = (float(x) for x in re.search(
        r"rollouts with compactions (\S+), one-segment rollouts (\S+)", out).groups())
    # The exact and the segment-discounted advantages differ where a rollout
    # has compactions, and are the same computation where it has none.
    assert multi > 1e-3 and single == 0.0, out
    steps = re.findall(r"PPO \((\w+)\s*\): policy loss (\S+), value loss (\S+), clip fraction ([0-9.]+)", out)
    assert [s[0] for s in steps] == ["compaction", "exact"], out
    for _, loss, vloss, clip in steps:
        assert abs(float(loss)) < 10 and 0 <= float(vloss) < 100 and 0 <= float(clip) <= 1, out
    assert re.search(r"GRPO: 16 rollouts in 1 pack\(s\).*policy loss \S+", out), out


def test_fsdp2_grpo_example():
    """python/examples/fsdp2_grpo.py: a GRPO step under FSDP2 on 2 gloo
    processes equals the single-process step (loss, every gradient), and the
    step lowers the loss."""
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "fsdp2_grpo.py"), "--dtype", "float64"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    m = re.search(r"step loss (\S+), one process (\S+), largest relative gradient difference (\S+)", out)
    assert m, out
    loss, ref, worst = (float(x) for x in m.groups())
    assert abs(loss - ref) <= 1e-12 * max(abs(ref), 1e-12), out
    assert worst <= 1e-10, out
    after = float(re.search(r"after one step: loss (\S+)", out).group(1))
    assert after < loss, out


def test_chat_grpo_example():
    """python/examples/chat_grpo.py: chat logs (a Qwen3-style template that
    drops earlier reasoning) through from_chat, a pack and a GRPO step; the
    packed log-probs equal each call alone, the step moves the targets the
    way their advantages say, and the final transcript alone drifts."""
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "chat_grpo.py"), "--dtype", "float64"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    assert re.search(r"from_chat: 4 rollouts, 16 calls \(15 tokenized here, 1 from engine ids\)", out), out
    per = re.findall(r"paris-\d: 4 calls, 1 junction\(s\), 1 made by the template; (\d+) tokens in the calls "
                     r"-> (\d+) in its trie", out)
    assert len(per) == 4 and all(int(b) < int(a) for a, b in per), out
    exact = float(re.search(r"packed vs each call alone: (\S+)", out).group(1))
    assert exact <= 1e-9, out
    up, down = (float(x) for x in re.search(r"advantage > 0 (\S+), < 0 (\S+)", out).groups())
    assert up > 0 > down, out
    mean, worst, n, unscored = re.search(
        r"Naive-Compressed +mean (\S+) +max (\S+) nats over (\d+) targets \((\d+) targets not scored", out).groups()
    assert float(worst) > 1e-2 and float(mean) > 0 and int(n) > 0 and int(unscored) > 0, out
