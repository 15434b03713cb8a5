//! Rotary position embedding, Hugging Face "rotate_half" layout: dimension `i` pairs with
//! `i + head_dim/2` (GGUF weights are un-permuted to this layout at load time).

/// Positions whose cos/sin are precomputed; later ones (rare, and a context length read
/// from a file must not size an allocation) are computed when needed, with the same
/// arithmetic and so the same bits.
const TABLE_POSITIONS: usize = 1 << 16;

/// Precomputed cos/sin per (position, frequency), computed like HF in f32.
pub struct Rope {
    half: usize,
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (longrope's attention factor; 1 otherwise).
    mscale: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// The unscaled inverse frequencies `1 / theta^(2i/d)`, in f32 as Hugging Face computes them.
pub fn inv_freq(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_positions: usize) -> Self {
        Self::with_inv_freq(inv_freq(head_dim, theta), 1.0, max_positions)
    }

    /// A rotation with given inverse frequencies (one per pair of dimensions), for scaled
    /// variants (Llama 3, linear, longrope) computed by the model's configuration; cos and
    /// sin are multiplied by `mscale`.
    pub fn with_inv_freq(inv_freq: Vec<f32>, mscale: f32, max_positions: usize) -> Self {
        let half = inv_freq.len();
        let table = max_positions.min(TABLE_POSITIONS);
        let mut cos = Vec::with_capacity(table * half);
        let mut sin = Vec::with_capacity(table * half);
        for p in 0..table {
            for f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos() * mscale);
                sin.push(angle.sin() * mscale);
            }
        }
        Rope { half, inv_freq, mscale, cos, sin }
    }

    /// Rotates every head (width `2 * half`) of `x` in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        self.apply_partial(x, pos, 2 * self.half);
    }

    /// Rotates the first `2 * half` dimensions of every head of width `head_dim` of `x`,
    /// leaving the rest (partial RoPE, Qwen3.5).
    pub fn apply_partial(&self, x: &mut [f32], pos: usize, head_dim: usize) {
        let h = self.half;
        assert!(2 * h <= head_dim, "{} rotated dimensions of a {head_dim}-dim head", 2 * h);
        let (mut cos_buf, mut sin_buf) = (Vec::new(), Vec::new());
        let (cos, sin) = if (pos + 1) * h <= self.cos.len() {
            (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h])
        } else {
            cos_buf.extend(self.inv_freq.iter().map(|f| (pos as f32 * f).cos() * self.mscale));
            sin_buf.extend(self.inv_freq.iter().map(|f| (pos as f32 * f).sin() * self.mscale));
            (&cos_buf[..], &sin_buf[..])
        };
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = head[..2 * h].split_at_mut(h);
            for i in 0..h {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x1 * cos[i] + x0 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    #[test]
    fn matches_naive_rotate_half() {
        let (hd, heads, pos, theta) = (10, 3, 37, 10000f64);
        let rope = Rope::new(hd, theta as f32, 64);
        let x = random_vec(hd * heads, 9);
        let mut got = x.clone();
        rope.apply(&mut got, pos);
        let mut want = vec![0f32; x.len()];
        for h in 0..heads {
            let v = &x[h * hd..(h + 1) * hd];
            for i in 0..hd / 2 {
                let a = pos as f64 / theta.powf((2 * i) as f64 / hd as f64);
                let (x0, x1) = (v[i] as f64, v[i + hd / 2] as f64);
                want[h * hd + i] = (x0 * a.cos() - x1 * a.sin()) as f32;
                want[h * hd + i + hd / 2] = (x1 * a.cos() + x0 * a.sin()) as f32;
            }
        }
        assert_close(&got, &want, 1e-5, "rope");
    }

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(8, 10000.0, 4);
        let x = random_vec(16, 1);
        let mut y = x.clone();
        rope.apply(&mut y, 0);
        assert_eq!(x, y);
    }

    /// Positions past the table give the bits the table would have given.
    #[test]
    fn computed_positions_match_the_table() {
        let small = Rope::new(8, 10000.0, 4);
        let big = Rope::new(8, 10000.0, 64);
        let x = random_vec(16, 2);
        for pos in [3, 4, 40, 63] {
            let (mut a, mut b) = (x.clone(), x.clone());
            small.apply(&mut a, pos);
            big.apply(&mut b, pos);
            assert_eq!(a, b, "position {pos}");
        }
    }

    /// Partial RoPE turns the first dimensions of each head as a full RoPE of their width
    /// would, and leaves the rest as they are.
    #[test]
    fn partial_turns_only_the_leading_dimensions() {
        let (hd, rot, heads) = (12, 4, 3);
        let partial = Rope::new(rot, 1e7, 64);
        let x = random_vec(hd * heads, 5);
        let mut got = x.clone();
        partial.apply_partial(&mut got, 29, hd);
        for h in 0..heads {
            let mut want = x[h * hd..h * hd + rot].to_vec();
            partial.apply(&mut want, 29);
            assert_eq!(&got[h * hd..h * hd + rot], &want[..]);
            assert_eq!(&got[h * hd + rot..(h + 1) * hd], &x[h * hd + rot..(h + 1) * hd]);
        }
    }
}
