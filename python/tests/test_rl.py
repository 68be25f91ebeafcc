"""treeattn.rl: rewards, groups, per-token rewards, truncation and segments
in packs; GAE, GRPO and whitening against plain loops over the unpacked
calls (float64), with verl's conventions checked by hand."""

import dataclasses
import json
import math
import random
import struct

import pytest
import torch

import treeattn
import treeattn.rl
from conftest import GOLDEN, SAMPLE

# gen.rs: the compaction harness appends this token to ask for a summary,
# so the bundled compaction's summary calls are the calls whose context
# ends with it (a test-side way to mark them in the input).
SUMMARY_REQUEST = 4


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def sample_rollouts(seed, extras=False):
    """data/sample.jsonl (golden, compaction, stack-pop, fold, memex, a GRPO
    group of 16, plain) with fresh random rewards (float32 values: a pack
    stores rewards as float32); the GRPO rollouts in two groups, the others
    each in a group of its own. With `extras`: the compaction's summary
    calls marked, and at random per-token "rewards" (some rollouts without a
    scalar "reward" then) and "truncated"."""
    rng = random.Random(seed)
    rs = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    for r in rs:
        x = rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
        r["reward"] = f32(x)
        r["group"] = f"g{rng.randrange(2)}" if r["id"].startswith("grpo") else r["id"]
        if not extras:
            continue
        for c in r["calls"]:
            if c["context"][-1] == SUMMARY_REQUEST:
                c["summary"] = True
        if rng.random() < 0.5:
            r["rewards"] = [[f32(rng.uniform(-1, 1)) for _ in c["completion"]] for c in r["calls"]]
            if rng.random() < 0.3:
                del r["reward"]
        r["truncated"] = rng.random() < 0.4
    return rs


def segments_of(rollout, split="junction"):
    """Per call: its segment, from the calls alone. "junction": +1 at a
    call whose context does not extend the previous call's context +
    completion; "summary": also a summary call is a segment of its own."""
    seg, out, prev, prev_summary = 0, [], None, False
    for c in rollout["calls"]:
        summary = split == "summary" and c.get("summary", False)
        if prev is not None and (c["context"][: len(prev)] != prev or summary or prev_summary):
            seg += 1
        out.append(seg)
        prev = c["context"] + c["completion"]
        prev_summary = summary
    return out


def plain_gae(values, token, reward, boot, gamma, lam):
    """GAE by a plain double loop over one run of targets: per-token rewards
    `token`, `reward` added at the last target, `boot` the value after it."""
    n = len(values)
    adv = [0.0] * n
    for t in range(n):
        acc = 0.0
        for u in range(t, n):
            r = token[u] + (reward if u == n - 1 else 0.0)
            nxt = values[u + 1] if u + 1 < n else boot
            acc += (gamma * lam) ** (u - t) * (r + gamma * nxt - values[u])
        adv[t] = acc
    return adv


def unpacked(rollouts, value_of, boot_of, gamma, lam, mode, split):
    """{(rollout index, call, offset): advantage}, rollout by rollout over
    the input's calls in generation order (no pack involved)."""
    out = {}
    for ri, r in enumerate(rollouts):
        keys = [(ri, c, o) for c, call in enumerate(r["calls"]) for o in range(len(call["completion"]))]
        token = [r["rewards"][c][o] if "rewards" in r else 0.0 for _, c, o in keys]
        reward = r.get("reward", 0.0)
        boot = boot_of[ri] if r.get("truncated") else 0.0
        seg = segments_of(r, split)
        lam_r = (1 - 1 / (1.5 * len(keys))) if lam == "adaptive" else lam
        vals = [value_of[k] for k in keys]
        if mode == "exact":
            adv = plain_gae(vals, token, reward, boot, gamma, lam_r)
        else:
            adv = []
            segs = [seg[k[1]] for k in keys]
            for s in sorted(set(segs)):
                idx = [i for i, x in enumerate(segs) if x == s]
                a = plain_gae([vals[i] for i in idx], [token[i] for i in idx], reward, boot, gamma, lam_r)
                if mode == "compaction":
                    later = sum(1 for x in segs if x > s)
                    a = [x * (gamma * lam_r) ** later for x in a]
                adv.extend(a)
        out.update(zip(keys, adv))
    return out


def calls_before(rs):
    out = [0]
    for r in rs:
        out.append(out[-1] + len(r["calls"]))
    return out


def keys_of(p, base):
    return [(r, c - base[r], o) for r, c, o in
            zip(p.loss_rollout.tolist(), p.loss_call.tolist(), p.loss_offset.tolist())]


@pytest.mark.parametrize("mode", ["exact", "segment", "compaction"])
@pytest.mark.parametrize("lam", [0.95, "adaptive"])
def test_gae_equals_a_plain_loop_over_the_unpacked_calls(mode, lam):
    """Scalar and per-token rewards, truncated rollouts bootstrapped, both
    segment definitions, the critic's own λ for the returns: every target's
    advantage and return against the plain loop (1e-12, float64)."""
    rs = sample_rollouts(seed=len(mode) * 7 + (lam == "adaptive"), extras=True)
    assert any("rewards" in r for r in rs) and any(r["truncated"] for r in rs)
    assert any("reward" not in r for r in rs)
    gen = torch.Generator().manual_seed(7)
    packs = treeattn.pack(rs, share_prefixes=True, budget=800)
    assert len(packs) > 1
    base = calls_before(rs)
    value_of = {}
    for ri, r in enumerate(rs):
        for c, call in enumerate(r["calls"]):
            for o in range(len(call["completion"])):
                value_of[(ri, c, o)] = float(torch.randn((), generator=gen, dtype=torch.float64))
    boot_of = torch.randn(len(rs), generator=gen, dtype=torch.float64).tolist()
    gamma = 0.99
    for split in ("summary", "junction"):
        want = unpacked(rs, value_of, boot_of, gamma, lam, mode, split)
        critic = unpacked(rs, value_of, boot_of, gamma, 1.0, mode, split)
        checked = 0
        for p in packs:
            keys = keys_of(p, base)
            values = torch.tensor([value_of[k] for k in keys], dtype=torch.float64)
            boot = torch.tensor([boot_of[i] for i in p.rollout_indices], dtype=torch.float64)
            adv, ret = treeattn.rl.gae(p, values, gamma=gamma, lam=lam, mode=mode, segments=split,
                                       critic_lam=1.0, bootstrap=boot)
            assert adv.dtype == torch.float64 and adv.shape == values.shape
            expect = torch.tensor([want[k] for k in keys], dtype=torch.float64)
            assert torch.allclose(adv, expect, rtol=1e-12, atol=1e-12)
            expect_ret = torch.tensor([critic[k] for k in keys], dtype=torch.float64) + values
            assert torch.allclose(ret, expect_ret, rtol=1e-12, atol=1e-12)
            checked += len(keys)
        assert checked == len(want)


def test_summary_calls_make_compactionrl_segments():
    """The bundled compaction (3 summaries) has 4 junction segments and 7
    CompactionRL segments; eq. 9 over the two differs (negative control:
    the summary marker is read), and an unmarked input gives the same as
    segments="junction"."""
    rs = sample_rollouts(seed=2, extras=True)
    comp = next(r for r in rs if r["id"].startswith("compaction"))
    assert max(segments_of(comp)) == 3 and max(segments_of(comp, "summary")) == 6
    (p,) = treeattn.pack([comp])
    assert p.loss_summary.dtype == torch.bool and int(p.loss_summary.sum()) > 0
    base = calls_before([comp])
    summary_calls = {c for c, call in enumerate(comp["calls"]) if call.get("summary")}
    assert len(summary_calls) == 3
    assert p.loss_summary.tolist() == [c in summary_calls for _, c, _ in keys_of(p, base)]
    assert p.loss_segment.max() == 3
    v = torch.randn(p.loss_rows.numel(), dtype=torch.float64)
    kw = dict(gamma=1.0, lam=0.9, mode="compaction", bootstrap=torch.zeros(1, dtype=torch.float64))
    a_sum, _ = treeattn.rl.gae(p, v, segments="summary", **kw)
    a_junc, _ = treeattn.rl.gae(p, v, segments="junction", **kw)
    assert (a_sum - a_junc).abs().max() > 1e-3
    for call in comp["calls"]:
        call.pop("summary", None)
    (q,) = treeattn.pack([comp])
    assert not q.loss_summary.any()
    a_plain, _ = treeattn.rl.gae(q, v, segments="summary", **kw)
    assert torch.equal(a_plain, a_junc)


def test_per_token_rewards_truncation_and_end_rows_in_packs():
    rs = sample_rollouts(seed=5, extras=True)
    for layout in ("trie", "replicated"):
        packs = treeattn.pack(rs, layout=layout, budget=900)
        base = calls_before(rs)
        for p in packs:
            for (r, c, o), x in zip(keys_of(p, base), p.loss_reward.tolist()):
                if "rewards" in rs[r]:
                    assert x == rs[r]["rewards"][c][o]
                else:
                    assert math.isnan(x)
            assert p.rollout_truncated.tolist() == [rs[i]["truncated"] for i in p.rollout_indices]
            # The row of a rollout's last token: its ancestors (and itself)
            # spell the last call's context + completion.
            rows = treeattn.rl.end_rows(p)
            for k, i in enumerate(p.rollout_indices):
                last = rs[i]["calls"][-1]
                seq = last["context"] + last["completion"]
                row = int(rows[k])
                path = [j for j in range(row + 1) if j <= row < int(p.kv_end[j])]
                assert [int(p.tokens[j]) for j in path] == seq
    # The `rewards` tensor replaces the input's per-token rewards.
    (p,) = treeattn.pack([dict(GOLDEN[0], reward=2.0, rewards=[[1.0, 1.0], [1.0], [1.0, 1.0], [1.0]])])
    v = torch.zeros(6, dtype=torch.float64)
    a, _ = treeattn.rl.gae(p, v, gamma=1.0, lam=1.0)
    assert a.tolist() == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    rho = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0], dtype=torch.float64)
    a, _ = treeattn.rl.gae(p, v, gamma=1.0, lam=1.0, rewards=rho)
    assert a.tolist() == [1.0] * 6


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


def grpo_reference(returns, groups, std="sample", eps=1e-6):
    """verl's compute_grpo_outcome_advantage (std="sample"), with the
    population std, or TRL's scale_rewards="batch" centred per group, in
    float64 torch: {index: advantage}."""
    r = torch.tensor(returns, dtype=torch.float64)
    out = {}
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    batch_std = r.std() if r.numel() > 1 else torch.tensor(1.0, dtype=torch.float64)
    for g, idx in members.items():
        x = r[idx]
        if len(idx) == 1:
            mean, sd = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        else:
            mean, sd = x.mean(), x.std(correction=0 if std == "population" else 1)
        if std == "batch":
            sd = batch_std
        for i in idx:
            if len(idx) > 1 and bool((x == x[0]).all()):
                out[i] = 0.0
            else:
                out[i] = float((r[i] - mean) / (sd + eps))
    return out


@pytest.mark.parametrize("std", ["sample", "population", "batch"])
def test_grpo_advantages_per_group_across_packs(std):
    rs = sample_rollouts(seed=3, extras=True)
    packs = treeattn.pack(rs, share_prefixes=True, budget=800)
    assert len(packs) > 2
    advs = treeattn.rl.grpo_advantages(packs, std=std, dtype=torch.float64)
    # A rollout's return: its reward plus its per-token rewards (verl sums
    # token_level_rewards).
    returns = [r.get("reward", 0.0) + sum(sum(x) for x in r.get("rewards", [])) for r in rs]
    want = grpo_reference(returns, [r["group"] for r in rs], std)
    for p, a in zip(packs, advs):
        assert a.shape == p.loss_rows.shape
        for r, x in zip(p.loss_rollout.tolist(), a.tolist()):
            assert x == pytest.approx(want[r], rel=1e-12, abs=1e-12)
    # verl's group of one (mean 0, std 1); golden is alone in its group.
    golden = next(i for i, p in enumerate(packs) if "golden" in p.rollout_ids)
    p = packs[golden]
    k = p.rollout_ids.index("golden")
    if std != "batch":
        assert torch.all(advs[golden][p.loss_rollout_local() == k] == returns[0] / (1 + 1e-6))
    unscaled = treeattn.rl.grpo_advantages(packs[0], scale="none", dtype=torch.float64)
    r = packs[0].loss_rollout[0].item()
    g = [returns[i] for i, x in enumerate(rs) if x["group"] == rs[r]["group"]]
    mean = sum(g) / len(g) if len(g) > 1 else 0.0
    assert unscaled[0].item() == pytest.approx(returns[r] - mean, abs=1e-12)


def test_grpo_sample_std_is_torch_std_at_g_2():
    """G = 2: the sample std is √2 × the population one, so verl's / TRL's
    advantages (±1/√2) are √(G/(G−1)) = √2 smaller than the population
    std's (±1)."""
    rs = [{"id": f"r{i}", "reward": float(i), "group": "q", "calls": [{"context": [1], "completion": [2 + i]}]}
          for i in range(2)]
    (p,) = treeattn.pack(rs)
    s = treeattn.rl.grpo_advantages(p, eps=0.0, dtype=torch.float64)
    pop = treeattn.rl.grpo_advantages(p, eps=0.0, std="population", dtype=torch.float64)
    assert s.tolist() == pytest.approx([-(0.5 ** 0.5), 0.5 ** 0.5], abs=1e-15)
    assert pop.tolist() == pytest.approx([-1.0, 1.0], abs=1e-15)
    ref = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert s.tolist() == pytest.approx(((ref - ref.mean()) / ref.std()).tolist(), abs=1e-15)


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
    assert torch.isnan(p.loss_reward).all() and not p.loss_summary.any() and not p.rollout_truncated.any()
    with pytest.raises(ValueError, match="no reward.*'c'"):
        treeattn.rl.grpo_advantages(p)
    with pytest.raises(ValueError, match="no reward.*'c'"):
        treeattn.rl.gae(p, torch.zeros(3))
    # Per-token rewards alone are a reward (R = 0).
    rs[2]["rewards"] = [[0.25]]
    (p,) = treeattn.pack(rs, share_prefixes=True)
    a, _ = treeattn.rl.gae(p, torch.zeros(3, dtype=torch.float64), lam=1.0)
    assert a.tolist() == [1.0, -0.5, 0.25]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("reward", "1", ['rollout "r"', "reward", "number"]),
        ("reward", True, ['rollout "r"', "reward"]),
        ("reward", 1e300, ['rollout "r"', "reward", "f32"]),
        ("reward", float("inf"), ["rollouts[0]", "reward must be finite"]),
        ("group", 7, ['rollout "r"', "group", "string"]),
        ("rewards", [[1.0, 2.0]], ['rollout "r"', "rewards", "2 rewards for 1 completion"]),
        ("rewards", [1.0], ['rollout "r"', "rewards", "list of numbers"]),
        ("truncated", "yes", ['rollout "r"', "truncated"]),
    ],
)
def test_bad_rl_fields_name_the_rollout(field, value, words):
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
    with pytest.raises(ValueError, match="critic_lam"):
        treeattn.rl.gae(p, v, critic_lam=2.0)
    with pytest.raises(ValueError, match="adaptive"):
        treeattn.rl.gae(p, v, lam="linear")
    with pytest.raises(ValueError, match="mode"):
        treeattn.rl.gae(p, v, mode="fast")
    with pytest.raises(ValueError, match="segments"):
        treeattn.rl.gae(p, v, segments="turn")
    with pytest.raises(ValueError, match="alpha"):
        treeattn.rl.gae(p, v, lam="adaptive", alpha=0.0)
    with pytest.raises(ValueError, match=r"rewards has 5 entries"):
        treeattn.rl.gae(p, v, rewards=v[:5])
    with pytest.raises(ValueError, match=r"rewards\[2\]"):
        treeattn.rl.gae(p, v, rewards=torch.tensor([0, 0, float("inf"), 0, 0, 0], dtype=torch.float64))
    (t,) = treeattn.pack([dict(GOLDEN[0], reward=1.0, truncated=True)])
    with pytest.raises(ValueError, match=r"bootstrap: 1 rollout\(s\).*'r17'.*end_rows"):
        treeattn.rl.gae(t, v)
    with pytest.raises(ValueError, match="bootstrap has 2 entries"):
        treeattn.rl.gae(t, v, bootstrap=torch.zeros(2))
    with pytest.raises(ValueError, match="scale"):
        treeattn.rl.grpo_advantages(p, scale="max")
    with pytest.raises(ValueError, match="std"):
        treeattn.rl.grpo_advantages(p, std="group")
    with pytest.raises(ValueError, match="eps"):
        treeattn.rl.grpo_advantages(p, eps=-1.0)
    # An integer dtype would truncate the advantages.
    with pytest.raises(ValueError, match="dtype"):
        treeattn.rl.grpo_advantages(p, dtype=torch.int64)
    (q,) = treeattn.pack([dict(GOLDEN[0], reward=1.0)])
    with pytest.raises(ValueError, match="no group.*'r17'"):
        treeattn.rl.grpo_advantages(q)
    # The same rollout id twice with different rewards (two inputs mixed up).
    (q2,) = treeattn.pack([dict(GOLDEN[0], reward=0.0, group="g")])
    with pytest.raises(ValueError, match="'r17' appears twice"):
        treeattn.rl.grpo_advantages([p, q2])
    # A group of one with eps = 0: R / 1, finite.
    assert (treeattn.rl.grpo_advantages(p, eps=0.0) == 1.0).all()


# --------------------------------------------------------------------------
# rollout identity across packs


def fnv1a_of_calls(rollout):
    """treeattn::pack::calls_fingerprint in Python: FNV-1a 64 over the u32
    words n_calls, then per call len(context), context, len(completion),
    completion; as an int64."""
    words = [len(rollout["calls"])]
    for c in rollout["calls"]:
        words += [len(c["context"]), *c["context"], len(c["completion"]), *c["completion"]]
    h = 0xCBF29CE484222325
    for b in struct.pack(f"<{len(words)}I", *words):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >= 1 << 63 else h


def group_file(ids, rewards, first_token):
    """A GRPO group "q" as one input file would hold it: its own calls."""
    return [{"id": i, "reward": r, "group": "q",
             "calls": [{"context": [first_token, 2], "completion": [3 + k]}]}
            for k, (i, r) in enumerate(zip(ids, rewards))]


def test_rollout_fingerprint_is_the_calls_hash_everywhere():
    rs = sample_rollouts(seed=5)
    want = {r["id"]: fnv1a_of_calls(r) for r in rs}
    assert len(set(want.values())) == len(rs)
    for kw in ({}, {"budget": 1000}, {"share_prefixes": False, "budget": 1500}, {"layout": "replicated"}):
        for p in treeattn.pack(rs, **kw):
            assert p.rollout_fingerprint.dtype == torch.int64
            assert p.rollout_fingerprint.tolist() == [want[i] for i in p.rollout_ids], kw
    # Calls alone: not the id, reward or group.
    (a,) = treeattn.pack([dict(GOLDEN[0], id="other", reward=3.0, group="z")])
    (b,) = treeattn.pack(GOLDEN)
    assert a.rollout_fingerprint.tolist() == b.rollout_fingerprint.tolist() == [fnv1a_of_calls(GOLDEN[0])]


def test_grpo_refuses_one_id_on_two_rollouts_across_packs():
    """Two files packed apart reuse ids r0, r1 (same group, same rewards)
    for other rollouts: without the fingerprint GRPO merged them into one
    group of 4 instead of 6. It is refused, naming the id and the packs."""
    (a,) = treeattn.pack(group_file(["r0", "r1", "r2"], [1.0, 0.0, 1.0], 1))
    (b,) = treeattn.pack(group_file(["r0", "r1", "r3"], [1.0, 0.0, 0.5], 9))
    with pytest.raises(ValueError, match=r"'r0' names two different rollouts.*packs\[0\].*packs\[1\]"):
        treeattn.rl.grpo_advantages([a, b])
    # The negative control: without fingerprints (a pack file of an earlier
    # version) the reuse cannot be seen and the group is scored as 4.
    old = [dataclasses.replace(p, rollout_fingerprint=None) for p in (a, b)]
    merged = per_rollout(old, "sample")
    assert len(merged) == 4
    want4 = grpo_reference([1.0, 0.0, 1.0, 0.5], ["q"] * 4, "sample")
    assert [merged[i] for i in ("r0", "r1", "r2", "r3")] == pytest.approx([want4[i] for i in range(4)], abs=1e-12)
    # Renamed apart, the six are one group of six.
    (b2,) = treeattn.pack(group_file(["s0", "s1", "r3"], [1.0, 0.0, 0.5], 9))
    six = per_rollout([a, b2], "sample")
    want6 = grpo_reference([1.0, 0.0, 1.0, 1.0, 0.0, 0.5], ["q"] * 6, "sample")
    assert [six[i] for i in ("r0", "r1", "r2", "s0", "s1", "r3")] == pytest.approx(
        [want6[i] for i in range(6)], abs=1e-12)
    # Different calls are refused also when the group or reward differ too.
    (c,) = treeattn.pack(group_file(["r0"], [0.25], 9))
    with pytest.raises(ValueError, match="'r0' names two different rollouts"):
        treeattn.rl.grpo_advantages([a, c])
    # A fingerprint tensor of the wrong shape or dtype.
    for bad in (a.rollout_fingerprint[:2], a.rollout_fingerprint.to(torch.float64), [1, 2, 3]):
        with pytest.raises(ValueError, match=r"packs\[0\].rollout_fingerprint"):
            treeattn.rl.grpo_advantages(dataclasses.replace(a, rollout_fingerprint=bad))


def test_grpo_counts_the_same_rollout_given_twice_once():
    rs = [r for r in sample_rollouts(seed=7) if r["id"].startswith("grpo")]
    packs = treeattn.pack(rs, share_prefixes=True, budget=300)
    assert len(packs) > 1
    want = per_rollout(packs, "sample")
    # The same rollouts again, packed apart (other budget, layout): each
    # is the same rollout (same id, calls, group, reward) and counts once.
    again = treeattn.pack(rs[::-1], layout="replicated", budget=250)
    got = per_rollout(packs + again, "sample")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k
    # A fingerprint-less copy of a pack matches its rollouts too.
    got = per_rollout(packs + [dataclasses.replace(packs[0], rollout_fingerprint=None)], "sample")
    assert all(got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12) for k in want)


# --------------------------------------------------------------------------
# whitening


def verl_masked_whiten(values, mask, shift_mean=True):
    """verl.utils.torch_functional.masked_whiten (masked_var unbiased)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def test_whiten_is_verl_masked_whiten_over_the_batch(gen):
    """Three tensors with 0/1 weights whitened together equal verl's
    masked_whiten of the padded [B, L] batch; real-valued weights are
    frequency weights (an entry of weight 2 counts twice); whitening each
    pack alone differs (negative control)."""
    lens = [5, 9, 3]
    advs = [torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1 for n in lens]
    ws = [(torch.rand(n, generator=gen) < 0.8).double() for n in lens]
    L = max(lens)
    vals = torch.zeros(len(lens), L, dtype=torch.float64)
    mask = torch.zeros(len(lens), L, dtype=torch.float64)
    for i, (a, w) in enumerate(zip(advs, ws)):
        vals[i, : lens[i]], mask[i, : lens[i]] = a, w
    for shift in (True, False):
        got = treeattn.rl.whiten(advs, ws, shift_mean=shift)
        want = verl_masked_whiten(vals, mask, shift)
        for i, g in enumerate(got):
            assert torch.allclose(g, want[i, : lens[i]], rtol=1e-13, atol=1e-13)
    alone = treeattn.rl.whiten(advs[0], ws[0])
    assert (alone - treeattn.rl.whiten(advs, ws)[0]).abs().max() > 1e-2
    dup = treeattn.rl.whiten(torch.cat([advs[1], advs[1][:2]]), None)[:9]
    w2 = torch.ones(9, dtype=torch.float64)
    w2[:2] = 2.0
    assert torch.allclose(treeattn.rl.whiten(advs[1], w2), dup, rtol=1e-13, atol=1e-13)
    # float32 in, float32 out; no gradient.
    x = advs[0].float().requires_grad_()
    y = treeattn.rl.whiten(x)
    assert y.dtype == torch.float32 and not y.requires_grad


def test_whiten_errors_name_the_argument():
    a = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="total weight is 1.0"):
        treeattn.rl.whiten(a, torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"weights_list\[0\]\[1\] = -1.0"):
        treeattn.rl.whiten([a], [torch.tensor([1.0, -1.0, 1.0])])
    with pytest.raises(ValueError, match="weights_list has 1 entries for 2"):
        treeattn.rl.whiten([a, a], [a])
    with pytest.raises(ValueError, match=r"advantages_list\[1\]"):
        treeattn.rl.whiten([a, torch.tensor([float("nan")])])
    with pytest.raises(ValueError, match=r"weights_list\[0\] has 2 entries"):
        treeattn.rl.whiten([a], [a[:2]])


# --------------------------------------------------------------------------
# many processes


def _rl_rank(rank, world, init, rollouts, advs, out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        mine = [r for i, r in enumerate(rollouts) if i % world == rank]
        packs = treeattn.pack(mine, share_prefixes=True, budget=200)
        res = {}
        for std in ("sample", "batch"):
            a = treeattn.rl.grpo_advantages(packs, std=std, dtype=torch.float64, distributed=True)
            res[std] = {p.rollout_ids[k]: float(x[p.loss_rollout_local() == k][0])
                        for p, x in zip(packs, a) for k in range(len(p.rollout_ids))}
        part = [a for i, a in enumerate(advs) if i % world == rank]
        res["whiten"] = [t.tolist() for t in treeattn.rl.whiten(part, [torch.ones_like(t) for t in part],
                                                                 distributed=True)]
        out.put((rank, res))
    finally:
        dist.destroy_process_group()


def per_rollout(packs, std):
    """{rollout id: its GRPO advantage} over `packs`, one process."""
    adv = treeattn.rl.grpo_advantages(packs, std=std, dtype=torch.float64)
    out = {}
    for p, a in zip(packs, adv):
        for k, rid in enumerate(p.rollout_ids):
            vals = a[p.loss_rollout_local() == k]
            assert (vals == vals[0]).all()
            out[rid] = float(vals[0])
    return out


def test_grpo_and_whiten_distributed_equal_one_process(tmp_path):
    """Two gloo ranks, each holding half of every group and half of the
    advantage tensors: the gathered GRPO statistics (group std and batch
    std) and the all-reduced whitening give what one process holding all
    gives."""
    import torch.multiprocessing as mp

    rs = [r for r in sample_rollouts(seed=11) if r["id"].startswith("grpo")]
    packs = treeattn.pack(rs, share_prefixes=True)
    want = {std: per_rollout(packs, std) for std in ("sample", "batch")}
    g = torch.Generator().manual_seed(3)
    advs = [torch.randn(n, generator=g, dtype=torch.float64) for n in (4, 7, 2, 5)]
    want_w = treeattn.rl.whiten(advs)
    # A file store: no TCP port to pick, so no race for it.
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rl_rank, args=(r, 2, init, rs, advs, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, res = q.get(timeout=120)
        got[rank] = res
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for std in ("sample", "batch"):
        mine = {**got[0][std], **got[1][std]}
        assert mine.keys() == want[std].keys()
        for k in want[std]:
            assert mine[k] == pytest.approx(want[std][k], rel=1e-12, abs=1e-12), (std, k)
    for i, w in enumerate(want_w):
        part = got[i % 2]["whiten"][i // 2]
        assert part == pytest.approx(w.tolist(), rel=1e-12, abs=1e-12)
    # Negative controls: rank 0's half alone (no gathering) differs.
    alone = per_rollout(treeattn.pack(rs[::2], share_prefixes=True), "sample")
    assert max(abs(alone[k] - want["sample"][k]) for k in alone) > 1e-3
    alone_w = treeattn.rl.whiten(advs[::2])
    assert (alone_w[0] - want_w[0]).abs().max() > 1e-3


def _identity_rank(rank, init, held, out):
    """Rank `rank` of 2 holds the rollouts `held[phase][rank]` in each
    phase; reports per phase {id: advantage} or the ValueError's text."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        res = []
        for phase in held:
            packs = treeattn.pack(phase[rank])
            try:
                a = treeattn.rl.grpo_advantages(packs, dtype=torch.float64, distributed=True)
                res.append({p.rollout_ids[k]: float(x[p.loss_rollout_local() == k][0])
                            for p, x in zip(packs, a) for k in range(len(p.rollout_ids))})
            except ValueError as e:
                res.append(str(e))
        out.put((rank, res))
    finally:
        dist.destroy_process_group()


def test_grpo_rollout_identity_across_ranks(tmp_path):
    """distributed=True: the same rollout on both ranks (as under context
    parallelism) counts once; one id on two different rollouts of two ranks
    is refused on every rank, naming the id and the ranks."""
    import torch.multiprocessing as mp

    a = group_file(["r0", "r1", "r2"], [1.0, 0.0, 1.0], 1)
    other = group_file(["r0", "r3"], [1.0, 0.5], 9)  # r0: same id, group and reward, other calls
    held = [
        [a, [a[0], other[1]]],  # r0 on both ranks, the same rollout
        [a, other],             # r0 on both ranks, two rollouts
    ]
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_identity_rank, args=(r, init, held, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = per_rollout(treeattn.pack(a + [other[1]]), "sample")
    for rank in (0, 1):
        same, clash = got[rank]
        assert isinstance(same, dict), same
        for k, x in same.items():
            assert x == pytest.approx(want[k], rel=1e-12, abs=1e-12), (rank, k)
        assert isinstance(clash, str) and "'r0' names two different rollouts" in clash, clash
        assert "rank 0 packs[0]" in clash and "rank 1 packs[0]" in clash, clash


def test_rl_takes_a_collated_batch_as_its_packs():
    """Every treeattn.rl function given treeattn.collate's dict returns what
    it returns for the packs one by one, concatenated: packs of two
    separate pack() calls (their rollout and call indices overlap), a group
    spanning them, per-token rewards, truncations, summary calls."""
    rs1 = [r for r in sample_rollouts(5, extras=True) if r["id"] != "golden"]
    rs2 = sample_rollouts(6, extras=True)[1:8]
    for r in rs2:
        r["id"] = "b-" + r["id"]
        r["group"] = "g0" if r["id"].startswith("b-grpo") else r["id"]
    packs = treeattn.pack(rs1, budget=900) + treeattn.pack(rs2)
    assert len(packs) >= 3 and packs[-1].rollout_indices[0] == 0
    batch = treeattn.collate(packs, pad_to_multiple_of=64)

    # The rollout fields, with each pack's indices mapped into the batch.
    assert batch["rollout_ids"] == [i for p in packs for i in p.rollout_ids]
    assert batch["rollout_batch"].tolist() == [b for b, p in enumerate(packs) for _ in p.rollout_ids]
    for name in ("rollout_reward", "rollout_truncated", "rollout_fingerprint", "loss_reward", "loss_summary"):
        want = torch.cat([getattr(p, name) for p in packs])
        assert torch.equal(batch[name].nan_to_num(), want.nan_to_num()), name
    names = [p.groups[g] if g >= 0 else None for p in packs for g in p.rollout_group.tolist()]
    assert [batch["groups"][g] if g >= 0 else None for g in batch["rollout_group"].tolist()] == names
    local = [p.rollout_ids[k] for p in packs for k in p.loss_rollout_local().tolist()]
    assert [batch["rollout_ids"][k] for k in batch["loss_rollout_local"].tolist()] == local

    g = torch.Generator().manual_seed(3)
    values = [torch.randn(p.loss_rows.numel(), generator=g, dtype=torch.float64) for p in packs]
    boots = [torch.randn(len(p.rollout_ids), generator=g, dtype=torch.float64) for p in packs]
    rewards = [torch.randn(p.loss_rows.numel(), generator=g, dtype=torch.float64) for p in packs]
    assert any(bool(p.rollout_truncated.any()) for p in packs) and any(bool(p.loss_summary.any()) for p in packs)
    for kw in (dict(mode="exact", lam=0.95), dict(mode="segment", lam="adaptive", critic_lam=1.0),
               dict(mode="compaction", lam=0.9, gamma=0.99, segments="junction"), dict(mode="compaction")):
        for extra in ({}, {"rewards": True}):
            rw = (lambda i: rewards[i]) if extra else (lambda i: None)  # noqa: E731
            alone = [treeattn.rl.gae(p, values[i], bootstrap=boots[i], rewards=rw(i), **kw)
                     for i, p in enumerate(packs)]
            got = treeattn.rl.gae(batch, torch.cat(values), bootstrap=torch.cat(boots),
                                  rewards=torch.cat(rewards) if extra else None, **kw)
            for j in range(2):
                assert torch.equal(got[j], torch.cat([a[j] for a in alone])), (kw, extra, j)

    rows = treeattn.rl.end_rows(batch)
    assert torch.equal(rows, torch.cat([treeattn.rl.end_rows(p) for p in packs]))
    # The rows index each pack's row of the [B, L] batch.
    assert torch.equal(batch["input_ids"][batch["rollout_batch"], rows],
                       torch.cat([p.tokens[treeattn.rl.end_rows(p)] for p in packs]))

    for std in ("sample", "batch"):
        want = torch.cat(treeattn.rl.grpo_advantages(packs, std=std, dtype=torch.float64))
        assert torch.equal(treeattn.rl.grpo_advantages(batch, std=std, dtype=torch.float64), want)
        # A batch beside a pack in one list: one result each, groups matched across.
        half = treeattn.collate(packs[:-1])
        a, b = treeattn.rl.grpo_advantages([half, packs[-1]], std=std, dtype=torch.float64)
        assert torch.equal(torch.cat([a, b]), want)

    adv = torch.cat(treeattn.rl.grpo_advantages(packs, dtype=torch.float64))
    lp = (torch.cat([p.loss_logprobs for p in packs]).double() + 0.1).requires_grad_(True)
    n_rollouts = sum(len(p.rollout_ids) for p in packs)
    kw = dict(agg="seq-mean-token-mean", normalizer=n_rollouts, tis_cap=1.5, clip_high=0.28)
    loss, stats = treeattn.rl.policy_loss(lp, batch, adv, weights=batch["loss_weights"], rollout_logp=batch,
                                          pack=batch, **kw)
    parts, off = [], 0
    for p in packs:
        n = p.loss_rows.numel()
        part, _ = treeattn.rl.policy_loss(lp[off:off + n], p, adv[off:off + n], weights=p.loss_weights,
                                          rollout_logp=p, pack=p, **kw)
        parts.append(part)
        off += n
    assert float(loss.detach()) == pytest.approx(float(sum(parts).detach()), rel=1e-12)

    with pytest.raises(ValueError, match=r"values has shape \(3,\), expected \[\d+\] .*of the batch"):
        treeattn.rl.gae(batch, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bootstrap has \(2,\), expected \[\d+\]"):
        treeattn.rl.gae(batch, torch.cat(values), bootstrap=torch.zeros(2))
    with pytest.raises(ValueError, match="dicts of pack tensors name no rollouts"):
        treeattn.rl.gae(treeattn.collate([p.tensors() for p in packs]), torch.cat(values))
