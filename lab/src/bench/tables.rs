//! The comparisons the `treeattn bench` command prints: [`quick`] (every
//! method timed on every shape, [`Table`]), [`costs`] (tokens and pairs
//! without timing, [`CostTable`]) and [`sdcc_table`] (SDCC fused against
//! unfused, [`SdccTable`]), each with its `Display`.

use std::fmt;

use super::diagnosis::{forward_balance, kernel_utilization, tile_utilization};
use super::mask_of;
use super::timing::{measure, measure_round_robin, Timing};
use super::workloads::{Case, Cost, Method, Pass, SdccCase, Workload, SHAPES};
use crate::gen::{Shape, Size};
use treeattn::backend::cpu::{
    gather_counts, num_threads, tile_counts, GatherCounts, TileCounts, BLOCK_KEYS, BLOCK_QUERIES,
    TILE,
};
use treeattn::{Error, Result};

/// One measured SDCC variant of [`sdcc_table`].
#[derive(Clone, Debug, PartialEq)]
pub struct SdccRow {
    /// Vocabulary size: logits per row.
    pub vocab: usize,
    /// (student row, teacher row) pairs, i.e. diverging targets, in the
    /// [`SdccCase`].
    pub pairs: usize,
    /// `"fused"` or `"unfused"`.
    pub method: &'static str,
    /// Median wall and CPU time of one call (forward KL and student
    /// gradient), seconds.
    pub time: Timing,
    /// Peak bytes by the buffer arithmetic of [`SdccCase`].
    pub peak_bytes: usize,
}

/// The SDCC comparison: fused against unfused on [`SdccCase`]s of `pairs`
/// pairs for each vocabulary size, `reps` timed runs each (median). `Display`
/// prints one line per (vocab, method) with the ratios unfused ÷ fused.
#[derive(Clone, Debug, PartialEq)]
pub struct SdccTable {
    /// Threads of the CPU backend ([`num_threads`]) during the runs.
    pub threads: usize,
    /// Timed runs per row; each row reports their median.
    pub reps: usize,
    /// A fused row then an unfused row for each vocabulary size, in the
    /// order given.
    pub rows: Vec<SdccRow>,
}

/// Measures [`SdccTable`]; the fused and unfused results are checked to
/// agree (loss within 1e-4 relative) before timing, so both compute the
/// same thing.
///
/// Errors: `reps` or `pairs` of 0, a vocabulary of 0, or fused and unfused
/// disagreeing.
pub fn sdcc_table(pairs: usize, vocabs: &[usize], reps: usize) -> Result<SdccTable> {
    if pairs == 0 || vocabs.contains(&0) {
        return Err(Error::Usage(
            "SDCC pairs and vocabulary sizes must be positive".into(),
        ));
    }
    let mut rows = Vec::new();
    for &vocab in vocabs {
        let case = SdccCase::new(pairs, vocab, 7);
        let (a, b) = (case.fused()?, case.unfused()?);
        if (a.loss.loss_sum - b.loss.loss_sum).abs() > 1e-4 * a.loss.loss_sum.abs() {
            return Err(Error::Shape(format!(
                "fused and unfused SDCC disagree at vocab {vocab}: {} vs {}",
                a.loss.loss_sum, b.loss.loss_sum
            )));
        }
        let fused = measure(reps, || case.fused().map(drop))?;
        let unfused = measure(reps, || case.unfused().map(drop))?;
        rows.push(SdccRow {
            vocab,
            pairs,
            method: "fused",
            time: fused,
            peak_bytes: case.fused_peak_bytes(),
        });
        rows.push(SdccRow {
            vocab,
            pairs,
            method: "unfused",
            time: unfused,
            peak_bytes: case.unfused_peak_bytes(),
        });
    }
    Ok(SdccTable {
        threads: num_threads(),
        reps,
        rows,
    })
}

impl fmt::Display for SdccTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "SDCC forward KL + student gradient, CPU, f32 logits: fused (one pass over vocabulary chunks) vs \
             unfused (materialised softmaxes);\n{} threads, median of {} reps; peak = heap bytes by buffer \
             arithmetic (lab/benches/sdcc.rs counts them with a global allocator); × = ÷ fused\n",
            self.threads, self.reps
        )?;
        writeln!(
            f,
            "{:>7} {:>6} {:<8} {:>9} {:>9} {:>10} {:>7} {:>7}",
            "vocab", "pairs", "method", "ms", "cpu ms", "peak MiB", "time×", "peak×"
        )?;
        for r in &self.rows {
            let fused = self
                .rows
                .iter()
                .find(|x| x.vocab == r.vocab && x.method == "fused")
                .unwrap_or(r);
            writeln!(
                f,
                "{:>7} {:>6} {:<8} {:>9.1} {:>9} {:>10.1} {:>7.2} {:>7.2}",
                r.vocab,
                r.pairs,
                r.method,
                r.time.wall_s * 1e3,
                r.time
                    .cpu_s
                    .map_or("-".to_string(), |c| format!("{:.1}", c * 1e3)),
                r.peak_bytes as f64 / (1024.0 * 1024.0),
                r.time.wall_s / fused.time.wall_s,
                r.peak_bytes as f64 / fused.peak_bytes as f64,
            )?;
        }
        Ok(())
    }
}

/// Settings of [`quick`].
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Shapes to run, in table order.
    pub shapes: Vec<Shape>,
    /// Generator preset of the rollouts ([`Size::Paper`] only for
    /// [`costs`]).
    pub size: Size,
    /// Seed of the rollout generators.
    pub seed: u64,
    /// Timed repetitions per measurement (after one warm-up); the median is
    /// reported.
    pub reps: usize,
    /// Query heads (= kv heads).
    pub heads: usize,
    /// Dimension of each head (lanes of Q, K, V and O per head).
    pub head_dim: usize,
}

impl Default for Options {
    /// Every shape of [`SHAPES`] at [`Size::Bench`], seed 0, 3 reps, 4 heads
    /// of dim 64.
    fn default() -> Self {
        Options {
            shapes: SHAPES.to_vec(),
            size: Size::Bench,
            seed: 0,
            reps: 3,
            heads: 4,
            head_dim: 64,
        }
    }
}

/// One measured (shape, method, pass).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The shape measured.
    pub shape: Shape,
    /// The attention method measured.
    pub method: Method,
    /// Forward only, or forward then backward.
    pub pass: Pass,
    /// Tokens, visible pairs and targets of the method on the shape.
    pub cost: Cost,
    /// Attention FLOPs over visible pairs.
    pub flops: f64,
    /// Median wall and CPU time of one run of `pass`, seconds.
    pub time: Timing,
}

impl Row {
    /// Visible-pair FLOPs per wall second.
    pub fn flops_per_s(&self) -> f64 {
        self.flops / self.time.wall_s
    }
    /// Visible-pair FLOPs per CPU second (all threads), where measured.
    pub fn flops_per_cpu_s(&self) -> Option<f64> {
        self.time.cpu_s.map(|c| self.flops / c)
    }
}

/// Per-shape facts of a [`Table`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeInfo {
    /// The shape described.
    pub shape: Shape,
    /// Junctions K (summed over the shape's rollouts).
    pub junctions: usize,
    /// LogitTree passes (branches).
    pub branches: usize,
    /// [`tile_utilization`] of the trie pack at the CPU backend's tile size
    /// ([`TILE`]): visible share of the entries in computed tiles.
    pub trie_tile_use: f64,
    /// [`tile_utilization`] of the causal pack at [`TILE`].
    pub causal_tile_use: f64,
    /// Visible pairs over [`computed_entries`](treeattn::backend::cpu::computed_entries) (the register blocks the CPU
    /// kernels compute) of the trie pack.
    pub trie_kernel_use: f64,
    /// The same ratio for the causal pack.
    pub causal_kernel_use: f64,
    /// The CPU backend's tile census of the trie pack.
    pub trie_tiles: TileCounts,
    /// Its partial tiles computed as chunks of gathered keys.
    pub trie_gather: GatherCounts,
    /// [`forward_balance`] of the trie pack over the backend's threads
    /// (1.0: perfect balance).
    pub trie_balance: f64,
    /// [`forward_balance`] of the causal pack.
    pub causal_balance: f64,
}

/// The result of [`quick`]; `Display` prints the comparison table and the
/// per-shape summary.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// The settings the table was measured with.
    pub options: Options,
    /// Threads of the CPU backend ([`num_threads`]) during the runs.
    pub threads: usize,
    /// Per-shape facts, in the order of `options.shapes`.
    pub shapes: Vec<ShapeInfo>,
    /// One row per (shape, method, pass): shapes in order, methods in
    /// [`Method::ALL`] order, forward before forward+backward.
    pub rows: Vec<Row>,
}

impl Table {
    /// The row of `(shape, method, pass)`, if measured.
    pub fn row(&self, shape: Shape, method: Method, pass: Pass) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.shape == shape && r.method == method && r.pass == pass)
    }

    /// The row's median wall time over the trie pack's, same shape and pass.
    pub fn time_ratio(&self, row: &Row) -> Option<f64> {
        self.row(row.shape, Method::Trie, row.pass)
            .map(|t| row.time.wall_s / t.time.wall_s)
    }

    /// The trie pack's visible-pair FLOP/s over the plain causal pack's (of
    /// the same length), for `shape` and `pass`: the throughput
    /// criterion (≥ 0.9). By wall time, and by CPU time where measured.
    pub fn causal_throughput_ratio(&self, shape: Shape, pass: Pass) -> Option<(f64, Option<f64>)> {
        let t = self.row(shape, Method::Trie, pass)?;
        let c = self.row(shape, Method::Causal, pass)?;
        let cpu = match (t.flops_per_cpu_s(), c.flops_per_cpu_s()) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
        Some((t.flops_per_s() / c.flops_per_s(), cpu))
    }
}

/// Runs the comparison of the [module docs](super): for every shape, every
/// [`Method`] forward and forward+backward, `reps` timed runs each (median),
/// on the CPU backend in f32 with the backend's thread count.
///
/// Errors: no shapes, `reps`, `heads` or `head_dim` of 0, [`Size::Paper`]
/// (too large to time here; see [`costs`]), and any error of the generators
/// or the ops.
pub fn quick(opts: &Options) -> Result<Table> {
    quick_with(opts, |_| Ok(()))
}

/// [`quick`], handing the table's text to `emit` as it is produced: the
/// header first, then each shape's rows as soon as that shape is timed (a
/// full run takes minutes); the summary is [`Table::summary`] once it
/// returns. An `Err` from `emit` stops the run.
pub fn quick_with(opts: &Options, mut emit: impl FnMut(&str) -> Result<()>) -> Result<Table> {
    if opts.shapes.is_empty() {
        return Err(Error::Usage("no shapes to benchmark".into()));
    }
    if opts.reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    if opts.size == Size::Paper {
        return Err(Error::Usage(
            "paper-scale trees (up to ~200k tokens) take hours to time on the CPU and the dense-mask \
             baseline cannot hold them; use --costs-only for their tokens and FLOPs"
                .into(),
        ));
    }
    let mut table = Table {
        options: opts.clone(),
        threads: num_threads(),
        shapes: Vec::new(),
        rows: Vec::new(),
    };
    emit(&table.text(|t, f| t.write_head(f)))?;
    for &shape in &opts.shapes {
        let w = Workload::generate(shape, opts.seed, opts.size)?;
        table.shapes.push(ShapeInfo {
            shape,
            junctions: w.junctions,
            branches: w.logittree.len(),
            trie_tile_use: tile_utilization(&w.trie, TILE),
            causal_tile_use: tile_utilization(&w.causal, TILE),
            trie_kernel_use: kernel_utilization(&w.trie),
            causal_kernel_use: kernel_utilization(&w.causal),
            trie_tiles: tile_counts(mask_of(&w.trie)),
            trie_gather: gather_counts(mask_of(&w.trie)),
            trie_balance: forward_balance(&w.trie, opts.heads, num_threads()),
            causal_balance: forward_balance(&w.causal, opts.heads, num_threads()),
        });
        // Every (method, pass) of the shape, each with output buffers
        // allocated once outside the timed runs.
        let cases = Method::ALL
            .into_iter()
            .map(|method| Case::new(&w, method, opts.heads, opts.head_dim))
            .collect::<Result<Vec<_>>>()?;
        let mut units: Vec<_> = cases
            .iter()
            .flat_map(|case| {
                [Pass::Forward, Pass::ForwardBackward].map(|pass| (case, pass, case.outputs()))
            })
            .collect();
        let times = measure_round_robin(opts.reps, &mut units, |(case, pass, out)| {
            case.run_into(*pass, out)
        })?;
        for ((case, pass, _), time) in units.iter().zip(times) {
            table.rows.push(Row {
                shape,
                method: case.method,
                pass: *pass,
                cost: case.cost,
                flops: case.flops(*pass),
                time,
            });
        }
        emit(&table.text(|t, f| t.write_rows(f, shape)))?;
    }
    Ok(table)
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_head(f)?;
        for s in &self.shapes {
            self.write_rows(f, s.shape)?;
        }
        self.write_summary(f)
    }
}

impl Table {
    /// The summary and diagnosis that follow the rows.
    pub fn summary(&self) -> String {
        self.text(|t, f| t.write_summary(f))
    }

    fn text(&self, write: impl Fn(&Self, &mut String) -> fmt::Result) -> String {
        let mut s = String::new();
        write(self, &mut s).expect("writing to a String does not fail");
        s
    }

    fn write_head(&self, f: &mut dyn fmt::Write) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "attention, CPU backend, f32: {} heads × head dim {}, {} threads, size {}, seed {}, median of {} reps",
            o.heads, o.head_dim, self.threads, o.size.name(), o.seed, o.reps
        )?;
        writeln!(
            f,
            "GFLOP = 4·d·heads per visible pair (fwd), ×3.5 for fwd+bwd; ms = wall, cpu ms = all threads; \
             ×-columns are ratios to the trie pack, same shape and pass;\n\
             CPU backend outputs written into buffers allocated once outside the timed runs \
             (as a training loop or caching allocator reuses them); dense-mask allocates per call\n"
        )?;
        writeln!(
            f,
            "{:<11} {:<17} {:<8} {:>6} {:>5} {:>9} {:>7} {:>5} {:>8} {:>8} {:>7} {:>6}",
            "shape",
            "method",
            "pass",
            "tokens",
            "tok×",
            "pairs",
            "GFLOP",
            "flop×",
            "ms",
            "cpu ms",
            "GFLOP/s",
            "time×"
        )
    }

    fn write_rows(&self, f: &mut dyn fmt::Write, shape: Shape) -> fmt::Result {
        let opt =
            |x: Option<f64>, scale: f64| x.map_or("-".to_string(), |v| format!("{:.1}", v * scale));
        for r in self.rows.iter().filter(|r| r.shape == shape) {
            let trie = self.row(r.shape, Method::Trie, r.pass);
            let rel = |x: f64, y: Option<f64>| y.map_or(f64::NAN, |y| x / y);
            writeln!(
                f,
                "{:<11} {:<17} {:<8} {:>6} {:>5.2} {:>9} {:>7.3} {:>5.2} {:>8.1} {:>8} {:>7.2} {:>6.2}",
                r.shape.name(),
                r.method.name(),
                r.pass.name(),
                r.cost.tokens,
                rel(r.cost.tokens as f64, trie.map(|t| t.cost.tokens as f64)),
                r.cost.pairs,
                r.flops * 1e-9,
                rel(r.flops, trie.map(|t| t.flops)),
                r.time.wall_s * 1e3,
                opt(r.time.cpu_s, 1e3),
                r.flops_per_s() * 1e-9,
                rel(r.time.wall_s, trie.map(|t| t.time.wall_s)),
            )?;
        }
        Ok(())
    }

    fn write_summary(&self, f: &mut dyn fmt::Write) -> fmt::Result {
        writeln!(f)?;
        writeln!(
            f,
            "summary: tree/causal = trie GFLOP/s ÷ causal GFLOP/s at the same length (target ≥ 0.90), by wall \
             and by CPU time;\ntile use = visible share of the entries in computed tiles, trie / causal; \
             logittree and replicated: time, FLOPs and tokens ÷ the trie's (both have the same FLOPs and \
             tokens);\ntrie÷naive: the trie's tokens, FLOPs and time ÷ Naive-Compressed's (the paper's 4D mask \
             costs 1.35×)"
        )?;
        writeln!(
            f,
            "{:<11} {:>2} {:>3} {:<8} {:>11} {:>6} {:>11} {:>18} {:>11} {:>18}",
            "shape",
            "K",
            "K+1",
            "pass",
            "tree/causal",
            "(cpu)",
            "tile use",
            "logittree t/f/tok",
            "replicated",
            "trie÷naive tok/f/t"
        )?;
        let num = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        for s in &self.shapes {
            for pass in [Pass::Forward, Pass::ForwardBackward] {
                let trie = self.row(s.shape, Method::Trie, pass);
                let over_trie = |m: Method| {
                    let r = self.row(s.shape, m, pass);
                    let ratio = |g: &dyn Fn(&Row) -> f64| match (r, trie) {
                        (Some(r), Some(t)) => Some(g(r) / g(t)),
                        _ => None,
                    };
                    (
                        ratio(&|r| r.time.wall_s),
                        ratio(&|r| r.flops),
                        ratio(&|r| r.cost.tokens as f64),
                    )
                };
                let (wall, cpu) = match self.causal_throughput_ratio(s.shape, pass) {
                    Some((w, c)) => (Some(w), c),
                    None => (None, None),
                };
                let lt = over_trie(Method::LogitTree);
                let naive = over_trie(Method::NaiveCompressed);
                let inv = |x: Option<f64>| x.map(|v| 1.0 / v);
                writeln!(
                    f,
                    "{:<11} {:>2} {:>3} {:<8} {:>11} {:>6} {:>11} {:>18} {:>11} {:>18}",
                    s.shape.name(),
                    s.junctions,
                    s.branches,
                    pass.name(),
                    num(wall),
                    num(cpu),
                    format!("{:.2} / {:.2}", s.trie_tile_use, s.causal_tile_use),
                    format!("{} / {} / {}", num(lt.0), num(lt.1), num(lt.2)),
                    num(over_trie(Method::Replicated).0),
                    format!(
                        "{} / {} / {}",
                        num(inv(naive.2)),
                        num(inv(naive.1)),
                        num(inv(naive.0))
                    ),
                )?;
            }
        }
        writeln!(f)?;
        writeln!(
            f,
            "diagnosis of tree/causal: trie tiles ({TILE}×{TILE}) skipped / full / partial, of the partial ones gathered → chunks of \
             {TILE} keys; kernel use = visible pairs ÷ entries the \
             kernels compute ({BLOCK_QUERIES}×{BLOCK_KEYS} blocks), trie / causal;\nper-entry = (tree/causal by CPU time) ÷ (trie ÷ causal \
             kernel use): the speed per computed entry on the tree relative to causal (below 1: partial-tile, masking\nand per-call \
             overheads weigh more on the tree); balance = simulated forward thread balance, trie / causal"
        )?;
        writeln!(
            f,
            "{:<11} {:>20} {:>9} {:>13} {:>17} {:>13}",
            "shape", "skip/full/partial", "gathered", "kernel use", "per-entry fwd/bwd", "balance"
        )?;
        for s in &self.shapes {
            let use_ratio = s.trie_kernel_use / s.causal_kernel_use;
            let per_entry = |pass| {
                self.causal_throughput_ratio(s.shape, pass)
                    .and_then(|(_, cpu)| cpu)
                    .map_or("-".to_string(), |c| format!("{:.2}", c / use_ratio))
            };
            let (t, g) = (s.trie_tiles, s.trie_gather);
            writeln!(
                f,
                "{:<11} {:>20} {:>9} {:>13} {:>17} {:>13}",
                s.shape.name(),
                format!("{}/{}/{}", t.skip, t.full, t.partial),
                format!("{}→{}", g.tiles, g.chunks),
                format!("{:.3} / {:.3}", s.trie_kernel_use, s.causal_kernel_use),
                format!(
                    "{} / {}",
                    per_entry(Pass::Forward),
                    per_entry(Pass::ForwardBackward)
                ),
                format!("{:.2} / {:.2}", s.trie_balance, s.causal_balance),
            )?;
        }
        Ok(())
    }
}

/// Tokens and visible pairs of every method on every shape, without
/// timing anything: the comparison for sizes too large to time on a CPU
/// ([`Size::Paper`]). `Display` prints one line per shape.
#[derive(Clone, Debug, PartialEq)]
pub struct CostTable {
    /// Generator preset of the rollouts.
    pub size: Size,
    /// Seed of the rollout generators.
    pub seed: u64,
    /// One entry per shape, in the order of [`Options::shapes`].
    pub shapes: Vec<ShapeCosts>,
}

/// One shape of a [`CostTable`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeCosts {
    /// The shape counted.
    pub shape: Shape,
    /// Junctions K, summed over the shape's rollouts.
    pub junctions: usize,
    /// Root-to-leaf branches of the tree (LogitTree's passes).
    pub branches: usize,
    /// In [`Method::ALL`] order.
    pub costs: Vec<(Method, Cost)>,
}

impl ShapeCosts {
    /// The cost of `method`.
    pub fn cost(&self, method: Method) -> Cost {
        self.costs
            .iter()
            .find(|(m, _)| *m == method)
            .map(|(_, c)| *c)
            .expect("every method is costed")
    }
}

/// Builds the workloads of `opts.shapes` at `opts.size` from `opts.seed`
/// and counts each method's tokens and visible pairs (no attention runs;
/// `reps`, `heads` and `head_dim` are not used).
///
/// Errors: no shapes, and any error of the generators.
pub fn costs(opts: &Options) -> Result<CostTable> {
    if opts.shapes.is_empty() {
        return Err(Error::Usage("no shapes to count".into()));
    }
    let mut shapes = Vec::new();
    for &shape in &opts.shapes {
        let w = Workload::generate(shape, opts.seed, opts.size)?;
        shapes.push(ShapeCosts {
            shape,
            junctions: w.junctions,
            branches: w.logittree.len(),
            costs: Method::ALL.iter().map(|&m| (m, w.cost(m))).collect(),
        });
    }
    Ok(CostTable {
        size: opts.size,
        seed: opts.seed,
        shapes,
    })
}

impl fmt::Display for CostTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tokens and visible pairs (FLOPs ∝ pairs), size {}, seed {}; LogitTree and the replicated pack \
             have the same tokens and pairs;\n×-columns: that method ÷ trie; trie÷naive: trie ÷ Naive-Compressed \
             (the paper's 4D mask costs 1.35×);\nnaive scores: the share of the sampled tokens Naive-Compressed \
             trains on at all (the exact methods score every one)\n",
            self.size.name(),
            self.seed
        )?;
        writeln!(
            f,
            "{:<11} {:>2} {:>3} {:>8} {:>13} {:>14} {:>14} {:>11} {:>11} {:>12} {:>12}",
            "shape",
            "K",
            "K+1",
            "trie tok",
            "trie pairs",
            "logittree tok×",
            "logittree flop×",
            "naive tok",
            "trie÷naive tok",
            "trie÷naive flop",
            "naive scores"
        )?;
        for s in &self.shapes {
            let (t, r, n) = (
                s.cost(Method::Trie),
                s.cost(Method::LogitTree),
                s.cost(Method::NaiveCompressed),
            );
            let ratio = |a: u64, b: u64| a as f64 / b as f64;
            writeln!(
                f,
                "{:<11} {:>2} {:>3} {:>8} {:>13} {:>14.2} {:>14.2} {:>11} {:>11.2} {:>12.2} {:>11.0}%",
                s.shape.name(),
                s.junctions,
                s.branches,
                t.tokens,
                t.pairs,
                ratio(r.tokens, t.tokens),
                ratio(r.pairs, t.pairs),
                n.tokens,
                ratio(t.tokens, n.tokens),
                ratio(t.pairs, n.pairs),
                100.0 * ratio(n.targets, t.targets),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workloads::Workload;

    #[test]
    fn sdcc_table_measures_both_variants() {
        let t = sdcc_table(3, &[500, 700], 1).unwrap();
        assert_eq!(t.rows.len(), 4);
        let fused = &t.rows[0];
        assert_eq!((fused.vocab, fused.method), (500, "fused"));
        assert!(t.rows[1].peak_bytes > fused.peak_bytes);
        let text = t.to_string();
        assert!(
            text.contains("unfused") && text.lines().any(|l| l.trim_start().starts_with("700"))
        );
        assert!(matches!(sdcc_table(0, &[500], 1), Err(Error::Usage(_))));
        assert!(matches!(sdcc_table(3, &[0], 1), Err(Error::Usage(_))));
        assert!(matches!(sdcc_table(3, &[500], 0), Err(Error::Usage(_))));
    }

    #[test]
    fn quick_measures_every_method_and_pass() {
        let opts = Options {
            shapes: vec![Shape::Fold, Shape::Grpo],
            size: Size::Small,
            seed: 1,
            reps: 1,
            heads: 1,
            head_dim: 8,
        };
        // Printed as produced: the header, then one piece per shape holding
        // that shape's rows; with the summary they make the whole table.
        let mut pieces = Vec::new();
        let t = quick_with(&opts, |s| {
            pieces.push(s.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(pieces.len(), 1 + 2, "{pieces:?}");
        assert!(pieces[0].contains("GFLOP/s") && !pieces[0].contains("fold"));
        assert!(pieces[1].lines().all(|l| l.starts_with("fold")));
        assert!(pieces[2].lines().all(|l| l.starts_with("grpo")));
        assert_eq!(pieces.concat() + &t.summary(), t.to_string());
        assert_eq!(t.rows.len(), 2 * Method::ALL.len() * 2);
        for s in [Shape::Fold, Shape::Grpo] {
            for pass in [Pass::Forward, Pass::ForwardBackward] {
                let trie = t.row(s, Method::Trie, pass).unwrap();
                assert_eq!(t.time_ratio(trie), Some(1.0));
                assert!(trie.time.wall_s > 0.0 && trie.flops > 0.0);
                assert!(
                    trie.time.cpu_s.is_some_and(|c| c > 0.0),
                    "Linux reports CPU time"
                );
                let (wall, cpu) = t.causal_throughput_ratio(s, pass).unwrap();
                assert!(wall.is_finite() && wall > 0.0 && cpu.unwrap() > 0.0);
            }
        }
        let text = t.to_string();
        assert!(text.contains("naive-compressed") && text.contains("dense-mask"));
        assert!(text
            .lines()
            .any(|l| l.starts_with("grpo") && l.contains("16")));
        for bad in [
            Options {
                reps: 0,
                ..opts.clone()
            },
            Options {
                heads: 0,
                ..opts.clone()
            },
            Options {
                head_dim: 0,
                ..opts.clone()
            },
            Options {
                shapes: vec![],
                ..opts.clone()
            },
            Options {
                size: Size::Paper,
                ..opts.clone()
            },
        ] {
            assert!(matches!(quick(&bad), Err(Error::Usage(_))), "{bad:?}");
        }
    }

    #[test]
    fn cost_table_counts_every_method_without_timing() {
        let opts = Options {
            shapes: vec![Shape::StackPop, Shape::Grpo],
            size: Size::Small,
            ..Options::default()
        };
        let t = costs(&opts).unwrap();
        assert_eq!(t.shapes.len(), 2);
        for s in &t.shapes {
            let w = Workload::generate(s.shape, 0, Size::Small).unwrap();
            for m in Method::ALL {
                assert_eq!(s.cost(m), w.cost(m), "{:?} {m:?}", s.shape);
            }
        }
        let text = t.to_string();
        assert!(text
            .lines()
            .any(|l| l.starts_with("grpo") && l.contains(" 16 ")));
        let none = Options {
            shapes: vec![],
            ..opts
        };
        assert!(matches!(costs(&none), Err(Error::Usage(_))));
    }
}
