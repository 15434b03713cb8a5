//! The gated delta rule (Qwen3.5's gated DeltaNet): linear attention whose state per value
//! head is a `key_dim × value_dim` matrix `S`, updated token by token as
//! `S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq`, and the causal depthwise convolution that
//! feeds it. The per-token (recurrent) form, the same arithmetic for a prompt's tokens and
//! for a decode, so that a chunked prefill meets a token-by-token one exactly.

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
/// value per channel) becomes `silu(Σⱼ w[c][j] · window[j])` over the window of the
/// channel's last `K − 1` inputs (`state`, `[K − 1][channels]`, oldest first) and `x`,
/// and `state` moves on by one input.
pub fn conv_step(state: &mut [f32], weight: &[f32], x: &mut [f32]) {
    let channels = x.len();
    let k = weight.len() / channels;
    debug_assert_eq!(state.len(), (k - 1) * channels);
    for (c, xc) in x.iter_mut().enumerate() {
        let w = &weight[c * k..(c + 1) * k];
        let mut acc = 0.0;
        for j in 0..k - 1 {
            acc += w[j] * state[j * channels + c];
        }
        acc += w[k - 1] * *xc;
        // Shift this channel's window: the oldest input leaves, this one enters.
        for j in 0..k.saturating_sub(2) {
            state[j * channels + c] = state[(j + 1) * channels + c];
        }
        state[(k - 2) * channels + c] = *xc;
        *xc = silu(acc);
    }
}

/// One token of the gated delta rule for one value head: `state` is `S`, `[key_dim][value_dim]`
/// (row `i` for key dimension `i`), decayed by `decay` (`e^g`), corrected towards `v` along
/// `k` with strength `beta`, then read with `q` into `out` (`[value_dim]`). `mem` is
/// `[value_dim]` scratch.
pub fn delta_step(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (decay, beta): (f32, f32),
    mem: &mut [f32],
    out: &mut [f32],
) {
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
            delta_step(&mut state, &q, &k, &v, (decay, beta), &mut mem, &mut out);
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

    /// The convolution over a whole sequence with zero padding on the left, token by token.
    #[test]
    fn conv_step_is_a_causal_convolution() {
        let (channels, k, len) = (3, 4, 6);
        let w = random_vec(channels * k, 3);
        let xs: Vec<Vec<f32>> = (0..len).map(|t| random_vec(channels, 40 + t as u64)).collect();
        let mut state = vec![0.0; (k - 1) * channels];
        for t in 0..len {
            let mut x = xs[t].clone();
            conv_step(&mut state, &w, &mut x);
            let want: Vec<f32> = (0..channels)
                .map(|c| {
                    let acc: f32 = (0..k)
                        .map(|j| {
                            let src = t as isize - (k - 1 - j) as isize;
                            if src < 0 {
                                0.0
                            } else {
                                w[c * k + j] * xs[src as usize][c]
                            }
                        })
                        .sum();
                    silu(acc)
                })
                .collect();
            assert_close(&x, &want, 1e-6, "conv");
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
