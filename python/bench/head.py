"""Benchmark (not a test): the log-prob head alone — per-target log-probs of
hidden states ``h [T, H]`` against an output embedding ``W [V, H]`` at labels
``y [T]``, forward + backward of ``Σ lp`` (∂h and ∂W) — by four methods on
the same inputs, CPU:

  naive     what a user writes: ``logits = h @ W.T`` (in W's dtype), then
            ``log_softmax(logits.float())`` and a gather; autograd backward;
  treeattn  ``treeattn.head._HeadLogprob`` — the autograd function that
            ``target_logprobs`` / ``pack_loss`` call inside the HF model's
            forward on the hidden states at the loss rows
            (``_chunked_logprobs``), ``chunk`` rows at a time (default
            ``treeattn.head.default_chunk(V)``), logits recomputed in backward,
            a 16-bit ∂W summed per vocabulary slice in float32 and rounded
            once. Called directly, without the model around it: the HF path
            adds the body's forward and a one-row probe of the model's logits,
            nothing to the head;
  trl       TRL 1.16.0's fused LM head: ``trl.kernels.ChunkedLogProbFunction``
            called exactly as ``trl.trainer.utils.add_fused_lm_head``'s
            patched forward calls it (``temperature 1``, vocabulary tile
            ``_CHUNKED_LOGPROB_CHUNK_SIZE`` = 32,768, token tile 4,096, no
            softcap, scale 1, ``outputs=("log_probs",)``). On a device without
            Triton (the CPU) TRL folds each tile with torch ops
            (``_forward_tile`` / ``_backward_tile``) instead of its Triton
            kernels: these figures are that path's, not its GPU one's;
  liger     Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction``
            (``reduction="sum"``: −Σ lp; it has no per-token log-probs, so
            only Σ lp, ∂h and ∂W are compared). Its kernels are Triton; it is
            tried on a tiny input first and reported "not run" with the error
            if it cannot run on the CPU (Triton has no CPU driver).

Inputs (seeded): ``h ~ N(0, 1)``, ``W ~ N(0, (2/√H)²)`` (logits of standard
deviation ~2), ``y`` uniform; h and W are drawn as bfloat16 values, so the
float32 and the bfloat16 runs see the same numbers and one float64 reference
serves both. The reference is the same math in float64, row chunk by row
chunk (``reference``), computed once per T in its own process.

Memory: each method runs in a fresh process, which builds the inputs and
then, per repetition: drops the previous gradients, ``gc.collect()``,
``malloc_trim(0)`` (glibc hands freed heap back), reads its resident set
(``VmRSS``), resets the kernel's peak-RSS mark (``echo 5 >
/proc/self/clear_refs``), runs forward + backward and reads the peak
(``VmHWM``). "Peak extra" = VmHWM − VmRSS before: everything the method
touched on top of its inputs — the logits blocks, saved tensors, the
allocator's and oneDNN's buffers, and the gradients ∂W and ∂h themselves
(listed apart: "grads"). Time: wall (``perf_counter``) and process CPU time
(all threads; it does not grow while the process waits for a core) of the
same forward + backward; one warm-up, then ``--reps``; the median.

    python python/bench/head.py [--tokens 2048,8192] [--vocab 151936] [--hidden 1024]
        [--dtypes float32,bfloat16] [--methods naive,treeattn,trl,liger] [--reps 3]
        [--threads 2] [--chunk N] [--json out.json]
    python python/bench/head.py --check [--tokens 64 --vocab 1000 --hidden 32]   # correctness only

The naive method's peak is about 3·T·V·4 bytes (float32 logits or their
log-softmax, its incoming gradient, its outgoing one: measured 3.0 × a
float32 ``[T, V]`` at T = 2,048) plus ∂W; it is skipped, saying so, when
3.2·T·V·4 bytes pass --mem-fraction of MemAvailable.
"""

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

METHODS = ("naive", "treeattn", "trl", "liger")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Allowed error against the float64 reference, per weight dtype. float32:
# rounding of V-long sums (seen ≤ 2e-5 at V = 151,936). bfloat16: the logits
# leave the matmul rounded to bfloat16 in every method (8 bits of mantissa:
# |Δz| up to 2⁻⁸·|z|), and ∂W / ∂h are rounded to bfloat16 once.
TOL = {
    torch.float32: {"lp_max_abs": 1e-3, "lp_sum_rel": 1e-5, "dw_max_rel": 1e-3, "dh_max_rel": 1e-3},
    torch.bfloat16: {"lp_max_abs": 0.25, "lp_sum_rel": 1e-3, "dw_max_rel": 5e-2, "dh_max_rel": 5e-2},
}


# ----------------------------------------------------------------------------
# inputs and the float64 reference


def inputs(T, V, H, dtype, seed=0):
    """h [T, H], W [V, H] (bfloat16 values, in ``dtype``), labels [T] int64."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dtype)
    W = torch.randn(V, H, generator=g).mul_(2.0 / math.sqrt(H)).to(torch.bfloat16).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    return h, W, y


def reference(h, W, y, rows=256):
    """lp [T], ∂(Σ lp)/∂W [V, H], ∂(Σ lp)/∂h [T, H], all float64, ``rows``
    rows at a time (∂lp_i/∂z_i = onehot(y_i) − p_i)."""
    h64, W64 = h.double(), W.double()
    T = h64.shape[0]
    lp = torch.empty(T, dtype=torch.float64)
    dw = torch.zeros_like(W64)
    dh = torch.empty_like(h64)
    for i in range(0, T, rows):
        j = min(T, i + rows)
        z = h64[i:j] @ W64.T
        lse = torch.logsumexp(z, -1)
        lp[i:j] = z.gather(1, y[i:j, None])[:, 0] - lse
        g = z.sub_(lse[:, None]).exp_().neg_()
        g.scatter_add_(1, y[i:j, None], torch.ones(j - i, 1, dtype=torch.float64))
        dw.addmm_(g.T, h64[i:j])
        dh[i:j] = g @ W64
        del z, g
    return lp, dw, dh


# ----------------------------------------------------------------------------
# the methods: each takes leaves h, W (requires_grad) and labels y and returns
# (lp [T] or None, Σ lp as a scalar to call backward on)


def run_naive(h, W, y, args):
    lp = torch.log_softmax((h @ W.T).float(), dim=-1).gather(-1, y[:, None])[:, 0]
    return lp, lp.sum()


def run_treeattn(h, W, y, args):
    import treeattn.head as head

    chunk = args.get("chunk") or head.default_chunk(W.shape[0])
    lp, _ent = head._HeadLogprob.apply(h, W, None, y, chunk, head._Post(1.0, None), False)
    return lp, lp.sum()


def run_trl(h, W, y, args):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    # add_fused_lm_head's call (trl/trainer/utils.py, _fused_forward), with its defaults.
    lp = ChunkedLogProbFunction.apply(h, W, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]
    return lp, lp.sum()


def run_liger(h, W, y, args):
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction

    loss = LigerFusedLinearCrossEntropyFunction.apply(h, W, y, None, None, -100, 0.0, 0.0, "sum")[0]
    return None, -loss


RUN = {"naive": run_naive, "treeattn": run_treeattn, "trl": run_trl, "liger": run_liger}


def unavailable(method):
    """Why ``method`` cannot run here (None if it can): a missing package, or
    an error on a tiny CPU input (Liger's Triton kernels without a GPU)."""
    try:
        h, W, y = inputs(4, 16, 8, torch.float32)
        h.requires_grad_()
        W.requires_grad_()
        _lp, s = RUN[method](h, W, y, {})
        s.backward()
        return None
    except ImportError as e:
        return f"not installed ({e})"
    except Exception as e:  # noqa: BLE001 — reported, never turned into a figure
        msg = f"{type(e).__name__}: " + (str(e).strip().splitlines()[0] if str(e).strip() else "")
        if method == "liger":
            import triton

            return f"needs a CUDA/Triton GPU (triton {triton.__version__} on the CPU: {msg})"
        return msg


def errors(lp, s, dw, dh, ref):
    """Errors against the float64 reference (lp may be None: Σ lp only)."""
    lp64, dw64, dh64 = ref
    ref_sum = float(lp64.sum())
    out = {
        "lp_sum": float(s.detach().double()),
        "lp_sum_rel": abs(float(s.detach().double()) - ref_sum) / abs(ref_sum),
        "lp_max_abs": float((lp.detach().double() - lp64).abs().max()) if lp is not None else None,
        "dw_max_rel": float((dw.double() - dw64).abs().max() / dw64.abs().max()),
        "dh_max_rel": float((dh.double() - dh64).abs().max() / dh64.abs().max()),
    }
    return out


def within(err, dtype):
    tol = TOL[dtype]
    return all(err[k] is None or err[k] <= tol[k] for k in tol)


def check(T=64, V=1000, H=32, dtypes=("float32", "bfloat16"), methods=METHODS, chunk=16):
    """Correctness only, in this process: every method that can run, both
    dtypes, against the float64 reference. Returns {(method, dtype): errors
    or the reason it did not run}."""
    out = {}
    ref = None
    for dname in dtypes:
        dtype = DTYPES[dname]
        h0, W0, y = inputs(T, V, H, dtype)
        if ref is None:
            ref = reference(h0, W0, y)
        for m in methods:
            why = unavailable(m)
            if why is not None:
                out[(m, dname)] = {"not_run": why}
                continue
            h, W = h0.clone().requires_grad_(), W0.clone().requires_grad_()
            lp, s = RUN[m](h, W, y, {"chunk": chunk})
            s.backward()
            err = errors(lp, s, W.grad, h.grad, ref)
            err["ok"] = within(err, dtype)
            out[(m, dname)] = err
    return out


# ----------------------------------------------------------------------------
# the measuring child


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(a):
    torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    out = {"method": a.child, "dtype": a.dtype, "T": a.T, "threads": torch.get_num_threads()}
    why = unavailable(a.child)
    if why is not None:
        out["not_run"] = why
        print(json.dumps(out))
        return
    h, W, y = inputs(a.T, a.vocab, a.hidden, dtype)
    h.requires_grad_()
    W.requires_grad_()
    libc = ctypes.CDLL("libc.so.6")
    runs = []
    lp = s = None
    for rep in range(1 + a.reps):
        h.grad = W.grad = None
        lp = s = None
        gc.collect()
        libc.malloc_trim(0)
        rss0 = _status("VmRSS")
        _reset_peak()
        c0, t0 = time.process_time(), time.perf_counter()
        lp, s = RUN[a.child](h, W, y, {"chunk": a.chunk})
        s.backward()
        t1, c1 = time.perf_counter(), time.process_time()
        peak = _status("VmHWM") - rss0
        runs.append({"wall_s": t1 - t0, "cpu_s": c1 - c0, "peak_extra_mib": peak / 2**20, "warmup": rep == 0})
    grads = (W.grad.numel() * W.grad.element_size() + h.grad.numel() * h.grad.element_size()) / 2**20
    out.update(runs=runs, grads_mib=grads)
    if a.ref:
        ref = torch.load(a.ref)
        out["errors"] = errors(lp, s, W.grad, h.grad, (ref["lp"], ref["dw"], ref["dh"]))
        out["errors"]["ok"] = within(out["errors"], dtype)
    print(json.dumps(out))


def ref_child(a):
    torch.set_num_threads(a.threads)
    h, W, y = inputs(a.T, a.vocab, a.hidden, torch.float32)
    lp, dw, dh = reference(h, W, y)
    torch.save({"lp": lp, "dw": dw, "dh": dh}, a.ref)


# ----------------------------------------------------------------------------
# the parent


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def fmt_err(e):
    if e is None:
        return "—"
    lp = "—" if e["lp_max_abs"] is None else f"{e['lp_max_abs']:.1e}"
    return f"{lp} / {e['lp_sum_rel']:.1e} / {e['dw_max_rel']:.1e} / {e['dh_max_rel']:.1e}" + (
        "" if e["ok"] else " **FAIL**")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="T values, comma-separated (default 2048,8192; --check: 64)")
    ap.add_argument("--vocab", type=int, default=None, help="V (default 151936; --check: 1000)")
    ap.add_argument("--hidden", type=int, default=None, help="H (default 1024; --check: 32)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process")
    ap.add_argument("--chunk", type=int, default=None, help="treeattn's rows per block (default: default_chunk(V))")
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--check", action="store_true", help="correctness only (tiny sizes by default), no timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    tokens = [int(t) for t in (a.tokens or ("64" if a.check else "2048,8192")).split(",")]
    a.vocab = a.vocab or (1000 if a.check else 151936)
    a.hidden = a.hidden or (32 if a.check else 1024)
    methods = a.methods.split(",")
    dtypes = a.dtypes.split(",")
    if a.child == "ref":
        return ref_child(a)
    if a.child:
        return child(a)
    if a.check:
        torch.set_num_threads(a.threads)
        bad = 0
        for T in tokens:
            res = check(T, a.vocab, a.hidden, dtypes, methods, a.chunk or 16)
            print(f"T = {T}, V = {a.vocab}, H = {a.hidden}: max |Δlp| / Σlp rel / ∂W max rel / ∂h max rel")
            for (m, d), e in res.items():
                print(f"  {m:8s} {d:8s} {e['not_run'] if 'not_run' in e else fmt_err(e)}")
                bad += "not_run" not in e and not e["ok"]
        sys.exit(1 if bad else 0)

    here = os.path.abspath(__file__)
    common = ["--vocab", str(a.vocab), "--hidden", str(a.hidden), "--threads", str(a.threads),
              "--reps", str(a.reps)] + (["--chunk", str(a.chunk)] if a.chunk else [])
    results = []
    tmp = tempfile.mkdtemp(prefix="treeattn-head-")
    try:
        for T in tokens:
            ref = os.path.join(tmp, f"ref{T}.pt")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, here, "--child", "ref", "--T", str(T), "--ref", ref] + common, check=True)
            print(f"T = {T}: float64 reference in {time.perf_counter() - t0:.0f} s", flush=True)
            for d in dtypes:
                for m in methods:
                    if m == "naive":
                        need, avail = 3.2 * T * a.vocab * 4, mem_available()
                        if avail is not None and need > a.mem_fraction * avail:
                            r = {"method": m, "dtype": d, "T": T, "not_run":
                                 f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"}
                            print(json.dumps(r), flush=True)
                            results.append(r)
                            continue
                    cmd = [sys.executable, here, "--child", m, "--dtype", d, "--T", str(T), "--ref", ref] + common
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    results.append(r)
                    if "not_run" in r:
                        print(f"T {T} {d:8s} {m:8s}: not run: {r['not_run']}", flush=True)
                        continue
                    timed = [x for x in r["runs"] if not x["warmup"]]
                    print(f"T {T} {d:8s} {m:8s}: wall " + " ".join(f"{x['wall_s']:.2f}" for x in r["runs"])
                          + " s, peak extra " + " ".join(f"{x['peak_extra_mib']:.0f}" for x in r["runs"])
                          + f" MiB (first = warm-up), errors {fmt_err(r['errors'])}", flush=True)
                    del timed
            os.remove(ref)
    finally:
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)

    import treeattn.head

    chunk = a.chunk or treeattn.head.default_chunk(a.vocab)
    print(f"\nV = {a.vocab}, H = {a.hidden}, torch {torch.__version__}, {a.threads} threads, "
          f"treeattn chunk {chunk} rows, median of {a.reps} after a warm-up")
    print("| T | weights | method | fwd+bwd wall, s (median; min–max) | CPU, s | peak extra, MiB (median; max) "
          "| of which ∂W + ∂h | max abs Δlp / Σlp rel / ∂W max rel / ∂h max rel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        head = f"| {r['T']:,} | {r['dtype']} | {r['method']} |"
        if "not_run" in r:
            print(f"{head} not run: {r['not_run']} | | | | |")
            continue
        timed = [x for x in r["runs"] if not x["warmup"]]
        w = [x["wall_s"] for x in timed]
        c = [x["cpu_s"] for x in timed]
        p = [x["peak_extra_mib"] for x in timed]
        print(f"{head} {statistics.median(w):.2f}; {min(w):.2f}–{max(w):.2f} | {statistics.median(c):.2f} | "
              f"{statistics.median(p):,.0f}; {max(p):,.0f} | {r['grads_mib']:,.0f} | {fmt_err(r['errors'])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
