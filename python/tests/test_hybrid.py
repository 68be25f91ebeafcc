"""Hybrid models on a tree pack (treeattn.hybrid, issue 25).

Two layers of checks:

1. The ops against a token-by-token recurrence written here, along each
   row's own path, on random forests in float64: the tree short
   convolution, gated delta rule and Mamba-2 scan agree to 1e-12 (float64
   rounding of sums of a few hundred terms; seen: ~2e-15), values and
   input gradients.
2. Tiny random transformers models of every supported family (Qwen3.5,
   Qwen3.5-MoE, Qwen3-Next, Mamba-2, Nemotron-H, Bamba, Falcon-H1,
   GraniteMoeHybrid; float64, MoE experts on the eager path): one packed forward of compaction / fold / GRPO rollouts
   from data/sample.jsonl, with ``kv_end``, against every call run alone
   with the model's own default path.

The bound of (2): the models are float64, but transformers runs the
recurrent cores in float32 on both sides (``torch_chunk_gated_delta_rule``
and ``mamba2_chunk_scan`` cast their inputs; the gated RMSNorms of both
families normalize in float32), and the packed run cuts its chunks at trie
nodes, not at multiples of the chunk size of each call, so the two sum the
same float32 terms in another order. Float32 unit roundoff 6e-8 times a
chunk of up to 64 terms bounds one layer's relative error by ~4e-6; a
log-probability is a difference of logits of order 1, so 1e-5 nats is the
bound (seen: <= 1.1e-6; Mamba-2 keeps its residual stream in float32,
so there log-probs resolve to ~5e-7). Parameter gradients sum
float32-rounded terms over all rows: ``max |a − b| / max(max |b|, 1)`` <=
1e-4. Seen: <= 6e-7 for the Mamba-2 families, <= 4e-5 for Gated DeltaNet,
on the decay parameters ``A_log`` / ``dt_bias``, whose gradients sum over
every row through products of decays — and that is transformers' own
float32 error: with the tree core run in float64 instead, the gap to the
per-call float32 reference stays 3e-5. The
negative control (the same pack with the recurrent layers in packed
order) is off by >= 1e-2 nats, three orders above the bound.
"""

import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402
import treeattn.hybrid as hybrid  # noqa: E402
import treeattn.recurrent as recurrent  # noqa: E402
from conftest import rel_err  # noqa: E402

VOCAB = 96
SAMPLE = pathlib.Path(__file__).resolve().parents[2] / "data" / "sample.jsonl"
LOGPROB_BOUND = 1e-5
GRAD_BOUND = 1e-4


# ---------------------------------------------------------------- the ops


def random_forest(gen, n):
    """``kv_end`` and parents of a random pre-order forest of ``n`` rows
    (runs, branch points and several roots)."""
    parent, open_ = [], []
    for t in range(n):
        if open_ and float(torch.rand(1, generator=gen)) < 0.3:
            del open_[int(torch.randint(0, len(open_) + 1, (1,), generator=gen)):]
        parent.append(open_[-1] if open_ else -1)
        open_.append(t)
    kv_end = list(range(1, n + 1))
    for t in reversed(range(n)):
        if parent[t] >= 0:
            kv_end[parent[t]] = max(kv_end[parent[t]], kv_end[t])
    return torch.tensor(kv_end), parent


def path_of(parent, t):
    """Rows from the root to ``t``."""
    out = [t]
    while parent[out[-1]] >= 0:
        out.append(parent[out[-1]])
    return out[::-1]


def test_paths_match_definition():
    gen = torch.Generator().manual_seed(7)
    kv, parent = random_forest(gen, 80)
    p = treeattn.paths(kv)
    assert p.parent.tolist() == parent
    # Nodes tile the rows; a node continues only through single-child rows.
    assert p.node_start[0] == 0 and p.node_end[-1] == 80
    assert (p.node_start[1:] == p.node_end[:-1]).all()
    for n, (s, e) in enumerate(zip(p.node_start.tolist(), p.node_end.tolist())):
        for t in range(s + 1, e):
            assert parent[t] == t - 1 and parent.count(t - 1) == 1
        np_ = int(p.node_parent[n])
        assert np_ == (-1 if parent[s] < 0 else int(p.row_node[parent[s]]))
    assert p.level_offsets[-1] == p.node_start.numel()


def test_paths_rejects_bad_kv_end():
    with pytest.raises(ValueError, match="do not nest"):
        treeattn.paths(torch.tensor([3, 4, 4, 4]))
    with pytest.raises(ValueError, match="kv_end\\[1\\] = 0"):
        treeattn.paths(torch.tensor([2, 0, 2]))
    with pytest.raises(ValueError, match="kv_end\\[0\\] = -1"):
        treeattn.paths(torch.tensor([-1]))
    with pytest.raises(ValueError, match="1-D"):
        treeattn.paths(torch.ones(2, 2, dtype=torch.int64))


def naive_ops(parent, q, k, v, g, beta, x, dt, A, B, C, cx, w, b):
    """The three recurrences token by token along each row's path."""
    n, H = v.shape[:2]
    rep = H // q.shape[1]
    qn = recurrent._l2norm(q.repeat_interleave(rep, 1)) * q.shape[-1] ** -0.5
    kn = recurrent._l2norm(k.repeat_interleave(rep, 1))
    Br, Cr = B.repeat_interleave(H // B.shape[1], 1), C.repeat_interleave(H // C.shape[1], 1)
    K = w.shape[1]
    o, y, conv = [], [], []
    for t in range(n):
        S = v.new_zeros(H, q.shape[-1], v.shape[-1])
        h = x.new_zeros(H, x.shape[-1], B.shape[-1])
        rows = path_of(parent, t)
        for r in rows:
            S = S * g[r].exp()[:, None, None]
            delta = (v[r] - (S * kn[r][..., None]).sum(-2)) * beta[r][:, None]
            S = S + kn[r][..., None] * delta[:, None, :]
            h = h * (dt[r] * A).exp()[:, None, None] + (dt[r][:, None] * x[r])[..., None] * Br[r][:, None, :]
        o.append((S * qn[t][..., None]).sum(-2))
        y.append((h * Cr[t][:, None, :]).sum(-1))
        last = rows[-K:]
        seq = torch.cat([cx.new_zeros(K - len(last), cx.shape[1]), cx[last]], 0)
        conv.append((seq.T * w).sum(-1) + b)
    return torch.stack(o), torch.stack(y), torch.stack(conv)


@pytest.mark.parametrize("n,chunk", [(1, 4), (37, 4), (90, 16), (90, 64)])
def test_ops_equal_recurrence_along_paths(n, chunk):
    gen = torch.Generator().manual_seed(n + chunk)
    kv, parent = random_forest(gen, n)
    tree = hybrid.plan(kv)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(n, 2, 8), r(n, 2, 8), r(n, 4, 6)
    g, beta = (-u(n, 4)).requires_grad_(), u(n, 4).requires_grad_()
    x, dt, A = r(n, 4, 3), u(n, 4).requires_grad_(), (-3 * u(4)).requires_grad_()
    B, C = r(n, 2, 5), r(n, 2, 5)
    cx, w, b = r(n, 10), r(10, 4), r(10)
    ins = (q, k, v, g, beta, x, dt, A, B, C, cx, w, b)
    ours = (
        hybrid.tree_gated_delta_rule(q, k, v, g, beta, tree, chunk_size=chunk),
        hybrid.tree_ssd_scan(x, dt, A, B, C, tree, chunk_size=chunk),
        hybrid.tree_causal_conv1d(cx, w, tree, b),
    )
    ref = naive_ops(parent, *ins)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ref]
    for a, b_ in zip(ours, ref):
        assert (a - b_).abs().max() <= 1e-12
    g1 = torch.autograd.grad(sum((o * wt).sum() for o, wt in zip(ours, weights)), ins)
    g2 = torch.autograd.grad(sum((o * wt).sum() for o, wt in zip(ref, weights)), ins)
    for a, b_ in zip(g1, g2):
        assert (a - b_).abs().max() <= 1e-12


# ---------------------------------------------------------------- models


def sample_rollouts():
    """A compaction rollout (its first 8 calls: one compaction), a fold
    rollout (first 6 calls: one fold), two GRPO rollouts of one group and
    the golden vector, token ids folded into the tiny vocabulary."""
    take = {"golden": 99, "compaction-1": 8, "fold-1": 6, "grpo-1-01": 99, "grpo-1-02": 99}
    out = []
    for line in SAMPLE.read_text().splitlines():
        r = json.loads(line)
        if r["id"] in take:
            calls = [
                {"context": [t % VOCAB for t in c["context"]], "completion": [t % VOCAB for t in c["completion"]]}
                for c in r["calls"][: take[r["id"]]]
            ]
            out.append({"id": r["id"], "calls": calls})
    return out


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, initializer_range=0.05,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )
    return Qwen3_5ForCausalLM(cfg)


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, experts_implementation="eager", initializer_range=0.05,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )
    return Qwen3NextForCausalLM(cfg)


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
        state_size=16, n_groups=2, expand=2, conv_kernel=4, chunk_size=32, initializer_range=0.2,
    )
    return Mamba2ForCausalLM(cfg)


def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, expand=2,
        conv_kernel=4, chunk_size=32, initializer_range=0.05,
    )
    return NemotronHForCausalLM(cfg)


def bamba():
    from transformers import BambaConfig, BambaForCausalLM
    cfg = BambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=32, initializer_range=0.1)
    return BambaForCausalLM(cfg)

def falcon_h1():
    from transformers import FalconH1Config, FalconH1ForCausalLM
    cfg = FalconH1Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=32, initializer_range=0.2)
    return FalconH1ForCausalLM(cfg)

def granitemoehybrid():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    cfg = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=32, initializer_range=0.1, experts_implementation="eager")
    return GraniteMoeHybridForCausalLM(cfg)

def qwen3_5_moe():
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, experts_implementation="eager",
        initializer_range=0.05, layer_types=["linear_attention", "full_attention"])
    return Qwen3_5MoeForCausalLM(cfg)


# Initializer ranges: large enough that the recurrent layers move the
# log-probs visibly (the negative control below is then >= 0.1 nats),
# small enough that float32 rounding stays ~1e-6 nats.
MODELS = {
    "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next, "mamba2": mamba2,
    "nemotron_h": nemotron_h, "bamba": bamba, "falcon_h1": falcon_h1, "granitemoehybrid": granitemoehybrid,
}
PURE_SSM = {"mamba2"}  # no attention layer: no attention implementation to set


def per_call_logprobs(model, rollouts, keys):
    """Log-prob of every target, each call run alone on the model's default
    path (no kv_end), in the order of ``keys`` (global call, offset)."""
    truth, g = {}, 0
    for r in rollouts:
        for c in r["calls"]:
            seq = torch.tensor(c["context"] + c["completion"])[None]
            lp = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[0], -1)
            n = len(c["context"])
            for j, tok in enumerate(c["completion"]):
                truth[(g, j)] = lp[n - 1 + j, tok]
            g += 1
    assert len(truth) == len(keys)
    return torch.stack([truth[k] for k in keys])


def packed_logprobs(model, pack):
    """One packed forward with kv_end (and depth positions where the model
    takes positions)."""
    logits = model(
        input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end, use_cache=False
    ).logits[0]
    return treeattn.hf.target_logprobs(model, pack, logits)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a shared 2-core
    machine two OpenMP threads per op made a 0.03 s forward take seconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data():
    treeattn.hf.register()
    rollouts = sample_rollouts()
    (pack,) = treeattn.pack(rollouts, share_prefixes=False)
    p = treeattn.paths(pack.kv_end)
    # Several trees, each a shared prefix with branches below it.
    assert (p.node_parent < 0).sum() >= 4 and p.node_start.numel() >= 10
    keys = list(zip(pack.loss_call.tolist(), pack.loss_offset.tolist()))
    return rollouts, pack, keys


def build(name):
    """The tiny model in float64 (every family here allows it), eval mode,
    attention (where it has any) through treeattn."""
    torch.manual_seed(0)
    model = MODELS[name]().to(torch.float64).eval()
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pack_equals_each_call_alone(data, name):
    rollouts, pack, keys = data
    model = build(name)
    if name not in PURE_SSM:
        model.set_attn_implementation("sdpa")
    model.zero_grad()
    ref = per_call_logprobs(model, rollouts, keys)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if name not in PURE_SSM:
        model.set_attn_implementation("treeattn")
    model.zero_grad()
    lp = packed_logprobs(model, pack)
    err = (lp - ref.detach()).abs().max()
    assert err <= LOGPROB_BOUND, f"{name}: max |Δ log p| = {err:.3g}"
    lp.sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    for n, gr in ref_grads.items():
        assert rel_err(got[n], gr) <= GRAD_BOUND, f"{name}: {n}"
    # Negative control: the same pack, the recurrent layers in packed order.
    with torch.no_grad(), hybrid._packed_order():
        bad = packed_logprobs(model, pack)
    assert (bad - ref.detach()).abs().max() >= 1e-2, name


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5"])
def test_gradient_checkpointing_keeps_the_tree(data, name):
    """Checkpointed layers re-run their forward in backward, outside the
    model call: the tree must still be used there (Mamba2ForCausalLM does
    not pass kv_end down itself)."""
    _, pack, _ = data
    model = build(name).train()
    if name not in PURE_SSM:
        model.set_attn_implementation("treeattn")
    packed_logprobs(model, pack).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    packed_logprobs(model, pack).sum().backward()
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= 1e-12, n


def test_kv_end_of_another_length_is_a_value_error(data):
    _, pack, _ = data
    model = build("mamba2")
    with pytest.raises(ValueError, match="kv_end has .* entries but the input has"):
        model(input_ids=pack.tokens[None, :-1], kv_end=pack.kv_end, use_cache=False)
    bad = pack.kv_end.clone()
    bad[1] = len(pack) + 5
    with pytest.raises(ValueError, match="kv_end"):
        model(input_ids=pack.tokens[None], kv_end=bad, use_cache=False)


def test_unsupported_recurrent_family_raises(data):
    from transformers import MambaConfig, MambaForCausalLM

    _, pack, _ = data
    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4))
    model(input_ids=pack.tokens[None, :8], use_cache=False)  # the ordinary path is untouched
    with pytest.raises(ValueError, match="cannot run on a tree pack"):
        model(input_ids=pack.tokens[None], kv_end=pack.kv_end, use_cache=False)



def test_unknown_recurrent_family_refuses_kv_end():
    """A modeling module of no listed family that defines a recurrent
    function (here ``causal_conv1d_fn``) is refused too; one that does not
    (plain attention) is left alone."""
    import sys
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    mods = {}
    for fam, recurrent in (("fakerec", True), ("fakeplain", False)):
        mod = types.ModuleType(f"transformers.models.{fam}.modeling_{fam}")
        model_cls = type(f"{fam}Model", (LlamaForCausalLM,), {"forward": LlamaForCausalLM.forward, "__module__": mod.__name__})
        setattr(mod, model_cls.__name__, model_cls)
        if recurrent:
            mod.causal_conv1d_fn = lambda *a, **k: None
        sys.modules[mod.__name__] = mod
        mods[fam] = model_cls
    try:
        states = hybrid.register()
        assert states.get("fakerec") == "refuse" and "fakeplain" not in states
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
        ids, kv_end = torch.tensor([[1, 2, 3]]), torch.tensor([3, 3, 3])
        with pytest.raises(ValueError, match="fakerec"):
            mods["fakerec"](cfg)(input_ids=ids, kv_end=kv_end)
        mods["fakeplain"](cfg)(input_ids=ids)  # untouched
    finally:
        for fam in mods:
            del sys.modules[f"transformers.models.{fam}.modeling_{fam}"]
