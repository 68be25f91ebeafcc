"""Log-probs without [L, V] logits (treeattn.hf.target_logprobs / pack_loss
with row chunks recomputed in backward) against the full-logits path, on
tiny random float64 models with attn_implementation="treeattn".

Tolerance 1e-12: both paths run the same float64 forward; they differ only
in the order of the head's sums (a chunk of rows vs all rows), which moves
log-probs and gradients by a few ulp (seen: <= 1e-15 relative)."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

transformers = pytest.importorskip("transformers")

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402
from conftest import GOLDEN, rel_err  # noqa: E402
from test_hf import random_rollouts  # noqa: E402

VOCAB = 97  # differs from every other size here, so a [*, V] tensor is recognisable
TOL = 1e-12


def hidden(model, pack):
    """(h, W, b, post) as the chunked head sees them inside one packed forward."""
    return treeattn.hf._score(model, treeattn.hf._Scored(pack), lambda *a: a)


def llama(hidden=16, tie=False, seed=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        attention_dropout=0.0, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.set_attn_implementation("treeattn")
    return model


def gemma2(softcap):
    """A tiny Gemma2 (tied embeddings, final logit softcapping)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
        attention_dropout=0.0, final_logit_softcapping=softcap, attn_logit_softcapping=None,
        query_pre_attn_scalar=8, sliding_window=512,
    )
    model = Gemma2ForCausalLM(cfg).to(torch.float64)
    model.set_attn_implementation("treeattn")
    return model


@pytest.fixture(scope="module")
def pack():
    treeattn.hf.register()
    gen = torch.Generator()
    gen.seed()
    (p,) = treeattn.pack(GOLDEN + random_rollouts(gen, n=6))
    assert p.sdcc_student_rows.numel() > 0
    return p


def full_path(model, pack, entropy=False):
    logits = treeattn.hf._forward(model, treeattn.hf._Scored(pack))[0]
    return treeattn.hf.target_logprobs(model, pack, logits, entropy=entropy)


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b, tol=TOL):
    assert a.keys() == b.keys()
    for n in a:
        assert rel_err(a[n], b[n]) <= tol, n


@pytest.mark.parametrize("chunk", [1, 3, "T-1", None, 10_000])
def test_chunked_equals_full_logits(pack, chunk):
    """Log-probs, entropy and every parameter gradient of Σ lp + 0.3 Σ H;
    chunk sizes that do not divide T (T − 1; T is printed on failure)."""
    model = llama()
    T = pack.loss_rows.numel()
    if chunk == "T-1":
        chunk = T - 1
        assert T > 2 and T % chunk
    lp_f, ent_f = full_path(model, pack, entropy=True)
    g_full = grads(model, lp_f.sum() + 0.3 * ent_f.sum())
    lp, ent = treeattn.hf.target_logprobs(model, pack, chunk=chunk, entropy=True)
    assert lp.shape == (T,) and ent.shape == (T,)
    assert rel_err(lp, lp_f) <= TOL, T
    assert rel_err(ent, ent_f) <= TOL, T
    assert_same_grads(grads(model, lp.sum() + 0.3 * ent.sum()), g_full)


def test_entropy_is_the_softmax_entropy(pack):
    model = llama()
    _, ent = treeattn.hf.target_logprobs(model, pack, chunk=5, entropy=True)
    logits = treeattn.hf._forward(model, treeattn.hf._Scored(pack))[0][pack.loss_rows]
    p = torch.softmax(logits, -1)
    assert rel_err(ent, -(p * p.log()).sum(-1)) <= TOL
    assert (ent > 0).all() and (ent <= torch.log(torch.tensor(float(VOCAB))) + 1e-12).all()


def test_tied_embeddings_get_the_head_gradient(pack):
    model = llama(tie=True)
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is emb
    g_full = grads(model, full_path(model, pack).sum())
    g = grads(model, treeattn.hf.target_logprobs(model, pack, chunk=4).sum())
    assert_same_grads(g, g_full)
    # The head's share is there: without it the gradient differs.
    model.zero_grad()
    h, w, _, _ = hidden(model, pack)
    (torch.log_softmax(h[pack.loss_rows] @ w.detach().t(), -1)
     .gather(1, pack.loss_labels[:, None]).sum()).backward()
    assert rel_err(emb.grad, g_full["model.embed_tokens.weight"]) > 1e-3


def test_head_bias(pack):
    model = llama()
    head = torch.nn.Linear(16, VOCAB, bias=True, dtype=torch.float64)
    torch.nn.init.normal_(head.bias, std=0.5)
    model.lm_head = head
    lp_f = full_path(model, pack)
    g_full = grads(model, lp_f.sum())
    lp = treeattn.hf.target_logprobs(model, pack, chunk=6)
    assert rel_err(lp, lp_f) <= TOL
    assert_same_grads(grads(model, lp.sum()), g_full)
    assert g_full["lm_head.bias"].abs().max() > 0


def test_final_logit_softcapping(pack):
    model = gemma2(softcap=2.0)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():  # logits of several units, so that the cap bends them
        model.get_output_embeddings().weight.mul_(40)
    lp_f, ent_f = full_path(model, pack, entropy=True)
    g_full = grads(model, lp_f.sum() - ent_f.sum())
    lp, ent = treeattn.hf.target_logprobs(model, pack, chunk=5, entropy=True)
    assert rel_err(lp, lp_f) <= TOL and rel_err(ent, ent_f) <= TOL
    assert_same_grads(grads(model, lp.sum() - ent.sum()), g_full)
    # The cap matters at this size (negative control): without it, other numbers.
    h, w, _, _ = hidden(model, pack)
    uncapped = torch.log_softmax(h[pack.loss_rows] @ w.t(), -1).gather(1, pack.loss_labels[:, None])[:, 0]
    assert rel_err(uncapped, lp_f) > 1e-3


@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_config_logit_scale(pack, arch):
    """Cohere multiplies its logits by config.logit_scale, Granite divides
    them by config.logits_scaling: both applied, gradients included."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    if arch == "cohere":
        model = tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.3))
    else:
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=3.0))
    model = model.to(torch.float64)
    model.set_attn_implementation("treeattn")
    lp_f = full_path(model, pack)
    g_full = grads(model, lp_f.sum())
    lp = treeattn.hf.target_logprobs(model, pack, chunk=5)
    assert rel_err(lp, lp_f) <= TOL
    assert_same_grads(grads(model, lp.sum()), g_full)


def test_unknown_logit_transform_is_refused(pack):
    """A config softcap or logit scale the model does not apply (Llama
    ignores both): the probe row disagrees, and the call says so instead of
    mis-scoring."""
    model = llama()
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(ValueError, match="after the output embedding"):
        treeattn.hf.target_logprobs(model, pack)
    model = llama()
    model.config.logit_scale = 2.0
    with pytest.raises(ValueError, match="after the output embedding"):
        treeattn.hf.pack_loss(model, pack)


def test_empty_loss_index(pack):
    """A pack with no loss entries (treeattn.pack never makes one — every
    call samples a token — but a filtered pack may): empty log-probs, zero
    gradients, a zero NLL."""
    empty = torch.empty(0, dtype=torch.int64)
    p0 = dataclasses.replace(pack, loss_rows=empty, loss_labels=empty,
                             loss_weights=torch.empty(0), loss_logprobs=torch.empty(0))
    model = llama()
    lp, ent = treeattn.hf.target_logprobs(model, p0, entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    g = grads(model, lp.sum() + treeattn.hf.pack_loss(model, p0)["loss"])
    assert all((v == 0).all() for v in g.values())


def test_pack_loss_sdcc_exact_tau_and_normalizer(pack):
    """pack_loss against full float64 logits: NLL with a normalizer, SDCC at
    tau = 1.7 (not rounded to float32), and the gradient of the total."""
    model = llama()
    tau, lam, norm = 1.7, 0.3, 123.25
    logits = treeattn.hf._forward(model, treeattn.hf._Scored(pack))[0]
    lp = torch.log_softmax(logits[pack.loss_rows], -1).gather(1, pack.loss_labels[:, None])[:, 0]
    nll = -(pack.loss_weights.double() * lp).sum() / norm
    ls = torch.log_softmax(logits[pack.sdcc_student_rows] / tau, -1)
    lt = torch.log_softmax(logits[pack.sdcc_teacher_rows].detach() / tau, -1)
    sdcc = (lt.exp() * (lt - ls)).sum(-1).mean()
    g_ref = grads(model, nll + lam * sdcc)
    parts = treeattn.hf.pack_loss(model, pack, sdcc_lambda=lam, tau=tau, normalizer=norm, chunk=4)
    assert rel_err(parts["nll"], nll) <= TOL and rel_err(parts["sdcc"], sdcc) <= TOL
    assert rel_err(parts["loss"], nll + lam * sdcc) <= TOL
    assert_same_grads(grads(model, parts["loss"]), g_ref)
    # Default normalizer: Σ w of the pack.
    d = treeattn.hf.pack_loss(model, pack)
    assert rel_err(d["nll"], -(pack.loss_weights.double() * lp).sum() / pack.loss_weights.double().sum()) <= TOL


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), torch.ones(2), "3"])
def test_bad_normalizer_and_chunk(pack, bad):
    model = llama()
    with pytest.raises(ValueError, match="normalizer"):
        treeattn.hf.pack_loss(model, pack, normalizer=bad)
    with pytest.raises(ValueError, match="chunk"):
        treeattn.hf.target_logprobs(model, pack, chunk=0)


class VocabRows(TorchDispatchMode):
    """Records the most rows of any op output (forward and backward) whose
    last dim is the vocabulary, except tensors of the head weight's size
    (W, Wᵀ, ∂W: [V, H] elements)."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab, self.hidden, self.rows, self.ops = vocab, hidden, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab
                    and t.numel() != self.vocab * self.hidden):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tensor_with_a_row_per_token(pack):
    """Every op of pack_loss / target_logprobs, forward and backward, makes
    tensors of at most `chunk` vocabulary rows (the model's own probe row
    is 1); the full-logits path makes [L, V] (negative control)."""
    model = llama(hidden=16)
    chunk = 4
    L, T = len(pack), pack.loss_rows.numel()
    assert T > 2 * chunk and pack.sdcc_student_rows.numel() > chunk
    with VocabRows(VOCAB, 16) as m:
        treeattn.hf.pack_loss(model, pack, sdcc_lambda=0.1, chunk=chunk, entropy=True)["loss"].backward()
    assert 1 <= m.rows <= chunk, m.rows
    # The backward ran under the mode too (scatter_add_ is only in the head's backward).
    assert "aten.scatter_add_.default" in m.ops
    with VocabRows(VOCAB, 16) as m:
        lp, ent = treeattn.hf.target_logprobs(model, pack, chunk=chunk, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert 1 <= m.rows <= chunk, m.rows
    with VocabRows(VOCAB, 16) as m:
        full_path(model, pack).sum().backward()
    assert m.rows >= L, (m.rows, L)


PEAK_SCRIPT = r"""
import resource, sys, time, torch
import treeattn, treeattn.hf
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
V, C, N = 131072, 800, 5000
treeattn.hf.register()
cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
model = LlamaForCausalLM(cfg)
model.set_attn_implementation("treeattn")
ids = torch.randint(0, V, (C + N,)).tolist()
(pack,) = treeattn.pack([{"id": "long", "calls": [{"context": ids[:C], "completion": ids[C:]}]}])
assert pack.loss_rows.numel() == N
kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before = kib()
t0 = time.perf_counter()
lp = treeattn.hf.target_logprobs(model, pack)
lp.sum().backward()
assert torch.isfinite(lp).all() and model.lm_head.weight.grad.abs().sum() > 0
print("GROWTH_KIB", kib() - before, "SECONDS", round(time.perf_counter() - t0, 2))
"""


def test_long_completion_peak_memory():
    """The issue's case: an 800-token context, a 5,000-token completion,
    V = 131,072, a one-layer Llama with hidden size 32. The full-logits path
    grew the process's peak RSS by 7.9 GiB; the chunked one must stay under
    1 GiB (a fresh process, so the high-water mark is this call's)."""
    # The child imports treeattn as this process does (installed, or PYTHONPATH).
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], check=True, capture_output=True,
                         text=True, timeout=600).stdout
    growth_kib = int(out.split("GROWTH_KIB")[1].split()[0])
    print(out)
    assert growth_kib < 1024 * 1024, out
