"""treeattn.rl: rewards, groups and segments in packs; GAE and GRPO
advantages against plain loops over the unpacked calls."""

import json
import random
import struct

import pytest
import torch

import treeattn
import treeattn.rl
from conftest import GOLDEN, SAMPLE


def sample_rollouts(seed):
    """data/sample.jsonl (golden, compaction, stack-pop, fold, memex, a GRPO
    group of 16, plain) with fresh random rewards (float32 values: a pack
    stores rewards as float32); the GRPO rollouts in two groups, the others
    each in a group of its own."""
    rng = random.Random(seed)
    rs = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    for r in rs:
        x = rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
        r["reward"] = struct.unpack("f", struct.pack("f", x))[0]
        r["group"] = f"g{rng.randrange(2)}" if r["id"].startswith("grpo") else r["id"]
    return rs


def segments_of(rollout):
    """Per call: its segment, from the calls alone (a junction: a context
    that does not extend the previous call's context + completion)."""
    seg, out, prev = 0, [], None
    for c in rollout["calls"]:
        if prev is not None and c["context"][: len(prev)] != prev:
            seg += 1
        out.append(seg)
        prev = c["context"] + c["completion"]
    return out


def plain_gae(values, reward, gamma, lam):
    """GAE by a plain loop over one run of targets ending with `reward`."""
    n = len(values)
    adv = [0.0] * n
    for t in range(n):
        acc = 0.0
        for u in range(t, n):
            r = reward if u == n - 1 else 0.0
            nxt = values[u + 1] if u + 1 < n else 0.0
            acc += (gamma * lam) ** (u - t) * (r + gamma * nxt - values[u])
        adv[t] = acc
    return adv


def unpacked(rollouts, value_of, gamma, lam, mode):
    """{(rollout index, call, offset): advantage}, rollout by rollout over
    the input's calls in generation order (no pack involved)."""
    out = {}
    for ri, r in enumerate(rollouts):
        keys = [(ri, c, o) for c, call in enumerate(r["calls"]) for o in range(len(call["completion"]))]
        seg = segments_of(r)
        lam_r = (1 - 1 / (1.5 * len(keys))) if lam == "adaptive" else lam
        vals = [value_of[k] for k in keys]
        if mode == "exact":
            adv = plain_gae(vals, r["reward"], gamma, lam_r)
        else:
            adv = []
            segs = [seg[k[1]] for k in keys]
            for s in sorted(set(segs)):
                idx = [i for i, x in enumerate(segs) if x == s]
                a = plain_gae([vals[i] for i in idx], r["reward"], gamma, lam_r)
                if mode == "compaction":
                    later = sum(1 for x in segs if x > s)
                    a = [x * (gamma * lam_r) ** later for x in a]
                adv.extend(a)
        out.update(zip(keys, adv))
    return out


@pytest.mark.parametrize("mode", ["exact", "segment", "compaction"])
@pytest.mark.parametrize("lam", [0.95, "adaptive"])
def test_gae_equals_a_plain_loop_over_the_unpacked_calls(mode, lam):
    rs = sample_rollouts(seed=len(mode) * 7 + (lam == "adaptive"))
    gen = torch.Generator().manual_seed(7)
    packs = treeattn.pack(rs, share_prefixes=True, budget=800)
    assert len(packs) > 1
    calls_before = [0]
    for r in rs:
        calls_before.append(calls_before[-1] + len(r["calls"]))
    value_of = {}
    for ri, r in enumerate(rs):
        for c, call in enumerate(r["calls"]):
            for o in range(len(call["completion"])):
                value_of[(ri, c, o)] = float(torch.randn((), generator=gen, dtype=torch.float64))
    gamma = 0.99
    want = unpacked(rs, value_of, gamma, lam, mode)
    checked = 0
    for p in packs:
        keys = [(r, c - calls_before[r], o) for r, c, o in
                zip(p.loss_rollout.tolist(), p.loss_call.tolist(), p.loss_offset.tolist())]
        values = torch.tensor([value_of[k] for k in keys], dtype=torch.float64)
        adv, ret = treeattn.rl.gae(p, values, gamma=gamma, lam=lam, mode=mode)
        assert adv.dtype == torch.float64 and adv.shape == values.shape
        expect = torch.tensor([want[k] for k in keys], dtype=torch.float64)
        assert torch.allclose(adv, expect, rtol=1e-12, atol=1e-12)
        assert torch.equal(ret, adv + values)
        checked += len(keys)
    assert checked == len(want)


def test_segments_follow_the_junctions():
    rs = sample_rollouts(seed=1)
    (p,) = treeattn.pack(rs, share_prefixes=True)
    calls_before = [0]
    for r in rs:
        calls_before.append(calls_before[-1] + len(r["calls"]))
    segs = [segments_of(r) for r in rs]
    for r, c, s in zip(p.loss_rollout.tolist(), p.loss_call.tolist(), p.loss_segment.tolist()):
        assert s == segs[r][c - calls_before[r]]
    assert p.loss_segment.max() >= 2  # the compaction rollout has several segments


def test_one_segment_all_modes_agree_and_float32_values_stay_float32():
    rs = [{"id": "a", "reward": 1.5, "calls": [
        {"context": [1, 2], "completion": [3, 4]},
        {"context": [1, 2, 3, 4, 5], "completion": [6, 7, 8]}]}]
    (p,) = treeattn.pack(rs)
    assert p.loss_segment.tolist() == [0] * 5
    v = torch.randn(5)
    outs = [treeattn.rl.gae(p, v, gamma=0.9, lam=0.8, mode=m)[0] for m in ("exact", "segment", "compaction")]
    assert outs[0].dtype == torch.float32
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_grpo_advantages_per_group_across_packs():
    rs = sample_rollouts(seed=3)
    packs = treeattn.pack(rs, share_prefixes=True, budget=800)
    assert len(packs) > 2
    advs = treeattn.rl.grpo_advantages(packs, dtype=torch.float64)
    by_group = {}
    for r in rs:
        by_group.setdefault(r["group"], []).append(r["reward"])
    stats = {g: (sum(x) / len(x), (sum((y - sum(x) / len(x)) ** 2 for y in x) / len(x)) ** 0.5)
             for g, x in by_group.items()}
    for p, a in zip(packs, advs):
        assert a.shape == p.loss_rows.shape
        for r, x in zip(p.loss_rollout.tolist(), a.tolist()):
            rw, g = rs[r]["reward"], rs[r]["group"]
            mean, sd = stats[g]
            want = 0.0 if len(set(by_group[g])) == 1 else (rw - mean) / (sd + 1e-6)
            assert x == pytest.approx(want, rel=1e-12, abs=1e-12)
    # A group of one: exactly 0 (rollouts other than GRPO's are alone).
    golden = next(i for i, p in enumerate(packs) if "golden" in p.rollout_ids)
    p = packs[golden]
    k = p.rollout_ids.index("golden")
    assert (advs[golden][p.loss_rollout_local() == k] == 0).all()
    unscaled = treeattn.rl.grpo_advantages(packs[0], scale="none", dtype=torch.float64)
    r = packs[0].loss_rollout[0].item()
    mean = stats[rs[r]["group"]][0]
    assert unscaled[0].item() == pytest.approx(rs[r]["reward"] - mean, abs=1e-12)


def test_rewards_and_groups_in_packs():
    rs = [
        {"id": "a", "reward": 1.0, "group": "q", "calls": [{"context": [1, 2], "completion": [3]}]},
        {"id": "b", "reward": -0.5, "group": "p", "calls": [{"context": [1, 2], "completion": [4]}]},
        {"id": "c", "group": "q", "calls": [{"context": [1, 2], "completion": [5]}]},
    ]
    (p,) = treeattn.pack(rs, share_prefixes=True)
    assert p.groups == ["q", "p"]
    assert p.rollout_group.tolist() == [0, 1, 0]
    assert p.rollout_reward[:2].tolist() == [1.0, -0.5] and torch.isnan(p.rollout_reward[2])
    with pytest.raises(ValueError, match="no reward.*'c'"):
        treeattn.rl.grpo_advantages(p)
    with pytest.raises(ValueError, match="no reward.*'c'"):
        treeattn.rl.gae(p, torch.zeros(3))


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("reward", "1", ['rollout "r"', "reward", "number"]),
        ("reward", True, ['rollout "r"', "reward"]),
        ("reward", 1e300, ['rollout "r"', "reward", "f32"]),
        ("reward", float("inf"), ["rollouts[0]", "reward must be finite"]),
        ("group", 7, ['rollout "r"', "group", "string"]),
    ],
)
def test_bad_reward_or_group_names_the_rollout(field, value, words):
    r = {"id": "r", field: value, "calls": [{"context": [1], "completion": [2]}]}
    with pytest.raises(ValueError) as e:
        treeattn.pack([r])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_arguments_are_value_errors():
    rs = [dict(GOLDEN[0], reward=1.0, group="g")]
    (p,) = treeattn.pack(rs)
    v = torch.zeros(6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"values has shape \(5,\), expected \[6\]"):
        treeattn.rl.gae(p, v[:5])
    with pytest.raises(ValueError, match="value"):
        treeattn.rl.gae(p, torch.full((6,), float("nan")))
    with pytest.raises(ValueError, match="gamma"):
        treeattn.rl.gae(p, v, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        treeattn.rl.gae(p, v, lam=2.0)
    with pytest.raises(ValueError, match="adaptive"):
        treeattn.rl.gae(p, v, lam="linear")
    with pytest.raises(ValueError, match="mode"):
        treeattn.rl.gae(p, v, mode="fast")
    with pytest.raises(ValueError, match="alpha"):
        treeattn.rl.gae(p, v, lam="adaptive", alpha=0.0)
    with pytest.raises(ValueError, match="scale"):
        treeattn.rl.grpo_advantages(p, scale="max")
    with pytest.raises(ValueError, match="eps"):
        treeattn.rl.grpo_advantages(p, eps=-1.0)
    (q,) = treeattn.pack([dict(GOLDEN[0], reward=1.0)])
    with pytest.raises(ValueError, match="no group.*'r17'"):
        treeattn.rl.grpo_advantages(q)
    # The same rollout id twice with different rewards (two inputs mixed up).
    (q2,) = treeattn.pack([dict(GOLDEN[0], reward=0.0, group="g")])
    with pytest.raises(ValueError, match="'r17' appears twice"):
        treeattn.rl.grpo_advantages([p, q2])
    # A group of one with eps = 0: 0, not NaN.
    assert (treeattn.rl.grpo_advantages(p, eps=0.0) == 0).all()


def _grpo_rank(rank, world, port, rollouts, out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        mine = [r for i, r in enumerate(rollouts) if i % world == rank]
        packs = treeattn.pack(mine, share_prefixes=True, budget=200)
        advs = treeattn.rl.grpo_advantages(packs, dtype=torch.float64, distributed=True)
        out.put((rank, {p.rollout_ids[k]: float(a[p.loss_rollout_local() == k][0])
                        for p, a in zip(packs, advs) for k in range(len(p.rollout_ids))}))
    finally:
        dist.destroy_process_group()


def per_rollout(packs):
    """{rollout id: its GRPO advantage} over `packs`, one process."""
    adv = treeattn.rl.grpo_advantages(packs, dtype=torch.float64)
    out = {}
    for p, a in zip(packs, adv):
        for k, rid in enumerate(p.rollout_ids):
            vals = a[p.loss_rollout_local() == k]
            assert (vals == vals[0]).all()
            out[rid] = float(vals[0])
    return out


def test_grpo_distributed_equals_one_process():
    """Two gloo ranks, each holding half of every group: the gathered
    statistics give each rollout the advantage of one process holding all."""
    import socket

    import torch.multiprocessing as mp

    rs = [r for r in sample_rollouts(seed=11) if r["id"].startswith("grpo")]
    want = per_rollout(treeattn.pack(rs, share_prefixes=True))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_grpo_rank, args=(r, 2, port, rs, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        got.update(q.get(timeout=120)[1])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k
    # Negative control: rank 0's half alone (no gathering) differs.
    alone = per_rollout(treeattn.pack(rs[::2], share_prefixes=True))
    assert max(abs(alone[k] - want[k]) for k in alone) > 1e-3
