"""treeattn.pack against the README's worked example and the CLI."""

import json
import os
import pathlib
import subprocess

import pytest
import torch

import treeattn
from conftest import GOLDEN, REPO, SAMPLE


def test_worked_example():
    (p,) = treeattn.pack(GOLDEN)
    assert p.tokens.tolist() == [10, 11, 20, 30, 31, 40, 32, 1, 50, 51, 3, 50, 51, 40, 32, 33]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7]
    assert p.kv_end.tolist() == [16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16]
    assert p.loss_rows.tolist() == [2, 3, 5, 7, 8, 14]
    assert p.loss_labels.tolist() == [30, 31, 32, 50, 51, 33]
    assert p.loss_call.tolist() == [0, 0, 1, 2, 2, 3]
    assert p.loss_offset.tolist() == [0, 1, 0, 0, 1, 0]
    assert p.loss_rollout.tolist() == [0] * 6
    assert p.loss_weights.tolist() == [1.0] * 6
    assert torch.isnan(p.loss_logprobs).all()
    pairs = sorted(zip(p.sdcc_student_rows.tolist(), p.sdcc_teacher_rows.tolist()))
    assert pairs == [(10, 7), (11, 8), (13, 5)]
    for name in treeattn.PACK_TENSORS:
        t = getattr(p, name)
        floats = ("loss_weights", "loss_logprobs", "rollout_reward", "loss_reward")
        bools = ("loss_summary", "rollout_truncated")
        want = torch.float32 if name in floats else torch.bool if name in bools else torch.int64
        assert t.dtype == want, name
    (st,) = p.stats
    assert (st["junctions"], st["branches"], st["targets"], st["diverging"]) == (1, 2, 6, 3)
    assert (st["trie_tokens"], st["branch_tokens"]) == (16, 18)
    assert p.rollout_ids == ["r17"] and p.rollout_indices == [0]
    # Call 3 is the junction: its target is in segment 1.
    assert p.loss_segment.tolist() == [0, 0, 0, 0, 0, 1]
    assert torch.isnan(p.rollout_reward).all() and p.rollout_group.tolist() == [-1] and p.groups == []


def test_replicated_layout():
    (p,) = treeattn.pack(GOLDEN, layout="replicated")
    assert len(p) == 18 and p.layout == "replicated"
    assert p.sdcc_student_rows is None and p.sdcc_teacher_rows is None
    assert p.loss_labels.tolist() == [30, 31, 32, 50, 51, 33]


def test_logprobs_and_nan_where_none():
    rs = [
        {"id": "a", "calls": [{"context": [1, 2], "completion": [3, 4], "logprobs": [-0.5, -1.25]}]},
        {"id": "b", "calls": [{"context": [1, 2], "completion": [5]}]},
    ]
    (p,) = treeattn.pack(rs)
    lp = {(r, o): x for r, o, x in zip(p.loss_rollout.tolist(), p.loss_offset.tolist(), p.loss_logprobs.tolist())}
    assert lp[(0, 0)] == -0.5 and lp[(0, 1)] == -1.25
    assert lp[(1, 0)] != lp[(1, 0)]  # NaN


def test_budget_and_sharing():
    rs = [{"id": f"g{i}", "calls": [{"context": [7, 8, 9, 10], "completion": [20 + i, 30]}]} for i in range(4)]
    assert len(treeattn.pack(rs, budget=6)) == 4
    # Prefixes are shared by default: the prompt is stored once.
    shared = treeattn.pack(rs, budget=12)
    assert len(shared) == 1 and len(shared[0]) == 4 + 4 * 2
    assert sorted(shared[0].rollout_ids) == ["g0", "g1", "g2", "g3"]
    (explicit,) = treeattn.pack(rs, budget=12, share_prefixes=True)
    assert torch.equal(explicit.tokens, shared[0].tokens) and torch.equal(explicit.kv_end, shared[0].kv_end)
    # share_prefixes=False: each rollout keeps its prompt, so 12 tokens fit two.
    own = treeattn.pack(rs, budget=12, share_prefixes=False)
    assert len(own) == 2 and all(len(p) == 2 * 6 for p in own)


def test_path_and_list_agree():
    lines = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    a = treeattn.pack(str(SAMPLE), share_prefixes=True, budget=1000)
    b = treeattn.pack(lines, share_prefixes=True, budget=1000)
    assert len(a) == len(b) > 1
    for x, y in zip(a, b):
        for name, t in x.tensors().items():
            assert torch.allclose(t, getattr(y, name), rtol=0, atol=0, equal_nan=True), name


def _cli():
    for p in (os.environ.get("TREEATTN_CLI"), REPO / "target" / "release" / "treeattn", REPO / "target" / "debug" / "treeattn"):
        if p and pathlib.Path(p).is_file():
            return str(p)
    return None


def test_same_tensors_as_cli(tmp_path):
    if _cli() is None:
        if os.environ.get("TREEATTN_REQUIRE_CLI"):
            pytest.fail(f"TREEATTN_CLI={os.environ.get('TREEATTN_CLI')!r} is not a file")
        pytest.skip("no treeattn CLI built (cargo build --release); .ci/run builds it before pytest")
    from safetensors.torch import load_file

    out = tmp_path / "pack.safetensors"
    subprocess.run([_cli(), "pack", str(SAMPLE), "--out", str(out), "--budget", "1000", "--share-prefixes"],
                   check=True, capture_output=True)
    ours = treeattn.pack(SAMPLE, budget=1000, share_prefixes=True)
    files = sorted(tmp_path.glob("pack-*.safetensors"))
    assert len(files) == len(ours) > 1
    for f, p in zip(files, ours):
        theirs = load_file(str(f))
        assert {"loss_reward", "loss_summary", "rollout_truncated", "rollout_fingerprint"} <= set(theirs)
        for name, t in theirs.items():
            # rollout_reward holds NaN where a rollout has no reward.
            mine = getattr(p, name)
            assert t.dtype == mine.dtype and torch.allclose(t, mine, rtol=0, atol=0, equal_nan=True), (f, name)
        # The file has loss_logprobs only when every target has one (equal
        # above); otherwise ours holds NaN for the targets without.
        if "loss_logprobs" not in theirs:
            assert torch.isnan(p.loss_logprobs).any()
    assert any("loss_logprobs" in load_file(str(f)) for f in files)


@pytest.mark.parametrize(
    "rollouts, words",
    [
        ([{"id": "bad", "calls": [{"context": [1], "completion": []}]}], ["bad", "call 0", "completion"]),
        ([{"id": "x", "calls": [{"context": [1], "completion": [2]}, {"context": [], "completion": [2]}]}], ["x", "call 1", "context"]),
        ([{"id": "lp", "calls": [{"context": [1], "completion": [2, 3], "logprobs": [-1.0]}]}], ["lp", "call 0", "logprobs"]),
        ([{"id": "pos", "calls": [{"context": [1], "completion": [2], "logprobs": [0.5]}]}], ["pos", "call 0", "logprobs"]),
        ([{"id": "e", "calls": []}], ['"e"', "calls"]),
        ([{"id": "d", "calls": [{"context": [1], "completion": [2]}]}] * 2, ["d", "duplicate"]),
        ([{"id": "neg", "calls": [{"context": [-1], "completion": [2]}]}], ["context"]),
        ([{"calls": [{"context": [1], "completion": [2]}]}], ["id"]),
        ([{"id": "ok", "calls": [{"context": [1], "completion": [2]}]}, 5], ["rollouts[1]"]),
        ([{"id": "nan", "calls": [{"context": [1], "completion": [2], "logprobs": [float("nan")]}]}], ["rollouts[0]", "'nan'", "NaN"]),
        ([{"id": "obj", "calls": [{"context": [object()], "completion": [2]}]}], ["rollouts[0]", "JSON"]),
    ],
)
def test_bad_rollouts_raise_value_error_naming_what(rollouts, words):
    with pytest.raises(ValueError) as e:
        treeattn.pack(rollouts)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        treeattn.pack(GOLDEN, layout="dense")
    with pytest.raises(ValueError, match="budget"):
        treeattn.pack(GOLDEN, budget=0)
    # Documented as ValueError, not OverflowError / TypeError from below.
    with pytest.raises(ValueError, match="budget"):
        treeattn.pack(GOLDEN, budget=10**30)
    with pytest.raises(ValueError, match="share_prefixes"):
        treeattn.pack(GOLDEN, share_prefixes="no")
    with pytest.raises(ValueError, match="budget|exceeds|token"):
        treeattn.pack(GOLDEN, budget=5)
    with pytest.raises(ValueError, match="rollouts"):
        treeattn.pack(42)
    with pytest.raises(OSError, match="nonexistent"):
        treeattn.pack("/nonexistent/rollouts.jsonl")
    with pytest.raises(ValueError):
        treeattn.pack([])


def test_reprs_show_sizes_and_dir_shows_the_api():
    import treeattn.torch as tt

    (p,) = treeattn.pack(SAMPLE)
    r = repr(p)
    assert r.startswith("Pack(layout='trie', tokens=1793, targets=662, sdcc_pairs=112, rollouts=22 ['golden', ")
    assert len(r) < 200 and "tensor" not in r  # the dataclass repr printed 36,847 characters
    (rep,) = treeattn.pack(SAMPLE, layout="replicated")
    assert "sdcc_pairs" not in repr(rep) and "tokens=3040" in repr(rep)
    assert repr(tt.MaskPlan(p.kv_end, p.position_ids)) == "MaskPlan(L=1793, with position_ids, device=cpu)"
    assert repr(treeattn.paths(p.kv_end)).startswith("Paths(rows=1793, nodes=")
    names = set(dir(treeattn))
    assert set(treeattn.__all__) <= names and "torch" in names  # imported above
    assert not names & {"json", "os", "reprlib", "sys", "dataclass", "field", "Any", "Dict", "List", "Optional",
                        "annotations", "PACK_TENSORS"}, names
    assert all(hasattr(treeattn, n) for n in treeattn.__all__)
    ns: dict = {}
    exec("from treeattn import *", ns)
    assert set(ns) - {"__builtins__"} == set(treeattn.__all__)
