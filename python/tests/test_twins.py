"""The native code that replaced treeattn's Python twins (issue 40) gives
what the twins gave: ``ModelCost`` (was a dataclass re-implementing
``treeattn::cost``), ``treeattn.distributed.balance`` (was a packer of its
own: JSON reading, GRPO grouping, LPT) and the per-row counts
``visible_keys_per_query`` / ``tree_depths`` (were difference arrays in
torch). The twins are kept below, verbatim but for names, as references."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

import treeattn
import treeattn.hf
import treeattn.torch as tt
from conftest import random_forest
from treeattn import distributed as D
from test_distributed import compaction_rollout, grpo_rollouts

# --------------------------------------------------------------------------
# the twins as they were (python/treeattn/{__init__,distributed,torch}.py)


def old_visible_keys_per_query(kv_end):
    L = int(kv_end.numel())
    ke = kv_end.to(torch.int64)
    idx = torch.arange(L, dtype=torch.int64)
    live = ke > idx
    delta = torch.zeros(L + 1, dtype=torch.int64)
    delta.index_add_(0, idx[live], torch.ones(int(live.sum()), dtype=torch.int64))
    delta.index_add_(0, ke[live], -torch.ones(int(live.sum()), dtype=torch.int64))
    return torch.cumsum(delta[:L], 0)


def old_depths(kv_end):
    n = kv_end.shape[0]
    end = kv_end.to(torch.int64)
    k = torch.arange(n, device=end.device)
    inner = end > k + 1
    diff = torch.zeros(n + 1, dtype=torch.int64, device=end.device)
    ones = torch.ones_like(k[inner])
    diff.index_add_(0, (k + 1)[inner], ones)
    diff.index_add_(0, end[inner], -ones)
    return diff.cumsum(0)[:n]


_COST_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


@dataclass(frozen=True)
class OldModelCost:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def __post_init__(self) -> None:
        for name in _COST_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelCost.{name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelCost.kv_heads = {self.kv_heads} does not divide heads = {self.heads}")

    @classmethod
    def from_config(cls, config: Any) -> "OldModelCost":
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        missing = [
            n for n in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
            if getattr(config, n, None) is None
        ]
        if missing:
            raise ValueError(f"ModelCost.from_config: the config has no {', '.join(missing)}")
        heads = int(config.num_attention_heads)
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(layers=int(config.num_hidden_layers), hidden=int(config.hidden_size), heads=heads,
                   kv_heads=int(kv), head_dim=int(head_dim), intermediate=int(config.intermediate_size),
                   vocab=int(config.vocab_size))

    def attention_per_pair(self) -> float:
        return float(self.layers * self.heads * 4 * self.head_dim) * 3.5

    def linear_per_token(self) -> float:
        H = self.hidden
        per_layer = 2 * H * self.heads * self.head_dim + 2 * H * self.kv_heads * self.head_dim + 3 * H * self.intermediate
        return float(self.layers * 2 * per_layer) * 3.0

    def logits_per_row(self) -> float:
        return float(2 * self.hidden * self.vocab) * 3.0


def _units(rollouts: List[Dict[str, Any]], share_prefixes: bool) -> List[List[int]]:
    if not share_prefixes:
        return [[i] for i in range(len(rollouts))]
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for i, r in enumerate(rollouts):
        calls = r.get("calls") or [{}]
        key = tuple(calls[0].get("context", ()))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _remap(p, members, call_base, rollouts):
    m = torch.tensor(members, dtype=torch.int64)
    local_base, acc = [], 0
    for i in members:
        local_base.append(acc)
        acc += len(rollouts[i]["calls"])
    lb = torch.tensor(local_base, dtype=torch.int64)
    gb = torch.tensor([call_base[i] for i in members], dtype=torch.int64)
    r = p.loss_rollout
    p.loss_call = p.loss_call - lb[r] + gb[r]
    p.loss_rollout = m[r]
    p.rollout_indices = [members[i] for i in p.rollout_indices]
    return p


def _pack_members(rollouts, members, layout, share_prefixes, call_base):
    (p,) = treeattn.pack([rollouts[i] for i in members], layout=layout, share_prefixes=share_prefixes)
    return _remap(p, members, call_base, rollouts)


def old_assign(costs, tokens, world_size, budget, micro):
    if tokens and max(tokens) > budget:
        raise ValueError(f"a unit of {max(tokens)} tokens does not fit the budget of {budget}")
    order = sorted(range(len(costs)), key=lambda u: (-costs[u], -tokens[u], u))
    while True:
        load = np.zeros(world_size * micro)
        room = np.full(world_size * micro, budget, dtype=np.int64)
        where = [0] * len(costs)
        ok = True
        for u in order:
            cand = np.where(room >= tokens[u], load, np.inf)
            b = int(np.argmin(cand))
            if not np.isfinite(cand[b]):
                ok = False
                break
            load[b] += costs[u]
            room[b] -= tokens[u]
            where[u] = b
        if ok:
            return micro, where
        micro += 1


def old_balance(rs, world_size, *, budget, model_cost, share_prefixes=True, layout="trie", objective="flops"):
    """Returns ``shards[rank][micro]``, a pack or None (an empty bin)."""
    call_base, acc = [], 0
    for r in rs:
        call_base.append(acc)
        acc += len(r["calls"])
    units, unit_packs = [], []
    for group in _units(rs, share_prefixes):
        whole = _pack_members(rs, group, layout, share_prefixes, call_base)
        if len(whole) <= budget:
            units.append(group)
            unit_packs.append(whole)
            continue
        chunk, chunk_pack = [], None
        for i in group:
            trial = _pack_members(rs, chunk + [i], layout, share_prefixes, call_base)
            if len(trial) <= budget:
                chunk, chunk_pack = chunk + [i], trial
                continue
            if not chunk:
                raise ValueError(f"rollouts[{i}] packs to {len(trial)} tokens, over the budget of {budget}")
            units.append(chunk)
            unit_packs.append(chunk_pack)
            chunk = [i]
            chunk_pack = _pack_members(rs, chunk, layout, share_prefixes, call_base)
            if len(chunk_pack) > budget:
                raise ValueError(f"rollouts[{i}] packs to {len(chunk_pack)} tokens, over the budget of {budget}")
        units.append(chunk)
        unit_packs.append(chunk_pack)
    tokens = [len(p) for p in unit_packs]
    if objective == "flops":
        weights = [treeattn.cost(p, model_cost)["total"] for p in unit_packs]
    elif objective == "tokens":
        weights = [float(t) for t in tokens]
    else:
        weights = [float(t) ** 2 for t in tokens]
    micro0 = max(1, math.ceil(sum(tokens) / (world_size * budget)))
    micro, where = old_assign(weights, tokens, world_size, budget, micro0)
    bins = [[] for _ in range(world_size * micro)]
    for u, b in enumerate(where):
        bins[b].append(u)
    shards = [[] for _ in range(world_size)]
    for m in range(micro):
        for r in range(world_size):
            us = bins[m * world_size + r]
            if not us:
                shards[r].append(None)
            elif len(us) == 1:
                shards[r].append(unit_packs[us[0]])
            else:
                members = sorted(i for u in us for i in units[u])
                shards[r].append(_pack_members(rs, members, layout, share_prefixes, call_base))
    return shards


# --------------------------------------------------------------------------
# the native code against them


def test_per_row_counts_equal_the_twins_on_random_forests():
    gen = torch.Generator().manual_seed(40)
    for L in (0, 1, 2, 3, 17, 90, 400):
        for padding in (0.0, 0.1, 0.5):
            kv = random_forest(L, gen, padding=padding)
            assert torch.equal(D.visible_keys_per_query(kv), old_visible_keys_per_query(kv))
            assert torch.equal(treeattn.hf.tree_depths(kv), old_depths(kv))
            assert torch.equal(tt.MaskPlan(kv).depths(), old_depths(kv))
            # int32 in, int64 out, like the twins
            assert torch.equal(treeattn.hf.tree_depths(kv.to(torch.int32)), old_depths(kv))
    # A valid kv_end that is no tree (crossing ranges): the same counts.
    kv = torch.tensor([3, 4, 4, 4])
    assert torch.equal(treeattn.hf.tree_depths(kv), old_depths(kv))
    assert torch.equal(D.visible_keys_per_query(kv), old_visible_keys_per_query(kv))


def test_per_row_counts_name_a_bad_kv_end():
    # The twins raised an index error for kv_end[k] > L and ignored
    # kv_end[k] < k; the crate names the key either way.
    for bad, key in (([5, 2], "kv_end[0] = 5"), ([2, 0], "kv_end[1] = 0"), ([-1], "kv_end[0] = -1")):
        for f in (treeattn.hf.tree_depths, D.visible_keys_per_query):
            with pytest.raises(treeattn.PackError, match=key.replace("[", r"\[").replace("]", r"\]")):
                f(torch.tensor(bad))
    with pytest.raises(ValueError, match="1-D"):
        treeattn.hf.tree_depths(torch.zeros(2, 2, dtype=torch.int64))


SHAPES = [
    dict(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10),
    dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    dict(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=152064),
    dict(layers=1, hidden=1, heads=1, kv_heads=1, head_dim=1, intermediate=1, vocab=1),
]


def test_model_cost_is_the_twin():
    for kw in SHAPES:
        new, old = treeattn.ModelCost(**kw), OldModelCost(**kw)
        for name in _COST_FIELDS:
            assert getattr(new, name) == getattr(old, name)
        for f in ("attention_per_pair", "linear_per_token", "logits_per_row"):
            assert getattr(new, f)() == getattr(old, f)(), f
        assert repr(new) == repr(old)[len("Old"):]
        assert new == treeattn.ModelCost(*kw.values()) and new != treeattn.ModelCost(**{**kw, "vocab": 7})
        assert hash(new) == hash(treeattn.ModelCost(**kw)) and len({new, treeattn.ModelCost(**kw)}) == 1
        assert pickle.loads(pickle.dumps(new)) == new
    assert treeattn.ModelCost.llama3_8b() == treeattn.ModelCost(**SHAPES[1])
    m = treeattn.ModelCost(**SHAPES[0])
    with pytest.raises(AttributeError):
        m.layers = 3  # frozen, as the dataclass was
    assert m != OldModelCost(**SHAPES[0])  # a different class is never equal


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "2", None, 2.5])
def test_model_cost_refuses_what_the_twin_refused(bad):
    for name in _COST_FIELDS:
        kw = {**SHAPES[0], name: bad}
        with pytest.raises(ValueError) as want:
            OldModelCost(**kw)
        with pytest.raises(ValueError) as got:
            treeattn.ModelCost(**kw)
        assert str(got.value) == str(want.value)
    kw = {**SHAPES[0], "heads": 3, "kv_heads": 2}
    with pytest.raises(ValueError) as want:
        OldModelCost(**kw)
    with pytest.raises(ValueError) as got:
        treeattn.ModelCost(**kw)
    assert str(got.value) == str(want.value)
    with pytest.raises(TypeError):
        treeattn.ModelCost(layers=2)  # missing fields: a TypeError, as the dataclass's


def test_model_cost_from_config_is_the_twin():
    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Multi:
        def __init__(self, text):
            self.text = text

        def get_text_config(self):
            return self.text

    base = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=77)
    for extra in ({}, {"num_key_value_heads": 2}, {"num_key_value_heads": None}, {"num_key_value_heads": 0},
                  {"head_dim": 32}, {"head_dim": None}, {"num_key_value_heads": 1, "head_dim": 8}):
        for cfg in (Cfg(**base, **extra), Multi(Cfg(**base, **extra))):
            old = OldModelCost.from_config(cfg)
            new = treeattn.ModelCost.from_config(cfg)
            assert repr(new) == repr(old)[len("Old"):], extra
    for drop in ("vocab_size", "hidden_size"):
        cfg = Cfg(**{k: v for k, v in base.items() if k != drop})
        with pytest.raises(ValueError) as want:
            OldModelCost.from_config(cfg)
        with pytest.raises(ValueError) as got:
            treeattn.ModelCost.from_config(cfg)
        assert str(got.value) == str(want.value)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, num_hidden_layers=3, vocab_size=77)
    assert repr(treeattn.ModelCost.from_config(cfg)) == repr(OldModelCost.from_config(cfg))[len("Old"):]


def _same_pack(a, b):
    assert a.rollout_indices == b.rollout_indices
    assert (a.rollout_ids, a.groups, a.stats, a.layout) == (b.rollout_ids, b.groups, b.stats, b.layout)
    for name in treeattn.PACK_TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(torch.nan_to_num(x, nan=-7.0) if x.is_floating_point() else x,
                                                      torch.nan_to_num(y, nan=-7.0) if y.is_floating_point() else y), name


def _random_rollouts(gen, n_groups):
    rs = []
    for j in range(n_groups):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if kind == 0:
            rs += grpo_rollouts(gen, prompt=int(torch.randint(4, 40, (1,), generator=gen)),
                                group=int(torch.randint(1, 6, (1,), generator=gen)), tag=f"g{j}-")
        elif kind == 1:
            rs.append(compaction_rollout(gen, f"c{j}"))
        else:  # a second group on an earlier group's prompt, later in the input
            earlier = [r for r in rs if r["id"].startswith("g")]
            if earlier:
                p = earlier[0]["calls"][0]["context"]
                rs.append({"id": f"x{j}", "calls": [{"context": p, "completion": [5, 6, 7]}]})
    perm = torch.randperm(len(rs), generator=gen).tolist()
    return [rs[i] for i in perm] if int(torch.randint(0, 2, (1,), generator=gen)) else rs


def test_balance_is_the_twin_on_random_inputs():
    gen = torch.Generator().manual_seed(41)
    m = treeattn.ModelCost(**SHAPES[0])
    cases = 0
    for case in range(40):
        rs = _random_rollouts(gen, 3 + case % 8)
        if not rs:
            continue
        world = 1 + case % 3
        share = case % 3 != 2
        layout = "replicated" if case % 5 == 4 else "trie"
        objective = ("flops", "tokens", "l2")[case % 3]
        longest = max(len(treeattn.pack([r], layout=layout)[0]) for r in rs)
        # Budgets from one rollout's size (groups split) to everything in one pack.
        budget = int(longest * (1.0 + float(torch.rand(1, generator=gen)) * (0.4 if case % 2 else 6)))
        model = m if case % 4 else treeattn.ModelCost.llama3_8b()
        try:
            want = old_balance(rs, world, budget=budget, model_cost=model, share_prefixes=share,
                               layout=layout, objective=objective)
        except ValueError:
            with pytest.raises(ValueError, match="over the budget"):
                D.balance(rs, world, budget=budget, model_cost=model, share_prefixes=share,
                          layout=layout, objective=objective)
            continue
        got = D.balance(rs, world, budget=budget, model_cost=model, share_prefixes=share,
                        layout=layout, objective=objective, pad_token=9)
        assert [len(s) for s in got] == [len(s) for s in want], case
        for gs, ws in zip(got, want):
            for g, w in zip(gs, ws):
                if w is None:
                    assert len(g) == 1 and g.loss_rows.numel() == 0 and g.tokens.tolist() == [9]
                else:
                    _same_pack(g, w)
        cases += 1
    assert cases >= 30


def test_lpt_is_the_twin():
    # The assignment alone, through balance's "tokens" objective on rollouts
    # of chosen sizes (no shared prefixes): the twin's LPT on the same units.
    gen = torch.Generator().manual_seed(42)
    for case in range(20):
        sizes = torch.randint(2, 30, (int(torch.randint(1, 25, (1,), generator=gen)),), generator=gen).tolist()
        rs = [{"id": f"r{i}", "calls": [{"context": [4 + i % 90] + [5] * (n - 2), "completion": [6]}]}
              for i, n in enumerate(sizes)]
        world, budget = 1 + case % 4, 30 + case
        micro0 = max(1, math.ceil(sum(sizes) / (world * budget)))
        micro, where = old_assign([float(s) for s in sizes], sizes, world, budget, micro0)
        got = D.balance(rs, world, budget=budget, share_prefixes=False, objective="tokens")
        assert len(got[0]) == micro
        for u, b in enumerate(where):
            p = got[b % world][b // world]
            assert u in p.rollout_indices
