//! `c (+)= a · b` with the operands rounded to bf16 and products summed in f32, on the CPU's bf16
//! dot-product instruction (AVX512_BF16's `vdpbf16ps`: 32 multiply-adds a vector instruction,
//! twice an f32 FMA's 16).
//!
//! Both operands are packed first, converting to bf16 with round-to-nearest-even: `b` into panels
//! of [`PANEL`] columns in which each `k`-pair of a column is two adjacent bf16 (the instruction's
//! operand layout), `a` into rows of `k`-pairs. The microkernel keeps a block of 8 rows × 48 columns
//! (24 vectors of 16 f32 sums) in registers while it walks the pairs: per pair it loads three
//! vectors of `b`, broadcasts each row's pair of `a`, and issues 24 dot products. Threads take
//! column panels. Chosen at run time (`avx512bf16` and `avx512f`); [`reference`] is the plain loop
//! over the same rounded values that it is tested against.
//!
//! Where the CPU has AMX (Intel Sapphire Rapids and later) and Linux grants this process the tile
//! state, the same panels go through the tile unit instead ([`Kernel::Amx`]): `tdpbf16ps` multiplies
//! a tile of 16 rows × 16 pairs of `a` by a tile of 16 pairs × 16 columns of `b` (8,192
//! multiply-adds an instruction), a block of 16 rows × 48 columns summed in three tiles. The packed
//! layouts are the vector kernel's, padded to whole tiles (rows to 16, pairs to 16 with zeros).
//! Which kernel a product runs on is the caller's choice (the run's [`crate::Cpu`]; `EMBER_AMX=0`
//! makes the binary choose the vector kernel).

#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;
#[cfg(target_arch = "x86_64")]
use std::mem::MaybeUninit;

#[cfg(target_arch = "x86_64")]
use crate::SharedOut;

/// Columns of a packed panel of `b`: three vectors of 16.
pub(crate) const PANEL: usize = 48;

/// Rows of `a` per microkernel call.
const ROWS: usize = 8;

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN; zeros and denormals to a zero of
/// their sign), as its bits: what AVX512_BF16's `vcvtne2ps2bf16` computes, which the packing runs.
pub(crate) fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    if bits & 0x7F80_0000 == 0 {
        return ((bits >> 16) & 0x8000) as u16;
    }
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// The f32 a bf16 stands for.
#[cfg(test)]
pub(crate) fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// The instructions that multiply the bf16 operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// AVX512_BF16's `vdpbf16ps`: 8 rows × 48 columns of sums in vector registers.
    Avx512,
    /// AMX's `tdpbf16ps`: 16 rows × 48 columns of sums in three tile registers.
    Amx,
}

impl Kernel {
    /// The kernels this CPU (and OS) runs, the faster first: every one of them is tested.
    pub fn reachable() -> Vec<Kernel> {
        [Kernel::Amx, Kernel::Avx512].into_iter().filter(|k| k.runs_here()).collect()
    }

    /// Whether this CPU (and OS) runs this kernel.
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => supported() && amx::usable(),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Amx => false,
            Kernel::Avx512 => supported(),
        }
    }

    /// How logs name it.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "AMX tiles",
            Kernel::Avx512 => "AVX512_BF16",
        }
    }

    /// The packed operands' shape for this kernel: rows of `a` padded to a multiple of `rows`, and
    /// `stride` pairs (≥ `k / 2`, zeros past it) to a row of `a` and to a panel of `b`.
    fn layout(self, k: usize) -> Layout {
        let pairs = k.div_ceil(2);
        match self {
            Kernel::Avx512 => Layout { rows: ROWS, stride: pairs },
            Kernel::Amx => Layout { rows: TILE_ROWS, stride: pairs.next_multiple_of(TILE_PAIRS) },
        }
    }
}

/// Rows of `a` in an AMX tile (and in a block of its kernel).
const TILE_ROWS: usize = 16;
/// k-pairs in an AMX tile's row of `a` (64 bytes), and rows of a tile of `b`.
const TILE_PAIRS: usize = 16;

/// How a kernel's packed operands are laid out ([`Kernel::layout`]).
#[derive(Debug, Clone, Copy)]
struct Layout {
    rows: usize,
    stride: usize,
}

/// Whether this CPU has AVX512_BF16 (which the AMX CPUs have too): the vector kernel, and the packing
/// of every kernel.
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An operand with its (row, column) strides.
pub(crate) type Strided<'a> = (&'a [f32], (usize, usize));

/// Whether a strided operand's `rows × cols` elements lie inside its slice.
fn reaches((s, (rs, cs)): Strided<'_>, rows: usize, cols: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < s.len()
}

/// `c (+)= a · b` on `kernel`, `a` `[m, k]`, `b` `[k, n]` given with strides (so that transposed
/// operands are read where they are), `c` `[m, n]` row-major; the operands rounded to bf16, the sums
/// in f32. Returns `false` (and leaves `c` alone) where the CPU lacks the kernel: the caller then
/// runs its f32 path.
///
/// # Panics
/// If a slice is shorter than its shape and strides reach.
pub(crate) fn gemm(
    kernel: Kernel,
    c: &mut [f32],
    accumulate: bool,
    a: Strided<'_>,
    b: Strided<'_>,
    (m, k, n): (usize, usize, usize),
) -> bool {
    assert!(c.len() >= m * n, "bf16 GEMM: output slice too short");
    assert!(reaches(a, m, k) && reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !kernel.runs_here() {
        return false;
    }
    // SAFETY: the kernel is reachable, the shapes were checked against the slices, and `c` is a
    // live, exclusively borrowed `[m, n]` output.
    unsafe { run(kernel, c.as_mut_ptr(), accumulate, a, b, (m, k, n)) };
    true
}

/// `a · b` into a new `[m, n]` vector, as [`gemm`] without accumulating, which is not zero-filled
/// first: the kernels write every element of an output they do not add to. `None` where the CPU
/// lacks the kernel (the caller then runs its f32 path).
///
/// # Panics
/// If a slice is shorter than its shape and strides reach.
pub(crate) fn gemm_new(
    kernel: Kernel,
    a: Strided<'_>,
    b: Strided<'_>,
    (m, k, n): (usize, usize, usize),
) -> Option<Vec<f32>> {
    assert!(reaches(a, m, k) && reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !kernel.runs_here() {
        return None;
    }
    let mut out = Box::<[f32]>::new_uninit_slice(m * n);
    // SAFETY: the kernel is reachable, the operands' shapes were checked; `out` is the `m·n`
    // elements just allocated, owned here, and without accumulation the kernels only write it.
    unsafe { run(kernel, out.as_mut_ptr().cast::<f32>(), false, a, b, (m, k, n)) };
    // SAFETY: every panel's columns of every row were written (the vector kernel's masked stores
    // and the tiles' copies cover `cols` columns of `rows` rows of each block, and k = 0 stores
    // zeros).
    Some(unsafe { out.assume_init() }.into_vec())
}

/// The body of [`gemm`] and [`gemm_new`]: packs a, then each thread packs and multiplies its
/// own panels of b (the packed panel stays in its cache).
///
/// # Safety
/// `kernel` must be reachable; `a` and `b` must hold their shapes; `c` must be valid for writes of
/// `m·n` elements (and reads, with `accumulate`) that nothing else touches meanwhile.
unsafe fn run(
    kernel: Kernel,
    c: *mut f32,
    accumulate: bool,
    a: Strided<'_>,
    b: Strided<'_>,
    (m, k, n): (usize, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kernel, c, accumulate, a, b, k); // no kernel is reachable there
    #[cfg(target_arch = "x86_64")]
    {
        let layout = kernel.layout(k);
        let packed_a = pack_a(a, m, k, layout);
        let out = SharedOut(c);
        (0..n.div_ceil(PANEL)).into_par_iter().for_each(|p| {
            let panel = pack_panel(b, k, p * PANEL, PANEL.min(n - p * PANEL), layout);
            // SAFETY: as the caller vouches; the panel is panel `p` of b, and no two tasks write the
            // same columns.
            unsafe { panel_product(kernel, out, accumulate, &packed_a, &panel, p, (m, n), layout) };
        });
    }
}

/// `b` (`[k, n]`) packed into bf16 panels once, for several products with it ([`gemm_packed`]):
/// the LM head's weight, multiplied by every block of rows.
pub(crate) struct PackedB {
    k: usize,
    n: usize,
    #[cfg(target_arch = "x86_64")]
    kernel: Kernel,
    #[cfg(target_arch = "x86_64")]
    panels: Vec<Vec<u32>>,
}

/// `b` packed for [`gemm_packed`] on `kernel`, or `None` where the CPU lacks it.
///
/// # Panics
/// If the slice is shorter than the shape and strides reach.
pub(crate) fn pack_b(kernel: Kernel, b: Strided<'_>, (k, n): (usize, usize)) -> Option<PackedB> {
    assert!(reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !kernel.runs_here() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let layout = kernel.layout(k);
        let panels = (0..n.div_ceil(PANEL))
            .into_par_iter()
            .map(|p| pack_panel(b, k, p * PANEL, PANEL.min(n - p * PANEL), layout));
        Some(PackedB { k, n, kernel, panels: panels.collect() })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// [`gemm`] with `b` packed beforehand: `c (+)= a · b`, `a` `[m, k]` strided, `c` `[m, n]`.
///
/// # Panics
/// If a slice is shorter than its shape and strides reach.
pub(crate) fn gemm_packed(c: &mut [f32], accumulate: bool, a: Strided<'_>, b: &PackedB, m: usize) {
    let (k, n) = (b.k, b.n);
    assert!(c.len() >= m * n, "bf16 GEMM: output slice too short");
    assert!(reaches(a, m, k), "bf16 GEMM: operand slice too short");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (accumulate, a); // no `PackedB` exists there: `pack_b` answers `None`
    #[cfg(target_arch = "x86_64")]
    {
        let layout = b.kernel.layout(k);
        let packed_a = pack_a(a, m, k, layout);
        let out = SharedOut(c.as_mut_ptr());
        b.panels.par_iter().enumerate().for_each(|(p, panel)| {
            // SAFETY: a `PackedB` exists only where its kernel is reachable; the shapes were checked
            // above and when b was packed, in this kernel's layout; no two tasks write the same columns.
            unsafe { panel_product(b.kernel, out, accumulate, &packed_a, panel, p, (m, n), layout) };
        });
    }
}

/// Pairs of `k` per pass over a panel: 1,024 pairs of 48 columns (192 KiB) stay in the L2 cache
/// while every block of rows is multiplied by them.
#[cfg(target_arch = "x86_64")]
const PAIRS_PER_PASS: usize = 1024;

/// Columns of panel `p` of `c` `(+)=` the packed rows of a times the panel, in passes over
/// [`PAIRS_PER_PASS`] pairs of `k`.
///
/// # Safety
/// The CPU must run `kernel` ([`Kernel::reachable`]); `c` must be an `[m, n]` output, `packed_a`
/// come from [`pack_a`] of an `[m, k]` operand and `panel` from [`pack_panel`] of panel `p` of a
/// `[k, n]` one, both in `layout` (the kernel's for this `k`), and no other task may write these
/// columns meanwhile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_product(
    kernel: Kernel,
    c: SharedOut,
    accumulate: bool,
    packed_a: &[u32],
    panel: &[u32],
    p: usize,
    (m, n): (usize, usize),
    layout: Layout,
) {
    let pairs = layout.stride;
    let cols = PANEL.min(n - p * PANEL);
    debug_assert!(packed_a.len() >= m.next_multiple_of(layout.rows) * pairs && panel.len() >= pairs * PANEL);
    match kernel {
        Kernel::Avx512 => {
            vector_panel_product(c.at(p * PANEL), n, accumulate, (packed_a, pairs, m), panel.as_ptr(), cols)
        }
        Kernel::Amx => {
            amx::configure();
            tile_panel_product(amx::block, c, accumulate, (packed_a, panel), p, (m, n), layout);
            amx::release();
        }
    }
}

/// The vector kernel over one panel: `c`'s `cols` columns (row stride `ldc`) `(+)=` the `m` packed
/// rows of a (`pairs` values each) times the panel from its first pair on, in passes of
/// [`PAIRS_PER_PASS`] pairs and blocks of [`ROWS`] rows.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512_BF16; `packed_a` must hold `m` rows (padded to whole
/// blocks of [`ROWS`]) of `pairs` values, `panel` `pairs · PANEL` values, and `c` `m` rows of `cols`
/// columns at stride `ldc` that no other task writes meanwhile.
#[cfg(target_arch = "x86_64")]
unsafe fn vector_panel_product(
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    (packed_a, pairs, m): (&[u32], usize, usize),
    panel: *const u32,
    cols: usize,
) {
    for p0 in (0..pairs.max(1)).step_by(PAIRS_PER_PASS) {
        let pass = PAIRS_PER_PASS.min(pairs - p0);
        for r0 in (0..m).step_by(ROWS) {
            avx512::block(
                c.add(r0 * ldc),
                ldc,
                (ROWS.min(m - r0), cols),
                accumulate || p0 > 0,
                packed_a.as_ptr().add(r0 * pairs + p0),
                (pass, pairs),
                panel.add(p0 * PANEL),
            );
        }
    }
}

/// A block of [`TILE_ROWS`] rows × [`PANEL`] columns of sums from packed `a` rows (a pointer and
/// their stride in pairs), a packed panel and a number of tile steps of [`TILE_PAIRS`] pairs:
/// [`amx::block`], or in the tests a plain model of the tiles.
#[cfg(target_arch = "x86_64")]
type TileBlock = unsafe fn(&mut [f32; TILE_ROWS * PANEL], (*const u32, usize), *const u32, usize);

/// The AMX arm of [`panel_product`] around its block kernel: passes over the pairs, blocks of 16
/// rows, and each block's sums into the rows and columns of c that exist.
///
/// # Safety
/// As [`panel_product`]'s, in the AMX layout; `block` must be safe to call on this thread (the
/// tiles configured).
#[cfg(target_arch = "x86_64")]
unsafe fn tile_panel_product(
    block: TileBlock,
    c: SharedOut,
    accumulate: bool,
    (packed_a, panel): (&[u32], &[u32]),
    p: usize,
    (m, n): (usize, usize),
    layout: Layout,
) {
    let pairs = layout.stride;
    let cols = PANEL.min(n - p * PANEL);
    debug_assert!(
        layout.rows == TILE_ROWS && pairs.is_multiple_of(TILE_PAIRS) && PAIRS_PER_PASS.is_multiple_of(TILE_PAIRS)
    );
    let mut sums = [0.0f32; TILE_ROWS * PANEL];
    // `pairs` is a whole number of tiles, and so is every pass; k = 0 makes one pass of no steps.
    for p0 in (0..pairs.max(1)).step_by(PAIRS_PER_PASS) {
        let pass = PAIRS_PER_PASS.min(pairs - p0);
        for r0 in (0..m).step_by(TILE_ROWS) {
            let a = packed_a.as_ptr().add(r0 * pairs + p0);
            block(&mut sums, (a, pairs), panel.as_ptr().add(p0 * PANEL), pass / TILE_PAIRS);
            let add = accumulate || p0 > 0;
            for (r, row) in sums.chunks_exact(PANEL).take(TILE_ROWS.min(m - r0)).enumerate() {
                let out = c.at((r0 + r) * n + p * PANEL);
                if add {
                    // Written already (this pass's first block, or the caller's): a slice may be made.
                    std::slice::from_raw_parts_mut(out, cols).iter_mut().zip(row).for_each(|(o, &v)| *o += v);
                } else {
                    // Possibly uninitialised ([`gemm_new`]): written through the pointer only.
                    std::ptr::copy_nonoverlapping(row.as_ptr(), out, cols);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// `a`'s rows as pairs of bf16 along k (a zero pads an odd k), rows padded with zeros to a
/// multiple of `layout.rows` and to `layout.stride` pairs: `[m', stride]` of `u32`, the lower half
/// the even k. Converted on all threads.
fn pack_a(a: Strided<'_>, m: usize, k: usize, layout: Layout) -> Vec<u32> {
    pack_a_on(a, m, k, layout, true)
}

#[cfg(target_arch = "x86_64")]
/// [`pack_a`] on all threads (`parallel`) or on the calling one.
fn pack_a_on((a, (rs, cs)): Strided<'_>, m: usize, k: usize, layout: Layout, parallel: bool) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let len = m.next_multiple_of(layout.rows) * layout.stride;
    // Each chunk is zeroed just before it is converted into (in the cache) rather than the whole
    // buffer first (a pass over memory that cost 2.6 % of a bf16 GPT-2 step in `memset`).
    let mut packed = Box::<[u32]>::new_uninit_slice(len);
    if rs == 1 && cs != 1 && pairs > 0 {
        // A transposed operand (Xᵀ of a weight gradient): the 16 rows of a block are contiguous at
        // each k, so they are converted a vector at a time and transposed through a small tile,
        // instead of gathered an element at a time, each a cache line apart.
        let stride = layout.stride;
        let convert = |(block, rows): (usize, &mut [u32])| {
            let i0 = 16 * block;
            if i0 < m {
                // SAFETY: `gemm` runs this only after `supported`; rows `i0 .. i0 + 16.min(m - i0)`
                // of `a` are inside it (checked by `gemm`), and `rows` holds them `stride` apart
                // (the packed rows are a multiple of 8 past `m`, so that a last chunk of 8 holds
                // the rows left).
                unsafe { avx512::convert_columns(rows, stride, a, cs, (i0, 16.min(m - i0)), k) };
            }
        };
        let convert = |(block, rows): (usize, &mut [MaybeUninit<u32>])| convert((block, zeroed(rows)));
        match parallel {
            true => packed.par_chunks_mut(16 * stride).enumerate().for_each(convert),
            false => packed.chunks_mut(16 * stride).enumerate().for_each(convert),
        }
        // SAFETY: `zeroed` wrote every chunk.
        return unsafe { packed.assume_init() }.into_vec();
    }
    let convert = |(i, row): (usize, &mut [u32])| {
        if i >= m {
            return; // a padding row: zeros
        }
        let row = &mut row[..pairs];
        if cs == 1 {
            // SAFETY: `gemm` runs this only after `supported`; the row's k elements are inside `a`
            // (checked by `gemm`), and `row` holds k.div_ceil(2) pairs.
            unsafe { avx512::convert_row(row, &a[i * rs..i * rs + k]) };
            return;
        }
        for (p, out) in row.iter_mut().enumerate() {
            let lo = to_bf16(a[i * rs + 2 * p * cs]);
            let hi = if 2 * p + 1 < k { to_bf16(a[i * rs + (2 * p + 1) * cs]) } else { 0 };
            *out = u32::from(lo) | (u32::from(hi) << 16);
        }
    };
    let convert = |(i, row): (usize, &mut [MaybeUninit<u32>])| convert((i, zeroed(row)));
    match parallel {
        true => packed.par_chunks_mut(layout.stride.max(1)).enumerate().for_each(convert),
        false => packed.chunks_mut(layout.stride.max(1)).enumerate().for_each(convert),
    }
    // SAFETY: `zeroed` wrote every chunk.
    unsafe { packed.assume_init() }.into_vec()
}

/// `c` filled with zeros, as the initialised slice it now is.
#[cfg(target_arch = "x86_64")]
fn zeroed(c: &mut [MaybeUninit<u32>]) -> &mut [u32] {
    c.fill(MaybeUninit::new(0));
    // SAFETY: every element was just written, and `MaybeUninit<u32>` has `u32`'s layout.
    unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast::<u32>(), c.len()) }
}

#[cfg(target_arch = "x86_64")]
/// Columns `c0 .. c0 + cols` of `b` as a panel: for each of `layout.stride` k-pairs, [`PANEL`]
/// columns of two bf16 (even k first), zeros past `cols` and past k.
fn pack_panel(b: Strided<'_>, k: usize, c0: usize, cols: usize, layout: Layout) -> Vec<u32> {
    let mut panel = vec![0u32; layout.stride * PANEL];
    pack_panel_into(&mut panel, b, k, c0, cols);
    panel
}

#[cfg(target_arch = "x86_64")]
/// [`pack_panel`] into `panel`, zeros already (`k.div_ceil(2)` pairs of [`PANEL`] values or more).
fn pack_panel_into(panel: &mut [u32], (b, (rs, cs)): Strided<'_>, k: usize, c0: usize, cols: usize) {
    let pairs = k.div_ceil(2);
    assert!(panel.len() >= pairs * PANEL && cols <= PANEL);
    if rs == 1 && cs != 1 {
        // A transposed operand (W read as Wᵀ): each column's k values are contiguous, so each is
        // converted as a row, and the rows' pairs gathered down the panel 16 columns a vector.
        if pairs == 0 || cols == 0 {
            return;
        }
        let mut rows = vec![0u32; cols * pairs];
        for (j, row) in rows.chunks_exact_mut(pairs).enumerate() {
            let col = (c0 + j) * cs;
            // SAFETY: `gemm` runs this only after `supported`; the column is inside `b` (checked by
            // `gemm`) and `row` holds its pairs.
            unsafe { avx512::convert_row(row, &b[col..col + k]) };
        }
        // SAFETY: as above; `rows` holds `cols` rows of `pairs`, and `panel` one panel of them.
        unsafe { avx512::gather_columns(panel, &rows, cols, pairs) };
        return;
    }
    for (p, out) in panel.chunks_exact_mut(PANEL).take(pairs).enumerate() {
        let (k0, k1) = (2 * p, 2 * p + 1);
        #[cfg(target_arch = "x86_64")]
        if cs == 1 {
            let lo = &b[k0 * rs + c0..k0 * rs + c0 + cols];
            let hi = (k1 < k).then(|| &b[k1 * rs + c0..k1 * rs + c0 + cols]);
            // SAFETY: `gemm` runs this only after `supported`; the slices are checked above.
            unsafe { avx512::interleave_rows(out, lo, hi) };
            continue;
        }
        for (j, o) in out.iter_mut().take(cols).enumerate() {
            let col = c0 + j;
            let lo = to_bf16(b[k0 * rs + col * cs]);
            let hi = if k1 < k { to_bf16(b[k1 * rs + col * cs]) } else { 0 };
            *o = u32::from(lo) | (u32::from(hi) << 16);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PANEL, ROWS};
    use std::arch::x86_64::*;

    /// [`super::to_bf16`] of 16 lanes, each result in the low half of its 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn round_lanes(x: __m512) -> __m512i {
        _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)))
    }

    /// The mask of the first `n` (≤ 16) lanes.
    fn lanes(n: usize) -> __mmask16 {
        ((1u32 << n.min(16)) - 1) as u16
    }

    /// `out` = `x` in bf16, two to a `u32` (even element in the low half; a zero pads an odd
    /// length).
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW and AVX512_BF16; `out` must hold `x.len().div_ceil(2)`
    /// values.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn convert_row(out: &mut [u32], x: &[f32]) {
        assert!(out.len() >= x.len().div_ceil(2));
        let dst = out.as_mut_ptr().cast::<u16>();
        for c in (0..x.len()).step_by(32) {
            let (lo, hi) = (lanes(x.len() - c), lanes((x.len() - c).saturating_sub(16)));
            let low = _mm512_maskz_loadu_ps(lo, x.as_ptr().add(c));
            // Masked off past the end: the address is only computed.
            let high = _mm512_maskz_loadu_ps(hi, x.as_ptr().wrapping_add(c + 16));
            // 32 bf16 in order, the first 16 from `low`: exactly the pairs' layout in memory.
            let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low));
            let mask = (u32::from(hi) << 16) | u32::from(lo);
            _mm512_mask_storeu_epi16(dst.add(c).cast(), mask, both);
        }
        if x.len() % 2 == 1 {
            *dst.add(x.len()) = 0;
        }
    }

    /// `out[j] = bf16(lo[j]) | bf16(hi[j]) << 16` (`hi` absent: zeros) for the columns of `lo`;
    /// `out` past them is left as it is.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW and AVX512_BF16; `out` must hold `lo.len()` values and
    /// `hi` be as long as `lo`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn interleave_rows(out: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
        let n = lo.len();
        assert!(out.len() >= n && hi.is_none_or(|h| h.len() == n));
        // Word `2j` from word `j` (the low row's), word `2j + 1` from word `16 + j` (the high row's).
        let order = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
            1, 16, 0,
        );
        for c in (0..n).step_by(16) {
            let mask = lanes(n - c);
            let low = _mm512_maskz_loadu_ps(mask, lo.as_ptr().add(c));
            let high = match hi {
                Some(h) => _mm512_maskz_loadu_ps(mask, h.as_ptr().add(c)),
                None => _mm512_setzero_ps(),
            };
            let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low));
            _mm512_mask_storeu_epi32(out.as_mut_ptr().add(c).cast(), mask, _mm512_permutexvar_epi16(order, both));
        }
    }

    /// Rows `i0 .. i0 + rows` (`rows` ≤ 16) of a transposed operand (`a[i][q]` at `i + q·cs`) as
    /// pairs of bf16 along q (a zero pads an odd `k`): row `r`'s `k.div_ceil(2)` pairs at
    /// `out[r · stride]`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW and AVX512_BF16; `a` must hold those rows' `k`
    /// elements, and `out` `rows` rows of `k.div_ceil(2)` values `stride` apart.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn convert_columns(
        out: &mut [u32],
        stride: usize,
        a: &[f32],
        cs: usize,
        (i0, rows): (usize, usize),
        k: usize,
    ) {
        let pairs = k.div_ceil(2);
        assert!(rows <= 16 && rows > 0 && out.len() >= (rows - 1) * stride + pairs);
        assert!(i0 + rows - 1 + (k - 1) * cs < a.len());
        let mask = lanes(rows);
        // 16 pairs of the block's rows: `tile[pair][row]`.
        let mut tile = [[0u32; 16]; 16];
        for p0 in (0..pairs).step_by(16) {
            let count = 16.min(pairs - p0);
            for (j, lane) in tile.iter_mut().enumerate().take(count) {
                let q = 2 * (p0 + j);
                let low = round_lanes(_mm512_maskz_loadu_ps(mask, a.as_ptr().add(q * cs + i0)));
                let high = if q + 1 < k {
                    _mm512_slli_epi32::<16>(round_lanes(_mm512_maskz_loadu_ps(mask, a.as_ptr().add((q + 1) * cs + i0))))
                } else {
                    _mm512_setzero_si512()
                };
                _mm512_storeu_si512(lane.as_mut_ptr().cast(), _mm512_or_si512(low, high));
            }
            for r in 0..rows {
                let row = &mut out[r * stride + p0..r * stride + p0 + count];
                row.iter_mut().zip(&tile).for_each(|(o, lane)| *o = lane[r]);
            }
        }
    }

    /// Panels of the transpose of `m` packed rows of `pairs` values: `out[(p · pairs + q) · PANEL
    /// + j] = rows[(PANEL · p + j) · pairs + q]`, zeros past row `m`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `rows` must hold `m · pairs` values and `out` `m.div_ceil(PANEL)`
    /// panels of `pairs · PANEL`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gather_columns(out: &mut [u32], rows: &[u32], m: usize, pairs: usize) {
        assert!(rows.len() >= m * pairs && out.len() >= m.div_ceil(PANEL) * pairs * PANEL && pairs > 0);
        assert!(15 * pairs <= i32::MAX as usize, "gather offsets fit 32 bits");
        let step = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(pairs as i32),
        );
        for (p, panel) in out.chunks_exact_mut(pairs * PANEL).take(m.div_ceil(PANEL)).enumerate() {
            for g in 0..PANEL / 16 {
                let j0 = PANEL * p + 16 * g;
                if j0 >= m {
                    break;
                }
                let mask = lanes(m - j0);
                for (q, row) in panel.chunks_exact_mut(PANEL).enumerate() {
                    // Lane l reads row j0 + l's pair q: offsets l · pairs from there (masked past m).
                    let base = rows.as_ptr().add(j0 * pairs + q);
                    let v = _mm512_mask_i32gather_epi32::<4>(_mm512_setzero_si512(), mask, step, base.cast());
                    _mm512_storeu_si512(row.as_mut_ptr().add(16 * g).cast(), v);
                }
            }
        }
    }

    /// One block: `rows` (≤ 8) rows × `cols` (≤ 48) columns of c (row stride `ldc`) `(+)=` the
    /// packed rows of a (`pairs` pairs each, `stride` apart) times the packed panel.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and AVX512_BF16; `a` must hold [`ROWS`] rows of `pairs` values
    /// `stride` apart, `panel` `pairs · PANEL` values, and c `rows` rows of `cols` at stride `ldc`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn block(
        c: *mut f32,
        ldc: usize,
        (rows, cols): (usize, usize),
        accumulate: bool,
        a: *const u32,
        (pairs, stride): (usize, usize),
        panel: *const u32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; ROWS];
        for p in 0..pairs {
            let b = panel.add(p * PANEL);
            let bv: [__m512bh; 3] = [
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(16).cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(32).cast())),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.add(r * stride + p) as i32));
                for (sum, &bj) in row.iter_mut().zip(&bv) {
                    *sum = _mm512_dpbf16_ps(*sum, av, bj);
                }
            }
        }
        let mask = |j: usize| -> __mmask16 { ((1u32 << cols.saturating_sub(16 * j).min(16)) - 1) as u16 };
        let masks = [mask(0), mask(1), mask(2)];
        for (r, row) in acc.iter().enumerate().take(rows) {
            let out = c.add(r * ldc);
            for (j, &sum) in row.iter().enumerate() {
                // Columns past `cols` are masked off: their addresses are only computed.
                let at = out.wrapping_add(16 * j);
                let value = if accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(masks[j], at), sum) } else { sum };
                _mm512_mask_storeu_ps(at, masks[j], value);
            }
        }
    }
}

/// The tile unit: the OS permission, the tile configuration and the block kernel. The tile
/// instructions go through `asm!` (stable Rust has no intrinsics for them); the compiler never uses
/// the tile registers itself, so that they keep their values from one `asm!` to the next.
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::{PANEL, TILE_PAIRS, TILE_ROWS};
    use std::arch::asm;
    use std::sync::OnceLock;

    /// Whether the CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile state.
    /// Asked once (a cache of the detection); the permission holds for every thread of the process.
    pub(super) fn usable() -> bool {
        static USABLE: OnceLock<bool> = OnceLock::new();
        *USABLE.get_or_init(|| cpu_has_amx() && request_tiles())
    }

    /// CPUID leaf 7, sub-leaf 0: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    pub(super) fn cpu_has_amx() -> bool {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        #[allow(unused_unsafe)] // `__cpuid` is safe in newer compilers
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 says it exists.
        let edx = unsafe {
            if __cpuid(0).eax < 7 {
                return false;
            }
            __cpuid_count(7, 0).edx
        };
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }

    /// Asks Linux (5.16 and later) for the tile data state: `arch_prctl(ARCH_REQ_XCOMP_PERM,
    /// XFEATURE_XTILEDATA)`. Without it the first tile instruction kills the process.
    #[cfg(target_os = "linux")]
    fn request_tiles() -> bool {
        const SYS_ARCH_PRCTL: isize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: arch_prctl takes two integers and changes only this process's permissions; the
        // syscall instruction clobbers rcx and r11, declared.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tiles() -> bool {
        false
    }

    /// The 64-byte operand of `ldtilecfg` (Intel SDM, vol. 2: LDTILECFG).
    #[repr(C, align(64))]
    pub(super) struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        /// Bytes a row, per tile.
        colsb: [u16; 16],
        /// Rows, per tile.
        rows: [u8; 16],
    }

    /// Palette 1; tiles 0–2 the sums (16 rows × 16 f32), tile 3 `a` (16 rows × 16 pairs), tiles
    /// 4–6 `b` (16 pairs × 16 columns of pairs): all 16 rows of 64 bytes. Tile 7 unused (zeros).
    pub(super) const CONFIG: TileConfig = {
        let (mut colsb, mut rows) = ([0u16; 16], [0u8; 16]);
        let mut t = 0;
        while t < 7 {
            colsb[t] = 64;
            rows[t] = TILE_ROWS as u8;
            t += 1;
        }
        TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows }
    };

    /// Configures this thread's tiles for [`block`].
    ///
    /// # Safety
    /// [`usable`] must have returned `true`.
    pub(super) unsafe fn configure() {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags));
    }

    /// Returns this thread's tiles to their initial state (nothing to save at a context switch).
    ///
    /// # Safety
    /// [`usable`] must have returned `true`.
    pub(super) unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem, preserves_flags));
    }

    /// `sums` (16 rows × 48 columns, row-major) = 16 packed rows of a (`steps · 16` pairs each,
    /// `stride` pairs apart) times a packed panel (`steps · 16` pairs of 48 columns).
    ///
    /// # Safety
    /// [`configure`] must have run on this thread; `a` must point at 16 rows of `steps · 16` values
    /// `stride` apart, `panel` at `steps · 16 · PANEL` values.
    pub(super) unsafe fn block(
        sums: &mut [f32; TILE_ROWS * PANEL],
        (a, stride): (*const u32, usize),
        panel: *const u32,
        steps: usize,
    ) {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", options(nostack, nomem, preserves_flags));
        for s in 0..steps {
            // Tile rows: a row of a (16 pairs), or a pair row of the panel (16 of its 48 columns).
            asm!(
                "tileloadd tmm3, [{a} + {a_stride} * 1]",
                "tileloadd tmm4, [{b} + {b_stride} * 1]",
                "tileloadd tmm5, [{b} + {b_stride} * 1 + 64]",
                "tileloadd tmm6, [{b} + {b_stride} * 1 + 128]",
                "tdpbf16ps tmm0, tmm3, tmm4",
                "tdpbf16ps tmm1, tmm3, tmm5",
                "tdpbf16ps tmm2, tmm3, tmm6",
                a = in(reg) a.add(s * TILE_PAIRS),
                a_stride = in(reg) stride * 4,
                b = in(reg) panel.add(s * TILE_PAIRS * PANEL),
                b_stride = in(reg) PANEL * 4,
                options(nostack, readonly, preserves_flags),
            );
        }
        asm!(
            "tilestored [{c} + {c_stride} * 1], tmm0",
            "tilestored [{c} + {c_stride} * 1 + 64], tmm1",
            "tilestored [{c} + {c_stride} * 1 + 128], tmm2",
            c = in(reg) sums.as_mut_ptr(),
            c_stride = in(reg) PANEL * 4,
            options(nostack, preserves_flags),
        );
    }
}

/// `a` (`[m, k]`) packed on the calling thread in the vector kernel's layout, for
/// [`product_on_this_thread`]: the operands of many small products that run side by side, one a
/// thread (the attention's blocks of one head).
pub(crate) struct PackedRows {
    m: usize,
    pairs: usize,
    #[cfg(target_arch = "x86_64")]
    data: Vec<u32>,
}

/// `b` (`[k, n]`) packed on the calling thread into all its panels, for
/// [`product_on_this_thread`] with any run of its k-pairs and panels.
pub(crate) struct PackedPanels {
    n: usize,
    pairs: usize,
    #[cfg(target_arch = "x86_64")]
    data: Vec<u32>,
}

/// [`PackedRows`] of `a`, or `None` where the CPU lacks AVX512_BF16.
///
/// # Panics
/// If the slice is shorter than the shape and strides reach.
pub(crate) fn pack_rows(a: Strided<'_>, (m, k): (usize, usize)) -> Option<PackedRows> {
    assert!(reaches(a, m, k), "bf16 GEMM: operand slice too short");
    if !supported() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let layout = Kernel::Avx512.layout(k);
        Some(PackedRows { m, pairs: layout.stride, data: pack_a_on(a, m, k, layout, false) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// [`PackedPanels`] of `b`, or `None` where the CPU lacks AVX512_BF16.
///
/// # Panics
/// If the slice is shorter than the shape and strides reach.
pub(crate) fn pack_panels(b: Strided<'_>, (k, n): (usize, usize)) -> Option<PackedPanels> {
    assert!(reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !supported() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let pairs = k.div_ceil(2);
        let mut data = vec![0u32; n.div_ceil(PANEL) * pairs * PANEL];
        for (p, panel) in data.chunks_exact_mut((pairs * PANEL).max(1)).take(n.div_ceil(PANEL)).enumerate() {
            pack_panel_into(panel, b, k, p * PANEL, PANEL.min(n - p * PANEL));
        }
        Some(PackedPanels { n, pairs, data })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The panels of `aᵀ` (`[k, m]`) from `a` packed as rows: pair `q` of column `j` is pair `q` of
/// row `j`, gathered 16 columns a vector (the keys of the attention's scores, converted a row at a
/// time instead of a column at a time).
pub(crate) fn transpose_rows(a: &PackedRows) -> PackedPanels {
    let (m, pairs) = (a.m, a.pairs);
    #[cfg(target_arch = "x86_64")]
    {
        let mut data = vec![0u32; m.div_ceil(PANEL) * pairs * PANEL];
        if pairs > 0 {
            // SAFETY: packed rows exist only where `supported` holds; rows `j0 .. j0 + lanes` of `a`
            // (each `pairs` long) are inside it, and each panel holds `pairs` rows of PANEL values.
            unsafe { avx512::gather_columns(&mut data, &a.data, m, pairs) };
        }
        PackedPanels { n: m, pairs, data }
    }
    #[cfg(not(target_arch = "x86_64"))]
    PackedPanels { n: m, pairs }
}

/// `c (+)= a · b[2·pair0 .., c0 .. c0 + cols]` on the calling thread, on the vector kernel: `a`'s
/// k-pairs meet `b`'s from pair `pair0` on (so a product may use a run of `b`'s rows, from an even
/// one), and `c`'s `cols` columns (row stride `ldc`) are `b`'s from `c0`, a multiple of [`PANEL`].
///
/// # Panics
/// If `c0` is not a multiple of [`PANEL`], the pairs or columns run past `b`'s, `cols` past `ldc`,
/// or `c` is shorter than `a`'s rows at stride `ldc`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_on_this_thread(
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: &PackedRows,
    b: &PackedPanels,
    pair0: usize,
    (c0, cols): (usize, usize),
) {
    let end = c0.checked_add(cols);
    assert!(c0.is_multiple_of(PANEL) && end.is_some_and(|e| e <= b.n) && cols <= ldc, "bf16 GEMM: columns outside b");
    assert!(pair0.checked_add(a.pairs).is_some_and(|e| e <= b.pairs), "bf16 GEMM: k-pairs outside b");
    let m = a.m;
    let last = (m.saturating_sub(1)).checked_mul(ldc).and_then(|r| r.checked_add(cols));
    assert!(m == 0 || cols == 0 || last.is_some_and(|l| l <= c.len()), "bf16 GEMM: output slice too short");
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, accumulate); // no packed operand exists there
    #[cfg(target_arch = "x86_64")]
    for p in (c0 / PANEL)..(c0 + cols).div_ceil(PANEL) {
        let (at, width) = (p * PANEL - c0, PANEL.min(c0 + cols - p * PANEL));
        let panel = &b.data[p * b.pairs * PANEL..(p + 1) * b.pairs * PANEL];
        // SAFETY: packed operands exist only where `supported` holds; `a` holds whole blocks of
        // ROWS rows of `a.pairs` values (zeros past m), the panel its pairs from `pair0` on, and c
        // the rows of `width` columns at `at` (all checked above: the last row ends inside c).
        unsafe {
            let (c, panel) = (c.as_mut_ptr().add(at), panel.as_ptr().add(pair0 * PANEL));
            vector_panel_product(c, ldc, accumulate, (&a.data, a.pairs, m), panel, width);
        }
    }
}

/// The plain loop over the bf16-rounded operands, in f64: what [`gemm`] is tested against.
#[cfg(test)]
pub(crate) fn reference(
    c: &mut [f32],
    accumulate: bool,
    (a, (ars, acs)): Strided<'_>,
    (b, (brs, bcs)): Strided<'_>,
    (m, k, n): (usize, usize, usize),
) {
    for i in 0..m {
        for j in 0..n {
            let mut sum = if accumulate { f64::from(c[i * n + j]) } else { 0.0 };
            for p in 0..k {
                let x = from_bf16(to_bf16(a[i * ars + p * acs]));
                let y = from_bf16(to_bf16(b[p * brs + j * bcs]));
                sum += f64::from(x) * f64::from(y);
            }
            c[i * n + j] = sum as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::transposed as transpose;
    use crate::testing::values;

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between two bf16: ties go to the even one (1.0).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 is halfway too: up to the even 1 + 2^-6.
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        // Denormals go to a zero of their sign, as the conversion instruction flushes them.
        assert_eq!((to_bf16(1e-40), to_bf16(-1e-40), to_bf16(-0.0)), (0, 0x8000, 0x8000));
        assert_eq!(to_bf16(f32::MIN_POSITIVE), 0x0080);
        assert_eq!(from_bf16(to_bf16(f32::INFINITY)), f32::INFINITY);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_conversions_round_as_the_scalar_one() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the vector conversions are not reachable here");
            return;
        }
        let specials = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::NAN, f32::INFINITY, -0.0, 1e-40, -1e-40, f32::MAX];
        let x: Vec<f32> = specials.iter().copied().chain(values(30, 9).into_iter().map(|v| v * 3.7)).collect();
        let want: Vec<u16> = x.iter().map(|&v| to_bf16(v)).collect();
        let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
        let mut row = vec![u32::MAX; x.len().div_ceil(2)];
        // SAFETY: the features were checked; `row` holds the pairs.
        unsafe { avx512::convert_row(&mut row, &x) };
        let expect: Vec<u32> = want.chunks(2).map(|c| pair(c[0], c.get(1).copied().unwrap_or(0))).collect();
        assert_eq!(row, expect);
        let (lo, hi) = x.split_at(x.len() / 2);
        let hi = &hi[..lo.len()];
        let mut out = vec![u32::MAX; lo.len()];
        // SAFETY: as above; `out` holds a value per column.
        unsafe { avx512::interleave_rows(&mut out, lo, Some(hi)) };
        let expect: Vec<u32> = lo.iter().zip(hi).map(|(&a, &b)| pair(to_bf16(a), to_bf16(b))).collect();
        assert_eq!(out, expect);
    }

    /// A plain model of [`amx::block`]: what `tdpbf16ps` computes (Intel SDM, vol. 2: TDPBF16PS)
    /// on the same packed memory, up to the order of the f32 sums (the instruction keeps the even
    /// and odd products apart, and flushes denormals): the tests' tolerance covers both.
    #[cfg(target_arch = "x86_64")]
    unsafe fn model_of_the_tiles(
        sums: &mut [f32; TILE_ROWS * PANEL],
        (a, stride): (*const u32, usize),
        panel: *const u32,
        steps: usize,
    ) {
        let half = |v: u32, hi: bool| from_bf16(if hi { (v >> 16) as u16 } else { v as u16 });
        for r in 0..TILE_ROWS {
            for j in 0..PANEL {
                let mut sum = 0.0f32;
                for q in 0..steps * TILE_PAIRS {
                    let (x, y) = (*a.add(r * stride + q), *panel.add(q * PANEL + j));
                    sum += half(x, false) * half(y, false) + half(x, true) * half(y, true);
                }
                sums[r * PANEL + j] = sum;
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_tile_layout_is_the_vector_one_padded_with_zeros() {
        assert_eq!(std::mem::size_of::<amx::TileConfig>(), 64);
        // SAFETY: `TileConfig` is 64 bytes of plain integers (asserted above), read as bytes.
        let config = unsafe { std::slice::from_raw_parts((&amx::CONFIG as *const amx::TileConfig).cast::<u8>(), 64) };
        // Byte 0 the palette, 16..48 bytes a row per tile (u16), 48..64 rows per tile.
        assert_eq!(config[0], 1);
        assert!(config[1..16].iter().all(|&b| b == 0));
        for t in 0..16 {
            let (colsb, rows) = (u16::from_le_bytes([config[16 + 2 * t], config[17 + 2 * t]]), config[48 + t]);
            assert_eq!((colsb, rows), if t < 7 { (64, 16) } else { (0, 0) }, "tile {t}");
        }
        assert_eq!((Kernel::Amx.layout(33).rows, Kernel::Amx.layout(33).stride), (16, 32));
        assert_eq!((Kernel::Amx.layout(0).stride, Kernel::Avx512.layout(33).stride), (0, 17));
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the packing is not reachable here");
            return;
        }
        let (m, k, n) = (9, 33, 50);
        let (a, b) = (values(m * k, 4), values(k * n, 5));
        let (vector, tile) = (Kernel::Avx512.layout(k), Kernel::Amx.layout(k));
        let (va, ta) = (pack_a((&a, (k, 1)), m, k, vector), pack_a((&a, (k, 1)), m, k, tile));
        assert_eq!(ta.len(), 16 * 32);
        for r in 0..16 {
            for q in 0..32 {
                let want = if r < m && q < 17 { va[r * 17 + q] } else { 0 };
                assert_eq!(ta[r * 32 + q], want, "a row {r} pair {q}");
            }
        }
        let (vp, tp) = (pack_panel((&b, (n, 1)), k, 48, 2, vector), pack_panel((&b, (n, 1)), k, 48, 2, tile));
        assert_eq!((vp.len(), tp.len()), (17 * PANEL, 32 * PANEL));
        assert_eq!(&tp[..17 * PANEL], &vp[..]);
        assert!(tp[17 * PANEL..].iter().all(|&v| v == 0));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_tile_kernels_passes_and_tails_match_the_reference_on_a_model_of_the_tiles() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the packing is not reachable here");
            return;
        }
        // Row tails (17, 40), column tails, odd k, k of several tiles and (2,100: 1,056 pairs) of
        // two passes; k = 0.
        for &(m, k, n) in &[(1, 1, 1), (17, 33, 50), (40, 576, 100), (9, 2100, 50), (3, 0, 5)] {
            for accumulate in [false, true] {
                let (a, b) = (values(m * k, 6), values(k * n, 7));
                let start = values(m * n, 8);
                let mut want = start.clone();
                reference(&mut want, accumulate, (&a, (k, 1)), (&b, (n, 1)), (m, k, n));
                let layout = Kernel::Amx.layout(k);
                let packed_a = pack_a((&a, (k, 1)), m, k, layout);
                let mut got = start.clone();
                for p in 0..n.div_ceil(PANEL) {
                    let panel = pack_panel((&b, (n, 1)), k, p * PANEL, PANEL.min(n - p * PANEL), layout);
                    let out = SharedOut(got.as_mut_ptr());
                    // SAFETY: the model reads only the packed slices, in the layout it was packed in.
                    unsafe {
                        tile_panel_product(model_of_the_tiles, out, accumulate, (&packed_a, &panel), p, (m, n), layout)
                    };
                }
                let err = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                assert!(err <= 1e-6 * (k as f32).max(1.0), "({m}, {k}, {n}), accumulate {accumulate}: {err}");
            }
        }
    }

    #[test]
    fn a_new_output_is_written_whole() {
        let Some(&fastest) = Kernel::reachable().first() else {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 GEMM kernel is not reachable here");
            return;
        };
        assert_eq!(gemm_new(fastest, (&[], (0, 1)), (&[], (0, 1)), (0, 0, 0)), Some(Vec::new()));
        // Every kernel here; row and column tails, k = 0, a transposed b, k of two passes (2,100:
        // 1,050 pairs); the output's size in NaN-filled blocks just freed first, so that an element
        // the kernel leaves unwritten is likely to show.
        for kernel in Kernel::reachable() {
            let shapes = [(9, 33, 50, false), (17, 0, 5, false), (40, 576, 100, true), (19, 2100, 60, true)];
            for (m, k, n, transposed) in shapes {
                drop(std::hint::black_box(vec![f32::NAN; m * n]));
                let (a, b) = (values(m * k, 9), values(k * n, 10));
                let bs = if transposed { (1, k) } else { (n, 1) };
                let got = gemm_new(kernel, (&a, (k, 1)), (&b, bs), (m, k, n)).expect("reachable");
                let mut want = vec![0.0; m * n];
                reference(&mut want, false, (&a, (k, 1)), (&b, bs), (m, k, n));
                // The same bits as the product into a zero-filled output.
                let mut zeroed = vec![0.0; m * n];
                assert!(gemm(kernel, &mut zeroed, false, (&a, (k, 1)), (&b, bs), (m, k, n)));
                assert!(got.iter().zip(&zeroed).all(|(x, y)| x.to_bits() == y.to_bits()), "{kernel:?} ({m}, {k}, {n})");
                // And the reference's values, within f32 summation's error of sums up to k terms.
                let scale = want.iter().fold(1.0f32, |s, v| s.max(v.abs()));
                let err = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                assert!(err <= 1e-6 * (k as f32).max(1.0) * scale, "{kernel:?} ({m}, {k}, {n}): {err}");
            }
        }
    }

    #[test]
    fn products_on_one_thread_match_the_reference() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the one-thread bf16 products are not reachable here");
            return;
        }
        assert!(pack_rows((&[], (0, 1)), (0, 0)).is_some());
        // (m, k, n, pair0, c0, cols, ldc): a run of b's rows from pair `pair0` and of its columns from
        // panel `c0 / 48`, into a window of a wider output; odd k, row tails, column tails, k of
        // two passes (2,100: 1,050 pairs).
        let cases = [
            (9, 33, 150, 0, 0, 150, 150),
            (17, 64, 200, 5, 48, 100, 160),
            (64, 130, 100, 3, 96, 4, 10),
            (3, 2100, 50, 1, 0, 50, 50),
            (8, 0, 60, 0, 48, 12, 12),
        ];
        for (m, k, n, pair0, c0, cols, ldc) in cases {
            for accumulate in [false, true] {
                for transposed in [false, true] {
                    let kb = 2 * pair0 + k + 1; // b has rows before and after the ones used
                    let (a, b) = (values(m * k, 11), values(kb * n, 12));
                    let (a, a_strides) = if transposed { (transpose(&a, (m, k)), (1, m)) } else { (a, (k, 1)) };
                    let (b, bs) = if transposed { (transpose(&b, (kb, n)), (1, kb)) } else { (b, (n, 1)) };
                    let start = values(m * ldc, 13);
                    let mut got = start.clone();
                    let packed_a = pack_rows((&a, a_strides), (m, k)).expect("reachable");
                    let packed_b = pack_panels((&b, bs), (kb, n)).expect("reachable");
                    product_on_this_thread(&mut got, ldc, accumulate, &packed_a, &packed_b, pair0, (c0, cols));
                    let mut want: Vec<f32> = start.chunks(ldc).flat_map(|r| r[..cols].to_vec()).collect();
                    let used_b = &b[2 * pair0 * bs.0 + c0 * bs.1..];
                    reference(&mut want, accumulate, (&a, a_strides), (used_b, bs), (m, k, cols));
                    let case =
                        format!("({m}, {k}, {n}) from pair {pair0}, columns {c0}+{cols}, transposed {transposed}");
                    for (i, (row, start)) in got.chunks(ldc).zip(start.chunks(ldc)).enumerate() {
                        let want = &want[i * cols..(i + 1) * cols];
                        let err = row[..cols].iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                        assert!(err <= 1e-6 * (k as f32).max(1.0), "{case}, accumulate {accumulate}: {err}");
                        assert_eq!(&row[cols..], &start[cols..], "{case}: columns past the window written");
                    }
                }
            }
        }
    }

    #[test]
    fn transposed_rows_are_the_panels_of_the_transpose() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the one-thread bf16 products are not reachable here");
            return;
        }
        // Column tails inside a group of 16 and inside a panel, an odd k, one row.
        for (m, k) in [(100, 64), (37, 9), (1, 2), (48, 30)] {
            let a = values(m * k, 14);
            let rows = pack_rows((&a, (k, 1)), (m, k)).expect("reachable");
            let got = transpose_rows(&rows);
            // The same panels as packing aᵀ (`[k, m]`, read through strides (1, k)) directly.
            let want = pack_panels((&a, (1, k)), (k, m)).expect("reachable");
            assert_eq!((got.n, got.pairs), (want.n, want.pairs), "({m}, {k})");
            assert_eq!(got.data, want.data, "({m}, {k})");
        }
    }

    #[test]
    fn kernel_matches_the_reference() {
        let kernels = Kernel::reachable();
        if kernels.is_empty() {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 GEMM kernel is not reachable here");
            return;
        }
        if !kernels.contains(&Kernel::Amx) {
            eprintln!("no AMX on this CPU (or not granted): the tile kernel is tested on a model of the tiles only");
        }
        for kernel in kernels {
            // Shapes with row and column tails, odd k, and one bigger than a panel in every way.
            // k = 2,100: 1,050 pairs, two passes over a panel (1,024 pairs a pass, then 26).
            for &(m, k, n) in
                &[(1, 1, 1), (3, 5, 7), (8, 64, 48), (9, 33, 50), (17, 130, 100), (40, 576, 200), (9, 2100, 50)]
            {
                for accumulate in [false, true] {
                    for transposed in [false, true] {
                        let a = values(m * k, 1);
                        let b = values(k * n, 2);
                        // b as stored, or as the transpose of an [n, k] matrix (strides (1, k)); and
                        let (b, bs) = if transposed { (transpose(&b, (k, n)), (1, k)) } else { (b, (n, 1)) };
                        // a likewise: as stored, or as the transpose of a [k, m] matrix (strides (1, m)).
                        let (a, a_strides) = if transposed { (transpose(&a, (m, k)), (1, m)) } else { (a, (k, 1)) };
                        let start = values(m * n, 3);
                        let mut want = start.clone();
                        reference(&mut want, accumulate, (&a, a_strides), (&b, bs), (m, k, n));
                        let mut got = start.clone();
                        assert!(gemm(kernel, &mut got, accumulate, (&a, a_strides), (&b, bs), (m, k, n)));
                        let mut got_packed = start.clone();
                        let packed = pack_b(kernel, (&b, bs), (k, n)).expect("reachable");
                        gemm_packed(&mut got_packed, accumulate, (&a, a_strides), &packed, m);
                        for (got, how) in [(got, "packed per call"), (got_packed, "packed once")] {
                            let err = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                            // f32 sums of k products of bf16 values ≤ 1: within k · 2^-24 · k of the f64 sum.
                            let tolerance = 1e-6 * (k as f32).max(1.0);
                            assert!(
                            err <= tolerance,
                            "{kernel:?} ({m}, {k}, {n}), accumulate {accumulate}, transposed {transposed}, {how}: {err}"
                        );
                        }
                    }
                }
            }
        }
    }
}
