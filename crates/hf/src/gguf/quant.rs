//! ggml tensor types: block sizes and dequantization to f32, and the quantizers export writes.
//!
//! Block layouts as ggml defines them (`ggml-common.h`); every block starts with its f16 scale(s):
//!
//! | type | values per block | bytes | value |
//! |------|------------------|-------|-------|
//! | Q4_0 | 32  | 18  | `d · (q - 8)`, q a nibble: element `j` low nibble of byte `j`, element `j + 16` high |
//! | Q4_1 | 32  | 20  | `d · q + m` |
//! | Q8_0 | 32  | 34  | `d · q`, q an i8 |
//! | Q4_K | 256 | 144 | 8 sub-blocks of 32 with 6-bit scales and mins: `d · sc · q - dmin · m` |
//! | Q6_K | 256 | 210 | 16 sub-blocks of 16 with i8 scales: `d · sc · (q - 32)`, q 6 bits (4 low + 2 high) |

use half::{bf16, f16};

/// The ggml tensor types ember reads (and, for some, writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
    Bf16,
}

impl GgmlType {
    /// The type of a ggml type id; `Err` carries the id and its name for the error message.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            other => {
                let name = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    13 => "Q5_K",
                    15 => "Q8_K",
                    16..=23 => "an IQ quantization",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    _ => "unknown",
                };
                return Err(format!("ggml type {other} ({name})"));
            }
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q6K => 14,
            Self::Bf16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q6K => "Q6_K",
            Self::Bf16 => "BF16",
        }
    }

    /// (values per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (256, 144),
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
        GgmlType::Q8_0 => blocks.for_each(|(y, b)| dequantize_q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(y, b)| dequantize_q4k(b, y)),
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

/// One Q8_0 block: 34 bytes -> 32 values.
fn dequantize_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = d * (b[2 + j] as i8) as f32;
    }
}

/// One Q4_K super-block: 144 bytes -> 256 values.
fn dequantize_q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    // Four groups of 64 values: 32 low nibbles then 32 high nibbles of 32 bytes, each
    // half with its own 6-bit scale and min.
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * g..32 * g + 32];
        let y = &mut y[64 * g..64 * g + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - min1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
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

/// Scale and min `j` (of 8) of a Q4_K super-block, 6 bits each, packed into 12 bytes: the first
/// four in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins), the last four in the nibbles of
/// bytes 8..12 with their top 2 bits in the spare bits of bytes 0..8.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Quantizes `values` (a whole number of blocks) into `ty`, for export: F32, F16, BF16 and Q8_0
/// (ggml's reference quantizer: `d = max|x| / 127`, `q = round(x / d)`).
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(ty.bytes_for(values.len() as u64).unwrap_or(0) as usize);
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::Bf16 => values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            if !values.len().is_multiple_of(32) {
                return Err(format!("{} values are not a whole number of Q8_0 blocks of 32", values.len()));
            }
            for x in values.chunks_exact(32) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
            }
        }
        other => return Err(format!("ember does not write {}", other.name())),
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
    fn sizes_and_unknown_types() {
        assert_eq!(GgmlType::Q6K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::Q4_1.bytes_for(33), None);
        assert_eq!(GgmlType::from_id(13).unwrap_err(), "ggml type 13 (Q5_K)");
        assert_eq!(GgmlType::from_id(99).unwrap_err(), "ggml type 99 (unknown)");
    }
}
