//! A run's metrics as columns, as they are read ([`Table`]) and as the JSON the dashboard serves
//! ([`Columns`], and [`MetricsJson`] for the same text a piece at a time).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

/// One run's metrics, column by column; `None` where a record lacks the key.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Columns {
    pub rows: usize,
    pub columns: BTreeMap<String, Vec<Option<f64>>>,
}

/// A metric value as read: numbers and booleans count, anything else is skipped.
pub(crate) struct Scalar(pub(crate) Option<f64>);

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as f64)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as f64)))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as u8 as f64)))
            }
            fn visit_str<E>(self, _: &str) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// One metrics line: key and value pairs, keys borrowed from the line where they can be.
pub(crate) type Row<'a> = Vec<(std::borrow::Cow<'a, str>, Scalar)>;

pub(crate) fn parse_row(line: &[u8]) -> Option<Row<'_>> {
    struct RowVisitor;
    impl<'de> serde::de::Visitor<'de> for RowVisitor {
        type Value = Row<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Row<'de>, A::Error> {
            let mut out = Vec::with_capacity(16);
            while let Some(k) = a.next_key::<std::borrow::Cow<'de, str>>()? {
                out.push((k, a.next_value::<Scalar>()?));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(line);
    let row = serde::Deserializer::deserialize_map(&mut de, RowVisitor).ok()?;
    de.end().ok()?;
    Some(row)
}

impl Columns {
    /// Rows from `from` on.
    pub fn since(&self, from: usize) -> Columns {
        let from = from.min(self.rows);
        Columns {
            rows: self.rows - from,
            columns: self.columns.iter().map(|(k, v)| (k.clone(), v[from..].to_vec())).collect(),
        }
    }
}

/// Rows per shared block of a [`Column`].
const BLOCK: usize = 1024;

/// One metric of a run as read so far: full blocks of [`BLOCK`] rows that are never changed again
/// (shared, not copied, by a [`MetricsJson`] still writing them out) and the rows since.
#[derive(Debug, Default, Clone)]
pub(crate) struct Column {
    blocks: Vec<Arc<[Option<f64>]>>,
    tail: Vec<Option<f64>>,
}

impl Column {
    fn len(&self) -> usize {
        self.blocks.len() * BLOCK + self.tail.len()
    }

    fn push(&mut self, v: Option<f64>) {
        self.tail.push(v);
        if self.tail.len() == BLOCK {
            self.blocks.push(Arc::from(std::mem::take(&mut self.tail)));
        }
    }

    fn get(&self, i: usize) -> Option<f64> {
        match self.blocks.get(i / BLOCK) {
            Some(b) => b[i % BLOCK],
            None => self.tail.get(i - self.blocks.len() * BLOCK).copied().flatten(),
        }
    }

    pub(crate) fn last(&self) -> Option<f64> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// The rows before `len` (the column as it was then): shares the full blocks.
    fn upto(&self, len: usize) -> Column {
        let blocks = (len / BLOCK).min(self.blocks.len());
        let tail = (blocks * BLOCK..len.min(self.len())).map(|i| self.get(i)).collect();
        Column { blocks: self.blocks[..blocks].to_vec(), tail }
    }
}

/// A run's metrics as read so far, column by column.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub(crate) rows: usize,
    pub(crate) columns: BTreeMap<String, Column>,
}

impl Table {
    pub(crate) fn push(&mut self, row: Row<'_>) {
        for (k, Scalar(v)) in row {
            let Some(v) = v else { continue };
            match self.columns.get_mut(k.as_ref()) {
                // A key repeated within one record keeps its first value.
                Some(col) if col.len() > self.rows => {}
                Some(col) => col.push(Some(v)),
                None => {
                    let mut col = Column::default();
                    for _ in 0..self.rows {
                        col.push(None);
                    }
                    col.push(Some(v));
                    self.columns.insert(k.into_owned(), col);
                }
            }
        }
        self.rows += 1;
        for col in self.columns.values_mut() {
            if col.len() < self.rows {
                col.push(None);
            }
        }
    }

    pub(crate) fn since(&self, from: usize) -> Columns {
        let from = from.min(self.rows);
        Columns {
            rows: self.rows - from,
            columns: self
                .columns
                .iter()
                .map(|(k, c)| (k.clone(), (from..self.rows).map(|i| c.get(i)).collect()))
                .collect(),
        }
    }

    pub(crate) fn json(&self, from: usize) -> MetricsJson {
        MetricsJson {
            rows: self.rows,
            from: from.min(self.rows),
            columns: self.columns.iter().map(|(k, c)| (k.clone(), c.upto(self.rows))).collect(),
            started: false,
            column: 0,
            row: None,
        }
    }
}

/// A run's metrics from a row on, as the JSON of [`Columns`], written a piece at a time: the
/// answer to a client that reads slowly (or never) holds one piece and the shared column blocks,
/// not the whole text.
pub struct MetricsJson {
    rows: usize,
    from: usize,
    columns: Vec<(String, Column)>,
    started: bool,
    /// The column being written; past the last one, the closing braces.
    column: usize,
    /// The next row of that column (`None`: its key comes first).
    row: Option<usize>,
}

impl MetricsJson {
    /// Appends about `budget` bytes (one value more at most) to `out`; `false` once the text is
    /// complete and nothing was left to add.
    pub fn write_to(&mut self, out: &mut Vec<u8>, budget: usize) -> bool {
        if self.column > self.columns.len() {
            return false;
        }
        let start = out.len();
        if !self.started {
            self.started = true;
            out.extend_from_slice(format!("{{\"rows\":{},\"columns\":{{", self.rows - self.from).as_bytes());
        }
        while out.len() - start < budget {
            let Some((key, col)) = self.columns.get(self.column) else {
                out.extend_from_slice(b"}}");
                self.column += 1;
                return true;
            };
            let row = match self.row {
                Some(r) => r,
                None => {
                    if self.column > 0 {
                        out.push(b',');
                    }
                    // A key is a string: serialising it cannot fail.
                    let _ = serde_json::to_writer(&mut *out, key);
                    out.extend_from_slice(b":[");
                    self.from
                }
            };
            if row >= self.rows {
                out.push(b']');
                self.column += 1;
                self.row = None;
                continue;
            }
            if row > self.from {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut *out, &col.get(row));
            self.row = Some(row + 1);
        }
        true
    }
}

impl Iterator for MetricsJson {
    type Item = Vec<u8>;

    /// The next piece of about 64 KiB.
    fn next(&mut self) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(64 << 10);
        self.write_to(&mut out, 64 << 10).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_json_in_pieces_is_the_json_of_the_columns() {
        // Keys that come and go, a string and an array (skipped), a repeated key, a boolean, more
        // rows than a block, and a key that needs escaping.
        let mut text = String::new();
        for step in 1..=2500 {
            text.push_str(&format!("{{\"step\":{step},\"train_loss\":{}", 4.0 - step as f64 * 1e-3));
            if step % 7 == 0 {
                text.push_str(&format!(",\"val_loss\":{},\"note\":\"x\",\"v\":[1]", 1.0 / step as f64));
            }
            if step == 1300 {
                text.push_str(",\"step\":-1,\"clipped\":true,\"q\\\"k\":1e300");
            }
            text.push_str("}\n");
        }
        let mut table = Table::default();
        for line in text.lines() {
            table.push(parse_row(line.as_bytes()).unwrap());
        }
        for since in [0, 1, 1023, 1024, 2000, 2500, 9999] {
            let expected = serde_json::to_vec(&table.since(since)).unwrap();
            for piece in [1, 7, 64 << 10] {
                let mut json = table.json(since);
                let mut out = Vec::new();
                while json.write_to(&mut out, piece) {}
                assert_eq!(String::from_utf8(out).unwrap(), String::from_utf8(expected.clone()).unwrap());
            }
            let whole: Vec<u8> = table.json(since).flatten().collect();
            assert_eq!(whole, expected);
        }
        let m = table.since(1299);
        assert_eq!(m.columns["step"][0], Some(1300.0), "a repeated key keeps its first value");
        assert_eq!(m.columns["clipped"][0], Some(1.0));
        assert_eq!(m.columns["clipped"][1], None);
        assert_eq!(m.columns["val_loss"].len(), m.rows);
    }
}
