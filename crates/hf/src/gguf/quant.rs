//! ggml tensor types: block sizes and dequantization to f32, and the quantizers export writes.
//!
//! Block layouts as ggml defines them (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`). Every
//! block holds f16 scale(s): first, except in Q2_K, Q3_K and Q6_K, which put them last.
//!
//! | type | values per block | bytes | value |
//! |------|------------------|-------|-------|
//! | Q4_0 | 32  | 18  | `d · (q - 8)`, q a nibble: element `j` low nibble of byte `j`, element `j + 16` high |
//! | Q4_1 | 32  | 20  | `d · q + m` |
//! | Q5_0 | 32  | 22  | `d · (q - 16)`, q 5 bits: nibbles as in Q4_0, element `j`'s fifth bit bit `j` of a u32 |
//! | Q5_1 | 32  | 24  | `d · q + m`, q 5 bits as in Q5_0 |
//! | Q8_0 | 32  | 34  | `d · q`, q an i8 |
//! | IQ4_NL | 32 | 18 | `d · K[q]`, q a nibble as in Q4_0, K ggml's 16-entry non-linear table |
//! | Q2_K | 256 | 84  | 16 sub-blocks of 16 with 4-bit scales and mins: `d · sc · q - dmin · m`, q 2 bits |
//! | Q3_K | 256 | 110 | 16 sub-blocks of 16, 6-bit scales: `d · (sc - 32) · (q - 4·(1 - h))`, q 2 bits, h 1 bit |
//! | Q4_K | 256 | 144 | 8 sub-blocks of 32 with 6-bit scales and mins: `d · sc · q - dmin · m` |
//! | Q5_K | 256 | 176 | as Q4_K, q 5 bits: a nibble and a high bit |
//! | Q6_K | 256 | 210 | 16 sub-blocks of 16 with i8 scales: `d · sc · (q - 32)`, q 6 bits (4 low + 2 high) |
//!
//! In the K-quants (256 values) the low bits of value `v` come from byte `32·(v / 128) + v % 32` of
//! the 2-bit quants (Q2_K, Q3_K; shift `2·((v % 128) / 32)`) or `32·(v / 64) + v % 32` of the
//! nibbles (Q4_K, Q5_K; high nibble when `(v / 32)` is odd), and a high bit (Q3_K, Q5_K) is bit
//! `v / 32` of byte `v % 32` of the high-bit array.

use ember_kernels::qdot::{scale_min_k4, DotFormat};
use half::{bf16, f16};

/// The ggml tensor types ember reads (and, for some, writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
    Bf16,
}

impl GgmlType {
    /// Every type ember reads, in ggml id order.
    pub const ALL: [GgmlType; 14] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Iq4Nl,
        Self::Bf16,
    ];

    /// The type of a ggml type id; `Err` carries the id and its name for the error message.
    pub fn from_id(id: u32) -> Result<Self, UnknownType> {
        if let Some(ty) = Self::ALL.into_iter().find(|ty| ty.id() == id) {
            return Ok(ty);
        }
        // Names as ggml.h's `enum ggml_type` spells them; ids it no longer uses are `unknown`.
        let name = match id {
            9 => "Q8_1",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            40 => "NVFP4",
            41 => "Q1_0",
            _ => "unknown",
        };
        Err(UnknownType { id, name })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Iq4Nl => 20,
            Self::Bf16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Iq4Nl => "IQ4_NL",
            Self::Bf16 => "BF16",
        }
    }

    /// The names of [`GgmlType::ALL`], comma-separated, for error messages.
    pub fn all_names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// (values per block, bytes per block), the sizes of ggml's `block_*` structs.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 | Self::Iq4Nl => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks (or overflows).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (per, bytes) = self.block();
        n.is_multiple_of(per as u64).then(|| (n / per as u64).checked_mul(bytes as u64)).flatten()
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The integer dot products a weight of this type runs its few-row products on, where the kernels
/// have them (the others decode tiles for an f32 product).
pub fn dot_format(ty: GgmlType) -> Option<DotFormat> {
    Some(match ty {
        GgmlType::Q8_0 => DotFormat::Q8_0,
        GgmlType::Q4_0 => DotFormat::Q4_0,
        GgmlType::Q4_1 => DotFormat::Q4_1,
        GgmlType::Q5_0 => DotFormat::Q5_0,
        GgmlType::Q5_1 => DotFormat::Q5_1,
        GgmlType::Q4K => DotFormat::Q4K,
        GgmlType::Q5K => DotFormat::Q5K,
        GgmlType::Q6K => DotFormat::Q6K,
        _ => return None,
    })
}

/// The block decoder of a block-quantized type, for weights kept in it
/// ([`ember_kernels::QuantWeight`]); `None` for the unquantized types (F32, F16, BF16).
pub fn block_decoder(ty: GgmlType) -> Option<ember_kernels::quant::DecodeBlocks> {
    Some(match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => return None,
        GgmlType::Q4_0 => |b, y| dequantize(GgmlType::Q4_0, b, y),
        GgmlType::Q4_1 => |b, y| dequantize(GgmlType::Q4_1, b, y),
        GgmlType::Q5_0 => |b, y| dequantize(GgmlType::Q5_0, b, y),
        GgmlType::Q5_1 => |b, y| dequantize(GgmlType::Q5_1, b, y),
        GgmlType::Q8_0 => |b, y| dequantize(GgmlType::Q8_0, b, y),
        GgmlType::Iq4Nl => |b, y| dequantize(GgmlType::Iq4Nl, b, y),
        GgmlType::Q2K => |b, y| dequantize(GgmlType::Q2K, b, y),
        GgmlType::Q3K => |b, y| dequantize(GgmlType::Q3K, b, y),
        GgmlType::Q4K => |b, y| dequantize(GgmlType::Q4K, b, y),
        GgmlType::Q5K => |b, y| dequantize(GgmlType::Q5K, b, y),
        GgmlType::Q6K => |b, y| dequantize(GgmlType::Q6K, b, y),
    })
}

/// Dequantizes `data` (exactly [`GgmlType::bytes_for`] of `out.len()` values) into `out`.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    let (per, size) = ty.block();
    debug_assert_eq!(data.len(), out.len() / per * size);
    let blocks = out.chunks_exact_mut(per).zip(data.chunks_exact(size));
    match ty {
        GgmlType::F32 => blocks.for_each(|(y, b)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(y, b)| y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Bf16 => blocks.for_each(|(y, b)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q4_0 => blocks.for_each(|(y, b)| dequantize_q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(y, b)| dequantize_q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(y, b)| dequantize_q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(y, b)| dequantize_q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(y, b)| dequantize_q8_0(b, y)),
        GgmlType::Iq4Nl => blocks.for_each(|(y, b)| dequantize_iq4_nl(b, y)),
        GgmlType::Q2K => blocks.for_each(|(y, b)| dequantize_q2k(b, y)),
        GgmlType::Q3K => blocks.for_each(|(y, b)| dequantize_q3k(b, y)),
        GgmlType::Q4K => blocks.for_each(|(y, b)| dequantize_q4k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(y, b)| dequantize_q5k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(y, b)| dequantize_q6k(b, y)),
    }
}

/// One Q4_0 block: 18 bytes -> 32 values.
fn dequantize_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        y[j] = d * ((b[2 + j] & 0xF) as i32 - 8) as f32;
        y[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
    }
}

/// One Q4_1 block: 20 bytes -> 32 values.
fn dequantize_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        y[j] = d * (b[4 + j] & 0xF) as f32 + m;
        y[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
    }
}

/// One Q5_0 block: 22 bytes -> 32 values.
fn dequantize_q5_0(b: &[u8], y: &mut [f32]) {
    let (d, qh, qs) = (f16_at(b, 0), u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]);
    for (j, y) in y.iter_mut().enumerate() {
        *y = d * (five_bits(qs, qh, j) as i32 - 16) as f32;
    }
}

/// One Q5_1 block: 24 bytes -> 32 values.
fn dequantize_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (qh, qs) = (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]);
    for (j, y) in y.iter_mut().enumerate() {
        *y = d * five_bits(qs, qh, j) as f32 + m;
    }
}

/// Value `j` (of 32) of a Q5_0 or Q5_1 block: its nibble as in Q4_0, its fifth bit bit `j` of `qh`.
fn five_bits(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
    nibble | (((qh >> j) & 1) as u8) << 4
}

/// One Q8_0 block: 34 bytes -> 32 values.
fn dequantize_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = d * (b[2 + j] as i8) as f32;
    }
}

/// IQ4_NL's code book: `kvalues_iq4nl` in ggml-common.h, a non-uniform grid denser near zero.
const IQ4_NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// One IQ4_NL block: 18 bytes -> 32 values, nibbles laid out as Q4_0's.
fn dequantize_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        y[j] = d * IQ4_NL_VALUES[(b[2 + j] & 0xF) as usize] as f32;
        y[j + 16] = d * IQ4_NL_VALUES[(b[2 + j] >> 4) as usize] as f32;
    }
}

/// The 2 low bits of value `v` of a Q2_K or Q3_K super-block from its 64 bytes of quants: each
/// half of 128 values reads 32 bytes four times, two bits further up each time.
fn two_bits(qs: &[u8], v: usize) -> u8 {
    (qs[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3
}

/// One Q2_K super-block: 84 bytes -> 256 values.
fn dequantize_q2k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (v, y) in y.iter_mut().enumerate() {
        // Sub-block v / 16: its scale in the low nibble, its min in the high.
        let sc = scales[v / 16];
        let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
        *y = dl * two_bits(qs, v) as f32 - ml;
    }
}

/// One Q3_K super-block: 110 bytes -> 256 values.
fn dequantize_q3k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (v, y) in y.iter_mut().enumerate() {
        // A clear high bit subtracts 4: q runs over -4..=3.
        let high = (hmask[v % 32] >> (v / 32)) & 1;
        let q = two_bits(qs, v) as i32 - if high == 1 { 0 } else { 4 };
        *y = d * scale_k3(v / 16, scales) as f32 * q as f32;
    }
}

/// Scale `s` (of 16) of a Q3_K super-block, 6 bits less 32, packed into 12 bytes: the low 4 bits in
/// the nibbles of bytes 0..8 (scales 0..8 low nibbles, 8..16 high), the top 2 bits in bytes 8..12,
/// scale `s` at bit `2·(s / 4)` of byte `8 + s % 4`.
fn scale_k3(s: usize, q: &[u8]) -> i32 {
    let low = if s < 8 { q[s] & 0xF } else { q[s - 8] >> 4 };
    let high = (q[8 + s % 4] >> (2 * (s / 4))) & 3;
    (low | high << 4) as i32 - 32
}

/// The (scale, min) of the two halves of group `g` (of 4, 64 values each) of a Q4_K or Q5_K
/// super-block whose super-scales are `d` and `dmin`.
#[inline]
fn group_scales_k4(g: usize, d: f32, dmin: f32, scales: &[u8]) -> [(f32, f32); 2] {
    [2 * g, 2 * g + 1].map(|s| {
        let (sc, m) = scale_min_k4(s, scales);
        (d * sc as f32, dmin * m as f32)
    })
}

/// One Q4_K super-block: 144 bytes -> 256 values.
fn dequantize_q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    // Four groups of 64 values: 32 low nibbles then 32 high nibbles of 32 bytes, each
    // half with its own 6-bit scale and min.
    for g in 0..4 {
        let [(d1, min1), (d2, min2)] = group_scales_k4(g, d, dmin, scales);
        let q = &qs[32 * g..32 * g + 32];
        let y = &mut y[64 * g..64 * g + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - min1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// One Q5_K super-block: 176 bytes -> 256 values; Q4_K's layout with a fifth bit per value.
fn dequantize_q5k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for g in 0..4 {
        let [(d1, min1), (d2, min2)] = group_scales_k4(g, d, dmin, scales);
        let q = &qs[32 * g..32 * g + 32];
        let y = &mut y[64 * g..64 * g + 64];
        for l in 0..32 {
            // Values 64·g + l and 64·g + 32 + l: high bits 2·g and 2·g + 1 of qh[l].
            let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
            y[l] = d1 * ((q[l] & 0xF) | h1) as f32 - min1;
            y[l + 32] = d2 * ((q[l] >> 4) | h2) as f32 - min2;
        }
    }
}

/// One Q6_K super-block: 210 bytes -> 256 values.
fn dequantize_q6k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    // Two halves of 128 values: 64 bytes of low nibbles, 32 of high bit pairs, 8 scales.
    for h in 0..2 {
        let (ql, qh, sc, y) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..], &mut y[128 * h..128 * h + 128]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// A ggml type id ember does not read: the id and ggml.h's name for it (`unknown` for an id it
/// does not use).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ggml type {id} ({name})")]
pub struct UnknownType {
    pub id: u32,
    pub name: &'static str,
}

/// Why [`quantize`] cannot store values in a type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantizeError {
    #[error("{values} values are not a whole number of Q8_0 blocks of 32")]
    PartialBlock { values: usize },
    #[error("ember does not write {0}")]
    NotWritten(&'static str),
}

/// Quantizes `values` (a whole number of blocks) into `ty`, for export: F32, F16, BF16 and Q8_0
/// (ggml's reference quantizer: `d = max|x| / 127`, `q = round(x / d)`).
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    let mut out = Vec::with_capacity(ty.bytes_for(values.len() as u64).unwrap_or(0) as usize);
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::Bf16 => values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            if !values.len().is_multiple_of(32) {
                return Err(QuantizeError::PartialBlock { values: values.len() });
            }
            for x in values.chunks_exact(32) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
            }
        }
        other => return Err(QuantizeError::NotWritten(other.name())),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference Q4_K dequantization written from the definition, value by value: sub-block `s`
    /// (32 values) of a super-block uses scale/min `s`; value `i` of sub-block `s` is nibble
    /// `(s % 2)` of byte `32·(s / 2) + i`.
    fn q4k_slow(b: &[u8]) -> Vec<f32> {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        (0..256)
            .map(|v| {
                let (s, i) = (v / 32, v % 32);
                let (sc, m) = scale_min_k4(s, &b[4..16]);
                let byte = b[16 + 32 * (s / 2) + i];
                let q = if s % 2 == 0 { byte & 0xF } else { byte >> 4 };
                d * sc as f32 * q as f32 - dmin * m as f32
            })
            .collect()
    }

    #[test]
    fn q4k_matches_its_definition() {
        let mut b: Vec<u8> = (0..144u32).map(|i| (i * 37 + 11) as u8).collect();
        b[0..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.003).to_le_bytes());
        let mut out = vec![0f32; 256];
        dequantize(GgmlType::Q4K, &b, &mut out);
        assert_eq!(out, q4k_slow(&b));
    }

    /// The kernels' integer products read each type's blocks as this file's decoders do: for random
    /// blocks, `qdot::product` equals the f32 product of the dequantized weight with the
    /// activations as quantized (exact integers on one side, f32 sums on the other).
    #[test]
    fn integer_products_read_the_blocks_as_the_decoders_do() {
        use ember_kernels::qdot::{product, Q8Rows};
        for ty in GgmlType::ALL {
            let Some(format) = dot_format(ty) else { continue };
            let (per, size) = ty.block();
            let (m, k, n) = (5, 512, 2);
            let mut bytes: Vec<u8> = (0..m * k / per * size).map(|i| ((i * 7919 + 13) % 251) as u8).collect();
            let scale_at: &[usize] = match ty {
                GgmlType::Q6K => &[208],
                GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
                _ => &[0, 2],
            };
            for (b, blk) in bytes.chunks_exact_mut(size).enumerate() {
                for &at in scale_at {
                    let v = 0.01 + 0.002 * (b % 7) as f32 - 0.015 * (at % 4 == 2 && b % 2 == 0) as u8 as f32;
                    blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            let x: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 97) as f32 / 20.0 - 2.4).collect();
            let got = product(ember_kernels::Cpu::detect(), format, &bytes, (m, k), &x, n);
            let mut w = vec![0f32; m * k];
            dequantize(ty, &bytes, &mut w);
            let xq = Q8Rows::quantize(&x, n, k, per).dequantize();
            for r in 0..n {
                for o in 0..m {
                    let want: f64 = (0..k).map(|i| w[o * k + i] as f64 * xq[r * k + i] as f64).sum();
                    let g = got[r * m + o] as f64;
                    assert!((g - want).abs() <= 1e-4 * want.abs().max(1.0), "{}: ({r}, {o}) {g} vs {want}", ty.name());
                }
            }
        }
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 7919) % 201) as f32 / 50.0 - 2.0).collect();
        let bytes = quantize(GgmlType::Q8_0, &values).unwrap();
        assert_eq!(bytes.len(), 68);
        let mut back = vec![0f32; 64];
        dequantize(GgmlType::Q8_0, &bytes, &mut back);
        for (block, (x, y)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in x.iter().zip(y) {
                // Half a step, plus the rounding of the scale to f16.
                assert!((a - b).abs() <= (0.5 + 127.0 / 2048.0) * step, "block {block}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn ids_round_trip_and_any_bytes_dequantize() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Ok(ty));
            let (per, size) = ty.block();
            // Every bit pattern is a valid block (0xFF scales are f16 NaNs): no panic, no length change.
            for fill in [0x00u8, 0xFF, 0x5A] {
                let mut out = vec![0f32; 2 * per];
                dequantize(ty, &vec![fill; 2 * size], &mut out);
                assert_eq!(out.len(), 2 * per, "{}", ty.name());
            }
        }
    }

    #[test]
    fn sizes_and_unknown_types() {
        assert_eq!(GgmlType::Q6K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::Q4_1.bytes_for(33), None);
        assert_eq!(GgmlType::Q5K.bytes_for(256), Some(176));
        assert_eq!(GgmlType::from_id(23).unwrap_err().to_string(), "ggml type 23 (IQ4_XS)");
        assert_eq!(GgmlType::from_id(99).unwrap_err().to_string(), "ggml type 99 (unknown)");
    }
}
