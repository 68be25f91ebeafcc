//! CPU tree attention against a dense f64 reference written here, finite
//! differences, fully masked rows, a negative control, tile coverage and
//! error handling.

use crate::common::calls;

use ndarray::Array3;
use proptest::prelude::*;
use treeattn::backend::cpu::{
    block_counts, gather_counts, tile_counts, Cpu, CpuElement, CpuFloat, TILE,
};
use treeattn::backend::{
    AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, HostAttention, Rope, Saved,
};
use treeattn::mask::PackMask;
use treeattn::ops;
use treeattn::Error;

// ---------------------------------------------------------------- inputs

/// SplitMix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi).
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo) as u64) as usize
    }
    fn values(&mut self, n: usize, amplitude: f64) -> Vec<f64> {
        (0..n)
            .map(|_| amplitude * (2.0 * self.unit() - 1.0))
            .collect()
    }
}

/// A pack's interval mask and position ids.
#[derive(Clone, Debug)]
struct Mask {
    kv_end: Vec<u32>,
    pos: Vec<u32>,
}

impl Mask {
    fn view(&self) -> PackMask<'_> {
        PackMask::new(&self.kv_end, &self.pos).expect("generated masks are valid")
    }
    fn causal(l: usize) -> Mask {
        Mask {
            kv_end: vec![l as u32; l],
            pos: (0..l as u32).collect(),
        }
    }
    /// Independent sequences (varlen): each key sees the rest of its sequence.
    fn varlen(rng: &mut Rng, l: usize) -> Mask {
        let (mut kv_end, mut pos) = (Vec::with_capacity(l), Vec::with_capacity(l));
        while kv_end.len() < l {
            let start = kv_end.len();
            let end = (start + rng.range(1, 90)).min(l);
            kv_end.extend(std::iter::repeat_n(end as u32, end - start));
            pos.extend(0..(end - start) as u32);
        }
        Mask { kv_end, pos }
    }
    /// A random tree (a forest if `forest`) laid out in pre-order: each new
    /// token is a child of a node on the current root path, after closing a
    /// random number of subtrees; `kv_end` = end of the token's subtree,
    /// position = depth.
    fn tree(rng: &mut Rng, l: usize, close_prob: f64, forest: bool) -> Mask {
        let mut kv_end = vec![l as u32; l];
        let mut pos = vec![0u32; l];
        let mut stack: Vec<usize> = Vec::new();
        for (i, depth) in pos.iter_mut().enumerate() {
            let keep = if forest || stack.is_empty() { 0 } else { 1 };
            while stack.len() > keep && rng.unit() < close_prob {
                let node = stack.pop().unwrap();
                kv_end[node] = i as u32;
            }
            *depth = stack.len() as u32;
            stack.push(i);
        }
        Mask { kv_end, pos }
    }
    /// `tree` over the first `l − pad` tokens, some of its leaves turned into
    /// padding keys (`kv_end[k] == k`), and a tail of `pad` padding tokens
    /// whose rows see no key at all.
    fn tree_with_padding(rng: &mut Rng, l: usize, pad: usize) -> Mask {
        let mut m = Mask::tree(rng, l - pad, 0.2, true);
        for k in 0..m.kv_end.len() {
            if m.kv_end[k] as usize == k + 1 && rng.unit() < 0.3 {
                m.kv_end[k] = k as u32;
            }
        }
        m.kv_end.extend(((l - pad) as u32)..(l as u32));
        m.pos.extend(std::iter::repeat_n(0, pad));
        m
    }
    /// Query rows with no visible key.
    fn empty_rows(&self) -> Vec<usize> {
        (0..self.kv_end.len())
            .filter(|&q| (0..=q).all(|k| q >= self.kv_end[k] as usize))
            .collect()
    }
}

#[derive(Clone, Copy, Debug)]
enum MaskKind {
    Causal,
    Varlen,
    Tree,
    Forest,
    Padded,
}

fn make_mask(rng: &mut Rng, kind: MaskKind, l: usize) -> Mask {
    match kind {
        MaskKind::Causal => Mask::causal(l),
        MaskKind::Varlen => Mask::varlen(rng, l),
        MaskKind::Tree => {
            let p = 0.01 + 0.3 * rng.unit();
            Mask::tree(rng, l, p, false)
        }
        MaskKind::Forest => Mask::tree(rng, l, 0.1, true),
        MaskKind::Padded => {
            let pad = rng.range(1, l.min(70) + 1);
            Mask::tree_with_padding(rng, l, pad)
        }
    }
}

// ------------------------------------------------------ dense reference

/// Rotates every `[heads, d]` row of token t by its position (Llama rotate
/// half); `inverse` rotates by the negative angle (the transpose).
fn rope_ref(
    x: &[f64],
    heads: usize,
    d: usize,
    pos: &[u32],
    rope: Option<Rope>,
    inverse: bool,
) -> Vec<f64> {
    let Some(r) = rope else { return x.to_vec() };
    let half = r.dims / 2;
    let mut y = x.to_vec();
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let row = (t * heads + h) * d;
            for i in 0..half {
                let theta = p as f64 * r.base.powf(-2.0 * i as f64 / r.dims as f64);
                let (s, c) = if inverse {
                    (-theta.sin(), theta.cos())
                } else {
                    (theta.sin(), theta.cos())
                };
                let (a, b) = (x[row + i], x[row + i + half]);
                y[row + i] = a * c - b * s;
                y[row + i + half] = b * c + a * s;
            }
        }
    }
    y
}

struct Dense {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// `[q_heads]`, zeros without sinks.
    dsinks: Vec<f64>,
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Straight O(L²) attention forward and backward, one query row at a time,
/// applying the mask rule `k <= q < kv_end[k]` literally — and the
/// variants as their definitions say: a window keeps the keys with
/// `depth(q) − depth(k) < W`, depth = the number of keys whose range holds
/// the row (`#{j < t : kv_end[j] > t}`, counted here pair by pair); a
/// softcap makes the scaled score `c · tanh(s / c)`; sinks add `exp(σ_h)`
/// to each row's sum (no value); V and O have `v_head_dim` columns.
#[allow(clippy::too_many_arguments)]
fn dense(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    sinks: Option<&[f64]>,
    key_starts: Option<&[u32]>,
    shape: AttnShape,
    m: &Mask,
    params: &AttnParams,
) -> Dense {
    let AttnShape {
        tokens: l,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        v_head_dim: dv_,
    } = shape;
    let group = hq / hkv;
    let qr = rope_ref(q, hq, d, &m.pos, params.rope, false);
    let kr = rope_ref(k, hkv, d, &m.pos, params.rope, false);
    let depth: Vec<usize> = (0..l)
        .map(|t| (0..t).filter(|&j| m.kv_end[j] as usize > t).count())
        .collect();
    let (mut o, mut lse) = (vec![0.0; l * hq * dv_], vec![f64::NEG_INFINITY; hq * l]);
    let (mut dqr, mut dkr, mut dv) = (
        vec![0.0; l * hq * d],
        vec![0.0; l * hkv * d],
        vec![0.0; l * hkv * dv_],
    );
    let mut dsinks = vec![0.0; hq];
    let qrow = |t: usize, h: usize| (t * hq + h) * d..(t * hq + h + 1) * d;
    let krow = |t: usize, g: usize| (t * hkv + g) * d..(t * hkv + g + 1) * d;
    let orow = |t: usize, h: usize| (t * hq + h) * dv_..(t * hq + h + 1) * dv_;
    let vrow = |t: usize, g: usize| (t * hkv + g) * dv_..(t * hkv + g + 1) * dv_;
    for h in 0..hq {
        let g = h / group;
        let sink = sinks.map(|s| s[h]);
        for i in 0..l {
            let keys: Vec<usize> = (0..=i)
                .filter(|&j| i < m.kv_end[j] as usize)
                .filter(|&j| {
                    params
                        .window
                        .is_none_or(|w| depth[i] - depth[j] < w as usize)
                })
                .filter(|&j| key_starts.is_none_or(|st| st[i] as usize <= j))
                .collect();
            if keys.is_empty() {
                // O = 0; with a sink the LSE is the sink's (D = 0: no gradient).
                if let Some(sg) = sink {
                    lse[h * l + i] = sg;
                }
                continue;
            }
            let s: Vec<f64> = keys
                .iter()
                .map(|&j| params.softmax_scale * dot(&qr[qrow(i, h)], &kr[krow(j, g)]))
                .map(|s| params.softcap.map_or(s, |c| c * (s / c).tanh()))
                .collect();
            let mx = s
                .iter()
                .cloned()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().cloned().chain(sink).map(|x| (x - mx).exp()).sum();
            let row_lse = mx + z.ln();
            lse[h * l + i] = row_lse;
            let p: Vec<f64> = s.iter().map(|x| (x - row_lse).exp()).collect();
            for (&j, &pj) in keys.iter().zip(&p) {
                for c in 0..dv_ {
                    o[orow(i, h).start + c] += pj * v[vrow(j, g).start + c];
                }
            }
            let dd = dot(&d_o[orow(i, h)], &o[orow(i, h)]);
            if let Some(sg) = sink {
                dsinks[h] -= (sg - row_lse).exp() * dd;
            }
            for ((&j, &pj), &sj) in keys.iter().zip(&p).zip(&s) {
                let dp = dot(&d_o[orow(i, h)], &v[vrow(j, g)]);
                let mut ds = pj * (dp - dd);
                if let Some(c) = params.softcap {
                    ds *= 1.0 - (sj / c) * (sj / c);
                }
                for c in 0..d {
                    dqr[qrow(i, h).start + c] +=
                        params.softmax_scale * ds * kr[krow(j, g).start + c];
                    dkr[krow(j, g).start + c] +=
                        params.softmax_scale * ds * qr[qrow(i, h).start + c];
                }
                for c in 0..dv_ {
                    dv[vrow(j, g).start + c] += pj * d_o[orow(i, h).start + c];
                }
            }
        }
    }
    Dense {
        o,
        lse,
        dq: rope_ref(&dqr, hq, d, &m.pos, params.rope, true),
        dk: rope_ref(&dkr, hkv, d, &m.pos, params.rope, true),
        dv,
        dsinks,
    }
}

/// ‖a − b‖ / max(‖b‖, 1e-2 · √n) (Frobenius; 0 for empty slices). The
/// floor is an RMS of 1e-2, below the size of real outputs (inputs are O(1);
/// O of a row averaging 200 random values is ~0.04), so it only matters when
/// the reference itself is ~0 — e.g. a row that sees exactly one key has
/// P = 1 and dS = P (dP − D) = 0 up to rounding, where a plain relative
/// error would compare rounding noise with rounding noise (in f32, ~3e-8
/// absolute on such a row's dQ).
fn rel_err<T: CpuFloat>(a: &[T], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    if b.is_empty() {
        return 0.0;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x.to_f64() - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-4 * b.len() as f64)).sqrt()
}

fn to_t<T: CpuFloat>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}
fn to_f64<T: CpuFloat>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

struct Case {
    shape: AttnShape,
    params: AttnParams,
    mask: Mask,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
}

fn make_case(
    seed: u64,
    kind: MaskKind,
    l: usize,
    kv_heads: usize,
    group: usize,
    d: usize,
    rope: bool,
) -> Case {
    let mut rng = Rng(seed);
    let mask = make_mask(&mut rng, kind, l);
    let shape = AttnShape {
        tokens: l,
        q_heads: kv_heads * group,
        kv_heads,
        head_dim: d,
        v_head_dim: d,
    };
    let mut params = AttnParams::new(d);
    if rope {
        let dims = 2 * rng.range(1, d / 2 + 1);
        params.rope = Some(Rope {
            base: 10_000.0,
            dims,
        });
    }
    // Amplitude 2 makes the softmax far from uniform (scale · q·k has a
    // spread of ~1.5), so a masking mistake changes O visibly.
    let q = rng.values(shape.q_len(), 2.0);
    let k = rng.values(shape.kv_len(), 2.0);
    let v = rng.values(shape.kv_len(), 1.0);
    let d_o = rng.values(shape.q_len(), 1.0);
    Case {
        shape,
        params,
        mask,
        q,
        k,
        v,
        d_o,
    }
}

/// Runs the CPU backend in `T` on the case (inputs rounded to `T` first; the
/// reference sees the rounded values) and returns the worst relative
/// Frobenius errors of (O, LSE, dQ, dK, dV).
fn check_case<T: CpuFloat>(c: &Case) -> [f64; 5] {
    let (q, k, v, d_o) = (
        to_t::<T>(&c.q),
        to_t::<T>(&c.k),
        to_t::<T>(&c.v),
        to_t::<T>(&c.d_o),
    );
    let reference = dense(
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &to_f64(&d_o),
        None,
        None,
        c.shape,
        &c.mask,
        &c.params,
    );
    let m = c.mask.view();
    let fwd = calls::cpu_forward(&q, &k, &v, c.shape, m, &c.params).unwrap();
    let g = calls::cpu_backward(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, c.shape, m, &c.params).unwrap();
    for x in fwd.o.iter().chain(&g.dq).chain(&g.dk).chain(&g.dv) {
        assert!(x.is_finite(), "non-finite output");
    }
    // LSE: −inf exactly where the reference has no visible key.
    let mut lse_ref = Vec::new();
    let mut lse_got = Vec::new();
    for (a, &b) in fwd.lse.iter().zip(&reference.lse) {
        if b == f64::NEG_INFINITY {
            assert_eq!(
                a.to_f64(),
                f64::NEG_INFINITY,
                "LSE of a row with no visible key"
            );
        } else {
            lse_ref.push(b);
            lse_got.push(*a);
        }
    }
    [
        rel_err(&fwd.o, &reference.o),
        rel_err(&lse_got, &lse_ref),
        rel_err(&g.dq, &reference.dq),
        rel_err(&g.dk, &reference.dk),
        rel_err(&g.dv, &reference.dv),
    ]
}

fn kind_strategy() -> impl Strategy<Value = MaskKind> {
    prop_oneof![
        Just(MaskKind::Causal),
        Just(MaskKind::Varlen),
        Just(MaskKind::Tree),
        Just(MaskKind::Forest),
        Just(MaskKind::Padded),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// f64: same math, different summation order (tiles, online softmax), so
    /// the errors are a few ulps times √(terms) (measured worst over 60
    /// cases: 1.4e-15). 1e-12 leaves ample headroom; any masking or indexing
    /// mistake gives O(1).
    #[test]
    fn f64_matches_dense_reference(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..200,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=128, rope in any::<bool>(),
    ) {
        let c = make_case(seed, kind, l, kv_heads, group, d, rope && d >= 2);
        let err = check_case::<f64>(&c);
        for (name, e) in ["o", "lse", "dq", "dk", "dv"].iter().zip(err) {
            prop_assert!(e < 1e-12, "{} relative error {:e} (l={}, {:?}, d={})", name, e, l, kind, d);
        }
    }

    /// f32 with f32 accumulation: each dot product of up to 128 terms and
    /// each softmax sum of up to 200 terms carries ~6e-8 · √n relative error
    /// (measured worst over 60 cases: 4e-7 for O, 1.1e-6 for dQ/dK, where
    /// dS = P ∘ (dP − D) subtracts nearly equal numbers). 1e-5 and 2e-5 keep
    /// ~10× headroom; a masking or indexing mistake gives O(1).
    #[test]
    fn f32_matches_dense_reference(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..200,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=128, rope in any::<bool>(),
    ) {
        let c = make_case(seed, kind, l, kv_heads, group, d, rope && d >= 2);
        let err = check_case::<f32>(&c);
        let tol = [1e-5, 1e-5, 2e-5, 2e-5, 1e-5];
        for ((name, e), t) in ["o", "lse", "dq", "dk", "dv"].iter().zip(err).zip(tol) {
            prop_assert!(e < t, "{} relative error {:e} (l={}, {:?}, d={})", name, e, l, kind, d);
        }
    }
}

// ------------------------------------------------------ variants

/// What a case adds to plain attention: a sliding window, a softcap,
/// attention sinks, a value head dim unlike the query/key one.
#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    window: Option<u32>,
    softcap: Option<f64>,
    sinks: bool,
    v_head_dim: Option<usize>,
}

/// A case of `make_case`'s kind with `var` applied; sinks are drawn with a
/// spread (±3) that puts them above and below the rows' scores.
struct VarCase {
    c: Case,
    sinks: Option<Vec<f64>>,
    /// Explicit first visible keys (`AttnArgs::with_key_starts`).
    key_starts: Option<Vec<u32>>,
}

#[allow(clippy::too_many_arguments)]
fn make_variant_case(
    seed: u64,
    kind: MaskKind,
    l: usize,
    kv_heads: usize,
    group: usize,
    d: usize,
    rope: bool,
    var: Variant,
) -> VarCase {
    let mut c = make_case(seed, kind, l, kv_heads, group, d, rope);
    let mut rng = Rng(seed ^ 0x5eed);
    let dv = var.v_head_dim.unwrap_or(d);
    c.shape.v_head_dim = dv;
    c.v = rng.values(c.shape.v_len(), 1.0);
    c.d_o = rng.values(c.shape.o_len(), 1.0);
    c.params.window = var.window;
    c.params.softcap = var.softcap;
    let sinks = var.sinks.then(|| rng.values(c.shape.q_heads, 3.0));
    VarCase {
        c,
        sinks,
        key_starts: None,
    }
}

/// The CPU backend in `T` on a variant case against the dense reference
/// (on the inputs rounded to `T`): relative errors of (O, LSE, dQ, dK, dV,
/// dsinks), outputs poisoned first.
fn check_variant<T: CpuFloat>(vc: &VarCase) -> [f64; 6] {
    let c = &vc.c;
    let (q, k, v, d_o) = (
        to_t::<T>(&c.q),
        to_t::<T>(&c.k),
        to_t::<T>(&c.v),
        to_t::<T>(&c.d_o),
    );
    let sinks = vc.sinks.as_deref().map(to_t::<T>);
    let reference = dense(
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &to_f64(&d_o),
        sinks.as_deref().map(to_f64).as_deref(),
        vc.key_starts.as_deref(),
        c.shape,
        &c.mask,
        &c.params,
    );
    let mut args = AttnArgs::new(&q[..], &k[..], &v[..], c.shape, c.mask.view(), c.params).unwrap();
    if let Some(s) = &sinks {
        args = args.with_sinks(&s[..]).unwrap();
    }
    if let Some(st) = &vc.key_starts {
        args = args.with_key_starts(st).unwrap();
    }
    let cpu = Cpu::default();
    let fwd = cpu.forward_owned(&args).unwrap();
    let g = cpu.backward_owned(&args, fwd.saved(), &d_o).unwrap();
    let mut lse_ref = Vec::new();
    let mut lse_got = Vec::new();
    for (a, &b) in fwd.lse.iter().zip(&reference.lse) {
        if b == f64::NEG_INFINITY {
            assert_eq!(
                a.to_f64(),
                f64::NEG_INFINITY,
                "LSE of a row with no visible key"
            );
        } else {
            lse_ref.push(b);
            lse_got.push(*a);
        }
    }
    let dsinks = match (&g.dsinks, sinks.is_some()) {
        (Some(ds), true) => rel_err(ds, &reference.dsinks),
        (None, false) => 0.0,
        other => panic!("dsinks {other:?}"),
    };
    [
        rel_err(&fwd.o, &reference.o),
        rel_err(&lse_got, &lse_ref),
        rel_err(&g.dq, &reference.dq),
        rel_err(&g.dk, &reference.dk),
        rel_err(&g.dv, &reference.dv),
        dsinks,
    ]
}

fn variant_strategy() -> impl Strategy<Value = Variant> {
    (
        prop_oneof![Just(None), (1u32..24).prop_map(Some)],
        prop_oneof![Just(None), (0.3f64..8.0).prop_map(Some)],
        any::<bool>(),
        prop_oneof![Just(None), (1usize..=80).prop_map(Some)],
    )
        .prop_map(|(window, softcap, sinks, v_head_dim)| Variant {
            window,
            softcap,
            sinks,
            v_head_dim,
        })
}

const VARIANT_OUTPUTS: [&str; 6] = ["o", "lse", "dq", "dk", "dv", "dsinks"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Windows (1 to 23 levels, on trees deeper than that), softcaps (0.3
    /// to 8: scaled scores spread over ~±3, so a cap of 1 bends most of
    /// them), sinks and value head dims, alone and together, with GQA,
    /// rotary and padding, in f64: the same bound as plain attention
    /// (summation order only); a window one level off, a softcap on the
    /// unscaled score or a sink with a value give O(1e-2) or more (the
    /// negative controls below).
    #[test]
    fn variants_f64_match_dense_reference(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..160,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=72, rope in any::<bool>(),
        var in variant_strategy(),
    ) {
        let vc = make_variant_case(seed, kind, l, kv_heads, group, d, rope && d >= 2, var);
        let err = check_variant::<f64>(&vc);
        for (name, e) in VARIANT_OUTPUTS.iter().zip(err) {
            prop_assert!(e < 1e-12, "{} relative error {:e} (l={}, {:?}, d={}, {:?})", name, e, l, kind, d, var);
        }
    }

    /// The same in f32: plain attention's bounds, with the softcap's tanh
    /// (an absolute error within 1.5e-7 before the cap's factor, from the
    /// backend's f32 exp) inside them.
    #[test]
    fn variants_f32_match_dense_reference(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..160,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=72, rope in any::<bool>(),
        var in variant_strategy(),
    ) {
        let vc = make_variant_case(seed, kind, l, kv_heads, group, d, rope && d >= 2, var);
        let err = check_variant::<f32>(&vc);
        let tol = [1e-5, 1e-5, 2e-5, 2e-5, 1e-5, 2e-5];
        for ((name, e), t) in VARIANT_OUTPUTS.iter().zip(err).zip(tol) {
            prop_assert!(e < t, "{} relative error {:e} (l={}, {:?}, d={}, {:?})", name, e, l, kind, d, var);
        }
    }
}

/// A deep tree (depths past 40) with every variant on: the backend against
/// the dense reference, and the reference under each wrong reading of a
/// variant — a window one level wider or narrower, the softcap applied
/// before the scale (`scale · c · tanh(q·k / c)`), a sink that carries a
/// value (a row of ones) — which must be far outside the tolerance, or the
/// tests above could not tell them apart.
#[test]
fn variant_negative_controls_differ() {
    let var = Variant {
        window: Some(6),
        softcap: Some(1.5),
        sinks: true,
        v_head_dim: Some(20),
    };
    let vc = make_variant_case(11, MaskKind::Tree, 150, 2, 2, 24, true, var);
    let c = &vc.c;
    let err = check_variant::<f64>(&vc);
    assert!(err.iter().all(|&e| e < 1e-12), "{err:?}");
    let depth = (0..150)
        .map(|t| (0..t).filter(|&j| c.mask.kv_end[j] as usize > t).count())
        .max()
        .unwrap();
    assert!(depth > 40, "the tree is {depth} levels deep");
    let sinks = vc.sinks.as_deref();
    let reference = |params: &AttnParams| {
        dense(
            &c.q, &c.k, &c.v, &c.d_o, sinks, None, c.shape, &c.mask, params,
        )
    };
    let truth = reference(&c.params);
    let far = |what: &str, wrong: &Dense| {
        let e = [
            rel_err(&truth.o, &wrong.o),
            rel_err(&truth.dq, &wrong.dq),
            rel_err(&truth.dk, &wrong.dk),
        ];
        assert!(e.iter().all(|&e| e > 1e-3), "{what}: {e:?}");
    };
    for w in [5, 7] {
        let mut p = c.params;
        p.window = Some(w);
        far(&format!("window {w}"), &reference(&p));
    }
    let mut p = c.params;
    p.softcap = Some(1.5 * p.softmax_scale);
    far("softcap before the scale", &reference(&p));
    // A sink with a value of ones adds exp(σ − LSE) to every O lane.
    let mut with_value = reference(&c.params);
    let (l, hq, dv) = (c.shape.tokens, c.shape.q_heads, c.shape.v_head_dim);
    for t in 0..l {
        for h in 0..hq {
            let p_sink = (sinks.unwrap()[h] - truth.lse[h * l + t]).exp();
            for x in &mut with_value.o[(t * hq + h) * dv..][..dv] {
                *x += p_sink;
            }
        }
    }
    assert!(rel_err(&truth.o, &with_value.o) > 1e-2);
}

/// Every variant at once gives the same bits on any thread count, and takes
/// bf16 inputs (the f32 call on their widened values, rounded once; on the
/// AVX-512 BF16 path, products on bf16 pairs: within bf16's roundings).
/// The code paths against each other: `attention_isa`.
#[test]
fn variants_take_half_inputs_and_any_thread_count() {
    let var = Variant {
        window: Some(9),
        softcap: Some(2.0),
        sinks: true,
        v_head_dim: None,
    };
    let vc = make_variant_case(5, MaskKind::Padded, 230, 2, 3, 40, true, var);
    let c = &vc.c;
    let (q, k, v, d_o) = (
        to_t::<f32>(&c.q),
        to_t::<f32>(&c.k),
        to_t::<f32>(&c.v),
        to_t::<f32>(&c.d_o),
    );
    let sinks = to_t::<f32>(vc.sinks.as_deref().unwrap());
    let run = |threads: usize| {
        let args = AttnArgs::new(&q[..], &k[..], &v[..], c.shape, c.mask.view(), c.params)
            .unwrap()
            .with_sinks(&sinks[..])
            .unwrap();
        let cpu = Cpu::with_threads(threads);
        let f = cpu.forward_owned(&args).unwrap();
        let g = cpu.backward_owned(&args, f.saved(), &d_o).unwrap();
        (f, g)
    };
    let one = run(1);
    for threads in [2, 3] {
        assert!(run(threads) == one, "{threads} threads");
    }
    // bf16: the f32 call on the widened inputs, rounded once.
    let to_h = |x: &[f64]| {
        x.iter()
            .map(|&v| treeattn::half::bf16::from_f64(v))
            .collect::<Vec<_>>()
    };
    let (qh, kh, vh, sh) = (
        to_h(&c.q),
        to_h(&c.k),
        to_h(&c.v),
        to_h(vc.sinks.as_deref().unwrap()),
    );
    let args = AttnArgs::new(&qh[..], &kh[..], &vh[..], c.shape, c.mask.view(), c.params)
        .unwrap()
        .with_sinks(&sh[..])
        .unwrap();
    let fh = Cpu::default().forward_owned(&args).unwrap();
    let wide = |x: &[treeattn::half::bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let (qw, kw, vw, sw) = (wide(&qh), wide(&kh), wide(&vh), wide(&sh));
    let args32 = AttnArgs::new(&qw[..], &kw[..], &vw[..], c.shape, c.mask.view(), c.params)
        .unwrap()
        .with_sinks(&sw[..])
        .unwrap();
    let f32_fwd = Cpu::default().forward_owned(&args32).unwrap();
    let o_err = rel_err(
        &fh.o.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        &to_f64(&f32_fwd.o),
    );
    // One bf16 rounding of O (2^-9 relative) at most, unless the bf16 path
    // computes the products on pairs (AVX-512 BF16: then a few roundings).
    assert!(o_err < 1.5e-2, "bf16 o {o_err:e}");
    let lse_err = rel_err(&fh.lse, &to_f64(&f32_fwd.lse));
    assert!(lse_err < 5e-3, "bf16 lse {lse_err:e}");
}

/// Explicit key starts (any first key per row, not only a window's) against
/// the dense reference, with the other variants; and a window's own starts
/// given explicitly compute the window's result bit for bit.
#[test]
fn explicit_key_starts_bound_each_row() {
    for (seed, kind) in [
        (1u64, MaskKind::Tree),
        (2, MaskKind::Padded),
        (3, MaskKind::Forest),
        (4, MaskKind::Causal),
    ] {
        let var = Variant {
            softcap: Some(2.0),
            sinks: seed % 2 == 0,
            ..Variant::default()
        };
        let mut vc = make_variant_case(seed, kind, 140, 2, 2, 24, seed == 3, var);
        let mut rng = Rng(seed);
        vc.key_starts = Some((0..140).map(|q| rng.range(0, q + 2) as u32).collect());
        let err = check_variant::<f64>(&vc);
        assert!(err.iter().all(|&e| e < 1e-12), "{kind:?}: {err:?}");
        let err = check_variant::<f32>(&vc);
        assert!(err.iter().all(|&e| e < 2e-5), "{kind:?}: {err:?}");
    }
    let vc = make_variant_case(9, MaskKind::Tree, 200, 1, 2, 16, false, Variant::default());
    let c = &vc.c;
    let mut windowed = c.params;
    windowed.window = Some(5);
    let starts = c.mask.view().window_starts(5).unwrap();
    let run = |params: AttnParams, starts: Option<&[u32]>| {
        let mut args =
            AttnArgs::new(&c.q[..], &c.k[..], &c.v[..], c.shape, c.mask.view(), params).unwrap();
        if let Some(st) = starts {
            args = args.with_key_starts(st).unwrap();
        }
        let f = Cpu::default().forward_owned(&args).unwrap();
        let g = Cpu::default()
            .backward_owned(&args, f.saved(), &c.d_o)
            .unwrap();
        (f, g)
    };
    assert!(run(windowed, None) == run(c.params, Some(&starts)));
    let both = AttnArgs::<treeattn::backend::Host, f64>::new(
        &c.q[..],
        &c.k[..],
        &c.v[..],
        c.shape,
        c.mask.view(),
        windowed,
    )
    .unwrap()
    .with_key_starts(&starts);
    assert!(matches!(both, Err(Error::Unsupported(_))));
}

/// DESIGN §5's policy on every path, small packs included: what rows that
/// enter no visible pair hold (K, V of keys no query sees; Q, dO of query
/// rows that see no key — with a window of one level, a padding row's too)
/// changes no bit of any result, f32 and f64, with and without the
/// variants. `kv_end = [2, 2, 2, 3]` with V[3] = NaN used to fail with "non-finite
/// value in o at index 0": the padding key shares a register block with
/// seen keys, and `0 · NaN` poisoned their rows. Negative control: a NaN in
/// a seen key's V is an error.
#[test]
fn non_finite_values_in_rows_no_pair_uses_change_nothing() {
    fn run<T: CpuFloat>(kv_end: &[u32], window: Option<u32>, plant: bool) -> Vec<Vec<u64>> {
        let l = kv_end.len();
        let pos = vec![0u32; l];
        let mask = PackMask::new(kv_end, &pos).unwrap();
        let shape = AttnShape::new(l, 2, 1, 8);
        let mut params = AttnParams::new(8);
        params.window = window;
        let mut rng = Rng(l as u64);
        let mut data = |n| to_t::<T>(&rng.values(n, 1.0));
        let (mut q, mut k, mut v, mut d_o) = (
            data(shape.q_len()),
            data(shape.kv_len()),
            data(shape.kv_len()),
            data(shape.q_len()),
        );
        if plant {
            let starts = window.map(|w| mask.window_starts(w).unwrap());
            let blind = mask.blind_queries_in(starts.as_deref());
            let bad = T::from_f64(f64::NAN);
            for (t, &u) in mask.unseen_keys().iter().enumerate() {
                if u {
                    k[t * 8..][..8].fill(T::from_f64(f64::INFINITY));
                    v[t * 8..][..8].fill(bad);
                }
            }
            for (t, &b) in blind.iter().enumerate() {
                if b {
                    q[t * 16..][..16].fill(bad);
                    d_o[t * 16..][..16].fill(T::from_f64(f64::NEG_INFINITY));
                }
            }
        }
        let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params).unwrap();
        let f = Cpu::default().forward_owned(&args).unwrap();
        let g = Cpu::default()
            .backward_owned(&args, f.saved(), &d_o)
            .unwrap();
        [f.o, f.lse, g.dq, g.dk, g.dv]
            .iter()
            .map(|x| x.iter().map(|e| e.to_f64().to_bits()).collect())
            .collect()
    }
    let cases: [&[u32]; 4] = [
        &[2, 2, 2, 3],
        &[4, 1, 4, 4, 4],
        &[3, 3, 3, 3, 6, 5, 6, 7],
        &[9, 9, 9, 3, 9, 9, 9, 9, 9],
    ];
    for kv_end in cases {
        for window in [None, Some(1), Some(2)] {
            assert_eq!(
                run::<f32>(kv_end, window, false),
                run::<f32>(kv_end, window, true),
                "{kv_end:?} {window:?}"
            );
            assert_eq!(
                run::<f64>(kv_end, window, false),
                run::<f64>(kv_end, window, true),
                "{kv_end:?} {window:?}"
            );
        }
    }
    // Control: NaN in a seen key's V.
    let (kv_end, pos) = ([2u32, 2, 2, 3], [0u32; 4]);
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let shape = AttnShape::new(4, 1, 1, 4);
    let mut v = [0.5f32; 16];
    v[0] = f32::NAN;
    let x = [0.5f32; 16];
    let args = AttnArgs::new(&x[..], &x[..], &v[..], shape, mask, AttnParams::new(4)).unwrap();
    assert!(matches!(
        Cpu::default().forward_owned(&args),
        Err(Error::NonFinite { .. })
    ));
}

/// A window on a mask whose key ranges cross (a valid interval mask of no
/// tree) is refused when the call is built; without a window it runs.
#[test]
fn a_window_needs_a_tree() {
    // Key 0 sees rows 0..3, key 1 rows 1..4: the ranges cross.
    let (kv_end, pos) = ([3u32, 4, 4, 4], [0u32, 1, 2, 3]);
    let m = PackMask::new(&kv_end, &pos).unwrap();
    assert!(!m.is_tree());
    let shape = AttnShape::new(4, 1, 1, 4);
    let x = vec![0.5f64; shape.q_len()];
    let mut params = AttnParams::new(4);
    assert!(AttnArgs::<treeattn::backend::Host, f64>::new(
        &x[..],
        &x[..],
        &x[..],
        shape,
        m,
        params
    )
    .is_ok());
    params.window = Some(2);
    match AttnArgs::<treeattn::backend::Host, f64>::new(&x[..], &x[..], &x[..], shape, m, params) {
        Err(Error::Pack(msg)) => assert!(msg.contains("tree-shaped"), "{msg}"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("a window on crossing ranges was accepted"),
    }
    params.window = Some(0);
    assert!(matches!(
        AttnArgs::<treeattn::backend::Host, f64>::new(&x[..], &x[..], &x[..], shape, m, params),
        Err(Error::Unsupported(_))
    ));
    let mut p = AttnParams::new(4);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        p.softcap = Some(bad);
        assert!(
            matches!(
                AttnArgs::<treeattn::backend::Host, f64>::new(&x[..], &x[..], &x[..], shape, m, p),
                Err(Error::Unsupported(_))
            ),
            "softcap {bad}"
        );
    }
}

/// Sinks of the wrong length, dsinks without sinks: shape errors.
#[test]
fn sinks_are_checked() {
    let kv_end = [3u32, 3, 3];
    let pos = [0u32, 1, 2];
    let m = PackMask::new(&kv_end, &pos).unwrap();
    let shape = AttnShape::new(3, 2, 1, 4);
    let (q, kv) = (vec![0.5f64; shape.q_len()], vec![0.25f64; shape.kv_len()]);
    let args = AttnArgs::new(&q[..], &kv[..], &kv[..], shape, m, AttnParams::new(4)).unwrap();
    assert!(matches!(args.with_sinks(&[0.0][..]), Err(Error::Shape(_))));
    let f = Cpu::default().forward_owned(&args).unwrap();
    let (mut dq, mut dk, mut dv, mut ds) = (
        vec![0.0; q.len()],
        vec![0.0; kv.len()],
        vec![0.0; kv.len()],
        vec![0.0; 2],
    );
    let grads = Grads {
        dq: &mut dq[..],
        dk: &mut dk[..],
        dv: &mut dv[..],
        dsinks: Some(&mut ds[..]),
    };
    match Cpu::default().backward(&args, f.saved(), &q[..], grads) {
        Err(Error::Shape(msg)) => assert!(msg.contains("without attention sinks"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

// ------------------------------------------------------ 16-bit inputs

/// The CPU backend on `H` inputs (bf16 or f16), on `threads` threads, with
/// every output poisoned with NaN first: its LSE is bit for bit the f32 call's
/// on the widened inputs, its O that call's O rounded once to `H`; its
/// gradients (from its own `H` output and an `H` dO) those of the f32
/// backward on the widened O, LSE and dO, rounded once. Returns how many
/// output values the rounding changed (the comparison is not between equal
/// things by accident).
fn check_half<H: CpuElement<Compute = f32>>(c: &Case, threads: usize) -> usize {
    let to_h = |x: &[f64]| x.iter().map(|&v| H::from_f64(v)).collect::<Vec<H>>();
    let wide = |x: &[H]| x.iter().map(|v| v.widen()).collect::<Vec<f32>>();
    let narrow = |x: &[f32]| {
        let mut out = vec![H::default(); x.len()];
        assert!(
            H::narrow_slice(x, &mut out),
            "reference result overflows {}",
            H::NAME
        );
        out
    };
    let bits = |x: &[H]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<u64>>();
    let (q, k, v, d_o) = (to_h(&c.q), to_h(&c.k), to_h(&c.v), to_h(&c.d_o));
    let (qw, kw, vw, dow) = (wide(&q), wide(&k), wide(&v), wide(&d_o));
    let (s, m, cpu) = (c.shape, c.mask.view(), Cpu::with_threads(threads));
    let poison = H::from_f64(f64::NAN);

    let args = AttnArgs::new(&q[..], &k[..], &v[..], s, m, c.params).unwrap();
    let (mut o, mut lse) = (vec![poison; s.q_len()], vec![f32::NAN; s.lse_len()]);
    cpu.forward(&args, &mut o[..], &mut lse[..]).unwrap();
    let args32 = AttnArgs::new(&qw[..], &kw[..], &vw[..], s, m, c.params).unwrap();
    let f32_fwd = cpu.forward_owned(&args32).unwrap();
    let lse_bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert_eq!(lse_bits(&lse), lse_bits(&f32_fwd.lse), "lse");
    assert_eq!(bits(&o), bits(&narrow(&f32_fwd.o)), "o");

    let mut g: [Vec<H>; 3] = [s.q_len(), s.kv_len(), s.kv_len()].map(|n| vec![poison; n]);
    let [dq, dk, dv] = &mut g;
    let saved = Saved {
        o: &o[..],
        lse: &lse[..],
    };
    let grads = Grads {
        dq: &mut dq[..],
        dk: &mut dk[..],
        dv: &mut dv[..],
        dsinks: None,
    };
    cpu.backward(&args, saved, &d_o[..], grads).unwrap();
    let ow = wide(&o);
    let saved32 = Saved {
        o: &ow[..],
        lse: &lse[..],
    };
    let r = cpu.backward_owned(&args32, saved32, &dow).unwrap();
    for (name, got, want) in [
        ("dq", &g[0], &r.dq),
        ("dk", &g[1], &r.dk),
        ("dv", &g[2], &r.dv),
    ] {
        assert_eq!(bits(got), bits(&narrow(want)), "{name}");
    }
    let changed = |got: &[H], want: &[f32]| {
        got.iter()
            .zip(want)
            .filter(|(a, b)| a.to_f64() != **b as f64)
            .count()
    };
    changed(&o, &f32_fwd.o) + changed(&g[0], &r.dq) + changed(&g[1], &r.dk) + changed(&g[2], &r.dv)
}

/// bf16 and f16 inputs are widened exactly and computed in f32: the
/// results are the f32 call's, bit for bit, up to the one rounding of each
/// stored value (no tolerance: any difference in what is computed shows).
/// Random trees, forests, padding, GQA, partial rotary, 1 to 3 threads. In
/// a process of its own on the AVX-512 path at most: the AVX-512 BF16 path
/// computes bf16 scores on bf16 pairs instead (`attention_isa`).
#[test]
fn half_inputs_compute_what_f32_computes_on_them() {
    if !crate::common::own_process(
        "attention_cpu::half_inputs_compute_what_f32_computes_on_them",
        &[("TREEATTN_ISA", "avx512")],
    ) {
        return;
    }
    let changed = std::cell::Cell::new(0);
    proptest!(ProptestConfig::with_cases(24), |(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..200,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=80, rope in any::<bool>(),
        threads in 1usize..4,
    )| {
        let c = make_case(seed, kind, l, kv_heads, group, d, rope && d >= 2);
        let n = check_half::<half::bf16>(&c, threads) + check_half::<half::f16>(&c, threads);
        changed.set(changed.get() + n);
    });
    // Negative control: f32 results of random inputs are almost never
    // representable in 8 or 11 significand bits, so over all the cases the
    // rounding shows (a tiny case, d = 1 over few keys, may round nothing).
    assert!(changed.get() > 0);
}

/// Results that do not fit the 16-bit output type are errors naming them:
/// dV beyond f16's 65504 (a sum over 64 queries of dO = 30000), never a
/// silent infinity; the same call in bf16, whose range is f32's, succeeds.
#[test]
fn an_f16_gradient_beyond_its_range_is_an_error() {
    let l = 64;
    let mask = Mask::causal(l);
    let shape = AttnShape {
        tokens: l,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 8,
        v_head_dim: 8,
    };
    let params = AttnParams::new(8);
    let run = |x: f64, d_o: f64| {
        let (q, kv) = (
            vec![half::f16::from_f64(x); shape.q_len()],
            vec![half::f16::from_f64(x); shape.kv_len()],
        );
        let args = AttnArgs::new(&q[..], &kv[..], &kv[..], shape, mask.view(), params).unwrap();
        let cpu = Cpu::default();
        let f = cpu.forward_owned(&args).unwrap();
        let d_o = vec![half::f16::from_f64(d_o); shape.q_len()];
        cpu.backward_owned(&args, f.saved(), &d_o).map(|_| ())
    };
    let r = run(0.5, 30_000.0);
    assert!(
        matches!(&r, Err(Error::NonFinite { what, index: 0 }) if what.starts_with("dv") && what.contains("f16")),
        "{r:?}"
    );
    assert!(run(0.5, 1_000.0).is_ok());
}

// ------------------------------------------------------ caller buffers

/// Runs `attention_forward_into` and `attention_backward_into` in `T` on the
/// case, twice on the same buffers (poisoned with NaN before the first call;
/// the second call, on other inputs, gets the first call's values), and
/// checks both calls bit for bit against the allocating functions: every
/// element is written, nothing is read from the buffers, and nothing
/// carries over between calls through the pooled workspaces.
fn check_into<T: CpuFloat>(c: &Case) {
    let m = c.mask.view();
    let nan = T::from_f64(f64::NAN);
    let (mut o, mut lse) = (
        vec![nan; c.shape.q_len()],
        vec![nan; c.shape.q_heads * c.shape.tokens],
    );
    let (mut dq, mut dk, mut dv) = (
        vec![nan; c.shape.q_len()],
        vec![nan; c.shape.kv_len()],
        vec![nan; c.shape.kv_len()],
    );
    for flip in [1.0, -0.5] {
        let t = |x: &[f64]| x.iter().map(|&v| T::from_f64(flip * v)).collect::<Vec<T>>();
        let (q, k, v, d_o) = (t(&c.q), t(&c.k), t(&c.v), t(&c.d_o));
        let want = calls::cpu_forward(&q, &k, &v, c.shape, m, &c.params).unwrap();
        calls::cpu_forward_into(&q, &k, &v, c.shape, m, &c.params, &mut o, &mut lse).unwrap();
        let bits = |x: &[T]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<u64>>();
        assert_eq!(bits(&o), bits(&want.o), "o");
        assert_eq!(bits(&lse), bits(&want.lse), "lse");
        let g = calls::cpu_backward(&q, &k, &v, &o, &lse, &d_o, c.shape, m, &c.params).unwrap();
        calls::cpu_backward_into(
            &q, &k, &v, &o, &lse, &d_o, c.shape, m, &c.params, &mut dq, &mut dk, &mut dv,
        )
        .unwrap();
        assert_eq!(bits(&dq), bits(&g.dq), "dq");
        assert_eq!(bits(&dk), bits(&g.dk), "dk");
        assert_eq!(bits(&dv), bits(&g.dv), "dv");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The `_into` variants equal the allocating ones exactly (same code
    /// path after validation, so no tolerance), on fresh random packs of
    /// every mask kind, with and without rotary, lengths across tile edges.
    #[test]
    fn into_variants_write_every_element_and_match(
        seed in any::<u64>(), kind in kind_strategy(), l in 1usize..200,
        kv_heads in 1usize..3, group in 1usize..4, d in 1usize..=80, rope in any::<bool>(),
        f32_not_f64 in any::<bool>(),
    ) {
        let c = make_case(seed, kind, l, kv_heads, group, d, rope && d >= 2);
        if f32_not_f64 {
            check_into::<f32>(&c);
        } else {
            check_into::<f64>(&c);
        }
    }
}

/// Output buffers of the wrong length are a `Shape` error naming the buffer,
/// raised before any work: the buffers are left as they were.
#[test]
fn into_variants_reject_wrong_length_buffers() {
    let (shape, params, m, q, kv) = small();
    let fwd = calls::cpu_forward(&q, &kv, &kv, shape, m.view(), &params).unwrap();
    let f = |o: &mut [f64], lse: &mut [f64]| {
        calls::cpu_forward_into(&q, &kv, &kv, shape, m.view(), &params, o, lse)
    };
    let (mut o, mut lse) = (vec![7.0; 512], vec![7.0; 64]);
    shape_err(f(&mut o[1..], &mut lse), "o has 511 elements, expected 512");
    shape_err(f(&mut vec![7.0; 513], &mut lse), "o has 513");
    shape_err(
        f(&mut o, &mut lse[..63]),
        "lse has 63 elements, expected 64",
    );
    shape_err(f(&mut o, &mut []), "lse has 0");
    assert!(
        o.iter().chain(&lse).all(|&x| x == 7.0),
        "written before the error"
    );
    f(&mut o, &mut lse).unwrap();
    assert_eq!((&o, &lse), (&fwd.o, &fwd.lse));

    let b = |dq: &mut [f64], dk: &mut [f64], dv: &mut [f64]| {
        calls::cpu_backward_into(
            &q,
            &kv,
            &kv,
            &fwd.o,
            &fwd.lse,
            &q,
            shape,
            m.view(),
            &params,
            dq,
            dk,
            dv,
        )
    };
    let (mut dq, mut dk, mut dv) = (vec![7.0; 512], vec![7.0; 256], vec![7.0; 256]);
    shape_err(
        b(&mut dq[1..], &mut dk, &mut dv),
        "dq has 511 elements, expected 512",
    );
    shape_err(
        b(&mut dq, &mut dk[..255], &mut dv),
        "dk has 255 elements, expected 256",
    );
    shape_err(
        b(&mut dq, &mut dk, &mut vec![7.0; 512]),
        "dv has 512 elements, expected 256",
    );
    // GQA: dk sized like dq (q_heads instead of kv_heads) is refused.
    shape_err(b(&mut dq, &mut vec![7.0; 512], &mut dv), "dk has 512");
    assert!(
        dq.iter().chain(&dk).chain(&dv).all(|&x| x == 7.0),
        "written before the error"
    );
    // Bad saved state is still reported first-class through the `_into` path.
    let mut bad_lse = fwd.lse.clone();
    bad_lse[3] = f64::NAN;
    assert!(matches!(
        calls::cpu_backward_into(
            &q,
            &kv,
            &kv,
            &fwd.o,
            &bad_lse,
            &q,
            shape,
            m.view(),
            &params,
            &mut dq,
            &mut dk,
            &mut dv,
        ),
        Err(Error::NonFinite { index: 3, .. })
    ));
    b(&mut dq, &mut dk, &mut dv).unwrap();
    let g =
        calls::cpu_backward(&q, &kv, &kv, &fwd.o, &fwd.lse, &q, shape, m.view(), &params).unwrap();
    assert_eq!((&dq, &dk, &dv), (&g.dq, &g.dk, &g.dv));
}

// ------------------------------------------------------ finite differences

/// Σ dO ∘ O for the CPU backend in f64.
fn loss(c: &Case, q: &[f64], k: &[f64], v: &[f64]) -> f64 {
    let o = calls::cpu_forward(q, k, v, c.shape, c.mask.view(), &c.params)
        .unwrap()
        .o;
    o.iter().zip(&c.d_o).map(|(a, b)| a * b).sum()
}

/// The analytic backward against central differences of `Σ dO ∘ O`, for
/// every element of q, k and v. With h = 1e-5 the truncation error is
/// ~h² · |f'''| ≈ 1e-10 and the rounding error ~1e-16 / h ≈ 1e-11; 1e-7
/// absolute-plus-relative is far above both and far below any real mistake
/// (a missing rotary transpose or GQA sum is O(1)).
fn check_finite_differences(rope: Option<Rope>) {
    let mut rng = Rng(0x5eed ^ rope.is_some() as u64);
    let mut c = make_case(rng.next_u64(), MaskKind::Tree, 13, 1, 2, 6, false);
    c.mask = Mask::tree(&mut rng, 13, 0.3, false);
    c.params.rope = rope;
    let fwd = calls::cpu_forward(&c.q, &c.k, &c.v, c.shape, c.mask.view(), &c.params).unwrap();
    let g = calls::cpu_backward(
        &c.q,
        &c.k,
        &c.v,
        &fwd.o,
        &fwd.lse,
        &c.d_o,
        c.shape,
        c.mask.view(),
        &c.params,
    )
    .unwrap();
    let h = 1e-5;
    for (which, analytic) in [("q", &g.dq), ("k", &g.dk), ("v", &g.dv)] {
        for (i, &an) in analytic.iter().enumerate() {
            let (mut q, mut k, mut v) = (c.q.clone(), c.k.clone(), c.v.clone());
            let x = match which {
                "q" => &mut q,
                "k" => &mut k,
                _ => &mut v,
            };
            x[i] += h;
            let up = loss(&c, &q, &k, &v);
            let x = match which {
                "q" => &mut q,
                "k" => &mut k,
                _ => &mut v,
            };
            x[i] -= 2.0 * h;
            let down = loss(&c, &q, &k, &v);
            let fd = (up - down) / (2.0 * h);
            assert!(
                (fd - an).abs() <= 1e-7 * (1.0 + an.abs()),
                "d{which}[{i}]: analytic {an}, finite difference {fd}"
            );
        }
    }
}

#[test]
fn backward_matches_finite_differences_without_rope() {
    check_finite_differences(None);
}

#[test]
fn backward_matches_finite_differences_with_partial_rope() {
    // dims 4 of head_dim 6: two lanes pass through unrotated.
    check_finite_differences(Some(Rope {
        base: 100.0,
        dims: 4,
    }));
}

// ------------------------------------------------------ fully masked rows

fn check_masked_rows<T: CpuFloat>() {
    let mut rng = Rng(99);
    let mut c = make_case(3, MaskKind::Padded, 150, 2, 2, 24, true);
    c.mask = Mask::tree_with_padding(&mut rng, 150, 40);
    let empty = c.mask.empty_rows();
    assert!(
        empty.len() >= 40,
        "the padding tail gives rows with no visible key"
    );
    let (q, k, v, d_o) = (
        to_t::<T>(&c.q),
        to_t::<T>(&c.k),
        to_t::<T>(&c.v),
        to_t::<T>(&c.d_o),
    );
    let m = c.mask.view();
    let fwd = calls::cpu_forward(&q, &k, &v, c.shape, m, &c.params).unwrap();
    let g = calls::cpu_backward(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, c.shape, m, &c.params).unwrap();
    let (hq, d, l) = (c.shape.q_heads, c.shape.head_dim, c.shape.tokens);
    assert!(fwd
        .o
        .iter()
        .chain(&g.dq)
        .chain(&g.dk)
        .chain(&g.dv)
        .all(|x| x.is_finite()));
    for &row in &empty {
        for h in 0..hq {
            assert_eq!(fwd.lse[h * l + row].to_f64(), f64::NEG_INFINITY);
            let at = (row * hq + h) * d;
            assert!(fwd.o[at..at + d]
                .iter()
                .chain(&g.dq[at..at + d])
                .all(|x| x.to_f64() == 0.0));
        }
    }
    // Padding keys (kv_end[k] == k) are seen by nobody: zero dK, dV.
    let kvd = c.shape.kv_heads * d;
    for key in (0..l).filter(|&key| c.mask.kv_end[key] as usize == key) {
        assert!(g.dk[key * kvd..(key + 1) * kvd]
            .iter()
            .chain(&g.dv[key * kvd..(key + 1) * kvd])
            .all(|x| x.to_f64() == 0.0));
    }
    // A pack made only of padding: everything is zero / −inf, nothing NaN.
    let all_pad = Mask {
        kv_end: (0..l as u32).collect(),
        pos: vec![0; l],
    };
    let fwd = calls::cpu_forward(&q, &k, &v, c.shape, all_pad.view(), &c.params).unwrap();
    let g = calls::cpu_backward(
        &q,
        &k,
        &v,
        &fwd.o,
        &fwd.lse,
        &d_o,
        c.shape,
        all_pad.view(),
        &c.params,
    )
    .unwrap();
    assert!(fwd.lse.iter().all(|x| x.to_f64() == f64::NEG_INFINITY));
    assert!(fwd
        .o
        .iter()
        .chain(&g.dq)
        .chain(&g.dk)
        .chain(&g.dv)
        .all(|x| x.to_f64() == 0.0));
}

#[test]
fn rows_without_visible_keys_are_zero_and_finite_f64() {
    check_masked_rows::<f64>();
}

#[test]
fn rows_without_visible_keys_are_zero_and_finite_f32() {
    check_masked_rows::<f32>();
}

// ------------------------------------------------------ negative control

/// The golden pack of DESIGN §4: one junction, two branches.
fn golden() -> Mask {
    Mask {
        kv_end: vec![
            16, 16, 10, 10, 10, 10, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16,
        ],
        pos: vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7],
    }
}

#[test]
fn causal_mask_gives_a_different_answer_on_a_branched_tree() {
    let mut c = make_case(11, MaskKind::Causal, 16, 1, 2, 8, false);
    let tree = golden();
    let causal = Mask {
        kv_end: vec![16; 16],
        pos: tree.pos.clone(),
    };
    c.params.rope = Some(Rope {
        base: 10_000.0,
        dims: 8,
    });
    let o_tree = calls::cpu_forward(&c.q, &c.k, &c.v, c.shape, tree.view(), &c.params)
        .unwrap()
        .o;
    let o_causal = calls::cpu_forward(&c.q, &c.k, &c.v, c.shape, causal.view(), &c.params)
        .unwrap()
        .o;
    let row = c.shape.q_heads * c.shape.head_dim;
    // Rows before the junction see the same keys under both masks...
    assert_eq!(o_tree[..10 * row], o_causal[..10 * row]);
    // ...rows of the second branch must not see the first branch's tokens 2..10.
    let diff = o_tree[10 * row..]
        .iter()
        .zip(&o_causal[10 * row..])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        diff > 1e-2,
        "tree and causal masks agree after the junction (max |ΔO| = {diff})"
    );
    // And the tree answer is the right one.
    let reference = dense(
        &c.q, &c.k, &c.v, &c.d_o, None, None, c.shape, &tree, &c.params,
    );
    assert!(rel_err(&o_tree, &reference.o) < 1e-12);
}

// ------------------------------------------------------ tile classes

/// A trunk, two long sibling branches (the second branch's query tiles skip
/// the first branch's key tiles), and small nested subtrees inside the second
/// branch (partial tiles away from the diagonal).
fn branched_pack(rng: &mut Rng) -> Mask {
    let (trunk, a, b) = (100usize, 260usize, 300usize);
    let l = trunk + a + b;
    let mut kv_end = vec![l as u32; l];
    let mut pos: Vec<u32> = (0..(trunk + a) as u32).collect();
    for e in &mut kv_end[trunk..trunk + a] {
        *e = (trunk + a) as u32;
    }
    pos.extend((trunk as u32)..((trunk + b) as u32));
    // Inside branch b: a few closed side subtrees of random size.
    let mut k = trunk + a + 20;
    while k + 40 < l {
        let size = rng.range(2, 40);
        for e in &mut kv_end[k..k + size] {
            *e = (k + size) as u32;
        }
        k += size + rng.range(10, 60);
    }
    Mask { kv_end, pos }
}

#[test]
fn tile_census_of_causal_is_diagonal_partial_and_rest_full() {
    let c = tile_counts(Mask::causal(4 * TILE).view());
    assert_eq!((c.skip, c.full, c.partial), (0, 6, 4));
    // A tail tile shorter than TILE is still on the diagonal.
    let c = tile_counts(Mask::causal(4 * TILE + 5).view());
    assert_eq!((c.skip, c.full, c.partial), (0, 10, 5));
    // Independent sequences of exactly one tile each: only diagonal blocks.
    let seqs = Mask {
        kv_end: (0..3 * TILE)
            .map(|k| ((k / TILE + 1) * TILE) as u32)
            .collect(),
        pos: vec![0; 3 * TILE],
    };
    let c = tile_counts(seqs.view());
    assert_eq!((c.skip, c.full, c.partial), (3, 0, 3));
}

#[test]
fn skip_full_and_partial_tiles_all_match_the_dense_reference() {
    let mut rng = Rng(2024);
    for (seed, rope) in [(1u64, false), (2, true)] {
        let mask = branched_pack(&mut rng);
        let counts = tile_counts(mask.view());
        assert!(
            counts.skip > 0 && counts.full > 0 && counts.partial > 0,
            "{counts:?}"
        );
        let mut c = make_case(seed, MaskKind::Causal, mask.kv_end.len(), 1, 2, 16, rope);
        c.mask = mask;
        let e64 = check_case::<f64>(&c);
        assert!(e64.iter().all(|&e| e < 1e-12), "{e64:?}");
        let e32 = check_case::<f32>(&c);
        assert!(e32.iter().all(|&e| e < 2e-5), "{e32:?}");
    }
}

/// A GRPO-like pack: a prompt, then `n` sibling responses of random
/// lengths that start and end inside tiles, so partial tiles hold register
/// blocks of every kind (a sibling's keys: skipped; the prompt's keys: full;
/// the diagonal: masked).
fn group_pack(rng: &mut Rng, prompt: usize, n: usize) -> Mask {
    let lens: Vec<usize> = (0..n).map(|_| rng.range(5, 60)).collect();
    fan_pack(prompt, &lens)
}

/// A prompt of `prompt` tokens, then sibling branches of the given lengths,
/// each seeing the prompt and itself (positions continue the prompt's).
fn fan_pack(prompt: usize, lens: &[usize]) -> Mask {
    let l = prompt + lens.iter().sum::<usize>();
    let mut kv_end = vec![l as u32; prompt];
    let mut pos: Vec<u32> = (0..prompt as u32).collect();
    for &len in lens {
        let end = (kv_end.len() + len) as u32;
        kv_end.extend(std::iter::repeat_n(end, len));
        pos.extend(prompt as u32..(prompt + len) as u32);
    }
    Mask { kv_end, pos }
}

/// Forward and backward on `mask` (2 kv heads × group 2, head dim 24, rotary
/// on or off) against the dense reference, f64 and f32. Same bounds as the
/// other reference checks: f64 agrees to rounding of sums of a few hundred
/// terms; f32 to ~10 ulp over the pipeline.
fn check_against_dense(mask: Mask, seed: u64, rope: bool) {
    let mut c = make_case(seed, MaskKind::Causal, mask.kv_end.len(), 2, 2, 24, rope);
    c.mask = mask;
    let e64 = check_case::<f64>(&c);
    assert!(e64.iter().all(|&e| e < 1e-12), "{e64:?}");
    let e32 = check_case::<f32>(&c);
    assert!(e32.iter().all(|&e| e < 2e-5), "{e32:?}");
}

#[test]
fn skipped_full_and_masked_register_blocks_match_the_dense_reference() {
    let mut rng = Rng(77);
    let cases = [
        (group_pack(&mut rng, 50, 16), 1u64, false),
        (group_pack(&mut rng, 70, 9), 2, true),
        (branched_pack(&mut rng), 3, true),
    ];
    for (mask, seed, rope) in cases {
        let blocks = block_counts(mask.view());
        assert!(
            blocks.skip > 0 && blocks.full > 0 && blocks.masked > 0,
            "{blocks:?}"
        );
        check_against_dense(mask, seed, rope);
    }
}

/// A compaction-like star: a shared prefix, then sibling branches that each
/// see the prefix and themselves, all of random lengths. Query tiles of the
/// later branches see the prefix's tail and their own branch's head inside
/// tiles split by columns: the keys the CPU forward gathers.
fn star_pack(rng: &mut Rng, branches: usize) -> Mask {
    let prefix = rng.range(20, 150);
    let lens: Vec<usize> = (0..branches).map(|_| rng.range(150, 320)).collect();
    fan_pack(prefix, &lens)
}

/// Gathered key chunks (and the tiles left to visit around them) against
/// the dense reference, forward and backward, with GQA, rotary on and off
/// and a partial last query tile; the same bounds as the other reference
/// checks. The census must show gathering, or this test checks nothing new.
#[test]
fn gathered_key_chunks_match_the_dense_reference() {
    let mut rng = Rng(4242);
    let mut gathered = 0;
    for (seed, branches, rope) in [(1u64, 3, false), (2, 4, true), (3, 5, true), (4, 3, true)] {
        let mask = star_pack(&mut rng, branches);
        let g = gather_counts(mask.view());
        assert!(g.chunks <= g.tiles, "{g:?}");
        gathered += g.tiles;
        check_against_dense(mask, seed, rope);
    }
    assert!(gathered >= 10, "{gathered} gathered tiles");
}

/// Scores that climb by far more than the forward's rescale margin (e^8)
/// from one key tile to the next, on the causal mask and on a star: the
/// online softmax must move its reference up and rescale (without it,
/// `exp(s − m)` overflows f32 at s − m > 88; the rise here is ~40 per tile
/// and ~250 in all). Half the heads' queries point the other way, so their
/// scores fall instead and the first tile's reference stands. Against the
/// dense reference, forward and backward, with the usual bounds.
#[test]
fn scores_rising_across_tiles_match_the_dense_reference() {
    let mut rng = Rng(99);
    let star = star_pack(&mut rng, 3);
    for mask in [Mask::causal(6 * TILE + 17), star] {
        let l = mask.kv_end.len();
        let mut c = make_case(5, MaskKind::Causal, l, 2, 2, 16, false);
        c.mask = mask;
        let d = c.shape.head_dim;
        // Keys along the first axis, growing with the token index; queries
        // along +axis (heads 0, 1) or −axis (heads 2, 3), plus noise.
        for t in 0..l {
            for g in 0..2 {
                let key = &mut c.k[(t * 2 + g) * d..][..d];
                key[0] = 250.0 / l as f64 * t as f64;
            }
            for h in 0..4 {
                let query = &mut c.q[(t * 4 + h) * d..][..d];
                query[0] = if h < 2 { 4.0 } else { -4.0 };
            }
        }
        let e64 = check_case::<f64>(&c);
        assert!(e64.iter().all(|&e| e < 1e-12), "{e64:?}");
        let e32 = check_case::<f32>(&c);
        assert!(e32.iter().all(|&e| e < 2e-5), "{e32:?}");
    }
}

/// Head dims that fill the 16-lane padding exactly (no zero lanes), with
/// whole and partial last tiles, GQA, rotary on and off and three mask
/// kinds, against the dense reference with the bounds of the proptests
/// above (which draw these dims rarely).
#[test]
fn lane_multiple_head_dims_match_the_dense_reference() {
    let mut seed = 500;
    for d in [16, 64] {
        for l in [64, 128, 150, 193] {
            for (kv_heads, group, rope) in [(1, 1, false), (2, 2, true), (2, 3, false)] {
                for kind in [MaskKind::Causal, MaskKind::Tree, MaskKind::Padded] {
                    seed += 1;
                    let c = make_case(seed, kind, l, kv_heads, group, d, rope);
                    let e64 = check_case::<f64>(&c);
                    assert!(
                        e64.iter().all(|&e| e < 1e-12),
                        "d={d} l={l} {kind:?}: {e64:?}"
                    );
                    let e32 = check_case::<f32>(&c);
                    assert!(
                        e32[..2].iter().all(|&e| e < 1e-5) && e32[2..].iter().all(|&e| e < 2e-5),
                        "d={d} l={l} {kind:?}: {e32:?}"
                    );
                }
            }
        }
    }
}

/// The census on a causal mask: inside the diagonal tiles, the blocks above
/// the diagonal are skipped, those below it need no mask, and those that
/// straddle it are masked.
#[test]
fn register_block_census_of_causal() {
    use treeattn::backend::cpu::{BLOCK_KEYS, BLOCK_QUERIES};
    let c = block_counts(Mask::causal(TILE).view());
    let (rows, strips) = (TILE / BLOCK_QUERIES, TILE / BLOCK_KEYS);
    // A block (queries qa..=qb, keys ka..=kb) is below the diagonal when
    // kb <= qa, above it when ka > qb.
    let (mut skip, mut full) = (0, 0);
    for r in 0..rows {
        let (qa, qb) = (r * BLOCK_QUERIES, (r + 1) * BLOCK_QUERIES - 1);
        for s in 0..strips {
            let (ka, kb) = (s * BLOCK_KEYS, (s + 1) * BLOCK_KEYS - 1);
            skip += (ka > qb) as u64;
            full += (kb <= qa) as u64;
        }
    }
    let total = (rows * strips) as u64;
    assert_eq!(
        (c.skip, c.full, c.masked),
        (skip, full, total - skip - full)
    );
    // 4 × 8 blocks: 16 rows of 8 strips; 56 above, 56 below, 16 straddle.
    assert_eq!((BLOCK_QUERIES, BLOCK_KEYS), (4, 8));
    assert_eq!((skip, full), (56, 56));
    // The kernels compute the live blocks whole: 72 blocks of 32 entries
    // for the 2,080 visible pairs of one causal tile.
    let computed = treeattn::backend::cpu::computed_entries(Mask::causal(TILE).view());
    assert_eq!(
        computed,
        (total - skip) * (BLOCK_QUERIES * BLOCK_KEYS) as u64
    );
    assert_eq!(computed, 2304);
}

// ------------------------------------------------------ errors

fn small() -> (AttnShape, AttnParams, Mask, Vec<f64>, Vec<f64>) {
    let shape = AttnShape {
        tokens: 16,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        v_head_dim: 8,
    };
    let mut rng = Rng(5);
    let (q, kv) = (
        rng.values(shape.q_len(), 1.0),
        rng.values(shape.kv_len(), 1.0),
    );
    (shape, AttnParams::new(8), golden(), q, kv)
}

fn shape_err(r: treeattn::Result<impl std::fmt::Debug>, needle: &str) {
    match r {
        Err(Error::Shape(m)) => assert!(m.contains(needle), "message {m:?} lacks {needle:?}"),
        other => panic!("expected a shape error naming {needle:?}, got {other:?}"),
    }
}

#[test]
fn forward_rejects_bad_inputs() {
    let (shape, params, m, q, kv) = small();
    let f = |q: &[f64], k: &[f64], v: &[f64], shape: AttnShape, m: PackMask<'_>, p: &AttnParams| {
        calls::cpu_forward(q, k, v, shape, m, p)
    };
    assert!(f(&q, &kv, &kv, shape, m.view(), &params).is_ok());
    shape_err(
        f(&q[1..], &kv, &kv, shape, m.view(), &params),
        "q has 511 elements, expected 512",
    );
    shape_err(f(&q, &kv[1..], &kv, shape, m.view(), &params), "k has 255");
    shape_err(f(&q, &kv, &kv[1..], shape, m.view(), &params), "v has 255");
    shape_err(
        f(
            &q,
            &kv,
            &kv,
            AttnShape {
                kv_heads: 3,
                ..shape
            },
            m.view(),
            &params,
        ),
        "not a multiple",
    );
    // A mask of another length.
    let short = Mask {
        kv_end: vec![15; 15],
        pos: vec![0; 15],
    };
    assert!(matches!(
        f(&q, &kv, &kv, shape, short.view(), &params),
        Err(Error::Pack(_))
    ));
    // An invalid kv_end cannot reach the backend: PackMask::new is the only
    // way to a mask (tests/it/contract.rs covers its errors).
    let mut bad = m.kv_end.clone();
    bad[3] = 2;
    let r = PackMask::new(&bad, &m.pos);
    assert!(
        matches!(&r, Err(Error::Pack(msg)) if msg.contains("kv_end[3] = 2")),
        "{r:?}"
    );
    // Rotary dims that do not fit the head.
    for dims in [3, 10, 0] {
        let p = AttnParams {
            rope: Some(Rope {
                base: 10_000.0,
                dims,
            }),
            ..params
        };
        assert!(
            matches!(
                f(&q, &kv, &kv, shape, m.view(), &p),
                Err(Error::Unsupported(_))
            ),
            "dims {dims}"
        );
    }
    // Non-finite inputs are reported (tensor and flat index) when asked for.
    let checked = AttnParams {
        check_finite: true,
        ..params
    };
    let mut k_nan = kv.clone();
    k_nan[37] = f64::NAN;
    assert_eq!(
        f(&q, &k_nan, &kv, shape, m.view(), &checked).unwrap_err(),
        Error::NonFinite {
            what: "k".into(),
            index: 37
        }
    );
    let mut v_inf = kv.clone();
    v_inf[200] = f64::INFINITY;
    assert_eq!(
        f(&q, &kv, &v_inf, shape, m.view(), &checked).unwrap_err(),
        Error::NonFinite {
            what: "v".into(),
            index: 200
        }
    );
    let mut q_inf = q.clone();
    q_inf[0] = f64::NEG_INFINITY;
    assert_eq!(
        f(&q_inf, &kv, &kv, shape, m.view(), &checked).unwrap_err(),
        Error::NonFinite {
            what: "q".into(),
            index: 0
        }
    );
}

#[test]
fn backward_rejects_bad_saved_state() {
    let (shape, params, m, q, kv) = small();
    let fwd = calls::cpu_forward(&q, &kv, &kv, shape, m.view(), &params).unwrap();
    let d_o = q.clone();
    let b = |o: &[f64], lse: &[f64], d_o: &[f64], p: &AttnParams| {
        calls::cpu_backward(&q, &kv, &kv, o, lse, d_o, shape, m.view(), p)
    };
    assert!(b(&fwd.o, &fwd.lse, &d_o, &params).is_ok());
    shape_err(b(&fwd.o[1..], &fwd.lse, &d_o, &params), "o has 511");
    shape_err(
        b(&fwd.o, &fwd.lse[1..], &d_o, &params),
        "lse has 63 elements, expected 64",
    );
    shape_err(b(&fwd.o, &fwd.lse, &d_o[..8], &params), "d_o has 8");
    let mut lse = fwd.lse.clone();
    lse[9] = f64::NAN;
    assert!(matches!(
        b(&fwd.o, &lse, &d_o, &params),
        Err(Error::NonFinite { index: 9, .. })
    ));
    lse[9] = f64::INFINITY;
    assert!(matches!(
        b(&fwd.o, &lse, &d_o, &params),
        Err(Error::NonFinite { index: 9, .. })
    ));
    let mut d_nan = d_o.clone();
    d_nan[100] = f64::NAN;
    let checked = AttnParams {
        check_finite: true,
        ..params
    };
    assert_eq!(
        b(&fwd.o, &fwd.lse, &d_nan, &checked).unwrap_err(),
        Error::NonFinite {
            what: "d_o".into(),
            index: 100
        }
    );
}

// ------------------------------------------------------ ndarray front

fn arr(shape: (usize, usize, usize), data: &[f64]) -> Array3<f64> {
    Array3::from_shape_vec(shape, data.to_vec()).unwrap()
}

#[test]
fn ops_front_matches_the_core_and_accepts_strided_views() {
    let c = make_case(77, MaskKind::Tree, 90, 2, 3, 12, true);
    let AttnShape {
        tokens: l,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        ..
    } = c.shape;
    let (q, k, v, d_o) = (
        arr((l, hq, d), &c.q),
        arr((l, hkv, d), &c.k),
        arr((l, hkv, d), &c.v),
        arr((l, hq, d), &c.d_o),
    );
    let m = c.mask.view();
    let fwd = ops::attention_forward(q.view(), k.view(), v.view(), m, &c.params).unwrap();
    let g = ops::attention_backward(&fwd, q.view(), k.view(), v.view(), d_o.view(), m).unwrap();
    let core = calls::cpu_forward(&c.q, &c.k, &c.v, c.shape, m, &c.params).unwrap();
    let core_g = calls::cpu_backward(
        &c.q, &c.k, &c.v, &core.o, &core.lse, &c.d_o, c.shape, m, &c.params,
    )
    .unwrap();
    assert_eq!(fwd.o.as_slice().unwrap(), &core.o[..]);
    assert_eq!(fwd.lse.dim(), (hq, l));
    assert_eq!(fwd.lse.as_slice().unwrap(), &core.lse[..]);
    assert_eq!(g.dq.as_slice().unwrap(), &core_g.dq[..]);
    assert_eq!(g.dk.as_slice().unwrap(), &core_g.dk[..]);
    assert_eq!(g.dv.as_slice().unwrap(), &core_g.dv[..]);

    // The same tensors stored head-major, viewed as [tokens, heads, d].
    let q_hm = q
        .view()
        .permuted_axes([1, 0, 2])
        .as_standard_layout()
        .into_owned();
    let q_strided = q_hm.view().permuted_axes([1, 0, 2]);
    assert!(q_strided.as_slice().is_none());
    let fwd2 = ops::attention_forward(q_strided, k.view(), v.view(), m, &c.params).unwrap();
    assert_eq!(fwd2.o, fwd.o);
}

#[test]
fn ops_backward_rejects_another_pack_and_other_shapes() {
    let (shape, params, m, q, kv) = small();
    let (q, k) = (arr((16, 4, 8), &q), arr((16, 2, 8), &kv));
    let fwd = ops::attention_forward(q.view(), k.view(), k.view(), m.view(), &params).unwrap();
    assert_eq!(fwd.shape(), shape);
    let d_o = q.clone();
    // Same length, different tree: the fingerprint catches it.
    let other = Mask::causal(16);
    let r = ops::attention_backward(&fwd, q.view(), k.view(), k.view(), d_o.view(), other.view());
    assert!(
        matches!(&r, Err(Error::Pack(msg)) if msg.contains("another pack")),
        "{r:?}"
    );
    // Same tree, different position ids: also another pack.
    let shifted = Mask {
        kv_end: m.kv_end.clone(),
        pos: m.pos.iter().map(|p| p + 1).collect(),
    };
    assert!(matches!(
        ops::attention_backward(
            &fwd,
            q.view(),
            k.view(),
            k.view(),
            d_o.view(),
            shifted.view()
        ),
        Err(Error::Pack(_))
    ));
    let d_small = arr((16, 4, 4), &vec![0.0; 256]);
    shape_err(
        ops::attention_backward(&fwd, q.view(), k.view(), k.view(), d_small.view(), m.view()),
        "d_o",
    );
    let k3 = arr((16, 2, 4), &vec![0.0; 128]);
    shape_err(
        ops::attention_forward(q.view(), k3.view(), k3.view(), m.view(), &params),
        "k is",
    );
    shape_err(
        ops::attention_forward(q.view(), k.view(), k3.view(), m.view(), &params),
        "v is",
    );
}

/// Finite inputs whose scores overflow f32, and unchecked NaN inputs: an
/// error naming the result, never a silent NaN.
#[test]
fn overflow_and_unchecked_nan_are_errors_not_nan() {
    let (shape, params, m, q, kv) = small();
    let big = |x: &[f64]| x.iter().map(|&v| (v * 1e20) as f32).collect::<Vec<f32>>();
    let (q32, k32) = (big(&q), big(&kv));
    let v32: Vec<f32> = kv.iter().map(|&v| v as f32).collect();
    let r = calls::cpu_forward(&q32, &k32, &v32, shape, m.view(), &params);
    assert!(
        matches!(&r, Err(Error::NonFinite { what, .. }) if what.contains("f32")),
        "{r:?}"
    );
    let mut q_nan = q.clone();
    q_nan[3] = f64::NAN;
    let r = calls::cpu_forward(&q_nan, &kv, &kv, shape, m.view(), &params);
    assert!(matches!(r, Err(Error::NonFinite { .. })), "{r:?}");
    // Backward: a NaN in d_o (unchecked) surfaces as an error on the gradients.
    let fwd = calls::cpu_forward(&q, &kv, &kv, shape, m.view(), &params).unwrap();
    let mut d_o = q.clone();
    d_o[0] = f64::NAN;
    let r = calls::cpu_backward(
        &q,
        &kv,
        &kv,
        &fwd.o,
        &fwd.lse,
        &d_o,
        shape,
        m.view(),
        &params,
    );
    assert!(
        matches!(&r, Err(Error::NonFinite { what, .. }) if what.starts_with("d")),
        "{r:?}"
    );
}
