//! The crate's one CPU matrix product, shared by the reference model's
//! projections ([`crate::model`]) and the bench's dense-mask baseline
//! ([`crate::bench::dense_attention_forward`]).
//!
//! The product itself is `matrixmultiply`'s `sgemm` / `dgemm` (already in the
//! dependency tree through `ndarray`): packed, cache-blocked, with AVX2/FMA
//! micro-kernels chosen at run time where the CPU has them and portable
//! ones elsewhere. Operands are strided views, so transposed products read
//! their operand in place. Rows of the result are split over the CPU
//! backend's threads ([`treeattn::backend::cpu::num_threads`]) when the product
//! is large enough to pay for the hand-off; each row is computed by one
//! call, in the same order whatever the thread count.

use std::any::TypeId;

use treeattn::backend::cpu::{num_threads, run_parallel, CpuFloat};

/// Multiply-adds below which a product stays on the calling thread.
const PARALLEL_WORK: usize = 1 << 18;

/// A read-only strided matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix whose rows are `cols` apart.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix whose rows are `cols` apart:
    /// element `(i, j)` is `data[j * cols + i]`.
    pub fn transposed(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Panics unless every element of a `rows × cols` view lies in `data`.
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.rs + (cols - 1) * self.cs;
            assert!(
                last < self.data.len(),
                "matmul: {what} view {rows}x{cols} (strides {}, {}) exceeds {} elements",
                self.rs,
                self.cs,
                self.data.len()
            );
        }
    }

    /// The view from row `r` on.
    fn skip_rows(self, r: usize) -> Self {
        Mat {
            data: &self.data[(r * self.rs).min(self.data.len())..],
            ..self
        }
    }
}

/// `C = A · B`, or `C += A · B` with `accumulate`: `A` is `m × k`, `B` is
/// `k × n`, `C` is row-major `m × n` (`c.len() == m * n`).
///
/// Panics when a view does not fit its slice.
pub(crate) fn matmul<T: CpuFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    accumulate: bool,
) {
    assert_eq!(c.len(), m * n, "matmul: C is not m × n");
    a.check(m, k, "A");
    b.check(k, n, "B");
    if m == 0 || n == 0 {
        return;
    }
    let threads = if m * k * n < PARALLEL_WORK {
        1
    } else {
        num_threads().min(m)
    };
    let per = m.div_ceil(threads.max(1));
    let work: Vec<_> = c.chunks_mut(per * n).enumerate().collect();
    run_parallel(
        work,
        threads,
        || (),
        |_, (i, c_rows)| {
            let rows = c_rows.len() / n;
            gemm(rows, k, n, a.skip_rows(i * per), b, c_rows, accumulate);
        },
    );
}

/// One `matrixmultiply` call on checked views: `rows × k` of `a`, `k × n` of
/// `b`, into the contiguous `rows × n` block `c`.
fn gemm<T: CpuFloat>(
    rows: usize,
    k: usize,
    n: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    accumulate: bool,
) {
    a.check(rows, k, "A rows");
    debug_assert_eq!(c.len(), rows * n);
    let (rsa, csa) = (a.rs as isize, a.cs as isize);
    let (rsb, csb) = (b.rs as isize, b.cs as isize);
    let beta = if accumulate { 1.0 } else { 0.0 };
    let (a, b, c) = (a.data.as_ptr(), b.data.as_ptr(), c.as_mut_ptr());
    // SAFETY: the views were checked to lie in their slices (`Mat::check`
    // for `a` here and `b` in `matmul`), `c` holds `rows × n` elements
    // written row-major with strides (n, 1) and borrowed mutably, so it
    // aliases neither input; the casts are to the type `T` is (TypeId).
    unsafe {
        if TypeId::of::<T>() == TypeId::of::<f32>() {
            matrixmultiply::sgemm(
                rows,
                k,
                n,
                1.0,
                a.cast(),
                rsa,
                csa,
                b.cast(),
                rsb,
                csb,
                beta as f32,
                c.cast(),
                n as isize,
                1,
            );
        } else if TypeId::of::<T>() == TypeId::of::<f64>() {
            matrixmultiply::dgemm(
                rows,
                k,
                n,
                1.0,
                a.cast(),
                rsa,
                csa,
                b.cast(),
                rsb,
                csb,
                beta,
                c.cast(),
                n as isize,
                1,
            );
        } else {
            unreachable!("CpuFloat is implemented for f32 and f64 only");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use treeattn::rng::Rng;

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    /// Plain, transposed and accumulating products against a triple loop, in
    /// f64 and f32, on sizes that are not multiples of any block and large
    /// enough to take the threaded path.
    #[test]
    fn strided_products_match_the_definition() {
        let mut rng = Rng::new(5);
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 2),
            (37, 130, 17),
            (300, 70, 41),
            (4, 0, 3),
        ] {
            let a: Vec<f64> = (0..m * k).map(|_| rng.unit() - 0.5).collect();
            let b: Vec<f64> = (0..k * n).map(|_| rng.unit() - 0.5).collect();
            let want = naive(&a, &b, m, k, n);
            let close =
                |x: &[f64], y: &[f64], tol: f64| x.iter().zip(y).all(|(p, q)| (p - q).abs() <= tol);
            let tol = 1e-13 * (k as f64).max(1.0);
            let mut c = vec![7.0; m * n];
            matmul(m, k, n, Mat::rows(&a, k), Mat::rows(&b, n), &mut c, false);
            assert!(close(&c, &want, tol), "A·B {m}x{k}x{n}");
            // Bᵀ stored row-major [n, k], read as B.
            let bt: Vec<f64> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let mut c = vec![1.0; m * n];
            matmul(
                m,
                k,
                n,
                Mat::rows(&a, k),
                Mat::transposed(&bt, k),
                &mut c,
                true,
            );
            let plus_one: Vec<f64> = want.iter().map(|v| v + 1.0).collect();
            assert!(close(&c, &plus_one, tol), "C + A·(Bᵀ)ᵀ {m}x{k}x{n}");
            let (a32, b32): (Vec<f32>, Vec<f32>) = (
                a.iter().map(|&x| x as f32).collect(),
                b.iter().map(|&x| x as f32).collect(),
            );
            let mut c32 = vec![0.0f32; m * n];
            matmul(
                m,
                k,
                n,
                Mat::rows(&a32, k),
                Mat::rows(&b32, n),
                &mut c32,
                false,
            );
            let c64: Vec<f64> = c32.iter().map(|&x| x as f64).collect();
            assert!(
                close(&c64, &want, 1e-6 * (k as f64).max(1.0)),
                "f32 {m}x{k}x{n}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "exceeds")]
    fn a_view_past_its_slice_panics() {
        let (a, b) = (vec![0.0f32; 5], vec![0.0f32; 6]);
        let mut c = vec![0.0f32; 9];
        matmul(3, 2, 3, Mat::rows(&a, 2), Mat::rows(&b, 3), &mut c, false);
    }
}
