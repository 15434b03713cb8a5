//! The gated delta rule (Qwen3.5's gated DeltaNet): linear attention whose state per value
//! head is a `key_dim × value_dim` matrix `S`, updated token by token as
//! `S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq`, and the causal depthwise convolution that
//! feeds it. Two forms of the rule: token by token (decodes, and rows whose states are kept)
//! and over a run of tokens at once with matrix products (prompts); they agree within float
//! rounding.

use super::exp::exp;

/// `x / sqrt(Σx² + 1e-6)`, in place (the reference's `l2norm`).
pub fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `x · σ(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, as torch's softplus (linear above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One token of a causal depthwise convolution of width `K` with SiLU, in place: `x` (one
/// value per channel) becomes `silu(Σⱼ w[j][c] · window[j])` over the window of the
/// channel's last `K − 1` inputs (`state`, `[K − 1][channels]`, oldest first) and `x`,
/// and `state` moves on by one input. `weight` is `[K][channels]`; `acc` is `[channels]`
/// scratch.
pub fn conv_step(state: &mut [f32], weight: &[f32], x: &mut [f32], acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { conv_avx2(state, weight, x, acc) };
    }
    conv_body(state, weight, x, acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn conv_avx2(state: &mut [f32], weight: &[f32], x: &mut [f32], acc: &mut [f32]) {
    conv_body(state, weight, x, acc)
}

#[inline(always)]
fn conv_body(state: &mut [f32], weight: &[f32], x: &mut [f32], acc: &mut [f32]) {
    let channels = x.len();
    debug_assert_eq!(state.len() + channels, weight.len());
    acc.fill(0.0);
    for (w, past) in weight.chunks_exact(channels).zip(state.chunks_exact(channels)) {
        acc.iter_mut().zip(w).zip(past).for_each(|((a, &w), &p)| *a += w * p);
    }
    let newest = &weight[state.len()..];
    acc.iter_mut().zip(newest).zip(x.iter()).for_each(|((a, &w), &x)| *a += w * x);
    // The window moves on: the oldest input leaves, this one enters.
    if !state.is_empty() {
        state.copy_within(channels.., 0);
        let at = state.len() - channels;
        state[at..].copy_from_slice(x);
    }
    x.iter_mut().zip(acc.iter()).for_each(|(x, &a)| *x = a / (1.0 + exp(-a)));
}

/// One token's inputs to the rule for one value head: `q` and `k` (`[key_dim]`, normalised,
/// `q` scaled), `v` (`[value_dim]`), its decay `e^g` and correction strength `beta`.
#[derive(Clone, Copy)]
pub struct Token<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub decay: f32,
    pub beta: f32,
}

/// One token of the gated delta rule for one value head: `state` is `S`, `[key_dim][value_dim]`
/// (row `i` for key dimension `i`), decayed by the token's decay, corrected towards `v` along
/// `k` with strength `beta`, then read with `q` into `out` (`[value_dim]`). `mem` is
/// `[value_dim]` scratch.
pub fn delta_step(state: &mut [f32], tok: &Token<'_>, mem: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { step_avx2(state, tok, mem, out) };
    }
    step_body(state, tok, mem, out)
}

/// One value head's inputs for a run of `c` tokens of one sequence: `q` and `k`
/// (`[c][key_dim]`, normalised, `q` scaled), `v` (`[c][value_dim]`), `beta` and `g` (the log
/// of each token's decay, `[c]`).
pub struct Run<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    pub g: &'a [f32],
}

/// Buffers of [`delta_chunk`], reused across runs.
#[derive(Default)]
pub struct ChunkScratch {
    /// `G_t`, the decay's log summed over the run up to token `t`.
    cum: Vec<f32>,
    /// `e^(G_t − G_s)` for `s ≤ t`, `[c][c]`.
    decay: Vec<f32>,
    /// `Sᵀk_t` of the starting state, then the corrections `u_t`, `[c][value_dim]`.
    u: Vec<f32>,
    /// The keys decayed to the run's end, transposed: `[key_dim][c]`.
    keys: Vec<f32>,
}

/// A run of tokens of the gated delta rule for one value head, in the matrix (chunked) form:
/// with `G_t` the summed log decay and `S₀` the starting state, the corrections
/// `u_t = β_t(v_t − e^{G_t}S₀ᵀk_t − Σ_{s<t} e^{G_t−G_s}(k_t·k_s)u_s)` are one triangular
/// solve, the outputs `o_t = e^{G_t}S₀ᵀq_t + Σ_{s≤t} e^{G_t−G_s}(q_t·k_s)u_s`, and the state
/// `S = e^{G_c}S₀ + Σ_s e^{G_c−G_s}k_s⊗u_s`. It equals [`delta_step`] token after token within
/// float rounding, and reads the state twice per run instead of twice per token.
pub fn delta_chunk(state: &mut [f32], run: &Run<'_>, s: &mut ChunkScratch, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { chunk_avx2(state, run, s, out) };
    }
    chunk_body(state, run, s, out)
}

/// Whether the AVX2 builds of the same arithmetic run (they give the same bits).
#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    crate::kernels::matmul::avx2::available()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn step_avx2(state: &mut [f32], tok: &Token<'_>, mem: &mut [f32], out: &mut [f32]) {
    step_body(state, tok, mem, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2(state: &mut [f32], run: &Run<'_>, s: &mut ChunkScratch, out: &mut [f32]) {
    chunk_body(state, run, s, out)
}

#[inline(always)]
fn step_body(state: &mut [f32], tok: &Token<'_>, mem: &mut [f32], out: &mut [f32]) {
    let Token { q, k, v, decay, beta } = *tok;
    let dv = v.len();
    // Sᵀk of the decayed state, decaying it on the way.
    mem.fill(0.0);
    for (row, &ki) in state.chunks_exact_mut(dv).zip(k) {
        for (s, m) in row.iter_mut().zip(mem.iter_mut()) {
            *s *= decay;
            *m += *s * ki;
        }
    }
    // The correction β(v − Sᵀk), then S += k ⊗ it and o = Sᵀq.
    mem.iter_mut().zip(v).for_each(|(m, &vj)| *m = (vj - *m) * beta);
    out.fill(0.0);
    for ((row, &ki), &qi) in state.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((s, &d), o) in row.iter_mut().zip(mem.iter()).zip(out.iter_mut()) {
            *s += ki * d;
            *o += *s * qi;
        }
    }
}

#[inline(always)]
fn chunk_body(state: &mut [f32], run: &Run<'_>, s: &mut ChunkScratch, out: &mut [f32]) {
    let c = run.beta.len();
    let (dk, dv) = (run.k.len() / c, run.v.len() / c);
    s.cum.clear();
    s.cum.extend(run.g.iter().scan(0.0, |acc, &g| {
        *acc += g;
        Some(*acc)
    }));
    let cum = &s.cum;
    s.decay.clear();
    s.decay.resize(c * c, 0.0);
    for (t, row) in s.decay.chunks_exact_mut(c).enumerate() {
        for (d, &gs) in row[..=t].iter_mut().zip(cum) {
            *d = (cum[t] - gs).exp();
        }
    }
    let decay = &s.decay;

    // S₀ᵀk_t into u and S₀ᵀq_t into out: products of the run's rows with the state.
    s.u.clear();
    s.u.resize(c * dv, 0.0);
    out.fill(0.0);
    gemm_acc(run.k, state, &mut s.u, dk);
    gemm_acc(run.q, state, out, dk);

    // The triangular solve for the corrections, token after token.
    for t in 0..c {
        let (done, rest) = s.u.split_at_mut(t * dv);
        let ut = &mut rest[..dv];
        let (bt, gt) = (run.beta[t], cum[t].exp());
        for (u, &v) in ut.iter_mut().zip(&run.v[t * dv..(t + 1) * dv]) {
            *u = bt * (v - gt * *u);
        }
        let kt = &run.k[t * dk..(t + 1) * dk];
        for (j, us) in done.chunks_exact(dv).enumerate() {
            let a = bt * decay[t * c + j] * dot(kt, &run.k[j * dk..(j + 1) * dk]);
            axpy(ut, -a, us);
        }
    }

    // The outputs: the decayed start read with q, plus the run's own corrections.
    for (t, ot) in out.chunks_exact_mut(dv).enumerate() {
        let gt = cum[t].exp();
        ot.iter_mut().for_each(|o| *o *= gt);
        let qt = &run.q[t * dk..(t + 1) * dk];
        for (j, us) in s.u[..(t + 1) * dv].chunks_exact(dv).enumerate() {
            axpy(ot, decay[t * c + j] * dot(qt, &run.k[j * dk..(j + 1) * dk]), us);
        }
    }

    // The state after the run: the decayed start plus each key, decayed to the run's end,
    // times its correction.
    let (ends, gc) = (&decay[(c - 1) * c..], cum[c - 1].exp());
    s.keys.clear();
    s.keys.extend((0..dk).flat_map(|i| (0..c).map(move |j| ends[j] * run.k[j * dk + i])));
    state.iter_mut().for_each(|x| *x *= gc);
    gemm_acc(&s.keys, &s.u, state, c);
}

/// `c += a · b` for row-major `a` (`[m][inner]`) and `b` (`[inner][n]`), each element summed
/// in `inner` order onto its start, as a loop of `axpy`s would; tiles of 4 rows × 16 columns
/// keep their sums in registers while `b` streams past.
#[inline(always)]
fn gemm_acc(a: &[f32], b: &[f32], c: &mut [f32], inner: usize) {
    let m = a.len() / inner;
    let n = b.len() / inner;
    let (rows4, cols16) = (m / 4 * 4, n / 16 * 16);
    for r0 in (0..rows4).step_by(4) {
        for j0 in (0..cols16).step_by(16) {
            tile::<4>(a, b, c, (r0, j0), inner, n);
        }
    }
    for r0 in rows4..m {
        for j0 in (0..cols16).step_by(16) {
            tile::<1>(a, b, c, (r0, j0), inner, n);
        }
    }
    for r in 0..m {
        for j in cols16..n {
            let mut acc = c[r * n + j];
            for i in 0..inner {
                acc += a[r * inner + i] * b[i * n + j];
            }
            c[r * n + j] = acc;
        }
    }
}

/// One `R × 16` tile of [`gemm_acc`] at (row, column) `at`.
#[inline(always)]
fn tile<const R: usize>(a: &[f32], b: &[f32], c: &mut [f32], (r0, j0): (usize, usize), inner: usize, n: usize) {
    let mut acc = [[0f32; 16]; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        acc.copy_from_slice(&c[(r0 + r) * n + j0..][..16]);
    }
    for i in 0..inner {
        let brow: &[f32; 16] = b[i * n + j0..][..16].try_into().expect("16 columns");
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = a[(r0 + r) * inner + i];
            for j in 0..16 {
                acc[j] += x * brow[j];
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        c[(r0 + r) * n + j0..][..16].copy_from_slice(acc);
    }
}

/// `y += a·x`, unfused, so every build gives the same bits.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

/// `a · b` in eight interleaved sums, added in order at the end.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let whole = a.len() / 8 * 8;
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        acc[l] += x * y;
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    /// The rule as the reference writes it, in f64 over whole matrices.
    #[test]
    fn delta_step_matches_the_reference_form() {
        let (dk, dv) = (5, 3);
        let mut state = random_vec(dk * dv, 1);
        let mut s: Vec<f64> = state.iter().map(|&x| x as f64).collect();
        let (mut mem, mut out) = (vec![0.0; dv], vec![0.0; dv]);
        for t in 0..4 {
            let (q, k, v) = (random_vec(dk, 10 + t), random_vec(dk, 20 + t), random_vec(dv, 30 + t));
            let (decay, beta) = (0.9 - 0.1 * t as f32, 0.3 + 0.1 * t as f32);
            delta_step(&mut state, &Token { q: &q, k: &k, v: &v, decay, beta }, &mut mem, &mut out);
            s.iter_mut().for_each(|x| *x *= decay as f64);
            let kv: Vec<f64> = (0..dv).map(|j| (0..dk).map(|i| s[i * dv + j] * k[i] as f64).sum()).collect();
            let delta: Vec<f64> = (0..dv).map(|j| (v[j] as f64 - kv[j]) * beta as f64).collect();
            (0..dk).for_each(|i| (0..dv).for_each(|j| s[i * dv + j] += k[i] as f64 * delta[j]));
            let want: Vec<f32> =
                (0..dv).map(|j| (0..dk).map(|i| s[i * dv + j] * q[i] as f64).sum::<f64>() as f32).collect();
            assert_close(&out, &want, 1e-5, "delta output");
            let sf: Vec<f32> = s.iter().map(|&x| x as f32).collect();
            assert_close(&state, &sf, 1e-5, "delta state");
        }
    }

    /// Normalised q and k, β in (0, 1) and decays from nearly 1 to underflowing, as the layer
    /// feeds them, for a run of `c` tokens.
    fn inputs(c: usize, dk: usize, dv: usize, seed: u64) -> [Vec<f32>; 5] {
        let unit = |n: usize, s: u64| -> Vec<f32> {
            let mut x = random_vec(n, s);
            x.chunks_exact_mut(dk).for_each(l2norm);
            x
        };
        let beta = random_vec(c, seed + 3).iter().map(|x| 0.5 + 0.49 * x).collect();
        let g =
            random_vec(c, seed + 4).iter().enumerate().map(|(t, x)| if t % 7 == 5 { -90.0 } else { x - 1.0 }).collect();
        [unit(c * dk, seed), unit(c * dk, seed + 1), random_vec(c * dv, seed + 2), beta, g]
    }

    /// The run at once against token after token, for every run length up to past the
    /// layer's chunk, from a nonzero state.
    #[test]
    fn a_chunk_equals_its_tokens_one_by_one() {
        for (dk, dv) in [(5, 3), (16, 8), (128, 128)] {
            for c in (1..=20).chain([63, 64, 65]) {
                if dk == 128 && c % 4 != 1 {
                    continue;
                }
                let [q, k, v, beta, g] = inputs(c, dk, dv, c as u64 * 31 + dk as u64);
                let start = random_vec(dk * dv, 7);
                let (mut one, mut mem, mut want) = (start.clone(), vec![0.0; dv], vec![0.0; c * dv]);
                for t in 0..c {
                    let at = |x: &[f32], d: usize| x[t * d..(t + 1) * d].to_vec();
                    let (q, k, v) = (at(&q, dk), at(&k, dk), at(&v, dv));
                    let tok = Token { q: &q, k: &k, v: &v, decay: g[t].exp(), beta: beta[t] };
                    delta_step(&mut one, &tok, &mut mem, &mut want[t * dv..(t + 1) * dv]);
                }
                let (mut all, mut got) = (start.clone(), vec![0.0; c * dv]);
                let run = Run { q: &q, k: &k, v: &v, beta: &beta, g: &g };
                delta_chunk(&mut all, &run, &mut ChunkScratch::default(), &mut got);
                assert_close(&got, &want, 2e-5, &format!("outputs of {c} × {dk}×{dv}"));
                assert_close(&all, &one, 2e-5, &format!("state after {c} × {dk}×{dv}"));
            }
        }
    }

    /// The AVX2 builds give the portable ones' bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_portable_forms_agree_bit_for_bit() {
        if !wide() {
            return;
        }
        let (c, dk, dv) = (37, 128, 128);
        let [q, k, v, beta, g] = inputs(c, dk, dv, 5);
        let run = Run { q: &q, k: &k, v: &v, beta: &beta, g: &g };
        let start = random_vec(dk * dv, 9);
        let (mut a, mut b) = (start.clone(), start.clone());
        let (mut oa, mut ob) = (vec![0.0; c * dv], vec![0.0; c * dv]);
        chunk_body(&mut a, &run, &mut ChunkScratch::default(), &mut oa);
        // SAFETY: `wide()` said AVX2 and FMA are available.
        unsafe { chunk_avx2(&mut b, &run, &mut ChunkScratch::default(), &mut ob) };
        assert!(a == b && oa == ob, "chunk");
        let mem = &mut vec![0.0; dv];
        let tok = Token { q: &q[..dk], k: &k[..dk], v: &v[..dv], decay: 0.9, beta: 0.4 };
        step_body(&mut a, &tok, mem, &mut oa[..dv]);
        // SAFETY: as above.
        unsafe { step_avx2(&mut b, &tok, mem, &mut ob[..dv]) };
        assert!(a == b && oa == ob, "step");
        let w = random_vec(4 * 100, 2);
        let (mut sa, mut xa, acc) = (random_vec(3 * 100, 3), random_vec(100, 4), &mut vec![0.0; 100]);
        let (mut sb, mut xb) = (sa.clone(), xa.clone());
        conv_body(&mut sa, &w, &mut xa, acc);
        // SAFETY: as above.
        unsafe { conv_avx2(&mut sb, &w, &mut xb, acc) };
        assert!(sa == sb && xa == xb, "conv");
    }

    /// The convolution over a whole sequence with zero padding on the left, token by token.
    #[test]
    fn conv_step_is_a_causal_convolution() {
        for (channels, k, len) in [(3, 4, 6), (37, 4, 9), (8, 2, 3)] {
            let w = random_vec(channels * k, 3);
            let xs: Vec<Vec<f32>> = (0..len).map(|t| random_vec(channels, 40 + t as u64)).collect();
            let mut state = vec![0.0; (k - 1) * channels];
            let mut acc = vec![0.0; channels];
            for t in 0..len {
                let mut x = xs[t].clone();
                conv_step(&mut state, &w, &mut x, &mut acc);
                let want: Vec<f32> = (0..channels)
                    .map(|c| {
                        let acc: f32 = (0..k)
                            .map(|j| {
                                let src = t as isize - (k - 1 - j) as isize;
                                if src < 0 {
                                    0.0
                                } else {
                                    w[j * channels + c] * xs[src as usize][c]
                                }
                            })
                            .sum();
                        silu(acc)
                    })
                    .collect();
                assert_close(&x, &want, 1e-6, "conv");
            }
        }
    }

    #[test]
    fn l2norm_and_softplus() {
        let mut x = vec![3.0, 4.0];
        l2norm(&mut x);
        assert_close(&x, &[0.6, 0.8], 1e-6, "l2norm");
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
    }
}
