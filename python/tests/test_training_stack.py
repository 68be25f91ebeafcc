"""The training stack RL teams run (issue 37): the chunked head runs inside
the model's own forward, so FSDP2 (``fully_shard``) and DDP give one
process's loss and gradients; activation checkpointing and torch.compile
change nothing; the sampling temperature, the critic's values and the SDCC
batch normalizer; and what a model call with a pack's mask refuses (issue
41): another attention implementation, ``labels=``, token ids outside the
vocabulary, a forward that never reached treeattn's attention.

Tolerances (float64 models): a rank's gradients against one process ≤ 1e-10
relative — the same per-row arithmetic, the ranks' sums added in another
order (LlamaRMSNorm's variance is float32 even in a float64 model, which
moves a row's result, not the order of the sums here: the same rows run on
one rank as in the single process); compiled and checkpointed runs ≤ 1e-12.
"""

import datetime
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402
import treeattn.rl  # noqa: E402
from conftest import GOLDEN, rel_err  # noqa: E402
from test_hf import random_rollouts  # noqa: E402

VOCAB = 83
TIMEOUT = datetime.timedelta(seconds=60)
WORLD = 2


def tiny_llama(seed=7):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attention_dropout=0.0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)  # the same weights in every process
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.set_attn_implementation("treeattn")
    return model


def packs_of(world, seed=3):
    """One pack per rank, each with SDCC pairs and rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = GOLDEN + random_rollouts(gen)
    for r in rollouts:
        r["reward"] = float(len(r["calls"]) % 3)
        for c in r["calls"]:
            c["logprobs"] = [-0.5 - 0.01 * i for i in range(len(c["completion"]))]
    (whole,) = treeattn.pack(rollouts)
    parts = [treeattn.pack(rollouts[r::world])[0] for r in range(world)]
    return whole, parts


def step_loss(model, pack, wsum, pairs, world=1):
    """A training step's loss on one pack, as a trainer would: the NLL with
    SDCC under batch normalizers, plus a PPO policy loss with TIS and a k3
    KL term on log-probs at temperature 0.7."""
    parts = treeattn.hf.pack_loss(model, pack, sdcc_lambda=0.1, normalizer=wsum, sdcc_normalizer=pairs)
    lp = treeattn.hf.target_logprobs(model, pack, temperature=0.7)
    adv = torch.linspace(-1, 1, lp.numel(), dtype=torch.float64)
    old = pack.loss_logprobs.double()
    pl, _ = treeattn.rl.policy_loss(
        lp, old, adv, weights=pack.loss_weights.double(), normalizer=wsum,
        rollout_logp=old - 0.05, tis_cap=2.0, ref_logp=old + 0.1, kl_coef=0.05,
    )
    return (parts["loss"] + pl) * world


def single_process_reference():
    treeattn.hf.register()
    model = tiny_llama()
    whole, parts = packs_of(WORLD)
    wsum = sum(float(p.loss_weights.double().sum()) for p in parts)
    pairs = sum(int(p.sdcc_student_rows.numel()) for p in parts)
    total = sum(step_loss(model, p, wsum, pairs) for p in parts)
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------
# spawning (as test_distributed.py: gloo on 127.0.0.1, a timeout everywhere)


def _rendezvous(tmp_path):
    """A file store for the process group: no TCP port to pick, so no race
    with another process taking a port between its choice and its bind."""
    return f"file://{tmp_path / 'rendezvous'}"


def _entry(rank, fn, init, errdir, ref):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        fn(rank, ref)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(fn, tmp_path, ref):
    try:
        mp.spawn(_entry, args=(fn, _rendezvous(tmp_path), str(tmp_path), ref), nprocs=WORLD, join=True)
    except Exception as e:
        msgs = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
        raise AssertionError("\n".join(msgs) or str(e)) from None


def _fsdp2_worker(rank, ref):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    treeattn.hf.register()
    ref_loss, ref_grads = ref
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings, norm, lm_head
    assert type(model.lm_head.weight).__name__ == "DTensor"
    _whole, parts = packs_of(WORLD)
    wsum = sum(float(p.loss_weights.double().sum()) for p in parts)
    pairs = sum(int(p.sdcc_student_rows.numel()) for p in parts)
    # FSDP2 averages gradients over ranks: the sum convention multiplies by P.
    loss = step_loss(model, parts[rank], wsum, pairs, world=WORLD)
    loss.backward()
    total = loss.detach() / WORLD
    dist.all_reduce(total)
    assert rel_err(total, torch.tensor(ref_loss, dtype=torch.float64)) <= 1e-12
    for n, p in model.named_parameters():
        g = p.grad.full_tensor()
        assert rel_err(g, ref_grads[n]) <= 1e-10, (rank, n, rel_err(g, ref_grads[n]))


def _ddp_worker(rank, ref):
    from torch.nn.parallel import DistributedDataParallel as DDP

    treeattn.hf.register()
    ref_loss, ref_grads = ref
    model = tiny_llama()
    ddp = DDP(model)
    _whole, parts = packs_of(WORLD)
    wsum = sum(float(p.loss_weights.double().sum()) for p in parts)
    pairs = sum(int(p.sdcc_student_rows.numel()) for p in parts)
    loss = step_loss(ddp, parts[rank], wsum, pairs, world=WORLD)  # DDP averages too
    loss.backward()
    total = loss.detach() / WORLD
    dist.all_reduce(total)
    assert rel_err(total, torch.tensor(ref_loss, dtype=torch.float64)) <= 1e-12
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-10, (rank, n, rel_err(p.grad, ref_grads[n]))


def test_fsdp2_and_ddp_equal_one_process(tmp_path):
    """The chunked head reads the output embedding inside the model's
    forward: under FSDP2 (decoder layers and the root sharded over 2 gloo
    ranks; the weight a DTensor outside the forward, which crashed before)
    and DDP, the step's loss and every gradient equal one process's."""
    ref = single_process_reference()
    (tmp_path / "fsdp2").mkdir()
    _spawn(_fsdp2_worker, tmp_path / "fsdp2", ref)
    (tmp_path / "ddp").mkdir()
    _spawn(_ddp_worker, tmp_path / "ddp", ref)


def test_checkpointing_and_compile_change_nothing():
    treeattn.hf.register()
    _whole, parts = packs_of(1)
    (pack,) = parts
    wsum = float(pack.loss_weights.double().sum())
    pairs = int(pack.sdcc_student_rows.numel())

    def run(prepare):
        model = tiny_llama()
        runner = prepare(model)
        loss = step_loss(runner, pack, wsum, pairs)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}

    base_loss, base = run(lambda m: m)

    def checkpointed(m):
        m.train()
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable()
        return m

    for name, prepare in [("checkpointing", checkpointed), ("compile", lambda m: torch.compile(m, backend="eager"))]:
        loss, grads = run(prepare)
        assert abs(loss - base_loss) <= 1e-12 * abs(base_loss), name
        for n in base:
            assert rel_err(grads[n], base[n]) <= 1e-12, (name, n)


def test_temperature_divides_the_logits():
    treeattn.hf.register()
    model = tiny_llama()
    _whole, (pack,) = packs_of(1)
    logits = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end,
                   use_cache=False).logits[0]
    for T in (0.6, 1.0, 1.7):
        want = torch.log_softmax(logits[pack.loss_rows] / T, -1).gather(-1, pack.loss_labels[:, None])[:, 0]
        got, ent = treeattn.hf.target_logprobs(model, pack, temperature=T, entropy=True)
        assert rel_err(got, want) <= 1e-12, T
        assert rel_err(treeattn.hf.target_logprobs(model, pack, logits, temperature=T), want) <= 1e-12
        p = torch.softmax(logits[pack.loss_rows] / T, -1)
        assert rel_err(ent, -(p * p.log()).sum(-1)) <= 1e-12
        g1 = torch.autograd.grad(got.sum(), model.lm_head.weight)[0]
        g2 = torch.autograd.grad(want.sum(), model.lm_head.weight, retain_graph=True)[0]
        assert rel_err(g1, g2) <= 1e-11
    # Negative control: T matters.
    assert rel_err(treeattn.hf.target_logprobs(model, pack, temperature=0.6),
                   treeattn.hf.target_logprobs(model, pack)) > 1e-2
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature"):
            treeattn.hf.target_logprobs(model, pack, temperature=bad)


def test_bfloat16_head_gradient_is_rounded_once():
    """A bfloat16 output embedding's gradient: summed per vocabulary slice in
    float32 and rounded once (no float32 [V, H] buffer): within bfloat16's
    rounding of the float64 gradient of the same (rounded) weights."""
    treeattn.hf.register()
    model = tiny_llama()
    _whole, (pack,) = packs_of(1)
    ref = tiny_llama()
    lp_ref = treeattn.hf.target_logprobs(ref, pack)
    (-lp_ref.sum()).backward()
    model.lm_head.to(torch.bfloat16)
    ref_w = model.lm_head.weight.detach().double()
    ref.lm_head.weight.data.copy_(ref_w)
    ref.zero_grad()
    (-treeattn.hf.target_logprobs(ref, pack).sum()).backward()
    h_model = model  # body float64, head bfloat16

    def head_dtype_hook(module, args):
        return (args[0].to(torch.bfloat16),)

    handle = h_model.lm_head.register_forward_pre_hook(head_dtype_hook)
    try:
        lp = treeattn.hf.target_logprobs(h_model, pack, chunk=5)
        (-lp.sum()).backward()
    finally:
        handle.remove()
    g = h_model.lm_head.weight.grad
    assert g.dtype == torch.bfloat16
    assert rel_err(g, ref.lm_head.weight.grad) <= 2e-2


def test_critic_values_at_the_loss_rows():
    from transformers import LlamaConfig, LlamaForTokenClassification

    treeattn.hf.register()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_labels=1)
    torch.manual_seed(5)
    critic = LlamaForTokenClassification(cfg).to(torch.float64).eval()  # no classifier dropout
    gen = torch.Generator().manual_seed(9)
    rollouts = GOLDEN + random_rollouts(gen)
    (pack,) = treeattn.pack(rollouts)
    critic.set_attn_implementation("treeattn")
    v = treeattn.hf.values(critic, pack)
    assert v.shape == pack.loss_rows.shape
    # Each target's value equals its call run alone (sdpa).
    critic.set_attn_implementation("sdpa")
    calls = [c for r in rollouts for c in r["calls"]]
    for t in range(len(pack.loss_rows)):
        c = calls[int(pack.loss_call[t])]
        seq = torch.tensor(c["context"] + c["completion"])[None]
        alone = critic(input_ids=seq).logits[0, len(c["context"]) - 1 + int(pack.loss_offset[t]), 0]
        assert abs(float(v[t] - alone)) <= 1e-9
    # A critic left on sdpa would ignore kv_end: refused.
    with pytest.raises(ValueError, match="does not use treeattn"):
        treeattn.hf.values(critic, pack)


def test_sdcc_batch_normalizer_adds_up():
    """With the batch's pair count as the normalizer, micro-batches' SDCC
    terms add up to the batch's mean KL (before: each micro-batch its own
    mean, 7× too large summed over 3 of them)."""
    treeattn.hf.register()
    model = tiny_llama()
    _whole, parts = packs_of(4)
    parts = [p for p in parts if p.sdcc_student_rows.numel() > 0]
    assert len(parts) >= 2
    pairs = [int(p.sdcc_student_rows.numel()) for p in parts]
    per_pack_mean = [treeattn.hf.pack_loss(model, p, sdcc_lambda=1.0)["sdcc"] for p in parts]
    batch = treeattn.collate(parts)
    whole_mean = treeattn.hf.pack_loss(model, batch, sdcc_lambda=1.0)["sdcc"]
    normed = [treeattn.hf.pack_loss(model, p, sdcc_lambda=1.0, sdcc_normalizer=sum(pairs))["sdcc"] for p in parts]
    rel = lambda a, b: abs(float(a - b)) / abs(float(b))  # noqa: E731
    assert rel(sum(normed), whole_mean) <= 1e-12
    assert rel(sum(per_pack_mean), whole_mean) > 0.5  # the old convention: each micro-batch its own mean


def test_a_pack_call_refuses_what_would_be_silently_wrong():
    treeattn.hf.register()
    model = tiny_llama()
    _whole, (pack,) = packs_of(1)
    kw = dict(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end)
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with pytest.raises(ValueError, match="set_attn_implementation"):
            model(**kw)
    model.set_attn_implementation("treeattn")
    with pytest.raises(ValueError, match="pack_loss"):
        model(**kw, labels=pack.tokens[None])
    # Token ids and labels outside the vocabulary: named before the forward.
    bad = treeattn.pack([{"id": "x", "calls": [{"context": [1, 2, VOCAB + 5], "completion": [4]}]}])[0]
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5} at row 2"):
        treeattn.hf.target_logprobs(model, bad)
    bad = treeattn.pack([{"id": "x", "calls": [{"context": [1, 2], "completion": [VOCAB + 1]}]}])[0]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        treeattn.hf.pack_loss(model, bad)
    # Logits that are not this pack's.
    logits = torch.zeros(len(pack) + 5, VOCAB, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits of shape"):
        treeattn.hf.target_logprobs(model, pack, logits)
    for lam in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="sdcc_lambda"):
            treeattn.hf.pack_loss(model, pack, sdcc_lambda=lam)


def test_a_forward_that_bypasses_the_attention_interface_is_refused(monkeypatch):
    """A model whose attention layers compute attention themselves (GIT's
    text attention is fixed at build time) never reaches treeattn: its
    log-probs would be plain causal attention over the pack. Simulated by
    routing Llama's attention to eager's function directly."""
    from transformers.models.llama import modeling_llama

    treeattn.hf.register()
    model = tiny_llama()
    _whole, (pack,) = packs_of(1)
    treeattn.hf.target_logprobs(model, pack)  # fine as it is
    monkeypatch.setattr(modeling_llama.ALL_ATTENTION_FUNCTIONS, "get_interface",
                        lambda name, default: modeling_llama.eager_attention_forward, raising=False)
    with pytest.raises(ValueError, match="never called treeattn's attention"):
        treeattn.hf.target_logprobs(model, pack)
    assert math.isfinite(0.0)


def test_bfloat16_autocast():
    """Under CPU bf16 autocast (q, k come out of rotary in float32, v in
    bfloat16): attention runs in the autocast dtype as SDPA does, the head's
    backward recomputes under the forward's autocast state; the loss and the
    head's gradient are the float32 run's within bfloat16's rounding."""
    treeattn.hf.register()
    _whole, (pack,) = packs_of(1)

    def run(autocast):
        model = tiny_llama().float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = treeattn.hf.pack_loss(model, pack, sdcc_lambda=0.1)["loss"]
        loss.backward()
        return float(loss), model.lm_head.weight.grad

    loss16, g16 = run(True)
    loss32, g32 = run(False)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    assert g16.dtype == torch.float32
    assert float((g16 - g32).norm() / g32.norm()) <= 3e-2
