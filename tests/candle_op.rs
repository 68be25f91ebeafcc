//! The candle op (feature `candle`): gradients through candle's autograd
//! equal those of candle's own softmax attention with the dense mask, and a
//! tiny attention block on a trie pack gives every call's log-probs equal
//! to running that call alone.
#![cfg(feature = "candle")]

use candle_core::{DType, Device, IndexOp, Tensor, Var, D};
use treeattn::backend::{AttnParams, Rope};
use treeattn::candle::tree_attention;
use treeattn::mask::{dense_mask, PackMask};
use treeattn::pack::Pack;
use treeattn::rng::Rng;
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::Tree;

type R<T> = candle_core::Result<T>;

fn random(rng: &mut Rng, dims: &[usize], dtype: DType) -> R<Tensor> {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.signed_unit() as f64).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)
}

/// Softmax attention in candle ops with the dense `[L, L]` 0/1 mask of
/// `kv_end`: q `[L, Hq, d]`, k, v `[L, Hkv, d]` → `[L, Hq, d]`.
fn dense_attention(q: &Tensor, k: &Tensor, v: &Tensor, kv_end: &[u32], scale: f64) -> R<Tensor> {
    let (l, hq, _) = q.dims3()?;
    let group = hq / k.dim(1)?;
    let ones: Vec<f64> = dense_mask(kv_end)
        .iter()
        .map(|&b| if b { 1.0 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(ones, (l, l), &Device::Cpu)?.to_dtype(q.dtype())?;
    let mut heads = Vec::with_capacity(hq);
    for h in 0..hq {
        let qh = q.i((.., h, ..))?.contiguous()?;
        let kh = k.i((.., h / group, ..))?.contiguous()?;
        let vh = v.i((.., h / group, ..))?.contiguous()?;
        let s = (qh.matmul(&kh.t()?)? * scale)?;
        let m = s.max_keepdim(1)?.detach();
        let e = (s.broadcast_sub(&m)?.exp()? * &mask)?;
        let p = e.broadcast_div(&e.sum_keepdim(1)?)?;
        heads.push(p.matmul(&vh)?);
    }
    Tensor::stack(&heads, 1)
}

fn golden() -> Rollout {
    Rollout::new(
        "golden",
        vec![
            Call::new(vec![10, 11, 20], vec![30, 31]),
            Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
            Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
            Call::new(vec![10, 11, 3, 50, 51, 40, 32], vec![33]),
        ],
    )
    .unwrap()
}

/// A stack pop: call 2 returns to call 0's frame with a result.
fn stack_pop() -> Rollout {
    Rollout::new(
        "pop",
        vec![
            Call::new(vec![10, 11, 21], vec![35, 36]),
            Call::new(vec![10, 11, 21, 35, 36, 41, 42], vec![37, 38, 39]),
            Call::new(vec![10, 11, 21, 35, 36, 43, 39], vec![44]),
        ],
    )
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn gradients_match_dense(dtype: DType, tol: f64) -> R<()> {
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let mask = pack.mask().unwrap();
    let (l, hq, hkv, d) = (pack.len(), 4, 2, 8);
    let mut rng = Rng::new(7);
    let q = Var::from_tensor(&random(&mut rng, &[l, hq, d], dtype)?)?;
    let k = Var::from_tensor(&random(&mut rng, &[l, hkv, d], dtype)?)?;
    let v = Var::from_tensor(&random(&mut rng, &[l, hkv, d], dtype)?)?;
    let w = random(&mut rng, &[l, hq, d], dtype)?;
    let params = AttnParams::new(d);

    let o = tree_attention(&q, &k, &v, &mask, &params)?;
    let g = (&o * &w)?.sum_all()?.backward()?;
    let o_ref = dense_attention(&q, &k, &v, &pack.kv_end, params.softmax_scale)?;
    let g_ref = (&o_ref * &w)?.sum_all()?.backward()?;

    assert_eq!(o.dtype(), dtype);
    let diff = max_diff(&o, &o_ref);
    assert!(diff <= tol, "{dtype:?} O differs by {diff:e}");
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let (a, b) = (g.get(x).unwrap(), g_ref.get(x).unwrap());
        assert_eq!(a.dims(), x.dims(), "{name}");
        let diff = max_diff(a, b);
        assert!(
            diff <= tol,
            "{dtype:?} {name} differs by {diff:e} (tolerance {tol:e})"
        );
    }
    Ok(())
}

/// The attention variants in candle ops with a dense mask, from their
/// definitions: a window of `w` tree levels (`depth(q) − depth(k) < w`,
/// depth = the number of keys whose range holds the row), a softcap `c`
/// (`c · tanh(s / c)` of the scaled score), sinks (`exp(σ_h)` in each row's
/// denominator), and v of its own head dim.
#[allow(clippy::too_many_arguments)]
fn dense_variant(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    kv_end: &[u32],
    scale: f64,
    window: Option<u32>,
    softcap: Option<f64>,
) -> R<Tensor> {
    let (l, hq, _) = q.dims3()?;
    let group = hq / k.dim(1)?;
    let depth: Vec<usize> = (0..l)
        .map(|t| (0..t).filter(|&j| kv_end[j] as usize > t).count())
        .collect();
    let visible = dense_mask(kv_end);
    let ones: Vec<f64> = (0..l * l)
        .map(|i| {
            let (qq, kk) = (i / l, i % l);
            // Visible keys are ancestors (or the row): their depth is at most the row's.
            if visible[i] && window.is_none_or(|w| depth[qq] - depth[kk] < w as usize) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(ones, (l, l), &Device::Cpu)?.to_dtype(q.dtype())?;
    let mut heads = Vec::with_capacity(hq);
    for h in 0..hq {
        let qh = q.i((.., h, ..))?.contiguous()?;
        let kh = k.i((.., h / group, ..))?.contiguous()?;
        let vh = v.i((.., h / group, ..))?.contiguous()?;
        let mut s = (qh.matmul(&kh.t()?)? * scale)?;
        if let Some(c) = softcap {
            s = ((s / c)?.tanh()? * c)?;
        }
        let m = s.max_keepdim(1)?.detach();
        let e = (s.broadcast_sub(&m)?.exp()? * &mask)?;
        let mut den = e.sum_keepdim(1)?;
        if let Some(sk) = sinks {
            // exp(σ_h − m) joins every row's sum.
            let sh = sk.i(h)?.broadcast_as((l, 1))?;
            den = (den + sh.broadcast_sub(&m)?.exp()?)?;
        }
        let p = e.broadcast_div(&den)?;
        heads.push(p.matmul(&vh)?);
    }
    Tensor::stack(&heads, 1)
}

/// A sliding window, a softcap, sinks (with their gradient) and a value
/// head dim unlike q's through the op, f64, against `dense_variant` and
/// candle's autograd.
#[test]
fn variants_match_their_dense_definitions() -> R<()> {
    use treeattn::candle::{tree_attention_plan, tree_attention_with_sinks};
    use treeattn::plan::MaskPlan;
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let plan = std::sync::Arc::new(MaskPlan::new(&pack.kv_end, &pack.position_ids).unwrap());
    let (l, hq, hkv, d, dv) = (pack.len(), 4, 2, 8, 6);
    let mut rng = Rng::new(11);
    let f = DType::F64;
    let q = Var::from_tensor(&(random(&mut rng, &[l, hq, d], f)? * 2.0)?)?;
    let k = Var::from_tensor(&(random(&mut rng, &[l, hkv, d], f)? * 2.0)?)?;
    let v = Var::from_tensor(&random(&mut rng, &[l, hkv, dv], f)?)?;
    let sinks = Var::from_tensor(&(random(&mut rng, &[hq], f)? * 2.0)?)?;
    let w = random(&mut rng, &[l, hq, dv], f)?;
    let mut params = AttnParams::new(d);
    params.window = Some(3);
    params.softcap = Some(1.5);
    let o = tree_attention_with_sinks(&q, &k, &v, &sinks, &plan, &params)?;
    assert_eq!(o.dims(), &[l, hq, dv]);
    let g = (&o * &w)?.sum_all()?.backward()?;
    let o_ref = dense_variant(
        &q,
        &k,
        &v,
        Some(&sinks),
        &pack.kv_end,
        params.softmax_scale,
        Some(3),
        Some(1.5),
    )?;
    let g_ref = (&o_ref * &w)?.sum_all()?.backward()?;
    assert!(max_diff(&o, &o_ref) <= 1e-12, "O");
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v), ("dsinks", &sinks)] {
        let (a, b) = (g.get(x).unwrap(), g_ref.get(x).unwrap());
        assert_eq!(a.dims(), x.dims(), "{name}");
        assert!(
            max_diff(a, b) <= 1e-11,
            "{name} differs by {:e}",
            max_diff(a, b)
        );
    }
    // Without sinks, the three-input op takes the window and softcap too.
    let o2 = tree_attention_plan(&q, &k, &v, &plan, &params)?;
    let o2_ref = dense_variant(
        &q,
        &k,
        &v,
        None,
        &pack.kv_end,
        params.softmax_scale,
        Some(3),
        Some(1.5),
    )?;
    assert!(max_diff(&o2, &o2_ref) <= 1e-12, "O without sinks");
    // Negative control: a window one level wider is another answer.
    let wider = dense_variant(
        &q,
        &k,
        &v,
        None,
        &pack.kv_end,
        params.softmax_scale,
        Some(4),
        Some(1.5),
    )?;
    assert!(max_diff(&o2, &wider) > 1e-3);
    // Sinks of the wrong length: an error.
    let bad = Tensor::zeros(3, f, &Device::Cpu)?;
    assert!(tree_attention_with_sinks(&q, &k, &v, &bad, &plan, &params).is_err());
    Ok(())
}

#[test]
fn f64_gradients_equal_dense_softmax_attention() -> R<()> {
    gradients_match_dense(DType::F64, 1e-9)
}

#[test]
fn f32_gradients_equal_dense_softmax_attention() -> R<()> {
    gradients_match_dense(DType::F32, 1e-5)
}

/// bf16 and f16 CPU tensors go to the CPU backend as they are: O is the
/// f32 op's O on the widened tensors rounded once, bit for bit (bf16 on
/// the AVX-512 BF16 path: within the tolerance below); the
/// gradients through candle's autograd are the f32 op's within the
/// rounding of O (which enters D = rowsum(dO ∘ O)) and of each gradient:
/// 2e-2 (bf16) and 5e-3 (f16) of the largest, the crate's tolerance table
/// for 16-bit kernels.
#[test]
fn half_tensors_run_as_they_are() -> R<()> {
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let mask = pack.mask().unwrap();
    let (l, hq, hkv, d) = (pack.len(), 4, 2, 8);
    let params = AttnParams::new(d);
    for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 5e-3)] {
        let mut rng = Rng::new(11);
        let [q, k, v] =
            [(l, hq), (l, hkv), (l, hkv)].map(|(l, h)| random(&mut rng, &[l, h, d], dtype));
        let [q, k, v] = [
            Var::from_tensor(&q?)?,
            Var::from_tensor(&k?)?,
            Var::from_tensor(&v?)?,
        ];
        let w = random(&mut rng, &[l, hq, d], dtype)?;
        let o = tree_attention(&q, &k, &v, &mask, &params)?;
        assert_eq!(o.dtype(), dtype);
        let g = (&o * &w)?.sum_all()?.backward()?;

        let wide = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| Var::from_tensor(&t));
        let (q32, k32, v32) = (wide(&q)?, wide(&k)?, wide(&v)?);
        let o32 = tree_attention(&q32, &k32, &v32, &mask, &params)?;
        let g32 = (&o32 * &w.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        let diff = max_diff(
            &o.to_dtype(DType::F32)?,
            &o32.to_dtype(dtype)?.to_dtype(DType::F32)?,
        );
        // On the AVX-512 BF16 path bf16's block products run on bf16 pairs
        // (another summation order, P rounded to bf16 before P V): O within
        // the 16-bit tolerance of |O| <= 1.
        let pairs = dtype == DType::BF16
            && treeattn::backend::cpu::isa() == treeattn::backend::cpu::Isa::Avx512Bf16;
        assert!(
            diff <= if pairs { tol } else { 0.0 },
            "{dtype:?} O differs by {diff:e}"
        );
        for (name, x, x32) in [("dq", &q, &q32), ("dk", &k, &k32), ("dv", &v, &v32)] {
            let (a, b) = (g.get(x).unwrap(), g32.get(x32).unwrap());
            assert_eq!(a.dtype(), dtype, "{name}");
            let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
            let diff = max_diff(&a.to_dtype(DType::F32)?, b);
            assert!(
                diff <= tol * scale,
                "{dtype:?} {name} differs by {diff:e} of {scale:e}"
            );
        }
    }
    Ok(())
}

#[test]
fn bad_input_is_an_error() {
    let (kv_end, pos) = ([3u32, 2, 3], [0u32, 1, 1]);
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let dev = Device::Cpu;
    let q = Tensor::zeros((3, 3, 4), DType::F32, &dev).unwrap();
    let kv = Tensor::zeros((3, 2, 4), DType::F32, &dev).unwrap();
    let e = tree_attention(&q, &kv, &kv, &mask, &AttnParams::new(4)).unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    let q4 = Tensor::zeros((4, 2, 4), DType::F32, &dev).unwrap();
    let kv4 = Tensor::zeros((4, 1, 4), DType::F32, &dev).unwrap();
    let e = tree_attention(&q4, &kv4, &kv4, &mask, &AttnParams::new(4)).unwrap_err();
    assert!(e.to_string().contains("mask"), "{e}");
    let qi = Tensor::zeros((3, 2, 4), DType::U32, &dev).unwrap();
    let ki = Tensor::zeros((3, 1, 4), DType::U32, &dev).unwrap();
    let e = tree_attention(&qi, &ki, &ki, &mask, &AttnParams::new(4)).unwrap_err();
    assert!(e.to_string().contains("unsupported"), "{e}");
    // candle's typed error for a dtype the op does not take (under the
    // backtrace or context candle may wrap it in).
    let mut root = &e;
    while let candle_core::Error::WithBacktrace { inner, .. }
    | candle_core::Error::Context { inner, .. } = root
    {
        root = inner;
    }
    assert!(
        matches!(
            root,
            candle_core::Error::UnsupportedDTypeForOp(DType::U32, "treeattn-tree-attention")
        ),
        "{e:?}"
    );
}

/// A tiny Llama-style attention block (embedding, GQA attention with
/// rotary at the pack's position ids, residual, output head) in candle ops,
/// with the op for attention: log-probs `[L, vocab]` of a pack.
struct Block {
    emb: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    head: Tensor,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl Block {
    fn new(vocab: usize, dm: usize) -> R<Block> {
        let (hq, hkv, d) = (4, 2, 8);
        let mut rng = Rng::new(11);
        let f = DType::F64;
        Ok(Block {
            emb: random(&mut rng, &[vocab, dm], f)?,
            wq: random(&mut rng, &[dm, hq * d], f)?,
            wk: random(&mut rng, &[dm, hkv * d], f)?,
            wv: random(&mut rng, &[dm, hkv * d], f)?,
            wo: random(&mut rng, &[hq * d, dm], f)?,
            head: random(&mut rng, &[dm, vocab], f)?,
            hq,
            hkv,
            d,
        })
    }

    fn log_probs(&self, tokens: &[u32], mask: &PackMask<'_>) -> R<Tensor> {
        let l = tokens.len();
        let ids = Tensor::from_vec(tokens.to_vec(), l, &Device::Cpu)?;
        let x = self.emb.index_select(&ids, 0)?;
        let q = x.matmul(&self.wq)?.reshape((l, self.hq, self.d))?;
        let k = x.matmul(&self.wk)?.reshape((l, self.hkv, self.d))?;
        let v = x.matmul(&self.wv)?.reshape((l, self.hkv, self.d))?;
        let mut params = AttnParams::new(self.d);
        params.rope = Some(Rope {
            base: 10000.0,
            dims: self.d,
        });
        let o = tree_attention(&q, &k, &v, mask, &params)?.reshape((l, self.hq * self.d))?;
        let h = (x + o.matmul(&self.wo)?)?;
        let logits = h.matmul(&self.head)?;
        let m = logits.max_keepdim(D::Minus1)?;
        let z = logits
            .broadcast_sub(&m)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?;
        logits.broadcast_sub(&(m + z)?)
    }
}

#[test]
fn trie_pack_log_probs_equal_each_call_alone() -> R<()> {
    let rollouts = [golden(), stack_pop()];
    let tree = Tree::build(&rollouts, true).unwrap();
    let pack: Pack = tree.trie_pack();
    let block = Block::new(64, 16)?;
    let lp = block.log_probs(&pack.tokens, &pack.mask().unwrap())?;
    let mut worst = 0.0f64;
    for e in &pack.loss {
        let call = &rollouts[e.rollout as usize].calls()[e.call as usize];
        let seq = call.sequence();
        let n = seq.len();
        let (kv_end, pos) = (vec![n as u32; n], (0..n as u32).collect::<Vec<_>>());
        let alone = block.log_probs(&seq, &PackMask::new(&kv_end, &pos).unwrap())?;
        let row = call.context.len() + e.offset as usize - 1;
        let a = alone.i((row, e.label as usize))?.to_scalar::<f64>()?;
        let p = lp
            .i((e.row as usize, e.label as usize))?
            .to_scalar::<f64>()?;
        worst = worst.max((a - p).abs());
    }
    assert_eq!(pack.loss.len(), 12);
    assert!(worst <= 1e-12, "trie pack vs calls alone: {worst:e}");
    Ok(())
}

/// `‖a − b‖ / ‖b‖` over all elements, in f64 on the host.
#[cfg(feature = "candle-cuda")]
fn rel_frobenius(a: &Tensor, b: &Tensor) -> f64 {
    let host = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f64>())
            .unwrap()
    };
    let (a, b) = (host(a), host(b));
    treeattn::backend::tolerance::rel_frobenius(a.iter().copied(), &b)
}

/// The op on CUDA tensors (feature `candle-cuda`) against the CPU op on the
/// same rounded inputs, forward and gradients, bf16 and f16, GQA, rotary,
/// with the bounds of `backend::tolerance`. Needs a GPU: this binary links
/// libcuda (candle-core's `cuda`), so it runs only where one exists; CI
/// type-checks it (`.ci/run`, clippy --features candle-cuda --test candle_op).
#[cfg(feature = "candle-cuda")]
#[test]
fn cuda_op_matches_the_cpu_op() -> R<()> {
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let mask = pack.mask().unwrap();
    let (l, hq, hkv) = (pack.len(), 4, 2);
    for (dtype, d, rope) in [
        (DType::BF16, 64, false),
        (DType::F16, 128, false),
        (DType::BF16, 128, true),
    ] {
        let tol = treeattn::backend::tolerance::attention(match dtype {
            DType::BF16 => treeattn::backend::launch::Dtype::Bf16,
            _ => treeattn::backend::launch::Dtype::F16,
        });
        let mut params = AttnParams::new(d);
        params.rope = rope.then_some(Rope {
            base: 10000.0,
            dims: d,
        });
        let mut rng = Rng::new(11);
        let inputs = [hq, hkv, hkv, hq].map(|h| random(&mut rng, &[l, h, d], dtype).unwrap());
        // The reference: the CPU op in f32 on the very values the GPU sees.
        let cpu: Vec<Var> = inputs[..3]
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap())
            .collect();
        let dev: Vec<Var> = inputs[..3]
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(&gpu).unwrap()).unwrap())
            .collect();
        let w = &inputs[3];
        let o_ref = tree_attention(&cpu[0], &cpu[1], &cpu[2], &mask, &params)?;
        let g_ref = (&o_ref * w.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        let o = tree_attention(&dev[0], &dev[1], &dev[2], &mask, &params)?;
        assert!(o.device().is_cuda() && o.dtype() == dtype);
        let g = (&o * w.to_device(&gpu)?)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .backward()?;
        let e = rel_frobenius(&o, &o_ref);
        assert!(e <= tol.o_rel, "{dtype:?} d{d} rope {rope}: O {e:e}");
        for (name, a, b) in [("dq", 0, 0), ("dk", 1, 1), ("dv", 2, 2)] {
            let e = rel_frobenius(g.get(&dev[a]).unwrap(), g_ref.get(&cpu[b]).unwrap());
            assert!(
                e <= tol.grad_rel,
                "{dtype:?} d{d} rope {rope}: {name} {e:e}"
            );
        }
    }
    Ok(())
}

/// The mask is planned once per pack: `tree_attention` called again with
/// the same pack (every layer) reuses the cached plan, another pack gets
/// its own; `tree_attention_plan` on a plan the caller holds gives the same
/// output and gradients bit for bit. Negative control: the cache tells
/// packs apart (a changed position id is another plan).
#[test]
fn the_mask_plan_is_built_once_per_pack_and_reused() -> R<()> {
    use std::sync::Arc;
    use treeattn::candle::{plan_for, tree_attention_plan};
    use treeattn::plan::MaskPlan;
    let (kv_end, pos) = ([5u32, 3, 3, 5, 5], [0u32, 1, 2, 1, 2]);
    let mask = PackMask::new(&kv_end, &pos).unwrap();
    let a = plan_for(mask);
    assert!(Arc::ptr_eq(&a, &plan_for(mask)));
    let pos2 = [0u32, 1, 2, 1, 3];
    let other = plan_for(PackMask::new(&kv_end, &pos2).unwrap());
    assert!(!Arc::ptr_eq(&a, &other) && other.mask().position_ids() == pos2);
    let mut rng = Rng::new(11);
    let q = Var::from_tensor(&random(&mut rng, &[5, 2, 8], DType::F64)?)?;
    let k = Var::from_tensor(&random(&mut rng, &[5, 1, 8], DType::F64)?)?;
    let v = random(&mut rng, &[5, 1, 8], DType::F64)?;
    let p = AttnParams {
        rope: Some(Rope {
            base: 100.0,
            dims: 8,
        }),
        ..AttnParams::new(8)
    };
    let plan = Arc::new(MaskPlan::new(&kv_end, &pos).unwrap());
    let o1 = tree_attention(&q, &k, &v, &mask, &p)?;
    let o2 = tree_attention_plan(&q, &k, &v, &plan, &p)?;
    assert_eq!(max_diff(&o1, &o2), 0.0);
    let (g1, g2) = (o1.sum_all()?.backward()?, o2.sum_all()?.backward()?);
    for x in [q.as_tensor(), k.as_tensor()] {
        assert_eq!(max_diff(g1.get(x).unwrap(), g2.get(x).unwrap()), 0.0);
    }
    Ok(())
}

/// `tree_attention_with(…, TreeAttentionOptions { deterministic })`: on
/// CPU tensors (deterministic anyway) the option changes nothing, bit for
/// bit, with and without sinks; the default options are those of
/// `tree_attention_plan` / `tree_attention_with_sinks`.
#[test]
fn deterministic_option_changes_nothing_on_cpu() -> R<()> {
    use treeattn::candle::{
        plan_for, tree_attention_plan, tree_attention_with, TreeAttentionOptions,
    };
    assert!(!TreeAttentionOptions::default().deterministic);
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let plan = plan_for(pack.mask().unwrap());
    let (l, hq, hkv, d) = (pack.len(), 4, 2, 8);
    let mut params = AttnParams::new(d);
    params.window = Some(3);
    params.softcap = Some(2.0);
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = Rng::new(5);
        let [q, k, v] = [hq, hkv, hkv].map(|h| random(&mut rng, &[l, h, d], dtype).unwrap());
        let sinks = random(&mut rng, &[hq], dtype)?;
        let w = random(&mut rng, &[l, hq, d], dtype)?;
        for with_sinks in [false, true] {
            let run = |options: Option<TreeAttentionOptions>| -> R<Vec<Vec<f32>>> {
                let vars = [&q, &k, &v, &sinks].map(|t| Var::from_tensor(t).unwrap());
                let s = with_sinks.then_some(vars[3].as_tensor());
                let o = match options {
                    Some(opt) => {
                        tree_attention_with(&vars[0], &vars[1], &vars[2], s, &plan, &params, opt)?
                    }
                    None if with_sinks => treeattn::candle::tree_attention_with_sinks(
                        &vars[0], &vars[1], &vars[2], &vars[3], &plan, &params,
                    )?,
                    None => tree_attention_plan(&vars[0], &vars[1], &vars[2], &plan, &params)?,
                };
                let g = (&o * &w)?.sum_all()?.backward()?;
                let mut out = vec![o.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?];
                for (i, x) in vars.iter().enumerate() {
                    if i < 3 || with_sinks {
                        let gx = g.get(x).unwrap();
                        out.push(gx.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                    }
                }
                Ok(out)
            };
            let plain = run(None)?;
            let atomic = run(Some(TreeAttentionOptions::default()))?;
            let det = run(Some(TreeAttentionOptions {
                deterministic: true,
            }))?;
            let bits = |x: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
                x.iter()
                    .map(|v| v.iter().map(|f| f.to_bits()).collect())
                    .collect()
            };
            assert_eq!(bits(&plain), bits(&atomic), "{dtype:?} sinks {with_sinks}");
            assert_eq!(bits(&plain), bits(&det), "{dtype:?} sinks {with_sinks}");
        }
    }
    Ok(())
}

/// With a GPU (feature `candle-cuda`): two backward runs with
/// `deterministic: true` give bit-identical dQ, dK, dV (and dsinks), within
/// the tolerance of the CPU op; skipped without a CUDA device.
#[cfg(feature = "candle-cuda")]
#[test]
fn cuda_deterministic_backward_is_bit_identical() -> R<()> {
    use treeattn::candle::{plan_for, tree_attention_with, TreeAttentionOptions};
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    let tree = Tree::build(&[golden(), stack_pop()], true).unwrap();
    let pack = tree.trie_pack();
    let plan = plan_for(pack.mask().unwrap());
    let (l, hq, hkv, d) = (pack.len(), 8, 2, 64);
    let params = AttnParams::new(d);
    let tol = treeattn::backend::tolerance::attention(treeattn::backend::launch::Dtype::Bf16);
    let mut rng = Rng::new(3);
    let [q, k, v, w] =
        [hq, hkv, hkv, hq].map(|h| random(&mut rng, &[l, h, d], DType::BF16).unwrap());
    let sinks = random(&mut rng, &[hq], DType::BF16)?;
    let det = TreeAttentionOptions {
        deterministic: true,
    };
    let run = |dev: &Device, opt: TreeAttentionOptions| -> R<Vec<Tensor>> {
        let vars = [&q, &k, &v, &sinks].map(|t| {
            let t = if dev.is_cuda() {
                t.clone()
            } else {
                t.to_dtype(DType::F32).unwrap()
            };
            Var::from_tensor(&t.to_device(dev).unwrap()).unwrap()
        });
        let o = tree_attention_with(
            &vars[0],
            &vars[1],
            &vars[2],
            Some(vars[3].as_tensor()),
            &plan,
            &params,
            opt,
        )?;
        let g = (&o * w.to_dtype(o.dtype())?.to_device(dev)?)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .backward()?;
        Ok(vars.iter().map(|x| g.get(x).unwrap().clone()).collect())
    };
    let a = run(&gpu, det)?;
    let b = run(&gpu, det)?;
    let reference = run(&Device::Cpu, TreeAttentionOptions::default())?;
    for (i, name) in ["dq", "dk", "dv", "dsinks"].iter().enumerate() {
        let bits = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .unwrap()
                .iter()
                .map(|f| f.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            bits(&a[i]),
            bits(&b[i]),
            "{name} differs between two deterministic runs"
        );
        if i < 3 {
            let e = rel_frobenius(&a[i], &reference[i]);
            assert!(e <= tol.grad_rel, "{name}: {e:e}");
        }
    }
    Ok(())
}
