//! Linear layers over a frozen weight kept in a block-quantized storage type (GGUF's Q8_0, Q4_0,
//! Q4_1, Q4_K, Q6_K, …): `y = x·W` and its input gradient `dx = dy·Wᵀ`, with `W` dequantized a tile
//! at a time inside the product, never whole. The weight is frozen: there is no weight gradient, so
//! nothing but the stored blocks is kept for the backward pass (not even `x`).
//!
//! The storage is the file's: `out` rows of `in` values, each row a run of blocks (`[out, in]`,
//! Hugging Face's orientation, the transpose of ember's `[in, out]` linear weight). How a block
//! decodes is the caller's ([`DecodeBlocks`]): this crate knows no file format.
//!
//! The CPU kernel splits the forward product by output columns (a panel of rows of the stored
//! weight decoded into a scratch buffer that stays in cache, then one GEMM into those columns) and
//! the input gradient by input columns (a panel of whole blocks of every row), panels spread over
//! the threads. Other backends, and non-f32 inputs, run the reference: the weight dequantized to a
//! tensor for the call, then a matmul.
//!
//! A weight whose type has integer dot products ([`QuantWeight::with_dot`], [`crate::qdot`]) runs
//! the forward product of a few rows (a decode step: up to [`DOT_ROWS`]) on them instead, its input
//! quantized to 8 bits on the fly as llama.cpp does: the stored bytes are read once and nothing is
//! decoded to f32. Where the CPU has AVX-512 VNNI and the rows are interleaved sixteen at a time
//! ([`crate::interleave`]), a prompt's rows take the integer products too (llama.cpp's prefill
//! does the same); elsewhere they multiply decoded tiles. [`Compute::int8_inputs`] off (training,
//! under autodiff always; `ember eval`) multiplies every row exactly, on decoded tiles.

use std::ops::Range;
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

use crate::compute::{Compute, Path};
use crate::qdot::{DotFormat, DotWeight, Isa};
use crate::{flex, float, prim, EmberBackend};

/// Rows up to which the forward product of a weight with integer dot products in the file's layout
/// runs on them; more rows decode tiles for the f32 GEMM (interleaved weights take any number).
pub const DOT_ROWS: usize = 16;

/// Decodes whole blocks: `bytes` holds `out.len() / values` blocks of the type, `out` receives
/// their values in order.
pub type DecodeBlocks = fn(bytes: &[u8], out: &mut [f32]);

/// Why stored blocks do not make a weight.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    #[error("{kind} weight [{rows}, {cols}]: rows of {cols} values are not whole blocks of {block}")]
    Ragged { kind: &'static str, rows: usize, cols: usize, block: usize },
    #[error("{kind} weight [{rows}, {cols}]: {found} bytes stored, {expected} expected")]
    Length { kind: &'static str, rows: usize, cols: usize, expected: usize, found: usize },
    #[error(
        "{kind} weight: blocks of {block:?} (values, bytes) cannot run as {format:?}, whose blocks are {expected:?}"
    )]
    Format { kind: &'static str, block: (usize, usize), format: DotFormat, expected: (usize, usize) },
}

/// A buffer weights may share: a `Vec`, or a file mapped into memory.
pub type SharedBuffer = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The stored bytes of a weight: its own, or a range of a buffer shared with other weights (a
/// whole GGUF file mapped once, each weight a view of its tensor: nothing copied).
#[derive(Clone)]
pub struct StoredBytes {
    buf: SharedBuffer,
    start: usize,
    len: usize,
}

impl StoredBytes {
    /// Bytes `range` of `buf`.
    ///
    /// # Panics
    /// If `range` lies outside `buf`.
    pub fn view(buf: SharedBuffer, range: Range<usize>) -> Self {
        let size = (*buf).as_ref().len();
        assert!(range.start <= range.end && range.end <= size, "StoredBytes::view: {range:?} outside {size}");
        Self { buf, start: range.start, len: range.len() }
    }
}

impl From<Vec<u8>> for StoredBytes {
    fn from(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self { buf: Arc::new(bytes), start: 0, len }
    }
}

impl std::ops::Deref for StoredBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &(*self.buf).as_ref()[self.start..self.start + self.len]
    }
}

/// A frozen linear weight in a block-quantized type: `d_out` rows of `d_in` values, each row whole
/// blocks. Cheap to clone (shared).
#[derive(Clone)]
pub struct QuantWeight(Arc<Stored>);

#[derive(Clone)]
struct Stored {
    kind: &'static str,
    rows: usize,
    cols: usize,
    /// (values, bytes) per block.
    block: (usize, usize),
    data: StoredBytes,
    decode: DecodeBlocks,
    /// The block layout's integer dot products, where it has them.
    dot: Option<DotFormat>,
    /// Whether `data` holds the rows interleaved sixteen at a time ([`crate::interleave`]) rather
    /// than one after the other.
    interleaved: bool,
}

impl std::fmt::Debug for QuantWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantWeight({} [{}, {}], {} bytes)", self.0.kind, self.0.rows, self.0.cols, self.0.data.len())
    }
}

impl QuantWeight {
    /// `rows` (the layer's outputs) of `cols` values (its inputs) stored as `data`, blocks of
    /// `block = (values, bytes)` of type `kind` that `decode` reads.
    pub fn new(
        kind: &'static str,
        [rows, cols]: [usize; 2],
        block: (usize, usize),
        data: impl Into<StoredBytes>,
        decode: DecodeBlocks,
    ) -> Result<Self, QuantError> {
        let data = data.into();
        let (values, bytes) = block;
        if values == 0 || !cols.is_multiple_of(values) {
            return Err(QuantError::Ragged { kind, rows, cols, block: values });
        }
        let expected = rows.saturating_mul(cols / values).saturating_mul(bytes);
        if data.len() != expected {
            return Err(QuantError::Length { kind, rows, cols, expected, found: data.len() });
        }
        Ok(Self(Arc::new(Stored { kind, rows, cols, block, data, decode, dot: None, interleaved: false })))
    }

    /// The same weight, its products of a few rows on `format`'s integer dot products (the stored
    /// blocks must be `format`'s). Where the CPU has AVX-512 VNNI and the type and rows allow, the
    /// rows are interleaved sixteen at a time for those products ([`crate::interleave`]: a copy as
    /// large as the blocks, which then replaces them).
    pub fn with_dot(self, format: DotFormat) -> Result<Self, QuantError> {
        self.with_dot_releasing(format, &mut |_| {})
    }

    /// [`Self::with_dot`], calling `consumed` with each range of the stored bytes the interleaving
    /// is done reading ([`crate::interleave::interleave_with`]): a mapped file's pages can go as
    /// the copy grows.
    pub fn with_dot_releasing(
        self,
        format: DotFormat,
        consumed: &mut dyn FnMut(Range<usize>),
    ) -> Result<Self, QuantError> {
        let s = &self.0;
        if s.block != format.block() {
            return Err(QuantError::Format { kind: s.kind, block: s.block, format, expected: format.block() });
        }
        let packed = (!s.interleaved && crate::interleave::pays(format, s.rows))
            .then(|| crate::interleave::interleave_with(format, &s.data, (s.rows, s.cols), consumed))
            .flatten();
        let stored = Arc::unwrap_or_clone(self.0);
        Ok(Self(Arc::new(match packed {
            Some(packed) => Stored { dot: Some(format), data: packed.into(), interleaved: true, ..stored },
            None => Stored { dot: Some(format), ..stored },
        })))
    }

    /// Whether the rows are stored interleaved for the integer products ([`QuantWeight::with_dot`]).
    pub fn interleaved(&self) -> bool {
        self.0.interleaved
    }

    /// Blocks `blocks` of stored row `row` in the file's layout: a view of the bytes, or,
    /// interleaved, restored into `buf`.
    fn stored_blocks<'a>(&'a self, row: usize, blocks: Range<usize>, buf: &'a mut Vec<u8>) -> &'a [u8] {
        let s = &self.0;
        let (rb, bb) = (self.row_bytes(), s.block.1);
        match (s.interleaved, s.dot) {
            (true, Some(format)) => {
                buf.resize(blocks.len() * bb, 0);
                crate::interleave::restore_blocks(format, &s.data, (s.rows, s.cols), row, blocks, buf);
                buf
            }
            _ => &s.data[row * rb + blocks.start * bb..row * rb + blocks.end * bb],
        }
    }

    /// The integer dot products the weight's few-row products run on, if any.
    pub fn dot(&self) -> Option<DotFormat> {
        self.0.dot
    }

    /// The storage type's name.
    pub fn kind(&self) -> &'static str {
        self.0.kind
    }

    /// The layer's inputs (values a stored row).
    pub fn d_in(&self) -> usize {
        self.0.cols
    }

    /// The layer's outputs (stored rows).
    pub fn d_out(&self) -> usize {
        self.0.rows
    }

    /// Bytes held.
    pub fn stored_bytes(&self) -> usize {
        self.0.data.len()
    }

    /// Values a block.
    pub fn block_values(&self) -> usize {
        self.0.block.0
    }

    fn row_bytes(&self) -> usize {
        self.0.cols / self.0.block.0 * self.0.block.1
    }

    /// The same weight with its rows reordered: row `i` of the result is row `order[i]` of this one
    /// (`order` a permutation of the rows).
    pub fn with_rows(&self, order: &[usize]) -> Self {
        assert_eq!(order.len(), self.0.rows, "with_rows: a permutation of {} rows", self.0.rows);
        let mut buf = Vec::new();
        let mut data: Vec<u8> = Vec::with_capacity(self.0.data.len());
        let blocks = self.0.cols / self.0.block.0;
        for &r in order {
            data.extend_from_slice(self.stored_blocks(r, 0..blocks, &mut buf));
        }
        let rows = Self(Arc::new(Stored { data: data.into(), interleaved: false, ..(*self.0).clone() }));
        match self.0.dot {
            // Interleaved again, where the original was.
            Some(format) if self.0.interleaved => rows.with_dot(format).unwrap_or_else(|_| unreachable!("same blocks")),
            _ => rows,
        }
    }

    /// Rows `rows`, columns `cols` (whole blocks) decoded into `out`, row-major `[rows, cols]`.
    pub fn decode_tile(&self, rows: Range<usize>, cols: Range<usize>, out: &mut [f32]) {
        let bv = self.0.block.0;
        assert!(cols.start.is_multiple_of(bv) && (cols.end.is_multiple_of(bv) || cols.end == self.0.cols));
        assert!(rows.end <= self.0.rows && cols.end <= self.0.cols, "decode_tile: outside the weight");
        let width = cols.len();
        assert_eq!(out.len(), rows.len() * width, "decode_tile: output of {} rows × {width}", rows.len());
        let blocks = cols.start / bv..cols.end / bv;
        let mut buf = Vec::new();
        for (row, out) in rows.zip(out.chunks_exact_mut(width.max(1))) {
            (self.0.decode)(self.stored_blocks(row, blocks.clone(), &mut buf), out);
        }
    }

    /// The whole weight dequantized, row-major `[d_out, d_in]` (the stored orientation).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.0.rows * self.0.cols];
        self.decode_tile(0..self.0.rows, 0..self.0.cols, &mut out);
        out
    }

    /// The whole weight dequantized as ember's `[d_in, d_out]` f32 tensor on `device`.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        let stored = TensorData::new(self.dequantize(), [self.0.rows, self.0.cols]);
        Tensor::<B, 2>::from_data(stored, device).transpose()
    }
}

/// A backend's product with a quantized weight; the default methods are the reference.
pub trait QuantLinearOps: Backend {
    /// `x·W`, W the weight dequantized.
    ///
    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    fn quant_linear(x: FloatTensor<Self>, w: &QuantWeight, _cx: Compute) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x), w))
    }

    /// `dy·Wᵀ`, the input's gradient.
    ///
    /// # Shapes
    /// - dy: `[N, out]` -> `[N, in]`
    fn quant_linear_backward(dy: FloatTensor<Self>, w: &QuantWeight, _cx: Compute) -> FloatTensor<Self> {
        prim(reference_backward(float::<Self, 2>(dy), w))
    }

    /// `x·W + scale·(x·A)·B`: the product with a low-rank adapter (`A: [in, r]`, `B: [r, out]`)
    /// inside it, in f32.
    ///
    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    fn quant_linear_lora(
        x: FloatTensor<Self>,
        w: &QuantWeight,
        (a, b, scale): (FloatTensor<Self>, FloatTensor<Self>, f32),
        cx: Compute,
    ) -> FloatTensor<Self> {
        let x = float::<Self, 2>(x);
        let y = float::<Self, 2>(Self::quant_linear(prim(x.clone()), w, cx));
        prim(y + x.matmul(float(a)).matmul(float::<Self, 2>(b).mul_scalar(scale)))
    }
}

/// The reference: the weight dequantized whole, then a matmul.
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: &QuantWeight) -> Tensor<B, 2> {
    let device = x.device();
    x.matmul(w.to_tensor(&device))
}

/// The reference's input gradient.
pub fn reference_backward<B: Backend>(dy: Tensor<B, 2>, w: &QuantWeight) -> Tensor<B, 2> {
    let device = dy.device();
    dy.matmul(w.to_tensor::<B>(&device).transpose())
}

/// `x·W` over a quantized frozen weight, in f32 (an input in another dtype is cast): one graph node
/// whose backward gives only the input's gradient.
///
/// # Shapes
/// - x: `[N, in]` -> `[N, out]`
pub fn quant_linear<B: EmberBackend>(x: Tensor<B, 2>, w: &QuantWeight, cx: Compute) -> Tensor<B, 2> {
    let x = if x.dtype() == DType::F32 { x } else { x.cast(DType::F32) };
    float(B::quant_linear(prim(x), w, cx))
}

/// [`quant_linear`] with a low-rank adapter inside the op: `x·W + scale·(x·A)·B` as one graph node
/// (under autodiff its output is the only tensor a checkpointing strategy keeps, as for the dense
/// packed product), whose backward gives the input's and the adapter's gradients. In f32.
///
/// # Shapes
/// - x: `[N, in]`, a: `[in, r]`, b: `[r, out]` -> `[N, out]`
pub fn quant_linear_lora<B: EmberBackend>(
    x: Tensor<B, 2>,
    w: &QuantWeight,
    (a, b, scale): (Tensor<B, 2>, Tensor<B, 2>, f32),
    cx: Compute,
) -> Tensor<B, 2> {
    let f32 = |t: Tensor<B, 2>| if t.dtype() == DType::F32 { t } else { t.cast(DType::F32) };
    float(B::quant_linear_lora(prim(f32(x)), w, (prim(f32(a)), prim(f32(b)), scale), cx))
}

impl QuantLinearOps for Flex {
    fn quant_linear(x: FlexTensor, w: &QuantWeight, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&x);
        if !flex::all_f32(&[&x]) || shape.len() != 2 || shape[1] != w.d_in() || cx.path != Path::Kernels {
            return prim(reference(float::<Self, 2>(x), w));
        }
        let (n, x) = (shape[0], flex::f32s(&x));
        let dot = |format| DotWeight::new(format, &w.0.data, (w.d_out(), w.d_in()));
        let y = match w.0.dot {
            Some(format) if cx.int8_inputs && w.0.interleaved => {
                crate::interleave::product(Isa::best(cx.cpu), dot(format), (&x, n, cx.activation_bits))
            }
            Some(format) if (n <= DOT_ROWS || cx.uniform_products) && cx.int8_inputs => {
                crate::qdot::product_with(Isa::best(cx.cpu), dot(format), (&x, n, cx.activation_bits))
            }
            _ => kernel::forward(&x, n, w),
        };
        flex::tensor(y, vec![n, w.d_out()])
    }

    fn quant_linear_backward(dy: FlexTensor, w: &QuantWeight, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&dy);
        if !flex::all_f32(&[&dy]) || shape.len() != 2 || shape[1] != w.d_out() || cx.path != Path::Kernels {
            return prim(reference_backward(float::<Self, 2>(dy), w));
        }
        flex::tensor(kernel::input_grad(&flex::f32s(&dy), shape[0], w), vec![shape[0], w.d_in()])
    }
}

/// One graph node whose backward is the inner backend's input gradient; the state is the weight
/// (shared, not copied) and nothing of the input.
impl<B: EmberBackend, C: CheckpointStrategy> QuantLinearOps for Autodiff<B, C> {
    fn quant_linear(x: FloatTensor<Self>, w: &QuantWeight, cx: Compute) -> FloatTensor<Self> {
        // Training (and a training run's evaluations) multiply exactly: 8-bit activations are an
        // inference choice, lossy.
        let cx = cx.with_int8_inputs(false);
        #[derive(Debug)]
        struct QuantLinearBackward;
        impl<B: EmberBackend> Backward<B, 1> for QuantLinearBackward {
            type State = (QuantWeight, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (w, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::quant_linear_backward(dy, &w, cx));
                }
            }
        }
        match QuantLinearBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::quant_linear(x.primitive, w, cx);
                prep.finish((w.clone(), cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::quant_linear(x.primitive, w, cx)),
        }
    }

    fn quant_linear_lora(
        x: FloatTensor<Self>,
        w: &QuantWeight,
        (a, b, scale): (FloatTensor<Self>, FloatTensor<Self>, f32),
        cx: Compute,
    ) -> FloatTensor<Self> {
        let cx = cx.with_int8_inputs(false); // as `quant_linear`
        #[derive(Debug)]
        struct QuantLoraBackward;
        impl<B: EmberBackend> Backward<B, 3> for QuantLoraBackward {
            /// The weight, x, A, B, the scale.
            type State = (QuantWeight, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, f32, Compute);
            fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_x, node_a, node_b] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (w, x, a, b, scale, cx) = ops.state;
                let (x, a, b) = (float::<B, 2>(x), float::<B, 2>(a), float::<B, 2>(b));
                let dy_t = float::<B, 2>(dy.clone());
                // g = scale·dy·Bᵀ, [N, r]: the gradient of x·A.
                let g = dy_t.clone().matmul(b.clone().transpose()).mul_scalar(scale);
                if let Some(n) = node_x {
                    let dx =
                        float::<B, 2>(B::quant_linear_backward(dy, &w, cx)) + g.clone().matmul(a.clone().transpose());
                    grads.register::<B>(n.id, prim(dx));
                }
                if let Some(n) = node_b {
                    let u = x.clone().matmul(a);
                    grads.register::<B>(n.id, prim(u.transpose().matmul(dy_t).mul_scalar(scale)));
                }
                if let Some(n) = node_a {
                    grads.register::<B>(n.id, prim(x.transpose().matmul(g)));
                }
            }
        }
        let parents = [x.node.clone(), a.node.clone(), b.node.clone()];
        match QuantLoraBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (xp, ap, bp) = (x.primitive, a.primitive, b.primitive);
                let y = B::quant_linear_lora(xp.clone(), w, (ap.clone(), bp.clone(), scale), cx);
                prep.finish((w.clone(), xp, ap, bp, scale, cx), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::quant_linear_lora(x.primitive, w, (a.primitive, b.primitive, scale), cx))
            }
        }
    }
}

/// The CPU kernels, on f32 slices.
mod kernel {
    use rayon::prelude::*;

    use super::QuantWeight;
    use crate::products::gemm_raw;
    use crate::SharedOut;

    /// Stored rows (output features) decoded at a time by the forward product: at most a `[64, in]`
    /// panel, 256 KiB at `in` = 1024, that stays in cache while the GEMM reads it.
    const PANEL_ROWS: usize = 64;

    /// Input columns decoded at a time by the input gradient: at most 128 values' worth of whole
    /// blocks (one block of a K-quant).
    const PANEL_COLS: usize = 128;

    /// Units (rows, or blocks) a task when `total` are split into tasks of at most `most` (at least
    /// one) in a multiple of the thread count: a projection of 3 panels on 2 threads would leave
    /// one idle a third of the time.
    fn per_task(total: usize, most: usize) -> usize {
        let threads = rayon::current_num_threads().max(1);
        let tasks = threads * total.div_ceil(most.max(1) * threads).max(1);
        total.div_ceil(tasks).max(1)
    }

    thread_local! {
        /// Each thread's decoded tile, kept from call to call: a tile is a few hundred KiB, which
        /// allocated afresh for each panel would be page-faulted in (and zeroed) every time.
        static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// `f` on this thread's tile buffer of `len` values (contents unspecified: decoding overwrites
    /// them). `f` must not run rayon work that could re-enter here on this thread.
    fn with_tile<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        TILE.with(|tile| {
            let mut tile = tile.borrow_mut();
            if tile.len() < len {
                tile.resize(len, 0.0);
            }
            f(&mut tile[..len])
        })
    }

    /// `x·W`: `x` `[n, in]` row-major, the result `[n, out]`.
    pub(super) fn forward(x: &[f32], n: usize, w: &QuantWeight) -> Vec<f32> {
        let (k, m) = (w.d_in(), w.d_out());
        assert_eq!(x.len(), n * k, "quant_linear: x is [{n}, {k}]");
        if n == 0 {
            return Vec::new();
        }
        let mut y = vec![0f32; n * m];
        let out = SharedOut(y.as_mut_ptr());
        let len = y.len();
        let rows = per_task(m, PANEL_ROWS);
        (0..m.div_ceil(rows)).into_par_iter().for_each(|p| {
            let (j0, j1) = (p * rows, ((p + 1) * rows).min(m));
            with_tile((j1 - j0) * k, |tile| {
                w.decode_tile(j0..j1, 0..k, tile);
                // y[:, j0..j1] = x · tileᵀ: the tile read with (row, column) strides (1, k).
                // SAFETY: each task writes columns j0..j1 of y only, y outlives the tasks, and
                // gemm_raw checks the extents against `len - j0` elements from column j0.
                unsafe {
                    let dst = (out.at(j0), len - j0, (m, 1));
                    gemm_raw((n, j1 - j0, k), dst, false, (x, (k, 1)), (tile, (1, k)), 1.0, gemm::Parallelism::None);
                }
            })
        });
        y
    }

    /// `dy·Wᵀ`: `dy` `[n, out]` row-major, the result `[n, in]`.
    pub(super) fn input_grad(dy: &[f32], n: usize, w: &QuantWeight) -> Vec<f32> {
        let (k, m) = (w.d_in(), w.d_out());
        assert_eq!(dy.len(), n * m, "quant_linear_backward: dy is [{n}, {m}]");
        if n == 0 {
            return Vec::new();
        }
        let bv = w.block_values();
        let width = bv * per_task(k / bv, PANEL_COLS.div_ceil(bv));
        let mut dx = vec![0f32; n * k];
        let out = SharedOut(dx.as_mut_ptr());
        let len = dx.len();
        (0..k.div_ceil(width)).into_par_iter().for_each(|p| {
            let (c0, c1) = (p * width, ((p + 1) * width).min(k));
            with_tile(m * (c1 - c0), |tile| {
                w.decode_tile(0..m, c0..c1, tile);
                // dx[:, c0..c1] = dy · tile, the tile `[out, c1 - c0]` row-major.
                // SAFETY: each task writes columns c0..c1 of dx only, dx outlives the tasks, and
                // gemm_raw checks the extents against `len - c0` elements from column c0.
                unsafe {
                    let dst = (out.at(c0), len - c0, (k, 1));
                    let rhs = (&*tile, (c1 - c0, 1));
                    gemm_raw((n, c1 - c0, m), dst, false, (dy, (m, 1)), rhs, 1.0, gemm::Parallelism::None);
                }
            })
        });
        dx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TestBackend;
    use burn::backend::Autodiff;
    use burn::tensor::{Distribution, Tolerance};

    /// A block type for the tests: 8 values, an f32 scale then 8 i8 quants (12 bytes).
    fn decode_q8x8(bytes: &[u8], out: &mut [f32]) {
        for (b, y) in bytes.chunks_exact(12).zip(out.chunks_exact_mut(8)) {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for (y, &q) in y.iter_mut().zip(&b[4..12]) {
                *y = d * q as i8 as f32;
            }
        }
    }

    fn quantize_q8x8(values: &[f32]) -> Vec<u8> {
        values
            .chunks_exact(8)
            .flat_map(|v| {
                let d = v.iter().fold(0f32, |a, x| a.max(x.abs())) / 127.0;
                let mut b = d.to_le_bytes().to_vec();
                b.extend(v.iter().map(|x| (x / d).round() as i8 as u8));
                b
            })
            .collect()
    }

    fn weight(rows: usize, cols: usize, seed: u64) -> QuantWeight {
        let values: Vec<f32> =
            (0..rows * cols).map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 - 500.0) / 700.0).collect();
        QuantWeight::new("q8x8", [rows, cols], (8, 12), quantize_q8x8(&values), decode_q8x8).expect("whole blocks")
    }

    #[test]
    fn the_tiled_product_and_input_gradient_equal_dequantize_then_gemm() {
        type AB = Autodiff<TestBackend>;
        let dev = Default::default();
        // Widths past one panel each way and not multiples of them; one row (decoding) and many.
        for (n, d_in, d_out) in [(1, 24, 16), (37, 136, 150), (200, 272, 65)] {
            let w = weight(d_out, d_in, n as u64);
            let x0 = Tensor::<TestBackend, 2>::random([n, d_in], Distribution::Normal(0.0, 1.0), &dev);
            let mix = Tensor::<AB, 2>::random([n, d_out], Distribution::Normal(0.0, 1.0), &dev);
            let run = |kernels: bool| {
                let cx = Compute::default().with_path(if kernels { Path::Kernels } else { Path::Reference });
                let x = Tensor::<AB, 2>::from_inner(x0.clone()).require_grad();
                let y = quant_linear(x.clone(), &w, cx);
                let grads = (y.clone() * mix.clone()).sum().backward();
                (y.into_data(), x.grad(&grads).expect("x's gradient").into_data())
            };
            let ((y, dx), (y_ref, dx_ref)) = (run(true), run(false));
            // The reference is literally dequantize-then-matmul.
            let dense = Tensor::<TestBackend, 2>::from_data(TensorData::new(w.dequantize(), [d_out, d_in]), &dev);
            x0.clone().matmul(dense.transpose()).into_data().assert_approx_eq::<f32>(&y_ref, Tolerance::absolute(1e-4));
            y.assert_approx_eq::<f32>(&y_ref, Tolerance::absolute(1e-4));
            dx.assert_approx_eq::<f32>(&dx_ref, Tolerance::absolute(1e-4));
            assert!(y.iter::<f32>().any(|v| v != 0.0) && dx.iter::<f32>().any(|v| v != 0.0));
        }
    }

    #[test]
    fn the_adapter_inside_the_op_equals_the_composition() {
        type AB = Autodiff<TestBackend>;
        let dev = Default::default();
        let (n, d_in, d_out, r) = (29, 136, 70, 3);
        let w = weight(d_out, d_in, 5);
        let x0 = Tensor::<TestBackend, 2>::random([n, d_in], Distribution::Normal(0.0, 1.0), &dev);
        let a0 = Tensor::<TestBackend, 2>::random([d_in, r], Distribution::Normal(0.0, 0.3), &dev);
        let b0 = Tensor::<TestBackend, 2>::random([r, d_out], Distribution::Normal(0.0, 0.3), &dev);
        let mix = Tensor::<AB, 2>::random([n, d_out], Distribution::Normal(0.0, 1.0), &dev);
        let run = |inside: bool| {
            let leaf = |t: &Tensor<TestBackend, 2>| Tensor::<AB, 2>::from_inner(t.clone()).require_grad();
            let (x, a, b) = (leaf(&x0), leaf(&a0), leaf(&b0));
            let y = match inside {
                true => quant_linear_lora(x.clone(), &w, (a.clone(), b.clone(), 2.5), Compute::default()),
                false => {
                    quant_linear(x.clone(), &w, Compute::default())
                        + x.clone().matmul(a.clone()).matmul(b.clone()) * 2.5
                }
            };
            let grads = (y.clone() * mix.clone()).sum().backward();
            let g = |t: Tensor<AB, 2>| t.grad(&grads).expect("a gradient").into_data();
            [y.into_data(), g(x), g(a), g(b)]
        };
        for (i, (got, want)) in run(true).iter().zip(run(false).iter()).enumerate() {
            got.assert_approx_eq::<f32>(want, Tolerance::absolute(1e-3));
            assert!(got.iter::<f32>().any(|v| v != 0.0), "output {i} all zeros");
        }
        // Frozen input (the first layer's): only the adapter's gradients.
        let x = Tensor::<AB, 2>::from_inner(x0.clone());
        let a = Tensor::<AB, 2>::from_inner(a0.clone()).require_grad();
        let b = Tensor::<AB, 2>::from_inner(b0.clone()).require_grad();
        let y = quant_linear_lora(x, &w, (a.clone(), b.clone(), 2.5), Compute::default());
        let grads = (y * mix).sum().backward();
        assert!(a.grad(&grads).is_some() && b.grad(&grads).is_some());
    }

    /// Q8_0 blocks (ggml's: an f16 scale, 32 i8 codes), every scale 1/16 (f16 0x2C00).
    fn decode_q8_0(bytes: &[u8], out: &mut [f32]) {
        for (b, y) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
            for (y, &q) in y.iter_mut().zip(&b[2..]) {
                *y = q as i8 as f32 / 16.0;
            }
        }
    }

    #[test]
    fn a_few_rows_run_on_integer_products_unless_the_run_asks_for_exact_ones() {
        // Rows in whole groups of 16: interleaved where the CPU has AVX-512 VNNI.
        let (rows, cols) = (48, 64);
        let data: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let codes = (0..32).map(move |i| ((b * 37 + i * 11) % 255) as u8);
                [0x00, 0x2C].into_iter().chain(codes)
            })
            .collect();
        let plain = QuantWeight::new("Q8_0", [rows, cols], (32, 34), data, decode_q8_0).unwrap();
        let w = plain.clone().with_dot(DotFormat::Q8_0).unwrap();
        assert_eq!(w.interleaved(), crate::interleave::pays(DotFormat::Q8_0, rows));
        // The f32 paths read the interleaved rows as they were.
        assert_eq!(w.dequantize(), plain.dequantize());
        let order: Vec<usize> = (0..rows).rev().collect();
        assert_eq!(w.with_rows(&order).dequantize(), plain.with_rows(&order).dequantize());
        assert_eq!(w.with_rows(&order).interleaved(), w.interleaved());
        // A tile of some blocks of some rows, restored block by block.
        let (mut a, mut b) = (vec![0f32; 4 * 32], vec![0f32; 4 * 32]);
        w.decode_tile(3..7, 32..64, &mut a);
        plain.decode_tile(3..7, 32..64, &mut b);
        assert_eq!(a, b);
        assert!(QuantWeight::new("Q8_0", [rows, cols], (32, 34), vec![0; rows * 68], decode_q8_0)
            .unwrap()
            .with_dot(DotFormat::Q4_0)
            .is_err());
        let dev = Default::default();
        let x = Tensor::<Flex, 2>::random([3, cols], Distribution::Normal(0.0, 1.0), &dev);
        let want = reference(x.clone(), &w).into_data();
        let exact = quant_linear(x.clone(), &w, Compute::default().with_int8_inputs(false)).into_data();
        exact.assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-4));
        let fast = quant_linear(x, &w, Compute::default()).into_data();
        let (fast, want) = (fast.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = fast.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // 8-bit inputs: off by a few hundredths of the largest output, never exactly equal.
        assert!(worst > 0.0 && worst < 0.03 * scale, "integer products off by {worst} (scale {scale})");
    }

    #[test]
    fn tiles_decode_the_blocks_they_cover_and_rows_reorder() {
        let w = weight(5, 32, 3);
        let full = w.dequantize();
        let mut tile = vec![0f32; 3 * 16];
        w.decode_tile(1..4, 8..24, &mut tile);
        for r in 0..3 {
            assert_eq!(&tile[r * 16..(r + 1) * 16], &full[(r + 1) * 32 + 8..(r + 1) * 32 + 24]);
        }
        let swapped = w.with_rows(&[4, 3, 2, 1, 0]).dequantize();
        assert_eq!(&swapped[..32], &full[4 * 32..]);
        let e = QuantWeight::new("q8x8", [2, 12], (8, 12), vec![0; 24], decode_q8x8).unwrap_err();
        assert!(e.to_string().contains("not whole blocks of 8"), "{e}");
        let e = QuantWeight::new("q8x8", [2, 16], (8, 12), vec![0; 47], decode_q8x8).unwrap_err();
        assert!(e.to_string().contains("47 bytes stored, 48 expected"), "{e}");
    }
}
