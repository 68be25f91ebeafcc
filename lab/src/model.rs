//! A tiny Llama-style transformer with a hand-written backward: the reference
//! model that shows a packed conditioning tree trains *exactly* like
//! LogitTree's K+1 separate passes (same per-target log-probs, same gradient
//! for every parameter).
//!
//! Architecture (pre-norm), hidden states `x ∈ R^{L×d}` over the `L` packed
//! tokens:
//!
//! ```text
//! x = E[tokens]                                             embedding
//! per layer:
//!     h = RMSNorm(x; g_attn)        RMSNorm(x; g)_j = g_j · x_j / sqrt(mean_i x_i² + ε)
//!     q = h W_q,  k = h W_k,  v = h W_v                     GQA: q_heads·hd, kv_heads·hd columns
//!     o = Attention(q, k, v)                                the pack's interval mask; RoPE applied
//!                                                           inside the op with the pack's position ids
//!     x = x + o W_o
//!     h = RMSNorm(x; g_mlp)
//!     x = x + (silu(h W_gate) ⊙ (h W_up)) W_down           silu(z) = z · σ(z)
//! x_f = RMSNorm(x; g_final)
//! logits[r] = W_lm x_f[r]                                   W_lm = E when the head is tied
//! log p(label | r) = logits[r][label] − logsumexp(logits[r])
//! ```
//!
//! A [`Target`] `(row, label, weight)` scores `label` at logit row `row`
//! (DESIGN §4: the row is the label's parent in the tree, not necessarily the
//! previous packed row). [`Model::backward`] returns the gradient of the
//! weighted log-likelihood
//!
//! ```text
//! J(θ) = Σ_e weight_e · log p(label_e | row_e)
//! ```
//!
//! with respect to every parameter — the *ascent* direction; a trainer that
//! minimises the loss `−J / N` steps along `+∂J/∂θ / N`.
//!
//! Memory is linear in the number of tokens: activations are `[L, d]`,
//! `[L, heads·hd]` or `[L, ffn]`, logits are kept only at target rows, and the
//! attention op never forms an `L×L` matrix. Matmuls are the crate's one CPU
//! matrix product (the private `matmul` module), split over rows across the CPU
//! backend's threads when large enough.
//!
//! The attention call goes through the crate's contract
//! ([`AttentionBackend`] on host memory), so the same model runs on any host
//! backend; [`Cpu`] (the crate's reference op) is the default.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::gen::Rng;
use crate::matmul::{matmul as gemm, Mat};
use treeattn::backend::cpu::{Cpu, CpuFloat};
use treeattn::backend::{AttentionBackend, AttnArgs, AttnGrads, Host, HostAttention, Saved};
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::mask::PackMask;
use treeattn::pack::Pack;
use treeattn::{Error, Result};

/// Sizes and switches of the tiny transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Token ids and labels must be `< vocab`.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Divides `q_heads` (GQA).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn_dim: usize,
    /// Rotary embedding inside the attention op, with the pack's position ids.
    pub rope: Option<Rope>,
    /// LM head shares the embedding matrix (`W_lm = E`).
    pub tied_embeddings: bool,
    /// ε of every RMSNorm.
    pub rms_eps: f64,
}

impl ModelConfig {
    /// A small GQA + RoPE configuration (d_model 32, 2 layers, 4 query heads
    /// over 2 kv heads of dim 8, SwiGLU width 64, untied head).
    pub fn tiny(vocab: usize) -> Self {
        ModelConfig {
            vocab,
            d_model: 32,
            layers: 2,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            ffn_dim: 64,
            rope: Some(Rope {
                base: 10_000.0,
                dims: 8,
            }),
            tied_embeddings: false,
            rms_eps: 1e-6,
        }
    }

    /// Checks that every size is positive and the attention settings fit.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("layers", self.layers),
            ("ffn_dim", self.ffn_dim),
        ] {
            if v == 0 {
                return Err(Error::Shape(format!("model config: {name} must be > 0")));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(Error::Unsupported(format!(
                "model config: rms_eps {} must be finite and > 0",
                self.rms_eps
            )));
        }
        let shape = self.attn_shape(0);
        shape.validate()?;
        self.attn_params().validate(&shape)
    }

    /// The attention shape for a pack of `tokens` tokens.
    pub fn attn_shape(&self, tokens: usize) -> AttnShape {
        AttnShape {
            tokens,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            v_head_dim: self.head_dim,
        }
    }

    /// `softmax_scale = 1/sqrt(head_dim)` and the configured rotary embedding.
    pub fn attn_params(&self) -> AttnParams {
        AttnParams {
            rope: self.rope,
            ..AttnParams::new(self.head_dim)
        }
    }

    fn q_width(&self) -> usize {
        self.q_heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The weights of one layer, row-major; a projection `W` of shape `[in, out]`
/// maps a row `h` to `h W`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerParams<T> {
    /// `[d_model]`
    pub attn_norm: Vec<T>,
    /// `[d_model, q_heads·head_dim]`
    pub wq: Vec<T>,
    /// `[d_model, kv_heads·head_dim]`
    pub wk: Vec<T>,
    /// `[d_model, kv_heads·head_dim]`
    pub wv: Vec<T>,
    /// `[q_heads·head_dim, d_model]`
    pub wo: Vec<T>,
    /// `[d_model]`
    pub mlp_norm: Vec<T>,
    /// `[d_model, ffn_dim]`
    pub w_gate: Vec<T>,
    /// `[d_model, ffn_dim]`
    pub w_up: Vec<T>,
    /// `[ffn_dim, d_model]`
    pub w_down: Vec<T>,
}

impl<T> LayerParams<T> {
    fn named(&self) -> [(&'static str, &Vec<T>); 9] {
        [
            ("attn_norm", &self.attn_norm),
            ("wq", &self.wq),
            ("wk", &self.wk),
            ("wv", &self.wv),
            ("wo", &self.wo),
            ("mlp_norm", &self.mlp_norm),
            ("w_gate", &self.w_gate),
            ("w_up", &self.w_up),
            ("w_down", &self.w_down),
        ]
    }

    fn named_mut(&mut self) -> [(&'static str, &mut Vec<T>); 9] {
        [
            ("attn_norm", &mut self.attn_norm),
            ("wq", &mut self.wq),
            ("wk", &mut self.wk),
            ("wv", &mut self.wv),
            ("wo", &mut self.wo),
            ("mlp_norm", &mut self.mlp_norm),
            ("w_gate", &mut self.w_gate),
            ("w_up", &mut self.w_up),
            ("w_down", &mut self.w_down),
        ]
    }
}

/// All weights of the model (and, with the same layout, their gradients).
#[derive(Clone, Debug, PartialEq)]
pub struct Params<T> {
    /// `[vocab, d_model]`
    pub embed: Vec<T>,
    /// One block's weights per layer.
    pub layers: Vec<LayerParams<T>>,
    /// `[d_model]`
    pub final_norm: Vec<T>,
    /// `[vocab, d_model]`; `None` when the head is tied to `embed`.
    pub lm_head: Option<Vec<T>>,
}

/// How a tensor is initialised.
#[derive(Clone, Copy)]
enum Init {
    /// Uniform with this standard deviation, centred at 0.
    Uniform(f64),
    /// RMSNorm gains: `1 + U(−0.1, 0.1)`, random so that no gain gradient is
    /// hidden behind a symmetric initialisation.
    Gain,
}

impl<T: CpuFloat> Params<T> {
    /// Builds every tensor of `cfg` with `make(len, init)`, in a fixed order.
    fn build(cfg: &ModelConfig, mut make: impl FnMut(usize, Init) -> Vec<T>) -> Self {
        let (d, f, qw, kw) = (cfg.d_model, cfg.ffn_dim, cfg.q_width(), cfg.kv_width());
        let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f64).sqrt());
        let embed = make(
            cfg.vocab * d,
            Init::Uniform(if cfg.tied_embeddings {
                1.0 / (d as f64).sqrt()
            } else {
                0.5
            }),
        );
        let layers = (0..cfg.layers)
            .map(|_| LayerParams {
                attn_norm: make(d, Init::Gain),
                wq: make(d * qw, lin(d)),
                wk: make(d * kw, lin(d)),
                wv: make(d * kw, lin(d)),
                wo: make(qw * d, lin(qw)),
                mlp_norm: make(d, Init::Gain),
                w_gate: make(d * f, lin(d)),
                w_up: make(d * f, lin(d)),
                w_down: make(f * d, lin(f)),
            })
            .collect();
        let final_norm = make(d, Init::Gain);
        let lm_head = (!cfg.tied_embeddings).then(|| make(cfg.vocab * d, lin(d)));
        Params {
            embed,
            layers,
            final_norm,
            lm_head,
        }
    }

    /// Random weights, a deterministic function of `(cfg, seed)`: projections
    /// uniform with standard deviation `1/sqrt(fan_in)`, RMSNorm gains near 1.
    pub fn random(cfg: &ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut rng = Rng::new(seed);
        Ok(Self::build(cfg, |len, init| {
            (0..len)
                .map(|_| {
                    let u = 2.0 * rng.unit() - 1.0; // U(−1, 1), std 1/√3
                    T::from_f64(match init {
                        Init::Uniform(std) => u * std * 3f64.sqrt(),
                        Init::Gain => 1.0 + 0.1 * u,
                    })
                })
                .collect()
        }))
    }

    /// All-zero tensors with the layout of `cfg` (a gradient accumulator).
    pub fn zeros(cfg: &ModelConfig) -> Self {
        Self::build(cfg, |len, _| vec![T::ZERO; len])
    }

    /// Every tensor with its name (`embed`, `layers.{i}.{wq,…}`,
    /// `final_norm`, `lm_head`), in a fixed order.
    pub fn tensors(&self) -> Vec<(String, &[T])> {
        let mut out: Vec<(String, &[T])> = vec![("embed".into(), &self.embed)];
        for (i, layer) in self.layers.iter().enumerate() {
            out.extend(
                layer
                    .named()
                    .into_iter()
                    .map(|(n, t)| (format!("layers.{i}.{n}"), t.as_slice())),
            );
        }
        out.push(("final_norm".into(), &self.final_norm));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head".into(), h));
        }
        out
    }

    /// [`Params::tensors`], mutably.
    pub fn tensors_mut(&mut self) -> Vec<(String, &mut [T])> {
        let mut out: Vec<(String, &mut [T])> = vec![("embed".into(), &mut self.embed)];
        for (i, layer) in self.layers.iter_mut().enumerate() {
            out.extend(
                layer
                    .named_mut()
                    .into_iter()
                    .map(|(n, t)| (format!("layers.{i}.{n}"), t.as_mut_slice())),
            );
        }
        out.push(("final_norm".into(), &mut self.final_norm));
        if let Some(h) = &mut self.lm_head {
            out.push(("lm_head".into(), h));
        }
        out
    }

    /// Total number of scalars.
    pub fn len(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.len()).sum()
    }

    /// True when there is no scalar at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `self += other`, tensor by tensor (summing gradients of separate passes).
    pub fn add_assign(&mut self, other: &Params<T>) -> Result<()> {
        let theirs = other.tensors();
        let mut mine = self.tensors_mut();
        if mine.len() != theirs.len() {
            return Err(Error::Shape(format!(
                "cannot add parameter sets of {} and {} tensors",
                mine.len(),
                theirs.len()
            )));
        }
        for ((name, a), (other_name, b)) in mine.iter_mut().zip(&theirs) {
            if name != other_name || a.len() != b.len() {
                return Err(Error::Shape(format!(
                    "cannot add {other_name} ({} values) to {name} ({} values)",
                    b.len(),
                    a.len()
                )));
            }
            for (x, &y) in a.iter_mut().zip(b.iter()) {
                *x += y;
            }
        }
        Ok(())
    }

    /// Checks every tensor's length against `cfg`.
    fn check_layout(&self, cfg: &ModelConfig) -> Result<()> {
        let want = Params::<T>::zeros(cfg);
        let (have, want) = (self.tensors(), want.tensors());
        if have.len() != want.len() {
            return Err(Error::Shape(format!(
                "parameters have {} tensors, the config (layers {}, tied head {}) needs {}",
                have.len(),
                cfg.layers,
                cfg.tied_embeddings,
                want.len()
            )));
        }
        for ((name, t), (_, w)) in have.iter().zip(&want) {
            if t.len() != w.len() {
                return Err(Error::Shape(format!(
                    "parameter {name} has {} values, the config needs {}",
                    t.len(),
                    w.len()
                )));
            }
        }
        Ok(())
    }
}

/// One scored label: `log p(label | hidden state at packed row `row`)`,
/// weighted by `weight` in the objective `J`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Target {
    /// Packed row whose logits predict the label.
    pub row: u32,
    /// The target token.
    pub label: u32,
    /// Its weight in `J`.
    pub weight: f64,
}

/// Identity of a model instance and of its parameter version, stored in a
/// [`Forward`] so that a backward with stale activations is refused.
static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

/// The tiny transformer: configuration, weights and the attention backend.
pub struct Model<T, A = Cpu> {
    config: ModelConfig,
    params: Params<T>,
    attention: A,
    id: u64,
    version: u64,
}

impl<T: CpuFloat> Model<T, Cpu> {
    /// Random weights from `seed` ([`Params::random`]), CPU attention.
    pub fn new(config: ModelConfig, seed: u64) -> Result<Self> {
        let params = Params::random(&config, seed)?;
        Model::with_attention(config, params, Cpu::default())
    }
}

/// Activations of one layer saved for backward.
struct LayerTape<T> {
    /// Layer input (residual stream).
    x: Vec<T>,
    /// `1/sqrt(mean(x²) + ε)` per row, and the normalised `h` (times gain).
    r_attn: Vec<T>,
    h_attn: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    o: Vec<T>,
    lse: Vec<T>,
    /// Residual stream after attention.
    x_mid: Vec<T>,
    r_mlp: Vec<T>,
    h_mlp: Vec<T>,
    gate: Vec<T>,
    up: Vec<T>,
}

/// The result of [`Model::forward`]: per-target log-probs, plus everything
/// backward needs (linear in the number of tokens).
pub struct Forward<T> {
    /// `log p(label_e | row_e)`, one per target, in the order given.
    pub logprobs: Vec<T>,
    tokens: Vec<u32>,
    kv_end: Vec<u32>,
    position_ids: Vec<u32>,
    targets: Vec<Target>,
    layers: Vec<LayerTape<T>>,
    x_final: Vec<T>,
    r_final: Vec<T>,
    h_final: Vec<T>,
    /// Distinct target rows (ascending), each target's index into them, and
    /// the logits `[rows, vocab]` with their log-sum-exp.
    rows: Vec<u32>,
    row_of_target: Vec<usize>,
    row_logits: Vec<T>,
    row_lse: Vec<T>,
    model: (u64, u64),
}

impl<T: CpuFloat, A: AttentionBackend<T, Memory = Host, Lse = T>> Model<T, A> {
    /// A model from given weights and attention backend; checks the weights
    /// against the configuration.
    pub fn with_attention(config: ModelConfig, params: Params<T>, attention: A) -> Result<Self> {
        config.validate()?;
        params.check_layout(&config)?;
        Ok(Model {
            config,
            params,
            attention,
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            version: 0,
        })
    }

    /// The model's sizes and switches.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's weights.
    pub fn params(&self) -> &Params<T> {
        &self.params
    }

    /// Mutable weights. Any [`Forward`] taken before this call is refused by
    /// [`Model::backward`] afterwards (its activations are stale).
    pub fn params_mut(&mut self) -> &mut Params<T> {
        self.version += 1;
        &mut self.params
    }

    /// Runs the model over one pack — tokens, interval mask and position ids
    /// of any layout — and scores `targets`.
    pub fn forward(
        &self,
        tokens: &[u32],
        mask: PackMask<'_>,
        targets: &[Target],
    ) -> Result<Forward<T>> {
        let cfg = &self.config;
        let l = tokens.len();
        if mask.len() != l {
            return Err(Error::Shape(format!(
                "{l} tokens but a mask over {} keys",
                mask.len()
            )));
        }
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= cfg.vocab)
        {
            return Err(Error::Shape(format!(
                "token {t} at packed row {i} is outside the vocabulary of {}",
                cfg.vocab
            )));
        }
        for (e, t) in targets.iter().enumerate() {
            if t.row as usize >= l {
                return Err(Error::Shape(format!(
                    "target {e}: logit row {} is outside the pack of {l} tokens",
                    t.row
                )));
            }
            if t.label as usize >= cfg.vocab {
                return Err(Error::Shape(format!(
                    "target {e}: label {} is outside the vocabulary of {}",
                    t.label, cfg.vocab
                )));
            }
            if !t.weight.is_finite() {
                return Err(Error::NonFinite {
                    what: "target weights".into(),
                    index: e,
                });
            }
        }
        let (d, qw, kw, f) = (cfg.d_model, cfg.q_width(), cfg.kv_width(), cfg.ffn_dim);
        let shape = cfg.attn_shape(l);
        let attn_params = cfg.attn_params();

        let mut x = vec![T::ZERO; l * d];
        for (i, &t) in tokens.iter().enumerate() {
            x[i * d..(i + 1) * d]
                .copy_from_slice(&self.params.embed[t as usize * d..(t as usize + 1) * d]);
        }
        let mut layers = Vec::with_capacity(cfg.layers);
        for lp in &self.params.layers {
            let (r_attn, h_attn) = rms_norm(&x, &lp.attn_norm, d, cfg.rms_eps);
            let q = matmul(&h_attn, &lp.wq, l, d, qw);
            let k = matmul(&h_attn, &lp.wk, l, d, kw);
            let v = matmul(&h_attn, &lp.wv, l, d, kw);
            let (o, lse) = if l == 0 {
                (Vec::new(), Vec::new())
            } else {
                let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, attn_params)?;
                let out = self.attention.forward_owned(&args)?;
                (out.o, out.lse)
            };
            let mut x_mid = matmul(&o, &lp.wo, l, qw, d);
            add_into(&mut x_mid, &x);
            let (r_mlp, h_mlp) = rms_norm(&x_mid, &lp.mlp_norm, d, cfg.rms_eps);
            let gate = matmul(&h_mlp, &lp.w_gate, l, d, f);
            let up = matmul(&h_mlp, &lp.w_up, l, d, f);
            let s: Vec<T> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
            let mut x_out = matmul(&s, &lp.w_down, l, f, d);
            add_into(&mut x_out, &x_mid);
            let x_in = std::mem::replace(&mut x, x_out);
            layers.push(LayerTape {
                x: x_in,
                r_attn,
                h_attn,
                q,
                k,
                v,
                o,
                lse,
                x_mid,
                r_mlp,
                h_mlp,
                gate,
                up,
            });
        }
        let (r_final, h_final) = rms_norm(&x, &self.params.final_norm, d, cfg.rms_eps);

        let mut rows: Vec<u32> = targets.iter().map(|t| t.row).collect();
        rows.sort_unstable();
        rows.dedup();
        let row_of_target: Vec<usize> = targets
            .iter()
            .map(|t| rows.binary_search(&t.row).expect("row collected above"))
            .collect();
        let row_logits = self.head(&h_final, &rows);
        let vocab = cfg.vocab;
        let row_lse: Vec<T> = row_logits.chunks_exact(vocab).map(log_sum_exp).collect();
        let logprobs = targets
            .iter()
            .zip(&row_of_target)
            .map(|(t, &u)| row_logits[u * vocab + t.label as usize] - row_lse[u])
            .collect();
        Ok(Forward {
            logprobs,
            tokens: tokens.to_vec(),
            kv_end: mask.kv_end().to_vec(),
            position_ids: mask.position_ids().to_vec(),
            targets: targets.to_vec(),
            layers,
            x_final: x,
            r_final,
            h_final,
            rows,
            row_of_target,
            row_logits,
            row_lse,
            model: (self.id, self.version),
        })
    }

    /// [`Model::forward`] on a [`Pack`] of any layout, scoring its loss
    /// entries in their (canonical) order with their weights.
    pub fn forward_pack(&self, pack: &Pack) -> Result<Forward<T>> {
        pack.validate()?;
        let targets: Vec<Target> = pack
            .loss
            .iter()
            .map(|e| Target {
                row: e.row,
                label: e.label,
                weight: e.weight as f64,
            })
            .collect();
        self.forward(&pack.tokens, pack.mask()?, &targets)
    }

    /// The LM-head matrix `[vocab, d_model]`.
    fn head_weights(&self) -> &[T] {
        self.params.lm_head.as_deref().unwrap_or(&self.params.embed)
    }

    /// Logits `[rows.len(), vocab]` at the given rows of `h_final`.
    fn head(&self, h_final: &[T], rows: &[u32]) -> Vec<T> {
        let d = self.config.d_model;
        let gathered: Vec<T> = rows
            .iter()
            .flat_map(|&r| &h_final[r as usize * d..(r as usize + 1) * d])
            .copied()
            .collect();
        matmul_a_bt(
            &gathered,
            self.head_weights(),
            rows.len(),
            d,
            self.config.vocab,
        )
    }

    /// Logits `[rows.len(), vocab]` of any packed rows of a forward pass (e.g.
    /// the student and teacher rows of SDCC pairs).
    pub fn logits(&self, fwd: &Forward<T>, rows: &[u32]) -> Result<Vec<T>> {
        self.check_tape(fwd)?;
        if let Some((i, &r)) = rows
            .iter()
            .enumerate()
            .find(|(_, &r)| r as usize >= fwd.tokens.len())
        {
            return Err(Error::Shape(format!(
                "rows[{i}] = {r} is outside the pack of {} tokens",
                fwd.tokens.len()
            )));
        }
        Ok(self.head(&fwd.h_final, rows))
    }

    fn check_tape(&self, fwd: &Forward<T>) -> Result<()> {
        if fwd.model != (self.id, self.version) {
            return Err(Error::Unsupported(
                "this forward state belongs to another model, or the weights changed since it was taken".into(),
            ));
        }
        Ok(())
    }

    /// `∂J/∂θ` for every parameter, `J = Σ_e weight_e · log p(label_e | row_e)`
    /// over the targets of `fwd` (see the module docs). With a tied head the
    /// embedding gradient holds both the input and the output use.
    pub fn backward(&self, fwd: &Forward<T>) -> Result<Params<T>> {
        self.check_tape(fwd)?;
        let cfg = &self.config;
        let (d, qw, kw, f, vocab) = (
            cfg.d_model,
            cfg.q_width(),
            cfg.kv_width(),
            cfg.ffn_dim,
            cfg.vocab,
        );
        let l = fwd.tokens.len();
        let mask = PackMask::new(&fwd.kv_end, &fwd.position_ids)?;
        let shape = cfg.attn_shape(l);
        let attn_params = cfg.attn_params();
        let mut grads = Params::zeros(cfg);

        // ∂J/∂logits[u] = Σ_{e at row u} w_e (onehot(label_e) − softmax(logits[u])).
        let n_rows = fwd.rows.len();
        let mut d_logits = vec![T::ZERO; n_rows * vocab];
        let mut row_weight = vec![T::ZERO; n_rows];
        for (t, &u) in fwd.targets.iter().zip(&fwd.row_of_target) {
            let w = T::from_f64(t.weight);
            row_weight[u] += w;
            d_logits[u * vocab + t.label as usize] += w;
        }
        for u in 0..n_rows {
            let (lse, w) = (fwd.row_lse[u], row_weight[u]);
            for (dz, &z) in d_logits[u * vocab..(u + 1) * vocab]
                .iter_mut()
                .zip(&fwd.row_logits[u * vocab..(u + 1) * vocab])
            {
                *dz -= w * (z - lse).exp();
            }
        }
        let gathered: Vec<T> = fwd
            .rows
            .iter()
            .flat_map(|&r| &fwd.h_final[r as usize * d..(r as usize + 1) * d])
            .copied()
            .collect();
        {
            let d_head = grads.lm_head.as_mut().unwrap_or(&mut grads.embed);
            matmul_at_b_acc(&d_logits, &gathered, n_rows, vocab, d, d_head);
        }
        let d_gathered = matmul(&d_logits, self.head_weights(), n_rows, vocab, d);
        let mut dh = vec![T::ZERO; l * d];
        for (i, &r) in fwd.rows.iter().enumerate() {
            dh[r as usize * d..(r as usize + 1) * d]
                .copy_from_slice(&d_gathered[i * d..(i + 1) * d]);
        }
        let mut dx = rms_norm_backward(
            &fwd.x_final,
            &fwd.r_final,
            &self.params.final_norm,
            &dh,
            d,
            &mut grads.final_norm,
        );

        for ((lp, tape), lg) in self
            .params
            .layers
            .iter()
            .zip(&fwd.layers)
            .zip(grads.layers.iter_mut())
            .rev()
        {
            // MLP: x_out = x_mid + (silu(gate) ⊙ up) W_down.
            let s: Vec<T> = tape
                .gate
                .iter()
                .zip(&tape.up)
                .map(|(&g, &u)| silu(g) * u)
                .collect();
            matmul_at_b_acc(&s, &dx, l, f, d, &mut lg.w_down);
            let ds = matmul_a_bt(&dx, &lp.w_down, l, d, f);
            let mut d_gate = Vec::with_capacity(l * f);
            let mut d_up = Vec::with_capacity(l * f);
            for ((&g, &u), &dsv) in tape.gate.iter().zip(&tape.up).zip(&ds) {
                let sg = sigmoid(g);
                d_gate.push(dsv * u * sg * (T::ONE + g * (T::ONE - sg)));
                d_up.push(dsv * g * sg);
            }
            matmul_at_b_acc(&tape.h_mlp, &d_gate, l, d, f, &mut lg.w_gate);
            matmul_at_b_acc(&tape.h_mlp, &d_up, l, d, f, &mut lg.w_up);
            let mut dh_mlp = matmul_a_bt(&d_gate, &lp.w_gate, l, f, d);
            add_into(&mut dh_mlp, &matmul_a_bt(&d_up, &lp.w_up, l, f, d));
            let mut dx_mid = rms_norm_backward(
                &tape.x_mid,
                &tape.r_mlp,
                &lp.mlp_norm,
                &dh_mlp,
                d,
                &mut lg.mlp_norm,
            );
            add_into(&mut dx_mid, &dx);

            // Attention: x_mid = x + Attention(h W_q, h W_k, h W_v) W_o.
            matmul_at_b_acc(&tape.o, &dx_mid, l, qw, d, &mut lg.wo);
            let d_o = matmul_a_bt(&dx_mid, &lp.wo, l, d, qw);
            let g = if l == 0 {
                AttnGrads {
                    dq: Vec::new(),
                    dk: Vec::new(),
                    dv: Vec::new(),
                    dsinks: None,
                }
            } else {
                let args = AttnArgs::new(
                    &tape.q[..],
                    &tape.k[..],
                    &tape.v[..],
                    shape,
                    mask,
                    attn_params,
                )?;
                let saved = Saved {
                    o: &tape.o[..],
                    lse: &tape.lse[..],
                };
                self.attention.backward_owned(&args, saved, &d_o)?
            };
            matmul_at_b_acc(&tape.h_attn, &g.dq, l, d, qw, &mut lg.wq);
            matmul_at_b_acc(&tape.h_attn, &g.dk, l, d, kw, &mut lg.wk);
            matmul_at_b_acc(&tape.h_attn, &g.dv, l, d, kw, &mut lg.wv);
            let mut dh_attn = matmul_a_bt(&g.dq, &lp.wq, l, qw, d);
            add_into(&mut dh_attn, &matmul_a_bt(&g.dk, &lp.wk, l, kw, d));
            add_into(&mut dh_attn, &matmul_a_bt(&g.dv, &lp.wv, l, kw, d));
            dx = rms_norm_backward(
                &tape.x,
                &tape.r_attn,
                &lp.attn_norm,
                &dh_attn,
                d,
                &mut lg.attn_norm,
            );
            add_into(&mut dx, &dx_mid);
        }

        for (i, &t) in fwd.tokens.iter().enumerate() {
            let row = &mut grads.embed[t as usize * d..(t as usize + 1) * d];
            for (g, &v) in row.iter_mut().zip(&dx[i * d..(i + 1) * d]) {
                *g += v;
            }
        }
        Ok(grads)
    }
}

fn add_into<T: CpuFloat>(acc: &mut [T], x: &[T]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// σ(z), without overflow for large |z|.
fn sigmoid<T: CpuFloat>(z: T) -> T {
    if z >= T::ZERO {
        T::ONE / (T::ONE + (-z).exp())
    } else {
        let e = z.exp();
        e / (T::ONE + e)
    }
}

fn silu<T: CpuFloat>(z: T) -> T {
    z * sigmoid(z)
}

/// `max + ln Σ exp(z − max)` of one row.
fn log_sum_exp<T: CpuFloat>(z: &[T]) -> T {
    let m = z
        .iter()
        .copied()
        .fold(z[0], |a, b| if b > a { b } else { a });
    let s = z.iter().fold(T::ZERO, |acc, &v| acc + (v - m).exp());
    m + s.ln()
}

/// RMSNorm of each row of `x` (`[rows, d]`): returns `r = 1/sqrt(mean(x²)+ε)`
/// per row and `y = g ⊙ x · r`.
fn rms_norm<T: CpuFloat>(x: &[T], g: &[T], d: usize, eps: f64) -> (Vec<T>, Vec<T>) {
    let rows = x.len() / d;
    let mut r = Vec::with_capacity(rows);
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().fold(T::ZERO, |a, &v| a + v * v) / T::from_f64(d as f64);
        let ri = T::ONE / T::from_f64((ms + T::from_f64(eps)).to_f64().sqrt());
        r.push(ri);
        y.extend(row.iter().zip(g).map(|(&v, &gj)| gj * v * ri));
    }
    (r, y)
}

/// Backward of [`rms_norm`]: with `u = g ⊙ dy`,
/// `dx = r·u − (r³/d)·x·(u·x)` and `dg += Σ_rows dy ⊙ x · r`.
fn rms_norm_backward<T: CpuFloat>(
    x: &[T],
    r: &[T],
    g: &[T],
    dy: &[T],
    d: usize,
    dg: &mut [T],
) -> Vec<T> {
    let mut dx = Vec::with_capacity(x.len());
    for ((xr, dyr), &ri) in x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(r) {
        let mut ux = T::ZERO;
        for j in 0..d {
            ux += g[j] * dyr[j] * xr[j];
            dg[j] += dyr[j] * xr[j] * ri;
        }
        let c = ri * ri * ri * ux / T::from_f64(d as f64);
        dx.extend((0..d).map(|j| ri * g[j] * dyr[j] - c * xr[j]));
    }
    dx
}

/// `C[m, n] = A[m, k] · B[k, n]`, row-major.
fn matmul<T: CpuFloat>(a: &[T], b: &[T], m: usize, k: usize, n: usize) -> Vec<T> {
    let mut c = vec![T::ZERO; m * n];
    gemm(m, k, n, Mat::rows(a, k), Mat::rows(b, n), &mut c, false);
    c
}

/// `C[m, k] = A[m, n] · B[k, n]ᵀ`, row-major.
fn matmul_a_bt<T: CpuFloat>(a: &[T], b: &[T], m: usize, n: usize, k: usize) -> Vec<T> {
    let mut c = vec![T::ZERO; m * k];
    gemm(
        m,
        n,
        k,
        Mat::rows(a, n),
        Mat::transposed(b, n),
        &mut c,
        false,
    );
    c
}

/// `C[k, n] += A[m, k]ᵀ · B[m, n]` (a weight gradient summed over rows).
fn matmul_at_b_acc<T: CpuFloat>(a: &[T], b: &[T], m: usize, k: usize, n: usize, c: &mut [T]) {
    gemm(k, m, n, Mat::transposed(a, k), Mat::rows(b, n), c, true);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
        let mut t = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = a[i * c + j];
            }
        }
        t
    }

    fn random(len: usize, rng: &mut Rng) -> Vec<f64> {
        (0..len).map(|_| rng.unit() - 0.5).collect()
    }

    /// The three products against a triple loop, on sizes that are not
    /// multiples of the blocks and large enough to take the threaded path.
    #[test]
    fn blocked_matmuls_match_the_definition() {
        let mut rng = Rng::new(7);
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 2), (37, 130, 17), (300, 70, 41)] {
            let a = random(m * k, &mut rng);
            let b = random(k * n, &mut rng);
            let want = naive_matmul(&a, &b, m, k, n);
            // Sums of k products of magnitude ≤ 1/4: reassociation error ≤ k·ε.
            let close = |x: &[f64], y: &[f64]| {
                x.iter()
                    .zip(y)
                    .all(|(p, q)| (p - q).abs() <= 1e-13 * k as f64)
            };
            assert!(close(&matmul(&a, &b, m, k, n), &want), "A·B {m}x{k}x{n}");
            let bt = transpose(&b, k, n);
            assert!(
                close(&matmul_a_bt(&a, &bt, m, k, n), &want),
                "A·Bᵀ {m}x{k}x{n}"
            );
            let at = transpose(&a, m, k);
            let mut c = vec![1.0; m * n];
            matmul_at_b_acc(&at, &b, k, m, n, &mut c);
            let want_acc: Vec<f64> = want.iter().map(|v| v + 1.0).collect();
            assert!(close(&c, &want_acc), "Aᵀ·B accumulate {m}x{k}x{n}");
        }
    }

    #[test]
    fn config_and_layout_errors_are_reported() {
        let mut cfg = ModelConfig::tiny(50);
        cfg.kv_heads = 3;
        assert!(matches!(cfg.validate(), Err(Error::Shape(_))));
        let cfg = ModelConfig::tiny(50);
        let mut p = Params::<f64>::random(&cfg, 1).unwrap();
        p.layers[1].wk.pop();
        let err = Model::with_attention(cfg.clone(), p, Cpu::default())
            .err()
            .unwrap();
        assert!(err.to_string().contains("layers.1.wk"), "{err}");
        let mut tied = cfg.clone();
        tied.tied_embeddings = true;
        let err = Model::with_attention(
            tied,
            Params::<f64>::random(&cfg, 1).unwrap(),
            Cpu::default(),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("tensors"), "{err}");
    }

    #[test]
    fn random_weights_depend_on_the_seed_only() {
        let cfg = ModelConfig::tiny(40);
        let a = Params::<f32>::random(&cfg, 3).unwrap();
        assert_eq!(a, Params::<f32>::random(&cfg, 3).unwrap());
        assert_ne!(a, Params::<f32>::random(&cfg, 4).unwrap());
        assert!(a
            .tensors()
            .iter()
            .all(|(_, t)| t.iter().all(|v| v.is_finite())));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let model = Model::<f64>::new(ModelConfig::tiny(20), 1).unwrap();
        let (kv, pos) = ([3u32, 3, 3], [0u32, 1, 2]);
        let mask = PackMask::new(&kv, &pos).unwrap();
        let t = |row, label| Target {
            row,
            label,
            weight: 1.0,
        };
        let e = model.forward(&[1, 2, 20], mask, &[]).err().unwrap();
        assert!(e.to_string().contains("token 20 at packed row 2"), "{e}");
        let e = model.forward(&[1, 2, 3], mask, &[t(3, 1)]).err().unwrap();
        assert!(e.to_string().contains("target 0"), "{e}");
        let e = model
            .forward(&[1, 2, 3], mask, &[t(0, 1), t(1, 25)])
            .err()
            .unwrap();
        assert!(e.to_string().contains("target 1: label 25"), "{e}");
        let e = model.forward(&[1, 2], mask, &[]).err().unwrap();
        assert!(matches!(e, Error::Shape(_)), "{e}");
    }

    #[test]
    fn stale_forward_is_refused() {
        let mut model = Model::<f64>::new(ModelConfig::tiny(20), 1).unwrap();
        let (kv, pos) = ([2u32, 2], [0u32, 1]);
        let mask = PackMask::new(&kv, &pos).unwrap();
        let fwd = model
            .forward(
                &[4, 5],
                mask,
                &[Target {
                    row: 0,
                    label: 5,
                    weight: 1.0,
                }],
            )
            .unwrap();
        assert!(model.backward(&fwd).is_ok());
        model.params_mut().final_norm[0] += 1.0;
        assert!(model.backward(&fwd).is_err());
        let other = Model::<f64>::new(ModelConfig::tiny(20), 1).unwrap();
        assert!(other.logits(&fwd, &[0]).is_err());
    }
}
