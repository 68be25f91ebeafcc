"""treeattn.distributed on torch.distributed with gloo on CPU (float64).

Multi-process tests spawn 4 processes once per test (torch.multiprocessing,
gloo on 127.0.0.1, a free port, a 60 s timeout on every process group so a
rank that raises cannot leave the others waiting forever) and run every
world size 1..4 on sub-groups of the 4 ranks, several checks per spawn, to
keep the file's runtime modest on a 2-core CI machine.

Tolerances: the sharded op against the whole-pack op ≤ 1e-12 relative (the
same op on a re-indexed subset of keys: f64 rounding, a different order of
the sums); the context-parallel Llama against each call run alone with sdpa
≤ 1e-9 (as test_hf.py); parameter gradients ≤ 1e-8 relative (LlamaRMSNorm
takes its variance in float32 even in an f64 model: rows computed in
another order can round differently there, INTEGRATION-NOTES); losses ≤
1e-12 relative (f64 sums in another order).
"""

from __future__ import annotations

import copy
import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treeattn
import treeattn.hf
import treeattn.torch as tt
from treeattn import distributed as D

from conftest import GOLDEN, depths, random_forest, rel_err

WORLD = 4
FIGURES = {}  # largest errors seen in a worker, printed by rank 0 (pytest -s)
TIMEOUT = datetime.timedelta(seconds=60)
VOCAB = 96


# --------------------------------------------------------------------------
# rollouts: GRPO fans and compaction trees with small token ids


def _tokens(gen, n):
    return torch.randint(4, VOCAB, (n,), generator=gen).tolist()


def grpo_rollouts(gen, prompt=24, group=4, lens=(4, 9), tag="g"):
    """One GRPO group: ``group`` rollouts answering one prompt (two turns)."""
    p = _tokens(gen, prompt)
    out = []
    for i in range(group):
        a = _tokens(gen, int(torch.randint(lens[0], lens[1], (1,), generator=gen)))
        tool = _tokens(gen, 3)
        b = _tokens(gen, int(torch.randint(lens[0], lens[1], (1,), generator=gen)))
        out.append({"id": f"{tag}{i}", "calls": [
            {"context": p, "completion": a},
            {"context": p + a + tool, "completion": b},
        ]})
    return out


def compaction_rollout(gen, rid):
    """A compaction rollout: two turns, a summary call, a resumed context
    (system prompt, marker 3, the summary, the last turn kept), one more turn."""
    sys_, task = _tokens(gen, 6), _tokens(gen, 4)
    a, tool, b = _tokens(gen, 5), _tokens(gen, 6), _tokens(gen, 5)
    summ, c, tool2, d = _tokens(gen, 6), _tokens(gen, 5), _tokens(gen, 4), _tokens(gen, 4)
    h = sys_ + task
    calls = [
        {"context": h, "completion": a},
        {"context": h + a + tool, "completion": b},
        {"context": h + a + tool + b + [1], "completion": summ},
        {"context": sys_ + [3] + summ + b, "completion": c},
        {"context": sys_ + [3] + summ + b + c + tool2, "completion": d},
    ]
    return {"id": rid, "calls": calls}


def maxdiff(a, b):
    """max |a - b| (0 for empty tensors)."""
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def per_call_logprobs(model_sdpa, rollouts, pack):
    """Every loss entry's log-prob from running its call alone (sdpa)."""
    calls = [c for r in rollouts for c in r["calls"]]
    cache = {}
    out = torch.empty(len(pack.loss_rows), dtype=torch.float64)
    for t in range(len(pack.loss_rows)):
        ci, off = int(pack.loss_call[t]), int(pack.loss_offset[t])
        c = calls[ci]
        if ci not in cache:
            seq = torch.tensor(c["context"] + c["completion"])[None]
            with torch.no_grad():
                cache[ci] = torch.log_softmax(model_sdpa(input_ids=seq, use_cache=False).logits[0], -1)
        out[t] = cache[ci][len(c["context"]) - 1 + off, c["completion"][off]]
    return out


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attention_dropout=0.0, attn_implementation="treeattn",
    )
    torch.manual_seed(1234)  # the same weights on every rank
    return LlamaForCausalLM(cfg).double()


# --------------------------------------------------------------------------
# spawning


def _rendezvous(tmp_path):
    """A file store for the process group: no TCP port to pick, so no race
    with another process taking a port between its choice and its bind."""
    return f"file://{tmp_path / 'rendezvous'}"


def _entry(rank, fn, init, errdir):
    torch.set_num_threads(1)
    tt.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        fn(rank)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(fn, tmp_path):
    """Runs fn(rank) on WORLD gloo processes; a failure shows each failing
    rank's traceback."""
    try:
        mp.spawn(_entry, args=(fn, _rendezvous(tmp_path), str(tmp_path)), nprocs=WORLD, join=True)
    except Exception as e:
        msgs = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
        raise AssertionError("\n".join(msgs) or str(e)) from None


def _subgroups():
    """Process groups of ranks 0..P-1 for P = 1..4 (every rank creates all)."""
    return {P: dist.new_group(list(range(P)), timeout=TIMEOUT) for P in range(1, WORLD + 1)}


# --------------------------------------------------------------------------
# 1. the sharded op equals the whole-pack op, world sizes 1..4


def _op_packs():
    g = torch.Generator().manual_seed(7)
    (golden,) = treeattn.pack(GOLDEN)
    (fan,) = treeattn.pack(grpo_rollouts(g, prompt=30, group=4), share_prefixes=True)
    (comp,) = treeattn.pack([compaction_rollout(g, "c0"), compaction_rollout(g, "c1")], share_prefixes=True)
    kv = random_forest(41, g, padding=0.15)
    forest = D.empty_pack()
    forest.tokens, forest.position_ids, forest.kv_end = torch.zeros(41, dtype=torch.int64), depths(kv), kv
    short = D.empty_pack()  # 2 rows: shorter than 3 or 4 ranks
    short.tokens, short.position_ids, short.kv_end = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1]), torch.tensor([2, 2])
    return {"golden": golden, "fan": fan, "compaction": comp, "forest": forest, "short": short}


def _check_op(rank, group, P, name, pack, hq, hkv, d, rope, chunk=None, var=None):
    """The sharded op against the whole-pack op on this rank's rows; with
    ``var``: a sliding window, a softcap, sinks (their gradient summed over
    the group's ranks) and a value head dim ``dv``."""
    var = var or {}
    dv = var.get("dv", d)
    L = len(pack)
    g = torch.Generator().manual_seed(L * 31 + hq)
    q = torch.randn(L, hq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, hkv, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, hkv, dv, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(L, hq, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64, requires_grad=True) if var.get("sinks") else None
    kw = dict(rope_base=10000.0) if rope else {}
    vk = dict(window=var.get("window"), softcap=var.get("softcap"))
    o = tt.tree_attention(q, k, v, pack.kv_end, position_ids=pack.position_ids if rope else None, sinks=sinks,
                          **kw, **vk)
    (o * w).sum().backward()

    s = D.shard(pack, group)
    a, b = s.start, s.end
    rows = slice(a, b) if not s.padded else slice(0, 1)
    ql, kl, vl = (t.detach()[rows].clone().requires_grad_() for t in (q, k, v))
    sl = None if sinks is None else sinks.detach().clone().requires_grad_()
    ol = D.tree_attention(ql, kl, vl, s, chunk=chunk, sinks=sl, **kw, **vk)
    (ol * w[rows]).sum().backward()
    if sl is not None:
        # Every rank holds its rows' share of the sinks' gradient.
        dist.all_reduce(sl.grad, group=group)
        assert rel_err(sl.grad, sinks.grad) <= 1e-12, (name, P, rank, "dsinks")
    if s.padded:
        assert P > L and len(s) == 0, (name, P, s.bounds)
        return
    what = f"{name} P={P} rank={rank} rows [{a}, {b}) rope={rope} chunk={chunk} {var}"
    errs = [rel_err(ol, o[a:b]), rel_err(ql.grad, q.grad[a:b]), rel_err(kl.grad, k.grad[a:b]),
            rel_err(vl.grad, v.grad[a:b])]
    assert max(errs) <= 1e-12, (what, "O, dQ, dK, dV relative errors", errs)
    FIGURES["op"] = max(FIGURES.get("op", 0.0), *errs)
    # Exactly the gathered rows were received, K and V, f64.
    row_bytes = hkv * (d + dv) * 8
    assert s.stats.bytes_received == s.gathered.numel() * row_bytes, what
    assert s.stats.allgather_bytes == (L - (b - a)) * row_bytes, what


def _op_worker(rank):
    groups = _subgroups()
    packs = _op_packs()
    fan = packs["fan"]
    for P in range(1, WORLD + 1):
        if rank >= P:
            continue
        for name, pack in packs.items():
            _check_op(rank, groups[P], P, name, pack, 4, 2, 8, rope=False)
        # Gathered rows in several chunks of 3 (one chunk by default here).
        _check_op(rank, groups[P], P, "fan", fan, 4, 4, 16, rope=True, chunk=3)
        _check_op(rank, groups[P], P, "compaction", packs["compaction"], 2, 1, 8, rope=True, chunk=3)
        _check_op(rank, groups[P], P, "forest", packs["forest"], 2, 2, 8, rope=False, chunk=5)
        # The attention variants: a window cutting the gathered ancestors,
        # a softcap, sinks, a value head dim unlike q's.
        variants = dict(window=3, softcap=2.0, sinks=True, dv=6)
        _check_op(rank, groups[P], P, "compaction", packs["compaction"], 4, 2, 8, rope=True, chunk=3, var=variants)
        _check_op(rank, groups[P], P, "fan", fan, 2, 1, 8, rope=False, chunk=4, var=dict(window=9))
        _check_op(rank, groups[P], P, "forest", packs["forest"], 2, 2, 8, rope=False, var=dict(window=1, sinks=True))

    # The GRPO prompt (30 rows, the first of the pack) spans several ranks at
    # P = 4, and a later rank's queries see it: its rows were gathered.
    s4 = [D.shard(fan, world_size=4, rank=r) for r in range(4)]
    assert s4[1].start < 30, s4[1].bounds
    assert any(s.gathered.numel() and int(s.gathered.max()) >= s4[1].start for s in s4[2:])
    # Compaction branches cross rank boundaries: at P = 3 some rank starts
    # inside the resumed branch and gathers two ranges (the system prompt
    # and that branch's first rows), which the checks above ran.
    comp = [D.shard(packs["compaction"], world_size=3, rank=r) for r in range(3)]
    assert any(len(s.gather_ranges) >= 2 for s in comp), [s.gather_ranges for s in comp]

    # Bad input: rank 1 holds a shard of another pack -> every rank raises
    # ValueError (all see the fingerprints), nobody hangs.
    other = packs["golden"] if rank == 1 else packs["compaction"]
    s = D.shard(other, groups[WORLD])
    n = 1 if s.padded else len(s)
    x = torch.zeros(n, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="another pack"):
        D.tree_attention(x, x[:, :1], x[:, :1], s)
    # Tensors whose length is not the shard's (checked before any collective).
    s = D.shard(packs["compaction"], groups[WORLD])
    y = torch.zeros(len(s) + 1, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"q has \d+ rows, the shard"):
        D.tree_attention(y, y[:, :1], y[:, :1], s)
    dist.barrier()
    if rank == 0:
        print("sharded op vs whole-pack op, largest relative error (O, dQ, dK, dV):", FIGURES)


def test_sharded_op_equals_whole_pack_op(tmp_path):
    _spawn(_op_worker, tmp_path)


# --------------------------------------------------------------------------
# 2. a tiny Llama: context parallel and data parallel


def _model_worker(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    treeattn.hf.register()
    groups = _subgroups()
    g = torch.Generator().manual_seed(11)
    rollouts = grpo_rollouts(g, prompt=20, group=3, tag="g") + [compaction_rollout(g, f"c{i}") for i in range(2)]
    model = tiny_llama()
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")

    # Context parallel: one pack of every rollout over P = 2 and 4 ranks.
    (pack,) = treeattn.pack(rollouts, share_prefixes=True)
    truth = per_call_logprobs(sdpa, rollouts, pack)
    wsum = pack.loss_weights.double().sum()
    model.zero_grad()
    lp_ref = treeattn.hf.target_logprobs(model, pack)
    assert rel_err(lp_ref, truth) <= 1e-9
    (-(pack.loss_weights.double() * lp_ref).sum() / wsum).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for P in (2, 4):
        if rank >= P:
            continue
        s = D.shard(pack, groups[P])
        model.zero_grad()
        lp = treeattn.hf.shard_logprobs(model, s)
        assert lp.shape == s.loss_index.shape
        assert maxdiff(lp, truth[s.loss_index]) <= 1e-9, (P, rank)
        FIGURES["cp_logprob"] = max(FIGURES.get("cp_logprob", 0.0), maxdiff(lp, truth[s.loss_index]))
        (-(s.loss_weights.double() * lp).sum() / wsum).backward()
        for n, p in model.named_parameters():
            gr = p.grad.clone()
            dist.all_reduce(gr, group=groups[P])
            assert rel_err(gr, ref[n]) <= 1e-8, (P, rank, n, rel_err(gr, ref[n]))
            FIGURES["cp_grad"] = max(FIGURES.get("cp_grad", 0.0), rel_err(gr, ref[n]))
        # Every loss entry is scored by exactly one rank.
        counts = torch.tensor([s.loss_index.numel()], dtype=torch.int64)
        dist.all_reduce(counts, group=groups[P])
        assert int(counts) == len(pack.loss_rows)

    # SDCC across ranks: a pair belongs to its student's rank, the teacher's
    # logits come from the teacher's rank. Σ of the shares = the pack's mean
    # KL, and the all-reduced gradients those of one process.
    P_all = int(pack.sdcc_student_rows.numel())
    assert P_all > 0
    model.zero_grad()
    logits = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end,
                   use_cache=False).logits[0]
    kl_ref, _ = tt.sdcc_forward_kl(logits, pack.sdcc_student_rows, pack.sdcc_teacher_rows, tau=0.7)
    kl_ref.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for P in (2, 4):
        if rank >= P:
            continue
        s = D.shard(pack, groups[P])
        model.zero_grad()
        lg = model(input_ids=s.tokens[None], position_ids=s.position_ids[None], treeattn_shard=s,
                   use_cache=False, logits_to_keep=s.logit_rows_local).logits[0]
        share, kl = D.sdcc_kl(lg, s, tau=0.7)
        assert kl.shape == s.sdcc_index.shape
        share.backward()
        tot = share.detach().clone()
        dist.all_reduce(tot, group=groups[P])
        assert rel_err(tot, kl_ref) <= 1e-12, (P, float(tot), float(kl_ref))
        FIGURES["sdcc"] = max(FIGURES.get("sdcc", 0.0), rel_err(tot, kl_ref))
        for n, p in model.named_parameters():
            gr = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(gr, group=groups[P])
            assert rel_err(gr, ref[n]) <= 1e-8, (P, rank, n, rel_err(gr, ref[n]))
            FIGURES["sdcc_grad"] = max(FIGURES.get("sdcc_grad", 0.0), rel_err(gr, ref[n]))
        t = s.sdcc_teacher_rows
        cross = torch.tensor([int(((t < s.start) | (t >= s.end)).sum())])
        dist.all_reduce(cross, group=groups[P])
        assert int(cross) >= 1  # some pair's teacher lives on another rank

    # A rank that owns no loss entry: a pack whose targets all sit in its
    # last rows, over 4 ranks (the prompt of 40 rows is not scored).
    prompt = _tokens(g, 40)
    lone = [{"id": "x", "calls": [{"context": prompt, "completion": _tokens(g, 3)}]}]
    (p2,) = treeattn.pack(lone)
    s = D.shard(p2, groups[WORLD])
    model.zero_grad()
    lp = treeattn.hf.shard_logprobs(model, s)
    t2 = per_call_logprobs(sdpa, lone, p2)
    assert maxdiff(lp, t2[s.loss_index]) <= 1e-9
    owners = torch.tensor([int(s.loss_index.numel() > 0)])
    dist.all_reduce(owners)
    assert int(owners) < WORLD  # some rank has none, and it still ran forward + backward
    (-(s.loss_weights.double() * lp).sum()).backward()
    assert all(p.grad is not None for p in model.parameters())

    # A pack shorter than the world size: 3 rows over 4 ranks.
    tiny = [{"id": "t", "calls": [{"context": [5, 6], "completion": [7]}]}]
    (p3,) = treeattn.pack(tiny)
    s = D.shard(p3, groups[WORLD])
    padded = torch.tensor([int(s.padded)])
    dist.all_reduce(padded)
    assert int(padded) == 1  # one rank holds no row and runs a padding row
    lp = treeattn.hf.shard_logprobs(model, s)
    lp.sum().backward()
    t3 = per_call_logprobs(sdpa, tiny, p3)
    assert maxdiff(lp, t3[s.loss_index]) <= 1e-9

    # Data parallel over 4 ranks with DDP: balance + global_weight give the
    # single-process loss and gradients; 5 units over 4 ranks × 2 micro-steps
    # leave empty packs, which still run forward and backward.
    dp_rollouts = rollouts + grpo_rollouts(g, prompt=12, group=2, tag="h") + [compaction_rollout(g, "c9")]
    shards = D.balance(dp_rollouts, WORLD, budget=80, model_cost=treeattn.ModelCost.from_config(model.config))
    assert len({len(sh) for sh in shards}) == 1
    empties = sum(len(p) == 1 and p.loss_rows.numel() == 0 for sh in shards for p in sh)
    assert empties >= 1, [[len(p) for p in sh] for sh in shards]
    (whole,) = treeattn.pack(dp_rollouts, share_prefixes=True)
    model.zero_grad()
    lpw = treeattn.hf.target_logprobs(model, whole)
    ref_loss = -(whole.loss_weights.double() * lpw).sum() / whole.loss_weights.double().sum()
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ddp = DDP(model)
    packs = shards[rank]
    G = D.global_weight(packs)
    assert float(G) == float(whole.loss_weights.double().sum())
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(packs):
        lp = treeattn.hf.target_logprobs(ddp, p)
        loss = -(p.loss_weights.double() * lp).sum() / G
        total += loss.detach()
        if i + 1 < len(packs):
            with ddp.no_sync():
                (loss * WORLD).backward()  # DDP averages over ranks
        else:
            (loss * WORLD).backward()
    dist.all_reduce(total)
    assert rel_err(total, ref_loss) <= 1e-12, (float(total), float(ref_loss))
    FIGURES["dp_loss"] = rel_err(total, ref_loss)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= 1e-8, (rank, n, rel_err(p.grad, ref[n]))
        FIGURES["dp_grad"] = max(FIGURES.get("dp_grad", 0.0), rel_err(p.grad, ref[n]))
    dist.barrier()
    if rank == 0:
        print("Llama f64, largest errors:", FIGURES, "micro-steps", len(packs), "empty packs", empties)


def test_llama_context_and_data_parallel(tmp_path):
    pytest.importorskip("transformers")
    _spawn(_model_worker, tmp_path)


# --------------------------------------------------------------------------
# single-process: planning, cost, bad input


def test_cost_counts_visible_pairs_and_rows():
    (p,) = treeattn.pack(GOLDEN)
    m = treeattn.ModelCost(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    c = treeattn.cost(p, m)
    dense = sum(1 for qq in range(len(p)) for kk in range(len(p)) if kk <= qq < int(p.kv_end[kk]))
    assert c["visible_pairs"] == dense == int(D.visible_keys_per_query(p.kv_end).sum())
    assert c["attention"] == dense * 2 * 2 * 4 * 4 * 3.5
    assert c["linear"] == 3 * (16 * 2 * 2 * (2 * 8 * 2 * 4 + 2 * 8 * 1 * 4 + 3 * 8 * 16) + 6 * 2 * 8 * 10)
    assert c["total"] == c["attention"] + c["linear"]
    assert float(D._row_costs(p, m).sum()) == pytest.approx(c["total"], rel=1e-15)
    pad = D.empty_pack()
    pad.kv_end = torch.tensor([0])  # a padding key adds no pair
    assert treeattn.cost(pad, m)["visible_pairs"] == 0
    with pytest.raises(ValueError, match="heads"):
        treeattn.ModelCost(layers=2, hidden=8, heads=3, kv_heads=2, head_dim=4, intermediate=16, vocab=10)
    with pytest.raises(ValueError, match="ModelCost.vocab"):
        treeattn.ModelCost(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=0)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, num_hidden_layers=3, vocab_size=77)
    assert treeattn.ModelCost.from_config(cfg) == treeattn.ModelCost(
        layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=77)


def test_shard_plan_balances_cost_and_covers_the_pack():
    g = torch.Generator().manual_seed(3)
    rollouts = grpo_rollouts(g, prompt=200, group=8, lens=(40, 80))
    (p,) = treeattn.pack(rollouts, share_prefixes=True)
    m = treeattn.ModelCost.llama3_8b()
    rc = D._row_costs(p, m)
    for P in (1, 2, 3, 5, 8):
        sh = [D.shard(p, world_size=P, rank=r) for r in range(P)]
        assert sh[0].bounds[0] == 0 and sh[0].bounds[-1] == len(p)
        assert all(len(s) >= 1 for s in sh)
        # Every loss entry and SDCC pair exactly once.
        assert sorted(torch.cat([s.loss_index for s in sh]).tolist()) == list(range(len(p.loss_rows)))
        assert sum(s.sdcc_index.numel() for s in sh) == p.sdcc_student_rows.numel()
        # Within one row's cost of the ideal.
        assert max(sh[0].cost) <= sum(sh[0].cost) / P + float(rc.max()) + 1e-6 * sum(sh[0].cost)
        for s in sh:
            # gathered = rows before start that some local query sees
            vis = (p.kv_end[: s.start] > s.start).nonzero().flatten()
            assert torch.equal(s.gathered, vis)
            assert s.owner(s.start) == s.rank
    plan = D.plan_comm(p, 4)
    assert sum(plan["rows"]) == len(p)
    assert sum(plan["visible_pairs"]) == treeattn.cost(p, m)["visible_pairs"]
    assert all(r < a for r, a in zip(plan["received"][1:], plan["allgather"][1:]))


def test_bad_input_names_it():
    (p,) = treeattn.pack(GOLDEN)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        D.shard(p, world_size=0, rank=0)
    with pytest.raises(ValueError, match="rank must be an int in 0..1"):
        D.shard(p, world_size=2, rank=2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        D.balance(GOLDEN, 0, budget=100)
    with pytest.raises(ValueError, match="budget"):
        D.balance(GOLDEN, 2, budget=3)  # the rollout alone is 16 tokens
    s = D.shard(p, world_size=1, rank=0)
    g = torch.Generator().manual_seed(5)
    (other,) = treeattn.pack([compaction_rollout(g, "c")])
    with pytest.raises(ValueError, match="another pack"):
        s.check_pack(other)
    s.check_pack(p)
    x = torch.zeros(len(p) - 1, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="q has 15 rows, the shard"):
        D.tree_attention(x, x, x, s)
    x = torch.zeros(len(p), 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="position_ids are not the shard's"):
        D.tree_attention(x, x, x, s, position_ids=other.position_ids[: len(p)])
    bad = D.empty_pack()
    bad.kv_end = torch.tensor([2])
    with pytest.raises(ValueError, match=r"kv_end\[0\] = 2"):
        D.shard(bad, world_size=1, rank=0)
    # Two ranks planned without a process group cannot run.
    s2 = D.shard(p, world_size=2, rank=0)
    y = torch.zeros(len(s2), 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs an initialized process group"):
        D.tree_attention(y, y, y, s2)


def test_balance_is_deterministic_and_complete():
    g = torch.Generator().manual_seed(9)
    rollouts = []
    for j in range(4):
        rollouts += grpo_rollouts(g, prompt=16 + 4 * j, group=3, tag=f"g{j}-")
    rollouts += [compaction_rollout(g, f"c{i}") for i in range(5)]
    a = D.balance(rollouts, 3, budget=120)
    b = D.balance(rollouts, 3, budget=120)
    assert [[p.rollout_indices for p in sh] for sh in a] == [[p.rollout_indices for p in sh] for sh in b]
    assert len({len(sh) for sh in a}) == 1
    assert all(len(p) <= 120 for sh in a for p in sh)
    seen = sorted(i for sh in a for p in sh for i in p.rollout_indices)
    assert seen == list(range(len(rollouts)))
    # A GRPO group stays in one pack (its prompt stored once).
    for sh in a:
        for p in sh:
            tags = {rollouts[i]["id"].split("-")[0] for i in p.rollout_indices if "-" in rollouts[i]["id"]}
            for t in tags:
                assert sum(rollouts[i]["id"].startswith(t + "-") for i in p.rollout_indices) == 3
    # Loss entries keep the whole input's rollout and call numbering.
    (whole,) = treeattn.pack(rollouts, share_prefixes=True)
    keys = sorted((int(r), int(c), int(o)) for sh in a for p in sh
                  for r, c, o in zip(p.loss_rollout, p.loss_call, p.loss_offset))
    assert keys == sorted(zip(whole.loss_rollout.tolist(), whole.loss_call.tolist(), whole.loss_offset.tolist()))
    rep = D.balance_report(a)
    assert rep["micro_steps"] == len(a[0]) and all(r >= 1.0 for r in rep["ratio"])
    assert rep["total"] == pytest.approx(sum(treeattn.cost(p, treeattn.ModelCost.llama3_8b())["total"]
                                             for sh in a for p in sh))


def test_one_rank_is_the_ordinary_packed_path():
    pytest.importorskip("transformers")
    treeattn.hf.register()
    g = torch.Generator().manual_seed(4)
    (p,) = treeattn.pack(grpo_rollouts(g, group=2) + [compaction_rollout(g, "c")], share_prefixes=True)
    model = tiny_llama()
    s = D.shard(p, world_size=1, rank=0)
    assert (s.start, s.end, len(s.gathered)) == (0, len(p), 0)
    lp = treeattn.hf.shard_logprobs(model, s)
    ref = treeattn.hf.target_logprobs(model, p)
    assert torch.equal(s.loss_index, torch.arange(len(p.loss_rows)))
    assert maxdiff(lp, ref) <= 1e-12  # the same op on the same rows; logits only at loss rows
    assert s.stats.calls == model.config.num_hidden_layers and s.stats.bytes_received == 0
