//! Products of a few rows with a weight stored in one of ggml's block-quantized types, on integer
//! dot products, as llama.cpp computes them: each input row is quantized on the fly to 8 bits
//! (blocks of 32 values for the 32-value weight types, 256 for the K-quants, each with an f32
//! scale and the integer sums of every 16 values), then every stored row is dotted with it block by
//! block in integers (u8 × i8 products summed four at a time into i32 lanes), each block's sum
//! scaled by the two blocks' scales in f32. The weight is read once, in its stored bytes: what a
//! decode step is bound by.
//!
//! Block layouts (ggml's `block_*` structs, `ggml-common.h`), values `v` of a block:
//!
//! | type | values | bytes | layout, value |
//! |------|--------|-------|---------------|
//! | Q8_0 | 32  | 34  | f16 d, i8 q[32]: `d·q` |
//! | Q4_0 | 32  | 18  | f16 d, u8 qs[16]: `d·(n − 8)`, n the low nibble of byte v (v < 16), the high of byte v − 16 |
//! | Q4_1 | 32  | 20  | f16 d, f16 m, qs[16] as Q4_0: `d·n + m` |
//! | Q5_0 | 32  | 22  | f16 d, u32 qh, qs[16]: `d·(n − 16)`, n a nibble as in Q4_0 and bit v of qh above it |
//! | Q5_1 | 32  | 24  | f16 d, f16 m, u32 qh, qs[16]: `d·n + m`, n as in Q5_0 |
//! | Q4_K | 256 | 144 | f16 d, f16 dmin, scales[12], qs[128]: `d·sc_s·n − dmin·m_s`, s = v / 32 (6-bit scale and min, [`scale_min_k4`]); n the low nibble of byte `32·(v / 64) + v % 32` when `(v / 32)` is even, the high one when odd |
//! | Q5_K | 256 | 176 | f16 d, f16 dmin, scales[12], qh[32], qs[128]: as Q4_K with a fifth bit, bit `v / 32` of `qh[v % 32]` |
//! | Q6_K | 256 | 210 | ql[128], qh[64], i8 sc[16], f16 d: `d·sc_{v/16}·(n − 32)`, n 6 bits: 4 from ql, 2 from qh ([`reference`]) |
//!
//! With 8-bit activations `x = d_x·q`, a block's product is `d_w·d_x·Σ n·q` plus terms in `Σ q` for
//! the offsets (`−8`, `m`, `−dmin·m_s`, `−32`): those come from the activation's sums of 16, so
//! the inner loops multiply unsigned weight codes by signed activations, which is what the
//! instructions take (`vpdpbusd`: AVX-512 VNNI, or AVX-VNNI; AVX2's `vpmaddubsw` + `vpmaddwd`
//! where neither is there, the codes small enough that its 16-bit pair sums cannot saturate). Q8_0's
//! signed codes go in as `|w|` and `x·sign(w)`.
//!
//! [`reference`] is the plain loop every path is tested against (the integer sums are exact, so
//! the paths differ only in the order of the f32 sums). Activation quantization is lossy: the
//! products differ from the f32 product of the dequantized weight by about 1% of the row's scale,
//! as llama.cpp's do.

use rayon::prelude::*;

use crate::compute::{ActivationBits, Cpu};
use crate::SharedOut;

/// The block types whose products run on integer dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DotFormat {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl DotFormat {
    pub const ALL: [DotFormat; 8] =
        [Self::Q8_0, Self::Q4_0, Self::Q4_1, Self::Q5_0, Self::Q5_1, Self::Q4K, Self::Q5K, Self::Q6K];

    /// (values, bytes) of one stored block.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::Q8_0 => (32, 34),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }
}

/// Scale and min `j` (of 8) of a Q4_K or Q5_K super-block, 6 bits each, packed into 12 bytes: the
/// first four in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins), the last four in the
/// nibbles of bytes 8..12 with their top 2 bits in the spare bits of bytes 0..8.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// An IEEE half (little-endian bytes `b[0..2]`) as f32.
#[inline(always)]
fn f16_at(b: &[u8]) -> f32 {
    let h = u16::from_le_bytes([b[0], b[1]]) as u32;
    let (sign, exp, man) = ((h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man · 2^-24, exact in f32.
        (0, _) => {
            let v = man as f32 * f32::from_bits(0x3380_0000);
            return if sign == 0 { v } else { -v };
        }
        (31, 0) => sign | 0x7F80_0000,
        (31, _) => sign | 0x7FC0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Rows of activations quantized to 8 bits: `x ≈ d·q`, one scale per block of `block` values, and
/// the integer sum of every 16 values.
pub struct Q8Rows {
    k: usize,
    block: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    dsum: Vec<f32>,
    sums: Vec<i32>,
}

/// The largest block [`Q8Rows::quantize_hi_lo`] takes (the K-quants' 256).
const MAX_BLOCK: usize = 256;

/// One row of [`Q8Rows`].
#[derive(Clone, Copy)]
pub(crate) struct Row<'a> {
    pub(crate) q: &'a [i8],
    pub(crate) d: &'a [f32],
    /// `d·Σq` of each block.
    pub(crate) dsum: &'a [f32],
    sums: &'a [i32],
}

impl Q8Rows {
    /// `n` rows of `k` values (`x` row-major) in blocks of `block` (a multiple of 16 dividing `k`):
    /// each block's scale its largest magnitude over 127, codes rounded to nearest.
    pub fn quantize(x: &[f32], n: usize, k: usize, block: usize) -> Self {
        Self::quantize_parts(x, (n, k, block), false)
    }

    /// The same rows to 16 bits, as `2n` rows of 8 bits: rows `0..n` are [`Self::quantize`]'s,
    /// rows `n..2n` the rounding residual `x − d·q` of each block quantized the same way (its own
    /// scale, at most 1/254 of the block's). Row `r` is the sum of rows `r` and `n + r`; a product
    /// is the sum of the two rows' products, each on the 8-bit integer kernels.
    ///
    /// # Panics
    /// If `block` is over 256 values (the residual of a block is kept on the stack).
    pub fn quantize_hi_lo(x: &[f32], n: usize, k: usize, block: usize) -> Self {
        assert!(block <= MAX_BLOCK, "Q8Rows: blocks of {block} (at most {MAX_BLOCK} for 16 bits)");
        Self::quantize_parts(x, (n, k, block), true)
    }

    fn quantize_parts(x: &[f32], (n, k, block): (usize, usize, usize), lo: bool) -> Self {
        assert!(block % 16 == 0 && k.is_multiple_of(block) && x.len() == n * k, "Q8Rows: {n} rows of {k} in {block}");
        let len = if lo { 2 * n * k } else { n * k };
        let mut q = vec![0i8; len];
        let mut d = vec![0f32; len / block];
        let mut sums = vec![0i32; len / 16];
        let (q_hi, q_lo) = q.split_at_mut(n * k);
        let (d_hi, d_lo) = d.split_at_mut(n * k / block);
        let (s_hi, s_lo) = sums.split_at_mut(n * k / 16);
        for (b, x) in x.chunks_exact(block).enumerate() {
            let (q, sums) = (&mut q_hi[b * block..(b + 1) * block], &mut s_hi[b * block / 16..(b + 1) * block / 16]);
            d_hi[b] = quantize_block(x, q, sums);
            if lo {
                let mut residual = [0f32; MAX_BLOCK];
                for ((r, &x), &q) in residual.iter_mut().zip(x).zip(q.iter()) {
                    *r = x - d_hi[b] * q as f32;
                }
                let (q, sums) =
                    (&mut q_lo[b * block..(b + 1) * block], &mut s_lo[b * block / 16..(b + 1) * block / 16]);
                d_lo[b] = quantize_block(&residual[..block], q, sums);
            }
        }
        let dsum = sums.chunks_exact(block / 16).zip(&d).map(|(s, d)| d * s.iter().sum::<i32>() as f32).collect();
        Self { k, block, q, d, dsum, sums }
    }

    pub(crate) fn row(&self, r: usize) -> Row<'_> {
        let k = self.k;
        Row {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[r * k / self.block..(r + 1) * k / self.block],
            dsum: &self.dsum[r * k / self.block..(r + 1) * k / self.block],
            sums: &self.sums[r * k / 16..(r + 1) * k / 16],
        }
    }

    /// The quantized rows as f32 (`d·q`): what the integer products compute with (after
    /// [`Self::quantize_hi_lo`], both parts: `2n` rows).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q.iter().enumerate().map(|(i, &q)| self.d[i / self.block] * q as f32).collect()
    }
}

/// One block of activations to 8 bits: its scale (the largest magnitude over 127), the codes
/// rounded to nearest (ties away from zero, as ggml's `roundf`) into `q`, the sum of every 16 codes
/// into `sums`.
fn quantize_block(x: &[f32], q: &mut [i8], sums: &mut [i32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(16) && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; whole groups of 16 values.
        return unsafe { quantize_block_avx2(x, q, sums) };
    }
    quantize_block_plain(x, q, sums)
}

fn quantize_block_plain(x: &[f32], q: &mut [i8], sums: &mut [i32]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i32).sum();
    }
    amax / 127.0
}

/// [`quantize_block_plain`] in AVX2 registers (the plain loop's float-to-byte conversions and
/// maximum do not vectorise). Rounding half away from zero is adding the largest float below ½
/// with the value's sign, then truncating (what the compiler makes of `round`); the codes are
/// within ±127 by the scale's choice.
///
/// # Safety
/// The CPU must have AVX2; `x` a multiple of 16 values, `q` as many, `sums` one per 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8], sums: &mut [i32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(16) && q.len() == x.len() && sums.len() == x.len() / 16);
    // SAFETY: AVX2 is enabled here and present by the `# Safety` contract; each load reads 8 f32s
    // of an 8- or 16-value chunk of `x`, each store the 16 bytes of a 16-code chunk of `q`.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(c.as_ptr())));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
        let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let half = _mm256_set1_ps(f32::from_bits(0.5f32.to_bits() - 1));
        for ((c, q), s) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).zip(sums.iter_mut()) {
            // (No closure for the rounding: it would not inherit the target features.)
            let a = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), inv);
            let a = _mm256_cvttps_epi32(_mm256_add_ps(a, _mm256_or_ps(_mm256_and_ps(a, sign), half)));
            let b = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8)), inv);
            let b = _mm256_cvttps_epi32(_mm256_add_ps(b, _mm256_or_ps(_mm256_and_ps(b, sign), half)));
            let t = _mm256_add_epi32(a, b);
            let t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let t2 = _mm_add_epi32(t4, _mm_shuffle_epi32::<0b01_00_11_10>(t4));
            *s = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32::<0b10_11_00_01>(t2)));
            // i32 -> i16 packs within 128-bit lanes: [a0..4, b0..4, a4..8, b4..8]; put a before b.
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            let bytes = _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p));
            _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, bytes);
        }
        amax / 127.0
    }
}

/// One stored row (`k / block` blocks of `format`) dotted with one quantized row: the plain loop,
/// block by block, exact integer sums scaled in f32.
pub(crate) fn reference(format: DotFormat, w: &[u8], x: Row<'_>) -> f32 {
    let (bv, bb) = format.block();
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(bb).enumerate() {
        let (q, dx, sums) = (&x.q[b * bv..(b + 1) * bv], x.d[b], &x.sums[b * bv / 16..(b + 1) * bv / 16]);
        let dot = |codes: &mut dyn FnMut(usize) -> i32, range: std::ops::Range<usize>| -> i32 {
            range.map(|v| codes(v) * q[v] as i32).sum()
        };
        acc += match format {
            DotFormat::Q8_0 => f16_at(blk) * dx * dot(&mut |v| blk[2 + v] as i8 as i32, 0..32) as f32,
            DotFormat::Q4_0 => f16_at(blk) * dx * dot(&mut |v| nibble(&blk[2..], v) - 8, 0..32) as f32,
            DotFormat::Q4_1 => {
                let n = dot(&mut |v| nibble(&blk[4..], v), 0..32);
                f16_at(blk) * dx * n as f32 + f16_at(&blk[2..]) * dx * (sums[0] + sums[1]) as f32
            }
            DotFormat::Q5_0 | DotFormat::Q5_1 => {
                let min = format == DotFormat::Q5_1;
                let at = if min { 4 } else { 2 };
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                let code = |v: usize| nibble(&blk[at + 4..], v) | (((qh >> v) & 1) << 4) as i32;
                if min {
                    let n = dot(&mut |v| code(v), 0..32);
                    f16_at(blk) * dx * n as f32 + f16_at(&blk[2..]) * dx * (sums[0] + sums[1]) as f32
                } else {
                    f16_at(blk) * dx * dot(&mut |v| code(v) - 16, 0..32) as f32
                }
            }
            DotFormat::Q4K | DotFormat::Q5K => {
                let (scales, high) = (&blk[4..16], format == DotFormat::Q5K);
                let qs = if high { &blk[48..176] } else { &blk[16..144] };
                let (mut isum, mut imin) = (0i32, 0i32);
                for s in 0..8 {
                    let (sc, m) = scale_min_k4(s, scales);
                    let code = |v: usize| {
                        let byte = qs[32 * (v / 64) + v % 32];
                        let low = if (v / 32).is_multiple_of(2) { byte & 0xF } else { byte >> 4 };
                        let fifth = if high { ((blk[16 + v % 32] >> (v / 32)) & 1) << 4 } else { 0 };
                        (low | fifth) as i32
                    };
                    isum += sc as i32 * dot(&mut |v| code(v), 32 * s..32 * s + 32);
                    imin += m as i32 * (sums[2 * s] + sums[2 * s + 1]);
                }
                f16_at(blk) * dx * isum as f32 - f16_at(&blk[2..]) * dx * imin as f32
            }
            DotFormat::Q6K => {
                let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                let code = |v: usize| {
                    // Half h of 128 values: part p (of 4) of 32, position l.
                    let (h, p, l) = (v / 128, (v % 128) / 32, v % 32);
                    let low = ql[64 * h + 32 * (p % 2) + l];
                    let low = if p < 2 { low & 0xF } else { low >> 4 };
                    let two = (qh[32 * h + l] >> (2 * p)) & 3;
                    (low | two << 4) as i32
                };
                let mut isum = 0i32;
                for s in 0..16 {
                    let scale = sc[s] as i8 as i32;
                    isum += scale * (dot(&mut |v| code(v), 16 * s..16 * s + 16) - 32 * sums[s]);
                }
                f16_at(&blk[208..]) * dx * isum as f32
            }
        };
    }
    acc
}

/// Value `v` (of 32) of a Q4_0 or Q4_1 block's 16 bytes of nibbles.
#[inline(always)]
fn nibble(qs: &[u8], v: usize) -> i32 {
    (if v < 16 { qs[v] & 0xF } else { qs[v - 16] >> 4 }) as i32
}

/// How the dot products run: the plain loop, or one of the x86 instruction sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Isa {
    /// Every set this CPU runs within `cpu`'s tier, narrowest first (the last is the fastest).
    pub(crate) fn reachable(cpu: Cpu) -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut out = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use crate::simd::{detected, Tier};
            let tier = detected().min(cpu.tier);
            if tier >= Tier::Avx2 && std::is_x86_feature_detected!("f16c") {
                out.push(Isa::Avx2);
                if std::is_x86_feature_detected!("avxvnni") {
                    out.push(Isa::AvxVnni);
                }
            }
            if tier >= Tier::Avx512
                && std::is_x86_feature_detected!("f16c")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                out.push(Isa::Avx512Vnni);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = cpu;
        out
    }

    pub(crate) fn best(cpu: Cpu) -> Isa {
        *Self::reachable(cpu).last().unwrap_or(&Isa::Scalar)
    }
}

/// `y = x·Wᵀ` for `n` rows `x` (`[n, k]` row-major) and W the `m` stored rows of `k` values in
/// `data` (`format`'s blocks, row after row): `y` is `[n, m]`. Each row of x is quantized to 8 bits
/// once; the stored rows are split among the threads.
///
/// # Panics
/// If `data` is not `m` rows of `k / block` blocks, or `x` not `n·k` values (callers check shapes).
pub fn product(cpu: Cpu, format: DotFormat, data: &[u8], (m, k): (usize, usize), x: &[f32], n: usize) -> Vec<f32> {
    product_with(Isa::best(cpu), DotWeight::new(format, data, (m, k)), (x, n, ActivationBits::Eight))
}

/// A weight in one of the [`DotFormat`]s, as its bytes: `rows` stored rows of `cols` values, one
/// after another (or interleaved, for the layout that multiplies sixteen rows at once).
#[derive(Clone, Copy)]
pub(crate) struct DotWeight<'a> {
    pub(crate) format: DotFormat,
    pub(crate) data: &'a [u8],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl<'a> DotWeight<'a> {
    pub(crate) fn new(format: DotFormat, data: &'a [u8], (rows, cols): (usize, usize)) -> Self {
        Self { format, data, rows, cols }
    }
}

/// [`product`] on `isa`'s instructions, the `n` rows of `x` quantized to `bits`.
pub(crate) fn product_with(isa: Isa, w: DotWeight<'_>, (x, n, bits): (&[f32], usize, ActivationBits)) -> Vec<f32> {
    let DotWeight { format, data, rows: m, cols: k } = w;
    let (bv, bb) = format.block();
    assert!(k.is_multiple_of(bv) && data.len() == m * (k / bv) * bb, "qdot: {m} rows of {k} {format:?} values");
    let row_bytes = k / bv * bb;
    // Tasks of whole rows, at least 16: small weights in one task.
    split_product((x, bits), (n, k, m), bv, (m, 16), |rows, xs, out| {
        let w = &data[rows.start * row_bytes..rows.end * row_bytes];
        let mut col = vec![0f32; xs.len()];
        for (i, row) in w.chunks_exact(row_bytes).enumerate() {
            row_times(isa, format, row, xs, &mut col);
            for (r, &v) in col.iter().enumerate() {
                // SAFETY: each task writes entries (r, rows) of y only, inside its n·m values.
                unsafe { *out.at(r * m + rows.start + i) = v };
            }
        }
    })
}

/// The frame of the products of several rows with a stored weight ([`product`], and the
/// interleaved layout's product): `y = x·Wᵀ`, `[n, m]`, with x (`[n, k]`) quantized to `bits`
/// once, in blocks of `block` values (the stored blocks'), and the weight's `units` (its rows, or
/// groups of them) split into a few tasks a thread, of at least `min_units` each.
/// `task(units, xs, y)` writes the entries of y that its units own, and only those: y is
/// `[xs.len(), m]`. With 16 bits `xs` holds both parts of every row ([`Q8Rows::quantize_hi_lo`]:
/// the kernels' several-rows paths unpack each weight block once for the two), whose products
/// are added here.
pub(crate) fn split_product(
    (x, bits): (&[f32], ActivationBits),
    (n, k, m): (usize, usize, usize),
    block: usize,
    (units, min_units): (usize, usize),
    task: impl Fn(std::ops::Range<usize>, &[Row<'_>], SharedOut) + Sync,
) -> Vec<f32> {
    let (acts, parts) = match bits {
        ActivationBits::Eight => (Q8Rows::quantize(x, n, k, block), 1),
        ActivationBits::Sixteen => (Q8Rows::quantize_hi_lo(x, n, k, block), 2),
    };
    let mut y = vec![0f32; parts * n * m];
    if n == 0 || m == 0 {
        return y;
    }
    let xs: Vec<Row<'_>> = (0..parts * n).map(|r| acts.row(r)).collect();
    let per_task = units.div_ceil(rayon::current_num_threads().max(1) * 4).max(min_units);
    let out = SharedOut(y.as_mut_ptr());
    (0..units.div_ceil(per_task))
        .into_par_iter()
        .for_each(|t| task(t * per_task..((t + 1) * per_task).min(units), &xs, out));
    if parts == 2 {
        let (hi, lo) = y.split_at_mut(n * m);
        for (h, l) in hi.iter_mut().zip(lo.iter()) {
            *h += *l;
        }
        y.truncate(n * m);
    }
    y
}

/// One stored row dotted with every row of `xs`, into `out` (as long as `xs`): groups of
/// [`ROWS`], each block's codes unpacked once for a group, then a pair (the two parts of a row of
/// 16-bit activations: the K-quants unpack once for both), then one row at a time. Each row's sums
/// run in the same order whatever path takes it.
fn row_times(isa: Isa, format: DotFormat, row: &[u8], xs: &[Row<'_>], out: &mut [f32]) {
    let grouped = xs.len() / ROWS * ROWS;
    for (g, o) in xs[..grouped].chunks_exact(ROWS).zip(out.chunks_exact_mut(ROWS)) {
        let g: &[Row<'_>; ROWS] = g.try_into().expect("a group of ROWS");
        o.copy_from_slice(&dots(isa, format, row, g));
    }
    let mut r = grouped;
    if xs.len() - r >= 2 {
        let pair: &[Row<'_>; 2] = xs[r..r + 2].try_into().expect("a pair");
        out[r..r + 2].copy_from_slice(&dots(isa, format, row, pair));
        r += 2;
    }
    for (x, o) in xs[r..].iter().zip(&mut out[r..]) {
        *o = dot(isa, format, row, *x);
    }
}

/// Activation rows a stored row is dotted with at once.
const ROWS: usize = 4;

/// One stored row dotted with `R` quantized rows on `isa`.
#[inline]
fn dots<const R: usize>(isa: Isa, format: DotFormat, row: &[u8], xs: &[Row<'_>; R]) -> [f32; R] {
    match isa {
        Isa::Scalar => std::array::from_fn(|r| reference(format, row, xs[r])),
        // SAFETY: as in `dot`, for each row of `xs`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { wide::dots_avx2(format, row, xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => unsafe { wide::dots_avxvnni(format, row, xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { wide::dots_avx512vnni(format, row, xs) },
    }
}

/// One stored row dotted with one quantized row on `isa`.
#[inline]
fn dot(isa: Isa, format: DotFormat, row: &[u8], x: Row<'_>) -> f32 {
    match isa {
        Isa::Scalar => reference(format, row, x),
        // SAFETY: `Isa::reachable` offers a set only where the CPU has it; `row` holds whole blocks
        // and `x` the same number of values (product_with checked both).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { wide::dot_avx2(format, row, x) },
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => unsafe { wide::dot_avxvnni(format, row, x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { wide::dot_avx512vnni(format, row, x) },
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use super::{scale_min_k4, DotFormat, Row, ROWS};

    /// The one instruction that differs between the sets: `acc + Σ_4 u8·i8` in each i32 lane.
    ///
    /// # Safety
    /// Implementors may only be called where the CPU has their set.
    unsafe trait Isa {
        unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;
    }

    struct Avx2;
    struct AvxVnni;
    struct Avx512Vnni;

    // SAFETY (the three impls): each is only called inside the matching `dot_*` entry point below,
    // whose target features include the instruction's.
    unsafe impl Isa for Avx2 {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            // Pairs of u8·i8 summed into i16 (the codes' bounds keep them under 2^15), then pairs
            // of those into i32.
            _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
        }
    }
    unsafe impl Isa for AvxVnni {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, u, s)
        }
    }
    unsafe impl Isa for Avx512Vnni {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, u, s)
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA; `row` whole blocks of `format`, `x` as many values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_avx2(format: DotFormat, row: &[u8], x: Row<'_>) -> f32 {
        // SAFETY: AVX2, FMA and F16C are enabled here and on the CPU (`# Safety`), `row` is
        // whole blocks of `format` and `x` as many values: what `dot_with::<Avx2>` needs.
        unsafe { dot_with::<Avx2>(format, row, x) }
    }

    /// # Safety
    /// The CPU must have AVX-VNNI; as [`dot_avx2`] otherwise.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn dot_avxvnni(format: DotFormat, row: &[u8], x: Row<'_>) -> f32 {
        // SAFETY: AVX2, FMA, F16C and AVX-VNNI are enabled here and on the CPU (`# Safety`), `row` is
        // whole blocks of `format` and `x` as many values: what `dot_with::<AvxVnni>` needs.
        unsafe { dot_with::<AvxVnni>(format, row, x) }
    }

    /// # Safety
    /// The CPU must have AVX-512 VNNI and VL; as [`dot_avx2`] otherwise.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot_avx512vnni(format: DotFormat, row: &[u8], x: Row<'_>) -> f32 {
        // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL are enabled here and on the CPU (`# Safety`), `row` is
        // whole blocks of `format` and `x` as many values: what `dot_with::<Avx512Vnni>` needs.
        unsafe { dot_with::<Avx512Vnni>(format, row, x) }
    }

    /// # Safety
    /// As [`dot_avx2`], for each row of `xs`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx2<const R: usize>(format: DotFormat, row: &[u8], xs: &[Row<'_>; R]) -> [f32; R] {
        // SAFETY: as in `dot_avx2` (the same features, enabled here and on the CPU by the
        // `# Safety` contract), for each row of `xs`.
        unsafe { dots_with::<Avx2, R>(format, row, xs) }
    }

    /// # Safety
    /// As [`dot_avxvnni`], for each row of `xs`.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn dots_avxvnni<const R: usize>(format: DotFormat, row: &[u8], xs: &[Row<'_>; R]) -> [f32; R] {
        // SAFETY: as in `dot_avxvnni` (the same features, enabled here and on the CPU by the
        // `# Safety` contract), for each row of `xs`.
        unsafe { dots_with::<AvxVnni, R>(format, row, xs) }
    }

    /// # Safety
    /// As [`dot_avx512vnni`], for each row of `xs`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn dots_avx512vnni<const R: usize>(format: DotFormat, row: &[u8], xs: &[Row<'_>; R]) -> [f32; R] {
        // SAFETY: as in `dot_avx512vnni` (the same features, enabled here and on the CPU by the
        // `# Safety` contract), for each row of `xs`.
        unsafe { dots_with::<Avx512Vnni, R>(format, row, xs) }
    }

    #[inline(always)]
    unsafe fn dots_with<I: Isa, const R: usize>(format: DotFormat, row: &[u8], xs: &[Row<'_>; R]) -> [f32; R] {
        let blocks = row.len() / format.block().1;
        // SAFETY: inlined only into the `dots_*` entry points, whose target features (and `# Safety`
        // contracts) give AVX2, FMA, F16C and I's set; `row` is `blocks` whole blocks, each row of
        // `xs` as many values.
        unsafe {
            match format {
                // A pair one row at a time, as a row on its own (`small`'s two accumulators).
                DotFormat::Q8_0 | DotFormat::Q4_0 | DotFormat::Q4_1 | DotFormat::Q5_0 | DotFormat::Q5_1
                    if R != ROWS =>
                {
                    let mut out = [0f32; R];
                    for r in 0..R {
                        out[r] = dot_with::<I>(format, row, xs[r]);
                    }
                    out
                }
                DotFormat::Q8_0 => small_rows::<I, Q8_0, R>(row, xs, blocks),
                DotFormat::Q4_0 => small_rows::<I, Q4_0, R>(row, xs, blocks),
                DotFormat::Q4_1 => small_rows::<I, Q4_1, R>(row, xs, blocks),
                DotFormat::Q5_0 => small_rows::<I, Q5_0, R>(row, xs, blocks),
                DotFormat::Q5_1 => small_rows::<I, Q5_1, R>(row, xs, blocks),
                DotFormat::Q4K => q4k::<I, false, R>(row, xs, blocks),
                DotFormat::Q5K => q4k::<I, true, R>(row, xs, blocks),
                DotFormat::Q6K => q6k::<I, R>(row, xs, blocks),
            }
        }
    }

    #[inline(always)]
    unsafe fn dot_with<I: Isa>(format: DotFormat, row: &[u8], x: Row<'_>) -> f32 {
        let (bv, bb) = format.block();
        let blocks = row.len() / bb;
        debug_assert!(x.q.len() >= blocks * bv && x.d.len() >= blocks && x.sums.len() >= blocks * bv / 16);
        // SAFETY: inlined only into the `dot_*`/`dots_*` entry points, whose target features (and
        // `# Safety` contracts) give AVX2, FMA, F16C and I's set; `row` is `blocks` whole blocks,
        // `x` as many values (the contracts; checked above in debug builds).
        unsafe {
            match format {
                DotFormat::Q8_0 => small::<I, Q8_0>(row, x, blocks),
                DotFormat::Q4_0 => small::<I, Q4_0>(row, x, blocks),
                DotFormat::Q4_1 => small::<I, Q4_1>(row, x, blocks),
                DotFormat::Q5_0 => small::<I, Q5_0>(row, x, blocks),
                DotFormat::Q5_1 => small::<I, Q5_1>(row, x, blocks),
                DotFormat::Q4K => q4k::<I, false, 1>(row, &[x], blocks)[0],
                DotFormat::Q5K => q4k::<I, true, 1>(row, &[x], blocks)[0],
                DotFormat::Q6K => q6k::<I, 1>(row, &[x], blocks)[0],
            }
        }
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: AVX from the entry points this inlines into; every caller passes `p` with 32
        // readable bytes (inside one block of `row`, or 32 activation codes of `x.q`).
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register-only AVX/SSE operations, AVX enabled by the entry points this inlines into.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }

    /// The bits of each byte of `v` that `mask` keeps after a right shift by `shift`, moved to bit 4
    /// (the high bits of the 5- and 6-bit codes). Not a closure: closures would not inherit the
    /// callers' target features.
    #[inline(always)]
    unsafe fn bits_at_4(v: __m256i, shift: i32, mask: __m256i) -> __m256i {
        // SAFETY: register-only AVX2 operations, enabled by the entry points this inlines into.
        unsafe { _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), mask)) }
    }

    /// Signed codes `w` times signed `x`: `|w|` times `x` with w's sign.
    #[inline(always)]
    unsafe fn signed<I: Isa>(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: register-only; AVX2 and I's set are enabled (and on the CPU) in the entry point
        // this inlines into, as `Isa`'s contract asks.
        unsafe { I::dot(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)) }
    }

    /// A Q4_0/Q4_1 block's 16 bytes of nibbles as 32 codes in value order.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: AVX from the entry points this inlines into; the callers (the 4- and 5-bit
        // types' `codes`) pass `p` at their block's 16 bytes of nibbles, the block's last 16.
        unsafe {
            let v = _mm_loadu_si128(p as *const __m128i);
            let m4 = _mm_set1_epi8(0x0F);
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(v), m4), _mm_and_si128(v, m4))
        }
    }

    /// A half at `p` (unaligned) as f32, on F16C.
    #[inline(always)]
    unsafe fn half(p: *const u8) -> f32 {
        // SAFETY: F16C from the entry points this inlines into; every caller passes `p` at an f16
        // inside one block of `row` (a scale or min: bytes 0, 2 or 208).
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const u16) as i32))) }
    }

    /// How a 32-value block type's codes multiply 32 activations (its f16 scale first).
    trait Small {
        /// Bytes a block.
        const BYTES: usize;
        /// Whether a min `m` (an f16 after the scale) adds `m·Σx`.
        const MIN: bool;
        /// Whether the codes are signed (they go in as `|w|` and `x·sign(w)`).
        const SIGNED: bool;
        /// The block's 32 codes, in value order.
        unsafe fn codes(blk: *const u8) -> __m256i;

        /// The codes of the block at `blk` times `x`, in i32 lanes.
        #[inline(always)]
        unsafe fn product<I: Isa>(blk: *const u8, x: __m256i) -> __m256i {
            // SAFETY: `small` passes `blk` at a whole block of `Self::BYTES` in `row`, what `codes`
            // reads; AVX2 and I's set are enabled in the entry point this inlines into.
            unsafe {
                match Self::SIGNED {
                    true => signed::<I>(Self::codes(blk), x),
                    false => I::dot(_mm256_setzero_si256(), Self::codes(blk), x),
                }
            }
        }
    }

    struct Q8_0;
    struct Q4_0;
    struct Q4_1;
    struct Q5_0;
    struct Q5_1;

    impl Small for Q8_0 {
        const BYTES: usize = 34;
        const MIN: bool = false;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn codes(blk: *const u8) -> __m256i {
            // SAFETY: `blk` is a whole 34-byte block (`small`, `small_rows` step through
            // `row` by blocks): the codes are its bytes 2..34.
            unsafe { load(blk.add(2)) }
        }
    }

    impl Small for Q4_0 {
        const BYTES: usize = 18;
        const MIN: bool = false;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn codes(blk: *const u8) -> __m256i {
            // SAFETY: `blk` is a whole 18-byte block (`small`, `small_rows` step through
            // `row` by blocks): the nibbles are its bytes 2..18.
            unsafe { _mm256_sub_epi8(nibbles(blk.add(2)), _mm256_set1_epi8(8)) }
        }
    }

    impl Small for Q4_1 {
        const BYTES: usize = 20;
        const MIN: bool = true;
        const SIGNED: bool = false;
        #[inline(always)]
        unsafe fn codes(blk: *const u8) -> __m256i {
            // SAFETY: `blk` is a whole 20-byte block (`small`, `small_rows` step through
            // `row` by blocks): the nibbles are its bytes 4..20.
            unsafe { nibbles(blk.add(4)) }
        }
    }

    impl Small for Q5_0 {
        const BYTES: usize = 22;
        const MIN: bool = false;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn codes(blk: *const u8) -> __m256i {
            // SAFETY: `blk` is a whole 22-byte block (`small`, `small_rows` step through
            // `row` by blocks): `qh` is its bytes 2..6, the nibbles 6..22.
            unsafe {
                _mm256_sub_epi8(_mm256_or_si256(nibbles(blk.add(6)), fifth_bits(blk.add(2))), _mm256_set1_epi8(16))
            }
        }
    }

    impl Small for Q5_1 {
        const BYTES: usize = 24;
        const MIN: bool = true;
        const SIGNED: bool = false;
        #[inline(always)]
        unsafe fn codes(blk: *const u8) -> __m256i {
            // SAFETY: `blk` is a whole 24-byte block (`small`, `small_rows` step through
            // `row` by blocks): `qh` is its bytes 4..8, the nibbles 8..24.
            unsafe { _mm256_or_si256(nibbles(blk.add(8)), fifth_bits(blk.add(4))) }
        }
    }

    /// The 32 bits of the u32 at `p` as 32 bytes: 16 in byte `j` where bit `j` is set, else 0.
    #[inline(always)]
    unsafe fn fifth_bits(p: *const u8) -> __m256i {
        // SAFETY: AVX2 from the entry points this inlines into; the callers (Q5_0's and Q5_1's
        // `codes`) pass `p` at their block's 4 bytes of `qh`.
        unsafe {
            let bits = _mm256_set1_epi32(std::ptr::read_unaligned(p as *const u32) as i32);
            // Byte j takes byte j / 8 of the u32 (each 128-bit lane holds all four), then keeps
            // its bit j % 8.
            let spread = _mm256_shuffle_epi8(
                bits,
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                ),
            );
            let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
            _mm256_and_si256(set, _mm256_set1_epi8(16))
        }
    }

    /// A row of 32-value blocks: two blocks an iteration into two accumulators (the fused
    /// multiply-add's latency would otherwise bound the loop), no bounds checks inside.
    #[inline(always)]
    unsafe fn small<I: Isa, T: Small>(row: &[u8], x: Row<'_>, blocks: usize) -> f32 {
        debug_assert!(row.len() >= blocks * T::BYTES && x.d.len() >= blocks && x.dsum.len() >= blocks);
        // SAFETY: `dot_with` passes `blocks = row.len() / T::BYTES`, so `blk` (b < blocks) is a
        // whole block; `x` has 32·blocks codes and `blocks` scales and sums (the entry points'
        // contract); their target features give AVX2, FMA, F16C and I's set.
        unsafe {
            let (w, xq, xd, xs) = (row.as_ptr(), x.q.as_ptr() as *const u8, x.d.as_ptr(), x.dsum.as_ptr());
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut offsets = [0f32; 2];
            let mut b = 0;
            while b < blocks {
                for (lane, (acc, offset)) in acc.iter_mut().zip(&mut offsets).enumerate() {
                    let b = b + lane;
                    if b == blocks {
                        break;
                    }
                    let blk = w.add(T::BYTES * b);
                    let p = T::product::<I>(blk, load(xq.add(32 * b)));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half(blk) * *xd.add(b)), *acc);
                    if T::MIN {
                        *offset += half(blk.add(2)) * *xs.add(b);
                    }
                }
                b += 2;
            }
            hsum(_mm256_add_ps(acc[0], acc[1])) + offsets[0] + offsets[1]
        }
    }

    /// One row of 32-value blocks against `R` rows of activations: each block's codes unpacked
    /// once for all of them (what makes a batch of rows cheaper than `R` single products), each
    /// row's sums in [`small`]'s order (even and odd blocks in two accumulators, added at the end),
    /// so that a row gets the same bits alone or in a batch.
    #[inline(always)]
    unsafe fn small_rows<I: Isa, T: Small, const R: usize>(row: &[u8], xs: &[Row<'_>; R], blocks: usize) -> [f32; R] {
        debug_assert!(row.len() >= blocks * T::BYTES);
        debug_assert!(xs.iter().all(|x| x.q.len() >= 32 * blocks && x.d.len() >= blocks && x.dsum.len() >= blocks));
        // SAFETY: as in `small`: `dots_with` passes `blocks = row.len() / T::BYTES`, and each row
        // of `xs` has 32·blocks codes and `blocks` scales and sums (the `dots_*` contracts).
        unsafe {
            let w = row.as_ptr();
            let xq: [*const u8; R] = std::array::from_fn(|r| xs[r].q.as_ptr() as *const u8);
            let xd: [*const f32; R] = std::array::from_fn(|r| xs[r].d.as_ptr());
            let xs_: [*const f32; R] = std::array::from_fn(|r| xs[r].dsum.as_ptr());
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let mut offsets = [[0f32; 2]; R];
            for b in 0..blocks {
                let lane = b & 1;
                let blk = w.add(T::BYTES * b);
                let codes = T::codes(blk);
                let u = if T::SIGNED { _mm256_abs_epi8(codes) } else { codes };
                let dw = half(blk);
                let m = if T::MIN { half(blk.add(2)) } else { 0.0 };
                for r in 0..R {
                    let x = load(xq[r].add(32 * b));
                    let x = if T::SIGNED { _mm256_sign_epi8(x, codes) } else { x };
                    let p = I::dot(_mm256_setzero_si256(), u, x);
                    let a = &mut acc[r][lane];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * *xd[r].add(b)), *a);
                    if T::MIN {
                        offsets[r][lane] += m * *xs_[r].add(b);
                    }
                }
            }
            std::array::from_fn(|r| hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r][0] + offsets[r][1])
        }
    }

    /// Q4_K, and Q5_K (`FIFTH`: a fifth bit per code from `qh`), against `R` activation rows:
    /// each block's codes unpacked once for all of them, each row's sums in the same order
    /// whatever `R`.
    #[inline(always)]
    unsafe fn q4k<I: Isa, const FIFTH: bool, const R: usize>(row: &[u8], xs: &[Row<'_>; R], blocks: usize) -> [f32; R] {
        let bb = if FIFTH { 176 } else { 144 };
        // SAFETY: `blk` points at `bytes`, one block (sliced with bounds checks), and every read
        // stays in its 144/176 bytes; `xq` at block b's 256 codes of each row of `xs` (the entry
        // points' contract: every row as many values as `row`), which also give AVX2, FMA, F16C
        // and I's set.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let one = _mm256_set1_epi8(1);
            let (mut acc, mut mins) = ([_mm256_setzero_ps(); R], [0f32; R]);
            for b in 0..blocks {
                let bytes = &row[bb * b..bb * (b + 1)];
                let blk = bytes.as_ptr();
                let qs = blk.add(if FIFTH { 48 } else { 16 });
                let qh = if FIFTH { load(blk.add(16)) } else { _mm256_setzero_si256() };
                let (mut isum, mut imin) = ([_mm256_setzero_si256(); R], [0i32; R]);
                for g in 0..4 {
                    let v = load(qs.add(32 * g));
                    let (mut lo, mut hi) = (_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4));
                    if FIFTH {
                        lo = _mm256_or_si256(lo, bits_at_4(qh, 2 * g as i32, one));
                        hi = _mm256_or_si256(hi, bits_at_4(qh, 2 * g as i32 + 1, one));
                    }
                    let (sc1, m1) = scale_min_k4(2 * g, &bytes[4..16]);
                    let (sc2, m2) = scale_min_k4(2 * g + 1, &bytes[4..16]);
                    let (sc1, sc2) = (_mm256_set1_epi32(sc1 as i32), _mm256_set1_epi32(sc2 as i32));
                    for r in 0..R {
                        let xq = xs[r].q.as_ptr().add(256 * b) as *const u8;
                        let p1 = I::dot(_mm256_setzero_si256(), lo, load(xq.add(64 * g)));
                        let p2 = I::dot(_mm256_setzero_si256(), hi, load(xq.add(64 * g + 32)));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(p1, sc1));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(p2, sc2));
                        let s = &xs[r].sums[16 * b + 4 * g..16 * b + 4 * g + 4];
                        imin[r] += m1 as i32 * (s[0] + s[1]) + m2 as i32 * (s[2] + s[3]);
                    }
                }
                for r in 0..R {
                    let (d, dmin) = (half(blk) * xs[r].d[b], half(blk.add(2)) * xs[r].d[b]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d), acc[r]);
                    mins[r] += dmin * imin[r] as f32;
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]) - mins[r];
            }
            out
        }
    }

    /// Q6_K against `R` activation rows, as [`q4k`].
    #[inline(always)]
    unsafe fn q6k<I: Isa, const R: usize>(row: &[u8], xs: &[Row<'_>; R], blocks: usize) -> [f32; R] {
        // SAFETY: as in `q4k`: `blk` points at one bounds-checked 210-byte block (reads: `ql`
        // 0..128, `qh` 128..192, `d` 208..210), `xq` at block b's 256 codes of each row of `xs`.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m3 = _mm256_set1_epi8(3);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let bytes = &row[210 * b..210 * (b + 1)];
                let blk = bytes.as_ptr();
                let sc = &bytes[192..208];
                let mut isum = [_mm256_setzero_si256(); R];
                for h in 0..2 {
                    let (ql0, ql1, qh) =
                        (load(blk.add(64 * h)), load(blk.add(64 * h + 32)), load(blk.add(128 + 32 * h)));
                    let codes = [
                        _mm256_or_si256(_mm256_and_si256(ql0, m4), bits_at_4(qh, 0, m3)),
                        _mm256_or_si256(_mm256_and_si256(ql1, m4), bits_at_4(qh, 2, m3)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), bits_at_4(qh, 4, m3)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), bits_at_4(qh, 6, m3)),
                    ];
                    for (p, codes) in codes.into_iter().enumerate() {
                        let s = 8 * h + 2 * p;
                        // Lanes 0..4 hold the first 16 values (scale s), lanes 4..8 the next (s + 1).
                        let scales = _mm256_set_m128i(
                            _mm_set1_epi32(sc[s + 1] as i8 as i32),
                            _mm_set1_epi32(sc[s] as i8 as i32),
                        );
                        for r in 0..R {
                            let xq = xs[r].q.as_ptr().add(256 * b) as *const u8;
                            let prod = I::dot(_mm256_setzero_si256(), codes, load(xq.add(128 * h + 32 * p)));
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(prod, scales));
                        }
                    }
                }
                for r in 0..R {
                    let d = half(blk.add(208)) * xs[r].d[b];
                    // The codes' offset of 32: Σ_s sc_s · 32 · Σ q over sub-block s.
                    let offset: i32 = (0..16).map(|s| sc[s] as i8 as i32 * xs[r].sums[16 * b + s]).sum();
                    let isum = _mm256_sub_epi32(isum[r], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// `rows` stored rows of `k` values: random code bytes, every f16 scale a normal half between
    /// 2^-5 and 2^0 of either sign.
    pub(crate) fn random_rows(format: DotFormat, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (bv, bb) = format.block();
        let mut data: Vec<u8> = (0..rows * k / bv * bb).map(|_| rng.random()).collect();
        let scales: &[usize] = match format {
            DotFormat::Q8_0 | DotFormat::Q4_0 | DotFormat::Q5_0 => &[0],
            DotFormat::Q4_1 | DotFormat::Q5_1 | DotFormat::Q4K | DotFormat::Q5K => &[0, 2],
            DotFormat::Q6K => &[208],
        };
        for blk in data.chunks_exact_mut(bb) {
            for &at in scales {
                let (sign, exp, man) =
                    (rng.random::<bool>() as u16, rng.random_range(10u16..15), rng.random_range(0u16..1024));
                blk[at..at + 2].copy_from_slice(&(sign << 15 | exp << 10 | man).to_le_bytes());
            }
        }
        data
    }

    #[test]
    fn halves_convert_as_ieee_says() {
        for (bits, want) in [(0x3C00u16, 1.0f32), (0xC000, -2.0), (0x0001, 5.960_464_5e-8), (0x8400, -6.103_515_6e-5)] {
            assert_eq!(f16_at(&bits.to_le_bytes()), want, "{bits:#06x}");
        }
        assert!(f16_at(&0x7E00u16.to_le_bytes()).is_nan());
        assert_eq!(f16_at(&0x7C00u16.to_le_bytes()), f32::INFINITY);
    }

    #[test]
    fn the_vector_quantizer_equals_the_plain_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        // Halves (exact ties after scaling) among the random values.
        let mut x: Vec<f32> = (0..256).map(|_| rng.random_range(-5.0f32..5.0)).collect();
        x[3] = 127.0;
        x[4] = 0.5;
        x[5] = -1.5;
        let (mut q1, mut s1, mut q2, mut s2) = (vec![0i8; 256], vec![0i32; 16], vec![0i8; 256], vec![0i32; 16]);
        let d1 = quantize_block_plain(&x, &mut q1, &mut s1);
        let d2 = quantize_block(&x, &mut q2, &mut s2);
        assert_eq!((d1, &q1, &s1), (d2, &q2, &s2));
        assert_eq!((q1[3], q1[4], q1[5]), (127, 1, -2), "ties away from zero");
    }

    #[test]
    fn activations_round_to_their_block_scale() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
        let q = Q8Rows::quantize(&x, 2, 32, 32);
        let back = q.dequantize();
        for (b, (x, y)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b2) in x.iter().zip(y) {
                assert!((a - b2).abs() <= amax / 127.0 / 2.0 * 1.0001, "block {b}: {a} -> {b2}");
            }
        }
        assert_eq!(q.sums[0], q.q[..16].iter().map(|&v| v as i32).sum::<i32>());
    }

    #[test]
    fn every_instruction_set_equals_the_plain_loop() {
        for format in DotFormat::ALL {
            let (bv, _) = format.block();
            // 11 rows: two groups of ROWS, a pair and one on its own.
            let (m, k, n) = (37, 2 * bv.max(256), 2 * ROWS + 3);
            let data = random_rows(format, m, k, 7 + format as u64);
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let want = product_with(Isa::Scalar, DotWeight::new(format, &data, (m, k)), (&x, n, ActivationBits::Eight));
            assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
            // The integer sums are exact; the f32 sums of the blocks' terms (each up to the row's
            // largest output) run in another order.
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for isa in Isa::reachable(Cpu::detect()) {
                let got = product_with(isa, DotWeight::new(format, &data, (m, k)), (&x, n, ActivationBits::Eight));
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * scale,
                        "{format:?} on {isa:?}, entry {i}: {a} vs {b} (scale {scale})"
                    );
                }
            }
        }
    }

    /// A row's product has the same bits alone or among others (grouped by ROWS, in a pair or on
    /// its own), on every instruction set: a served request's tokens do not depend on what runs
    /// beside it.
    #[test]
    fn a_row_gets_the_same_bits_alone_or_in_a_batch() {
        for format in DotFormat::ALL {
            let (bv, _) = format.block();
            let (m, k, n) = (19, 3 * bv.max(256), 2 * ROWS + 3);
            let data = random_rows(format, m, k, 3 + format as u64);
            let mut rng = ChaCha8Rng::seed_from_u64(5);
            let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            for isa in Isa::reachable(Cpu::detect()) {
                let w = DotWeight::new(format, &data, (m, k));
                let together = product_with(isa, w, (&x, n, ActivationBits::Eight));
                for r in 0..n {
                    let alone = product_with(isa, w, (&x[r * k..(r + 1) * k], 1, ActivationBits::Eight));
                    assert_eq!(&together[r * m..(r + 1) * m], &alone[..], "{format:?} on {isa:?}, row {r}");
                }
            }
        }
    }

    #[test]
    fn the_low_part_holds_the_rounding_residual() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let x: Vec<f32> = (0..2 * 256).map(|_| rng.random_range(-4.0f32..4.0)).collect();
        for block in [32, 256] {
            let hi = Q8Rows::quantize(&x, 2, 256, block);
            let both = Q8Rows::quantize_hi_lo(&x, 2, 256, block);
            assert_eq!(
                (&both.q[..512], &both.d[..512 / block], &both.sums[..32]),
                (&hi.q[..], &hi.d[..], &hi.sums[..])
            );
            let back = both.dequantize();
            for (b, x) in x.chunks(block).enumerate() {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, &v) in x.iter().enumerate() {
                    let at = b * block + i;
                    let sum = back[at] + back[512 + at];
                    assert!((v - sum).abs() <= amax / 127.0 / 254.0 / 2.0 * 1.01, "block {b} of {block}: {v} -> {sum}");
                }
            }
        }
    }

    /// The stored rows decoded to f32 by the plain loop: their products with the one-hot rows
    /// (each quantized exactly: code 127, scale 1/127), `[k, m]`.
    fn decoded_columns(format: DotFormat, data: &[u8], (m, k): (usize, usize)) -> Vec<f32> {
        let eye: Vec<f32> = (0..k * k).map(|i| f32::from(i / k == i % k)).collect();
        product_with(Isa::Scalar, DotWeight::new(format, data, (m, k)), (&eye, k, ActivationBits::Eight))
    }

    /// 16-bit activations: every type on every set within 1e-4 (relative, L2) of the f32 product
    /// of the decoded weight, 2e-4 for the K-quants, whose blocks of 256 more often hold an outlier
    /// (the low part's step is 1/(127·254) of the block's largest value); 8-bit ones a hundred
    /// times further.
    #[test]
    fn sixteen_bit_activations_multiply_as_the_decoded_weight_does() {
        for format in DotFormat::ALL {
            let (m, k) = (37, 512);
            let data = random_rows(format, m, k, 3 + format as u64);
            let w = decoded_columns(format, &data, (m, k));
            let bound = if format.block().0 == 256 { 2e-4 } else { 1e-4 };
            let mut rng = ChaCha8Rng::seed_from_u64(12);
            for n in [1, 2, 5] {
                // Outliers, as hidden states have: every 50th value 20 times the rest.
                let x: Vec<f32> =
                    (0..n * k).map(|i| rng.random_range(-1.0f32..1.0) * if i % 50 == 7 { 20.0 } else { 1.0 }).collect();
                let want: Vec<f32> = (0..n * m)
                    .map(|e| {
                        let (r, o) = (e / m, e % m);
                        (0..k).map(|i| x[r * k + i] as f64 * w[i * m + o] as f64).sum::<f64>() as f32
                    })
                    .collect();
                let weight = DotWeight::new(format, &data, (m, k));
                let eight = relative(&product_with(Isa::Scalar, weight, (&x, n, ActivationBits::Eight)), &want);
                for isa in Isa::reachable(Cpu::detect()) {
                    let got = product_with(isa, weight, (&x, n, ActivationBits::Sixteen));
                    let r = relative(&got, &want);
                    assert!(r < bound && r * 100.0 < eight, "{format:?} on {isa:?}, {n} rows: {r} (8 bits: {eight})");
                }
            }
        }
    }

    /// `‖a − b‖ / ‖b‖`.
    pub(crate) fn relative(a: &[f32], b: &[f32]) -> f64 {
        let diff: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
        let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        assert!(norm > 0.0);
        (diff / norm).sqrt()
    }

    #[test]
    fn the_dispatch_takes_the_widest_set_the_tier_allows() {
        let scalar = Isa::reachable(Cpu::detect().capped(crate::Tier::Baseline));
        assert_eq!(scalar, vec![Isa::Scalar]);
        assert_eq!(Isa::best(Cpu::detect()), *Isa::reachable(Cpu::detect()).last().unwrap());
    }
}
