//! Stored rows interleaved sixteen at a time, for the integer products of several activation rows
//! on AVX-512 VNNI: one `vpdpbusd` multiplies four codes of sixteen weight rows by the same four
//! activations (broadcast) and leaves each weight row's sum in its own lane. There are no
//! horizontal sums, each block's scales apply to sixteen rows in one multiply, and a block's codes
//! are unpacked once for every activation row of the call. llama.cpp repacks its CPU weights the
//! same way (ggml-cpu's `repack.cpp`).
//!
//! One record per (group of 16 rows, block of 32 values): the 16 rows' f16 scales, Q4_1's 16 f16
//! mins, then the codes in chunks of 64 bytes whose 4-byte lane `j` belongs to row `j`:
//!
//! | type | record | chunks | chunk `c`, lane `j` |
//! |------|--------|--------|---------------------|
//! | Q8_0 | 32 + 512 | 8 | codes `4c..4c+4` of row `j`, each + 128 (as a u8) |
//! | Q4_0 | 32 + 256 | 4 | nibble bytes `4c..4c+4` of row `j` (low nibbles values `4c..`, high ones `16+4c..`) |
//! | Q4_1 | 64 + 256 | 4 | as Q4_0 |
//!
//! A record holds exactly the bytes of the 16 rows' blocks: the layout costs no memory. Values:
//! Q8_0 `d·(u − 128)`, Q4_0 `d·(n − 8)`, Q4_1 `d·n + m`; so every type is `d·code + o` with an
//! unsigned code and a per-row offset `o` (`−128d`, `−8d`, `m`), whose product with the activations
//! is `o·d_x·Σq`, from the activations' block sums. [`restore_row`] gives a row back in the file's
//! layout (what the f32 paths decode), and [`product`] on CPUs without AVX-512 VNNI runs the plain
//! loop of [`crate::qdot`] over the restored rows: the reference the fast path is tested against.

use crate::compute::{ActivationBits, Cpu};
use crate::qdot::{reference, split_product, DotFormat, DotWeight, Isa, Row};

/// Rows a group.
pub const GROUP: usize = 16;

/// Whether `format`'s blocks interleave.
pub fn supports(format: DotFormat) -> bool {
    matches!(format, DotFormat::Q8_0 | DotFormat::Q4_0 | DotFormat::Q4_1)
}

/// Whether a weight of `rows` rows in `format` is worth interleaving on this machine: its type
/// interleaves, its rows make whole groups, and the CPU has the instructions the layout is for.
pub fn pays(format: DotFormat, rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return supports(format) && rows.is_multiple_of(GROUP) && Isa::best(Cpu::detect()) == Isa::Avx512Vnni;
    // Elsewhere only the plain loop would read the layout.
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, rows);
        false
    }
}

/// Bytes of the scales (and mins) at the head of a record.
fn header(format: DotFormat) -> usize {
    if format == DotFormat::Q4_1 {
        64
    } else {
        32
    }
}

/// Where byte `t` of the codes of chunk `c`, lane `j` comes from in a block of the file's layout,
/// and whether it is flipped by 128 (Q8_0's signed codes).
fn code_at(format: DotFormat, c: usize, t: usize) -> (usize, bool) {
    match format {
        DotFormat::Q8_0 => (2 + 4 * c + t, true),
        DotFormat::Q4_1 => (4 + 4 * c + t, false),
        _ => (2 + 4 * c + t, false),
    }
}

/// Chunks of codes a record holds.
fn chunks(format: DotFormat) -> usize {
    if format == DotFormat::Q8_0 {
        8
    } else {
        4
    }
}

/// `m` rows of `k` values in the file's layout (`data`), interleaved; `None` where the type does not
/// interleave or the rows do not make whole groups.
pub fn interleave(format: DotFormat, data: &[u8], shape: (usize, usize)) -> Option<Vec<u8>> {
    interleave_with(format, data, shape, &mut |_| {})
}

/// Source bytes read between two calls of [`interleave_with`]'s `consumed`.
const CONSUMED_STEP: usize = 1 << 20;

/// [`interleave`], calling `consumed` with each range of `data` it is done reading (about a MiB at
/// a time, in order): a mapped file's pages can be let go as the copy grows, so that the two are
/// never whole at once.
pub fn interleave_with(
    format: DotFormat,
    data: &[u8],
    (m, k): (usize, usize),
    consumed: &mut dyn FnMut(std::ops::Range<usize>),
) -> Option<Vec<u8>> {
    let (bv, bb) = format.block();
    if !supports(format) || !m.is_multiple_of(GROUP) || !k.is_multiple_of(bv) || data.len() != m * k / bv * bb {
        return None;
    }
    let (blocks, head) = (k / bv, header(format));
    let group_bytes = GROUP * blocks * bb;
    let mut out = vec![0u8; data.len()];
    let mut done = 0;
    for (g, group) in out.chunks_exact_mut(group_bytes).enumerate() {
        for (b, rec) in group.chunks_exact_mut(GROUP * bb).enumerate() {
            for j in 0..GROUP {
                let block = &data[((g * GROUP + j) * blocks + b) * bb..][..bb];
                rec[2 * j..2 * j + 2].copy_from_slice(&block[..2]);
                if format == DotFormat::Q4_1 {
                    rec[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&block[2..4]);
                }
                for c in 0..chunks(format) {
                    for t in 0..4 {
                        let (at, flip) = code_at(format, c, t);
                        rec[head + 64 * c + 4 * j + t] = block[at] ^ if flip { 0x80 } else { 0 };
                    }
                }
            }
        }
        // A group's records come from its 16 rows, which are contiguous in the file's layout.
        let read = (g + 1) * group_bytes;
        if read - done >= CONSUMED_STEP || read == data.len() {
            consumed(done..read);
            done = read;
        }
    }
    Some(out)
}

/// Row `row` of an interleaved weight of `m` rows of `k` values, in the file's layout, into `out`
/// (`k / 32` blocks).
pub fn restore_row(format: DotFormat, data: &[u8], (m, k): (usize, usize), row: usize, out: &mut [u8]) {
    restore_blocks(format, data, (m, k), row, 0..k / format.block().0, out);
}

/// Blocks `blocks` of row `row` of an interleaved weight, in the file's layout, into `out`.
pub fn restore_blocks(
    format: DotFormat,
    data: &[u8],
    (m, k): (usize, usize),
    row: usize,
    blocks: std::ops::Range<usize>,
    out: &mut [u8],
) {
    let (bv, bb) = format.block();
    let head = header(format);
    let (first, len, all) = (blocks.start, blocks.len(), k / bv);
    assert!(row < m && blocks.end <= all && out.len() == len * bb, "restore_blocks: row {row} of {m}, {blocks:?}");
    let blocks = all;
    let (g, j) = (row / GROUP, row % GROUP);
    for (b, block) in (first..).zip(out.chunks_exact_mut(bb)) {
        let rec = &data[(g * blocks + b) * GROUP * bb..][..GROUP * bb];
        block[..2].copy_from_slice(&rec[2 * j..2 * j + 2]);
        if format == DotFormat::Q4_1 {
            block[2..4].copy_from_slice(&rec[32 + 2 * j..32 + 2 * j + 2]);
        }
        for c in 0..chunks(format) {
            for t in 0..4 {
                let (at, flip) = code_at(format, c, t);
                block[at] = rec[head + 64 * c + 4 * j + t] ^ if flip { 0x80 } else { 0 };
            }
        }
    }
}

/// `y = x·Wᵀ` for `n` rows `x` (`[n, k]` row-major) and W the `m` rows of `k` values of `w`,
/// interleaved: `y` is `[n, m]`, the activations quantized to `bits` in blocks of 32 as
/// [`crate::qdot`]'s (16 bits: two 8-bit parts, each block's codes serving both). On AVX-512 VNNI (`isa`, [`Isa::best`] for the caller's CPU) the interleaved
/// kernel runs, on every other set the plain loop over the restored rows.
///
/// # Panics
/// If `w` is not `m` interleaved rows of `k` values of its format, or `x` not `n·k` values.
pub(crate) fn product(isa: Isa, w: DotWeight<'_>, (x, n, bits): (&[f32], usize, ActivationBits)) -> Vec<f32> {
    let DotWeight { format, data, rows: m, cols: k } = w;
    let (bv, bb) = format.block();
    assert!(
        supports(format) && m.is_multiple_of(GROUP) && k.is_multiple_of(bv) && data.len() == m * (k / bv) * bb,
        "interleave::product: {m} rows of {k} {format:?} values in {} bytes",
        data.len()
    );
    assert_eq!(x.len(), n * k, "interleave::product: x is [{n}, {k}]");
    let group_bytes = GROUP * k / bv * bb;
    split_product((x, bits), (n, k, m), bv, (m / GROUP, 1), |groups, xs, out| {
        let mut row = Vec::new();
        for g in groups {
            let rec = &data[g * group_bytes..(g + 1) * group_bytes];
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512Vnni {
                // SAFETY: `Isa::reachable` offers AVX-512 VNNI only where the CPU has it; `rec` is
                // one group's records, `xs` rows of `k` values, and each task writes the entries
                // (r, 16g..16g + 16) of y only, inside its n·m values.
                unsafe { wide::group(format, rec, xs, |r| out.at(r * m + g * GROUP)) };
                continue;
            }
            row.resize(k / bv * bb, 0);
            for j in 0..GROUP {
                restore_row(format, data, (m, k), g * GROUP + j, &mut row);
                for (r, x) in xs.iter().enumerate() {
                    // SAFETY: as above, entry (r, 16g + j).
                    unsafe { *out.at(r * m + g * GROUP + j) = reference(format, &row, *x) };
                }
            }
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use super::{header, DotFormat, Row, GROUP};

    /// Activation rows a group's codes serve at once (their accumulators stay in registers).
    const ROWS: usize = 8;

    /// One group's records against every row of `xs`, row `r`'s 16 results written at `out(r)`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, VL and VNNI, and F16C; `rec` one group's records of `format`
    /// (a type that interleaves), `xs` rows of as many values, `out(r)` 16 writable f32s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn group(format: DotFormat, rec: &[u8], xs: &[Row<'_>], out: impl Fn(usize) -> *mut f32) {
        let grouped = xs.len() / ROWS * ROWS;
        // SAFETY: the features enabled here are `rows`' (on the CPU by the `# Safety` contract); it
        // gets all of `rec`, rows of `xs` in range and their `out` (16 f32s each by the contract).
        unsafe {
            for r0 in (0..grouped).step_by(ROWS) {
                let mut o = [std::ptr::null_mut(); ROWS];
                for (j, o) in o.iter_mut().enumerate() {
                    *o = out(r0 + j);
                }
                rows::<ROWS>(format, rec, &xs[r0..r0 + ROWS], o);
            }
            let mut r = grouped;
            while r + 4 <= xs.len() {
                rows::<4>(format, rec, &xs[r..r + 4], [out(r), out(r + 1), out(r + 2), out(r + 3)]);
                r += 4;
            }
            // (A decode step's two parts with 16-bit activations; each row's sums are the same
            // whatever the rows beside it.)
            while r + 2 <= xs.len() {
                rows::<2>(format, rec, &xs[r..r + 2], [out(r), out(r + 1)]);
                r += 2;
            }
            for r in r..xs.len() {
                rows::<1>(format, rec, &xs[r..r + 1], [out(r)]);
            }
        }
    }

    #[inline(always)]
    unsafe fn rows<const R: usize>(format: DotFormat, rec: &[u8], xs: &[Row<'_>], out: [*mut f32; R]) {
        // SAFETY: inlined into `group`, whose target features and `# Safety` contract `records`
        // needs; `CHUNKS` is `format`'s chunks of codes (8 for Q8_0, 4 for Q4_0 and Q4_1).
        unsafe {
            match format {
                DotFormat::Q8_0 => records::<R, 8>(format, rec, xs, out),
                _ => records::<R, 4>(format, rec, xs, out),
            }
        }
    }

    /// The records of one group against `R` activation rows: per block the 16 rows' scales and
    /// offsets, the codes of 8 steps of 4 values, then per activation row 8 `vpdpbusd` (two chains
    /// of 4) and two multiply-adds. `CHUNKS`: 8 for Q8_0's bytes, 4 for the nibbles (each chunk two
    /// steps). No closures inside: they would not inherit the target features.
    #[inline(always)]
    unsafe fn records<const R: usize, const CHUNKS: usize>(
        format: DotFormat,
        rec: &[u8],
        xs: &[Row<'_>],
        out: [*mut f32; R],
    ) {
        let (_, bb) = format.block();
        let size = GROUP * bb;
        let blocks = rec.len() / size;
        let head = header(format);
        debug_assert!(xs.len() == R && xs.iter().all(|x| x.q.len() >= 32 * blocks && x.d.len() >= blocks));
        // SAFETY: `group`'s features and contract: `p` (b < blocks) is a whole record of `size`
        // bytes (header + 64·CHUNKS), each row of `xs` has 32·blocks codes and `blocks` scales and
        // sums, and `out[r]` 16 writable f32s.
        unsafe {
            let mut xq = [std::ptr::null::<u8>(); R];
            let (mut xd, mut xsum) = ([std::ptr::null::<f32>(); R], [std::ptr::null::<f32>(); R]);
            for r in 0..R {
                (xq[r], xd[r], xsum[r]) = (xs[r].q.as_ptr() as *const u8, xs[r].d.as_ptr(), xs[r].dsum.as_ptr());
            }
            let m4 = _mm512_set1_epi8(0x0F);
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..blocks {
                let p = rec.as_ptr().add(b * size);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
                let offset = match format {
                    DotFormat::Q4_1 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)),
                    DotFormat::Q8_0 => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
                    _ => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
                };
                // Step i's codes: values 4i..4i+4 of each row.
                let mut codes = [_mm512_setzero_si512(); 8];
                for c in 0..CHUNKS {
                    let v = _mm512_loadu_si512(p.add(head + 64 * c) as *const _);
                    if CHUNKS == 8 {
                        codes[c] = v;
                    } else {
                        codes[c] = _mm512_and_si512(v, m4);
                        // (Shifted in 32-bit lanes: the bits a byte takes from its neighbour land
                        // in its high nibble, which the mask drops.)
                        codes[c + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4);
                    }
                }
                for r in 0..R {
                    let x = xq[r].add(32 * b);
                    let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for i in 0..4 {
                        let lo = _mm512_set1_epi32(std::ptr::read_unaligned(x.add(4 * i) as *const i32));
                        let hi = _mm512_set1_epi32(std::ptr::read_unaligned(x.add(16 + 4 * i) as *const i32));
                        s0 = _mm512_dpbusd_epi32(s0, codes[i], lo);
                        s1 = _mm512_dpbusd_epi32(s1, codes[i + 4], hi);
                    }
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(*xd[r].add(b))), acc[r]);
                    acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(*xsum[r].add(b)), acc[r]);
                }
            }
            for r in 0..R {
                _mm512_storeu_ps(out[r], acc[r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qdot::tests::random_rows;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn interleaving_keeps_every_row_and_refuses_what_does_not_fit() {
        for format in [DotFormat::Q8_0, DotFormat::Q4_0, DotFormat::Q4_1] {
            let (m, k) = (32, 96);
            let data = random_rows(format, m, k, 3);
            let packed = interleave(format, &data, (m, k)).unwrap();
            assert_eq!(packed.len(), data.len());
            assert_ne!(packed, data);
            let rb = data.len() / m;
            let mut row = vec![0u8; rb];
            for r in 0..m {
                restore_row(format, &packed, (m, k), r, &mut row);
                assert_eq!(row, data[r * rb..(r + 1) * rb], "{format:?} row {r}");
            }
            assert!(interleave(format, &data[..data.len() - rb], (m - 1, k)).is_none(), "31 rows");
            // What is read is reported once, in order, to the end.
            let mut ranges = Vec::new();
            assert_eq!(interleave_with(format, &data, (m, k), &mut |r| ranges.push(r)).unwrap(), packed);
            assert_eq!(ranges, vec![0..data.len()]);
        }
        assert!(interleave(DotFormat::Q4K, &[0; 144 * 16], (16, 256)).is_none());
    }

    /// The fast path against the plain loop over the rows restored, for 1 to 16 activation rows
    /// (groups of 8, of 4, and the rest alone), and against qdot's product on the file's layout.
    #[test]
    fn the_wide_path_equals_the_plain_loop() {
        for format in [DotFormat::Q8_0, DotFormat::Q4_0, DotFormat::Q4_1] {
            let (m, k) = (48, 160);
            let data = random_rows(format, m, k, 5 + format as u64);
            let packed = interleave(format, &data, (m, k)).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(9);
            for n in [1, 4, 9, 13, 16] {
                let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                let eight = (&x[..], n, ActivationBits::Eight);
                let want = product(Isa::Scalar, DotWeight::new(format, &packed, (m, k)), eight);
                let on_rows = crate::qdot::product_with(Isa::Scalar, DotWeight::new(format, &data, (m, k)), eight);
                assert_eq!(want, on_rows, "{format:?}: the restored rows are the rows");
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert!(scale > 0.0);
                for isa in Isa::reachable(Cpu::detect()) {
                    let got = product(isa, DotWeight::new(format, &packed, (m, k)), eight);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= 1e-5 * scale, "{format:?} on {isa:?}, n {n}, entry {i}: {a} vs {b}");
                    }
                }
                // 16-bit activations: both parts through the same paths.
                let sixteen = (&x[..], n, ActivationBits::Sixteen);
                let want = product(Isa::Scalar, DotWeight::new(format, &packed, (m, k)), sixteen);
                let on_rows = crate::qdot::product_with(Isa::Scalar, DotWeight::new(format, &data, (m, k)), sixteen);
                assert_eq!(want, on_rows, "{format:?}, 16 bits: the restored rows are the rows");
                for isa in Isa::reachable(Cpu::detect()) {
                    let got = product(isa, DotWeight::new(format, &packed, (m, k)), sixteen);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * scale,
                            "{format:?} on {isa:?}, n {n}, 16 bits, {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
