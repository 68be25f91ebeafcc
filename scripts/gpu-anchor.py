#!/usr/bin/env python3
"""GPU anchor: PyTorch on the very packs `treeattn gpu-check --dump DIR` ran.

For every case of the dump (manifest.json + one safetensors file per case:
kv_end, position_ids, q, k, v [, d_o], and our o, lse [, dq, dk, dv]) it runs,
on --device (cpu or cuda):

  reference   SDPA with the dense boolean mask k <= q < kv_end[k] (the rule of
              src/mask.rs), in float64 on CPU / float32 on CUDA, from the same
              rounded inputs; LSE = logsumexp of the masked scores; dQ, dK, dV
              by autograd (rotary, when the case has it, applied to q and k in
              torch, Llama rotate-half at the pack's position ids, so the
              gradients are with respect to the unrotated q, k, as ours are);
  flex        torch FlexAttention, block mask from the same rule: forward with
              its LSE (and forward+backward on CUDA; it has no CPU backward);
              compiled (--flex auto: compiled, eager if the compile fails);
  sdpa-dense  SDPA with the dense mask, timed (the input dtype on CUDA, float32
              on CPU);
  sdpa-causal SDPA is_causal=True on the same length, timed (on CUDA the flash
              backend), as the speed of plain attention.

Then, when the dump has `timing/` (gpu-check's timing rows: the packs and
our times), torch on each of those very packs and shapes at full size —
FlexAttention (block mask from the same rule; rotary applied in torch where
the row has it) and SDPA causal of the same length — timed as ours were (all
calls between one pair of CUDA events, the mean), forward or forward +
backward as the row was, side by side with ours: flex/ours and our
visible-pair throughput over SDPA causal's.

Compares our O, LSE, dQ, dK, dV with the reference by the measures and bounds
of the manifest (relative Frobenius error; LSE max absolute error; the bounds
our kernels are held to against the CPU backend), and flex's O and LSE with ours
(twice the bound on CUDA, where flex computes in bf16/f16). Prints a line per
case as it goes (flushed), then one side-by-side table with the timings (median
of --reps after one warm-up; ours are one launch from the dump, and on the
emulator they are its wall clock: meaningless; on CPU torch's timings mean
little too). Every section's error is caught and reported; a fault keeps what
came before. Exit status 1 when any comparison with the reference fails or a
case could not be checked; a FlexAttention failure is reported, and fails the
run only with --require-flex.

Needs torch (FlexAttention for the flex column); no other package. Example:

  treeattn gpu-check --backend emu --dump /tmp/d && python3 scripts/gpu-anchor.py /tmp/d
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time
import traceback


def say(*a):
    print(*a, flush=True)


DTYPES = {}


def torch_dtype(name):
    import torch

    if not DTYPES:
        DTYPES.update({"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                       "F64": torch.float64, "I64": torch.int64, "I32": torch.int32})
    return DTYPES[name]


def load_safetensors(path):
    """A safetensors file as {name: CPU tensor}; read by hand (8-byte header
    size, JSON header, little-endian data) so that no package beyond torch is
    needed."""
    import torch

    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dt = torch_dtype(info["dtype"])
        buf = bytearray(data[base + b:base + e])
        t = torch.frombuffer(buf, dtype=dt) if len(buf) else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def rel_fro(got, want):
    got, want = got.double(), want.double()
    if not bool(torch_isfinite(got).all()):
        return math.inf
    num = float(((got - want) ** 2).sum())
    den = float((want ** 2).sum())
    return 0.0 if num == 0 else math.sqrt(num / max(den, 1e-300))


def torch_isfinite(x):
    import torch

    return torch.isfinite(x)


def max_abs_lse(got, want):
    """Largest |got - want| where both are finite; inf where only one is -inf."""
    import torch

    got, want = got.double(), want.double()
    same_inf = (got == want)
    both = torch.isfinite(got) & torch.isfinite(want)
    if bool((~same_inf & ~both).any()):
        return math.inf
    d = (got - want).abs()[both]
    return float(d.max()) if d.numel() else 0.0


def rope_apply(x, pos, base, dims, round_to=None):
    """Llama rotate-half on the first `dims` lanes of x [B, H, L, d] at
    position ids pos [L] (src/backend/mod.rs `Rope`). With `round_to` (the
    case's element type), the rotated values are rounded to it, as the
    kernels round their rotated Q and K tiles (straight-through for
    autograd: the gradient is that of the unrounded rotation)."""
    import torch

    half = dims // 2
    i = torch.arange(half, dtype=torch.float64, device=x.device)
    theta = base ** (-2.0 * i / dims)
    ang = pos.to(torch.float64)[:, None] * theta[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    y = torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)
    if round_to is not None and round_to != y.dtype:
        y = y + (y.detach().to(round_to).to(y.dtype) - y.detach())
    return y


def median_ms(fn, reps, sync):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class Case:
    def __init__(self, meta, tensors, device, ref_dtype):
        import torch

        self.meta = meta
        self.t = tensors
        self.L, self.hq, self.hk, self.d = meta["tokens"], meta["q_heads"], meta["kv_heads"], meta["head_dim"]
        self.scale = meta["softmax_scale"]
        self.rope = meta.get("rope")
        self.device = device
        self.ref_dtype = ref_dtype
        self.elem = tensors["q"].dtype  # bf16 / f16: what the kernels round rotated tiles to
        kv_end = tensors["kv_end"].to(device)
        self.kv_end = kv_end
        self.pos = tensors["position_ids"].to(device)
        idx = torch.arange(self.L, device=device)
        # query q sees key k  <=>  k <= q < kv_end[k]   (rows: queries, columns: keys)
        self.mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :])
        self.has_key = self.mask.any(dim=1)
        # A row with no visible key sees its own key in the computation (its
        # output is zeroed afterwards): SDPA would give NaN, and NaN
        # gradients, for a fully masked row.
        self.mask_safe = self.mask | (torch.eye(self.L, dtype=torch.bool, device=device) & ~self.has_key[:, None])

    def bhld(self, name, dtype):
        """[L, H, d] -> [1, H, L, d] in dtype on the device."""
        return self.t[name].to(self.device).to(dtype).permute(1, 0, 2).unsqueeze(0).contiguous()

    def inputs(self, dtype, grad=False):
        q, k, v = (self.bhld(n, dtype) for n in ("q", "k", "v"))
        if grad:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
        return q, k, v

    def prep(self, q, k, v):
        """Rotary (if any) and GQA repetition: what the attention sees."""
        if self.rope:
            q = rope_apply(q, self.pos, self.rope["base"], self.rope["dims"], self.elem)
            k = rope_apply(k, self.pos, self.rope["base"], self.rope["dims"], self.elem)
        g = self.hq // self.hk
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        return q, k, v

    def sdpa_dense(self, q, k, v):
        import torch
        import torch.nn.functional as F

        q, k, v = self.prep(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_safe, scale=self.scale)
        return torch.where(self.has_key[None, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))

    def lse(self, q, k):
        import torch

        q, k, _ = self.prep(q, k, k)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(~self.mask, float("-inf"))
        return torch.logsumexp(s, dim=-1)[0]  # [hq, L]


def back_to_lhd(x):
    return x[0].permute(1, 0, 2)


def run_case(case, args, flex_state, row):
    """Fills `row` (one line of the final table) for one case; returns the
    list of failures."""
    import torch

    fails = []
    meta, dev = case.meta, case.device
    tol = meta["tolerance"]
    ref = case.ref_dtype
    backward = meta["kind"] == "backward"
    sync = (lambda: torch.cuda.synchronize()) if dev == "cuda" else (lambda: None)
    # 1. reference and our errors
    try:
        q, k, v = case.inputs(ref, grad=backward)
        o_ref = case.sdpa_dense(q, k, v)
        with torch.no_grad():
            lse_ref = case.lse(q.detach(), k.detach())
        errs = {
            "O": rel_fro(case.t["o"].to(dev), back_to_lhd(o_ref.detach())),
            "LSE": max_abs_lse(case.t["lse"].to(dev), lse_ref),
        }
        bounds = {"O": tol["o_rel"], "LSE": tol["lse_abs"]}
        if backward:
            d_o = case.bhld("d_o", ref)
            o_ref.backward(d_o)
            for name, x in (("dQ", q), ("dK", k), ("dV", v)):
                errs[name] = rel_fro(case.t[name.lower()].to(dev), back_to_lhd(x.grad))
                bounds[name] = tol["grad_rel"]
        ok = all(errs[n] <= bounds[n] for n in errs)
        row["ours"] = errs
        row["ok"] = ok
        if not ok:
            fails.append(meta["name"] + ": ours vs reference")
        say(f"  {meta['name']:<36} L={case.L:<5} ours vs reference: "
            + "  ".join(f"{n} {errs[n]:.2e} (tol {bounds[n]:.0e})" for n in errs)
            + ("  ok" if ok else "  MISMATCH"))
    except Exception as e:  # noqa: BLE001 - a fault is a result to report
        fails.append(meta["name"] + f": reference failed ({type(e).__name__})")
        row["ok"] = False
        say(f"  {meta['name']:<36} reference FAILED: {type(e).__name__}: {e}")
        if args.verbose:
            traceback.print_exc()
        return fails
    # 2. FlexAttention forward (and backward on CUDA), against ours
    if args.flex != "off":
        try:
            fx = flex_run(case, args, flex_state, backward and dev == "cuda")
            scale_tol = 2.0 if dev == "cuda" else 1.0
            fe = {"O": rel_fro(back_to_lhd(fx["o"]), case.t["o"].to(dev)),
                  "LSE": max_abs_lse(fx["lse"], case.t["lse"].to(dev))}
            fb = {"O": scale_tol * tol["o_rel"], "LSE": scale_tol * tol["lse_abs"]}
            for name in ("dq", "dk", "dv"):
                if name in fx:
                    fe["d" + name[1:].upper()] = rel_fro(back_to_lhd(fx[name]), case.t[name].to(dev))
                    fb["d" + name[1:].upper()] = scale_tol * tol["grad_rel"]
            fok = all(fe[n] <= fb[n] for n in fe)
            row["flex_err"] = fe
            row["flex_ok"] = fok
            row["flex_mode"] = fx["mode"]
            if not fok:
                fails.append(meta["name"] + ": flex vs ours")
            say(f"  {'':<36} {'':<7} flex ({fx['mode']}) vs ours: "
                + "  ".join(f"{n} {fe[n]:.2e} (tol {fb[n]:.0e})" for n in fe)
                + ("  ok" if fok else "  MISMATCH"))
        except Exception as e:  # noqa: BLE001
            row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            say(f"  {'':<36} {'':<7} flex FAILED: {row['flex_error']}")
            if args.require_flex:
                fails.append(meta["name"] + ": flex failed")
            if args.verbose:
                traceback.print_exc()
    # 3. timings (on the case's small pack; the timing packs come later)
    if args.no_case_timing:
        return fails
    try:
        row["times"] = time_case(case, args, flex_state, sync)
    except Exception as e:  # noqa: BLE001
        row["times_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        say(f"  {'':<36} {'':<7} timing FAILED: {row['times_error']}")
    return fails


def flex_fn(args, flex_state, want_lse):
    """flex_attention, compiled or eager as --flex says (auto: compiled,
    eager after a compile failure, remembered for the rest of the run; on
    CPU torch compiles flex for inference without the LSE only, so calls
    that want the LSE may run eager while the timed ones run compiled)."""
    from torch.nn.attention.flex_attention import flex_attention

    if (args.flex == "eager" or flex_state.get("compile_failed")
            or (want_lse and (flex_state.get("no_compiled_lse") or args.flex_check == "eager"))):
        return flex_attention, "eager"
    if "compiled" not in flex_state:
        import torch

        flex_state["compiled"] = torch.compile(flex_attention, dynamic=False)
    return flex_state["compiled"], "compiled"


def flex_call(case, args, flex_state, q, k, v, want_lse=True):
    """FlexAttention on q [1, hq, L, d], k, v [1, hkv, L, d] (unrotated):
    rotary applied here when the case has it, GQA by flex itself. Returns
    (out, lse [1, hq, L] or None, mode)."""
    from torch.nn.attention.flex_attention import create_block_mask

    kv_end = case.kv_end

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (qi < kv_end[ki])

    bm = getattr(case, "_bm", None)
    if bm is None:
        bm = create_block_mask(mask_mod, None, None, case.L, case.L, device=case.device)
        case._bm = bm
    if case.rope:
        q = rope_apply(q, case.pos, case.rope["base"], case.rope["dims"], case.elem)
        k = rope_apply(k, case.pos, case.rope["base"], case.rope["dims"], case.elem)
    kw = dict(block_mask=bm, scale=case.scale, enable_gqa=case.hq != case.hk)
    while True:
        fn, mode = flex_fn(args, flex_state, want_lse)
        try:
            if not want_lse:
                return fn(q, k, v, **kw), None, mode
            try:
                from torch.nn.attention.flex_attention import AuxRequest
            except ImportError:
                AuxRequest = None
            if AuxRequest is not None:
                out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kw)
                lse = aux.lse
            else:
                out, lse = fn(q, k, v, return_lse=True, **kw)
            return out, lse, mode
        except Exception as e:  # noqa: BLE001
            if mode != "compiled" or args.flex == "compile":
                raise
            key = "no_compiled_lse" if want_lse else "compile_failed"
            flex_state[key] = True
            say(f"  (flex: the compile{' with the LSE' if want_lse else ''} failed, eager from here on"
                f"{' for the LSE' if want_lse else ''}: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:160] if str(e) else ''})")


def flex_run(case, args, flex_state, with_backward):
    import torch

    dt = case.t["q"].dtype if case.device == "cuda" else torch.float32
    q, k, v = case.inputs(dt, grad=with_backward)
    out, lse, mode = flex_call(case, args, flex_state, q, k, v)
    res = {"o": out.detach(), "lse": lse.detach()[0], "mode": mode}
    if with_backward:
        out.backward(case.bhld("d_o", dt))
        res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return res


def time_case(case, args, flex_state, sync):
    import torch
    import torch.nn.functional as F

    dev = case.device
    dt = case.t["q"].dtype if dev == "cuda" else torch.float32
    q, k, v = case.inputs(dt)
    d_o = case.bhld("d_o", dt) if "d_o" in case.t else torch.randn_like(q)
    reps = args.reps
    t = {}

    def fb(run):
        def go():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            run(qq, kk, vv).backward(d_o)
        return go

    dense = lambda a, b, c: case.sdpa_dense(a, b, c)
    with torch.no_grad():
        t["dense fwd"] = median_ms(lambda: dense(q, k, v), reps, sync)
    t["dense f+b"] = median_ms(fb(dense), reps, sync)

    def causal(a, b, c):
        a, b, c = case.prep(a, b, c)
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=case.scale)

    try:
        if dev == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                with torch.no_grad():
                    t["causal fwd"] = median_ms(lambda: causal(q, k, v), reps, sync)
                t["causal f+b"] = median_ms(fb(causal), reps, sync)
        else:
            with torch.no_grad():
                t["causal fwd"] = median_ms(lambda: causal(q, k, v), reps, sync)
            t["causal f+b"] = median_ms(fb(causal), reps, sync)
    except Exception as e:  # noqa: BLE001
        say(f"  {'':<36} {'':<7} causal timing failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if args.flex != "off":
        try:
            with torch.no_grad():
                t["flex fwd"] = median_ms(lambda: flex_any(case, args, flex_state, q, k, v), reps, sync)
            if dev == "cuda":
                t["flex f+b"] = median_ms(fb(lambda a, b, c: flex_any(case, args, flex_state, a, b, c)), reps, sync)
            t["flex mode"] = flex_state.get("timed_mode")
        except Exception as e:  # noqa: BLE001
            say(f"  {'':<36} {'':<7} flex timing failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return t


def event_ms(fn, warm, reps, dev):
    """Milliseconds per call: `warm` untimed calls, then `reps` calls between
    one pair of CUDA events (the mean) — how gpu-check times ours; on CPU
    the wall clock."""
    import torch

    for _ in range(warm):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def timing_section(args, flex_state, dev):
    """The timing packs of `DIR/timing/` (gpu-check's own timing rows):
    torch on the same pack and shape, timed as ours were, side by side.
    Returns the rows (for --json-out)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    path = os.path.join(args.dump, "timing", "timing.json")
    if not os.path.exists(path):
        say("\nno timing packs in the dump (gpu-check ran with --check-only or stopped before its timings)")
        return []
    with open(path) as f:
        tm = json.load(f)
    recs = tm.get("records", [])
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    say(f"\ntiming packs (gpu-check's own rows; ours: {tm.get('timing')}, {tm.get('method')}); torch on {dev} in "
        f"{str(dt)[6:]}, timed the same way ({args.timing_reps} calls between one pair of events after 2 warm-up)")
    say("  per pair: ours' visible-pair throughput / SDPA causal's (L(L+1)/2 pairs) at the same L and heads; "
        "targets on a GPU: per pair >= 0.90, flex/ours >= 1.2")
    hdr = (f"{'row':<34} {'kind':>4} {'d':>4} {'L':>6} {'pairs M':>8} {'ours ms':>9} {'flex ms':>9} "
           f"{'sdpa-c ms':>9} {'flex/ours':>9} {'per pair':>8}")
    say(hdr)
    budget_end = time.monotonic() + args.timing_budget
    packs, rows = {}, []
    for r in recs:
        row = dict(r)
        rows.append(row)
        kind = "f+b" if r["kind"] == "forward+backward" else "fwd"
        label = f"{r['name'][:34]:<34} {kind:>4} {r['head_dim']:>4} {r['tokens']:>6} {r['pairs'] / 1e6:>8.1f} " \
                f"{r['ours_ms']:>9.3f}"
        if time.monotonic() > budget_end:
            say(f"{label} skipped (--timing-budget {args.timing_budget} s spent)")
            continue
        try:
            if r["file"] not in packs:
                t = load_safetensors(os.path.join(args.dump, "timing", r["file"]))
                packs[r["file"]] = (t["kv_end"].to(dev), t["position_ids"].to(dev), {})
            kv_end, pos, masks = packs[r["file"]]
            L, hq, hk, d = r["tokens"], r["q_heads"], r["kv_heads"], r["head_dim"]
            scale = 1.0 / math.sqrt(d)
            g = torch.Generator(device=dev).manual_seed(len(rows))
            mk = lambda h: torch.randn(1, h, L, d, device=dev, generator=g).to(dt)
            q, k, v, d_o = mk(hq), mk(hk), mk(hk), mk(hq)
            rope = r.get("rope")
            fwd = r["kind"] == "forward"

            if L not in masks:
                def mask_mod(b, h, qi, ki):
                    return (ki <= qi) & (qi < kv_end[ki])
                masks[L] = create_block_mask(mask_mod, None, None, L, L, device=dev)
            bm = masks[L]

            def flex(a, b, c):
                if rope:
                    a = rope_apply(a, pos, rope["base"], rope["dims"], dt)
                    b = rope_apply(b, pos, rope["base"], rope["dims"], dt)
                fn, mode = flex_fn(args, flex_state, False)
                flex_state["timed_mode"] = mode
                return fn(a, b, c, block_mask=bm, scale=scale, enable_gqa=hq != hk)

            def causal(a, b, c):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=hq != hk)

            def run(attn):
                if fwd:
                    def go():
                        with torch.no_grad():
                            attn(q, k, v)
                    return go

                def go():
                    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                    attn(qq, kk, vv).backward(d_o)
                return go

            t = {}
            try:
                if dev == "cuda":
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        t["sdpa"] = event_ms(run(causal), 2, args.timing_reps, dev)
                else:
                    t["sdpa"] = event_ms(run(causal), 1, args.timing_reps, dev)
            except Exception as e:  # noqa: BLE001
                row["sdpa_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if args.flex != "off" and (fwd or dev == "cuda"):
                try:
                    t["flex"] = event_ms(run(flex), 2, args.timing_reps, dev)
                    row["flex_mode"] = flex_state.get("timed_mode")
                except Exception as e:  # noqa: BLE001
                    row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            row["torch_ms"] = t
            causal_pairs = L * (L + 1) / 2
            per_pair = (r["pairs"] / r["ours_ms"]) / (causal_pairs / t["sdpa"]) if "sdpa" in t else None
            f = lambda x, w=9, p=3: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"
            say(f"{label} {f(t.get('flex'))} {f(t.get('sdpa'))} "
                f"{f(t['flex'] / r['ours_ms'] if 'flex' in t else None, 9, 2)} {f(per_pair, 8, 2)}"
                + (f"  flex: {row['flex_error']}" if "flex_error" in row else "")
                + (f"  sdpa: {row['sdpa_error']}" if "sdpa_error" in row else ""))
            del q, k, v, d_o
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            say(f"{label} FAILED: {row['error']}")
            if args.verbose:
                traceback.print_exc()
    if flex_state.get("timed_mode"):
        say(f"flex timed: {flex_state['timed_mode']}")
    if dev != "cuda":
        say("(on CPU: torch in float32 and ours on the emulator; these times mean nothing for a GPU)")
    return rows


def flex_any(case, args, flex_state, q, k, v):
    out, _, mode = flex_call(case, args, flex_state, q, k, v, want_lse=False)
    flex_state["timed_mode"] = mode
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="the directory `treeattn gpu-check --dump DIR` wrote")
    ap.add_argument("--device", default=None, help="cpu or cuda [default: cuda when available]")
    ap.add_argument("--flex", choices=["auto", "compile", "eager", "off"], default="auto",
                    help="FlexAttention: auto = compiled, eager if the compile fails [default: auto]")
    ap.add_argument("--require-flex", action="store_true", help="a FlexAttention failure fails the run")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per method, median shown [default: 5]")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    ap.add_argument("--cases", help="only these cases: comma-separated indices into the manifest's list")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of caught errors")
    ap.add_argument("--no-case-timing", action="store_true",
                    help="do not time torch on each correctness case's small pack (the timing packs still run)")
    ap.add_argument("--flex-check", choices=["auto", "eager"], default="auto",
                    help="FlexAttention for the correctness comparisons: eager saves a compile per case shape")
    ap.add_argument("--timing-reps", type=int, default=20,
                    help="calls between one pair of events per timing-pack row [default: 20]")
    ap.add_argument("--timing-budget", type=float, default=1e9,
                    help="seconds for the timing packs; rows past it are listed as skipped [default: no limit]")
    a = ap.parse_args()

    import warnings

    import torch

    # Eager FlexAttention warns on every call that it is not compiled: --flex
    # says which one runs, and the table says which one ran.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        # The float32 reference must be float32: no TF32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # One compiled flex per case shape (dynamic=False): raise dynamo's
    # recompile limit (8 by default), past which it would quietly run eager.
    try:
        import torch._dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
    except Exception:  # noqa: BLE001 - an older torch: keep its default
        pass
    ref_dtype = torch.float64 if dev == "cpu" else torch.float32
    try:
        with open(os.path.join(a.dump, "manifest.json")) as f:
            manifest = json.load(f)
    except Exception as e:  # noqa: BLE001
        say(f"gpu-anchor: cannot read {a.dump}/manifest.json: {type(e).__name__}: {e}")
        return 1
    timing_note = manifest.get("timing", "?")
    dev_name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    say(f"# gpu-anchor: torch {torch.__version__} on {dev} ({dev_name}), reference {str(ref_dtype)[6:]}; "
        f"dump of gpu-check --backend {manifest.get('backend')} on {manifest.get('device')} "
        f"(seed {manifest.get('seed')}); our timings: {timing_note}")
    if manifest.get("failed"):
        say(f"# gpu-check itself reported failures: {', '.join(manifest['failed'])}")
    if dev == "cpu":
        say("# on CPU: the torch timings mean little (float32 on CPU, not the kernels' dtype); "
            "FlexAttention has no CPU backward")
    say("\nours vs the reference (SDPA dense mask + autograd), and FlexAttention vs ours")
    fails, rows = [], []
    flex_state = {}
    cases = manifest.get("cases", [])
    if a.cases:
        try:
            cases = [cases[int(i)] for i in a.cases.split(",")]
        except (ValueError, IndexError) as e:
            say(f"gpu-anchor: --cases {a.cases}: {e} ({len(cases)} cases in the dump)")
            return 2
    for meta in cases:
        row = {"name": meta.get("name", "?"), "L": meta.get("tokens"), "dtype": meta.get("dtype"),
               "kind": meta.get("kind"), "ours_ms": meta.get("ours_ms") or {}}
        rows.append(row)
        try:
            tensors = load_safetensors(os.path.join(a.dump, meta["file"]))
            case = Case(meta, tensors, dev, ref_dtype)
        except Exception as e:  # noqa: BLE001
            fails.append(f"{row['name']}: could not load ({type(e).__name__})")
            row["ok"] = False
            say(f"  {row['name']:<36} LOAD FAILED: {type(e).__name__}: {e}")
            continue
        fails += run_case(case, a, flex_state, row)

    # The side-by-side table.
    ours_clock = "ours (emulator wall clock: meaningless)" if manifest.get("backend") == "emu" else "ours (one launch)"
    say(f"\nside by side: errors of ours vs the reference; ms: {ours_clock} | torch on {dev}, median of {a.reps}")
    cols = ["ours fwd", "ours bwd", "dense fwd", "dense f+b", "causal fwd", "causal f+b", "flex fwd", "flex f+b"]
    say(f"{'case':<36} {'L':>5} {'dtype':>5} {'O err':>8} {'LSE err':>8} {'dQKV err':>8} {'flex O':>8} {'ok':>4} "
        + " ".join(f"{c:>10}" for c in cols))
    fmt_e = lambda x: "-" if x is None else ("inf" if x == math.inf else f"{x:.1e}")
    fmt_t = lambda x: "-" if x is None else f"{x:.3f}"
    for r in rows:
        ours = r.get("ours", {})
        grads = [ours[n] for n in ("dQ", "dK", "dV") if n in ours]
        ms = r.get("times", {})
        times = [r["ours_ms"].get("fwd"), r["ours_ms"].get("bwd")] + [ms.get(c) for c in cols[2:]]
        ok = r.get("ok") and r.get("flex_ok", True)
        say(f"{r['name'][:36]:<36} {r['L'] or 0:>5} {r['dtype'] or '?':>5} {fmt_e(ours.get('O')):>8} "
            f"{fmt_e(ours.get('LSE')):>8} {fmt_e(max(grads) if grads else None):>8} "
            f"{fmt_e(r.get('flex_err', {}).get('O')):>8} {('ok' if ok else 'FAIL'):>4} "
            + " ".join(f"{fmt_t(x):>10}" for x in times))
    timed = sorted({r.get("times", {}).get("flex mode") for r in rows} - {None})
    checked = sorted({r.get("flex_mode") for r in rows} - {None})
    if timed or checked:
        say(f"flex: checked {'/'.join(checked) or '-'}, timed {'/'.join(timed) or '-'}"
            + (" (torch compiles flex on CPU without the LSE only)" if dev == "cpu" and "eager" in checked
               and "compiled" in timed else ""))
    try:
        timing_rows = timing_section(a, flex_state, dev)
    except Exception as e:  # noqa: BLE001 - a fault is a result to report
        timing_rows = []
        say(f"timing packs FAILED: {type(e).__name__}: {e}")
        if a.verbose:
            traceback.print_exc()
    if a.json_out:
        try:
            with open(a.json_out, "w") as f:
                json.dump({"device": dev, "torch": torch.__version__, "manifest": {k: v for k, v in manifest.items()
                                                                                    if k != "cases"},
                           "rows": rows, "timing_rows": timing_rows, "failures": fails}, f, indent=1,
                          default=str)
        except Exception as e:  # noqa: BLE001
            say(f"could not write {a.json_out}: {e}")
    if not cases:
        say("gpu-anchor: the dump has no cases")
        return 1
    if fails:
        say(f"\ngpu-anchor: {len(fails)} problem(s): " + "; ".join(fails))
        return 1
    say(f"\ngpu-anchor: all {len(rows)} cases agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
