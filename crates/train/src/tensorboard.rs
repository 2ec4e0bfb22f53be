//! TensorBoard event files, written without TensorFlow: `events.out.tfevents.*` files of TFRecord
//! records, each an `Event` protocol buffer holding scalar or text summaries.
//!
//! TFRecord framing (tensorflow/core/lib/io/record_writer.cc):
//! ```text
//! u64 length (little-endian) | u32 masked crc32c(length bytes) | data | u32 masked crc32c(data)
//! masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8
//! ```
//! The messages used (tensorflow/core/util/event.proto, framework/summary.proto):
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//!           SessionLog session_log = 6; }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; float simple_value = 2; TensorProto tensor = 8; SummaryMetadata metadata = 9; }
//! SummaryMetadata { PluginData plugin_data = 1; }   PluginData { string plugin_name = 1; }
//! TensorProto { DataType dtype = 1 (DT_STRING = 7); TensorShapeProto tensor_shape = 2; repeated bytes string_val = 8; }
//! SessionLog { SessionStatus status = 1 (START = 1); }
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::TrainError;

/// Masked CRC-32C, as TFRecord stores it.
pub(crate) fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Protocol-buffer encoding of the few field kinds the event messages use.
mod pb {
    pub(crate) fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, ((field as u64) << 3) | wire as u64);
    }
    pub(crate) fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }
    pub(crate) fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, 2);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }
}

/// An open events file.
pub(crate) struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Starts a new events file in `dir`. With `resumed_at`, a `SessionLog.START` at that step tells
    /// TensorBoard to drop what earlier files logged from that step on (the stopped run's tail).
    pub(crate) fn create(dir: &Path, resumed_at: Option<u64>) -> Result<Self, TrainError> {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!("events.out.tfevents.{secs}.{}.{}.ember", host.trim(), std::process::id());
        let path = dir.join(name);
        let file = File::create(&path).map_err(TrainError::io(&path))?;
        let mut w = Self { path, out: BufWriter::new(file) };
        let mut e = Vec::new();
        pb::double(&mut e, 1, wall_time());
        pb::bytes(&mut e, 3, b"brain.Event:2");
        w.record(&e)?;
        if let Some(step) = resumed_at {
            let mut log = Vec::new();
            pb::uint(&mut log, 1, 1); // START
            let mut e = Vec::new();
            pb::double(&mut e, 1, wall_time());
            pb::uint(&mut e, 2, step);
            pb::bytes(&mut e, 6, &log);
            w.record(&e)?;
        }
        Ok(w)
    }

    fn record(&mut self, data: &[u8]) -> Result<(), TrainError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(data.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&masked_crc(&len).to_le_bytes());
        frame.extend_from_slice(data);
        frame.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out.write_all(&frame).map_err(TrainError::io(&self.path))
    }

    fn event(&mut self, step: u64, wall: f64, summary: &[u8]) -> Result<(), TrainError> {
        let mut e = Vec::new();
        pb::double(&mut e, 1, wall);
        pb::uint(&mut e, 2, step);
        pb::bytes(&mut e, 5, summary);
        self.record(&e)
    }

    /// One event with a scalar summary per `(tag, value)`.
    pub(crate) fn scalars(&mut self, step: u64, wall: f64, values: &[(&str, f32)]) -> Result<(), TrainError> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            pb::bytes(&mut value, 1, tag.as_bytes());
            pb::float(&mut value, 2, *v);
            pb::bytes(&mut summary, 1, &value);
        }
        self.event(step, wall, &summary)
    }

    /// A text summary (TensorBoard's Text tab).
    pub(crate) fn text(&mut self, step: u64, wall: f64, tag: &str, text: &str) -> Result<(), TrainError> {
        let mut plugin = Vec::new();
        pb::bytes(&mut plugin, 1, b"text");
        let mut metadata = Vec::new();
        pb::bytes(&mut metadata, 1, &plugin);
        let mut tensor = Vec::new();
        pb::uint(&mut tensor, 1, 7); // DT_STRING
        pb::bytes(&mut tensor, 2, &[]); // scalar shape
        pb::bytes(&mut tensor, 8, text.as_bytes());
        let mut value = Vec::new();
        pb::bytes(&mut value, 1, tag.as_bytes());
        pb::bytes(&mut value, 8, &tensor);
        pb::bytes(&mut value, 9, &metadata);
        let mut summary = Vec::new();
        pb::bytes(&mut summary, 1, &value);
        self.event(step, wall, &summary)
    }

    pub(crate) fn flush(&mut self) -> Result<(), TrainError> {
        self.out.flush().map_err(TrainError::io(&self.path))
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_of_known_input() {
        // crc32c("123456789") = 0xe3069283 (the CRC-32C check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let c: u32 = 0xe306_9283;
        assert_eq!(masked_crc(b"123456789"), c.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn varints() {
        let mut v = Vec::new();
        pb::varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
    }
}
