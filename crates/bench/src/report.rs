//! How every benchmark prints its results: one row per measurement, shown as an
//! aligned table for people or, with `--json`, as one JSON object per line.

use serde::Serialize;
use serde_json::{Map, Value};
use std::io::Write;

/// Collects rows (any `Serialize` struct with flat fields) and prints them.
pub struct Report {
    json: bool,
    rows: Vec<Map<String, Value>>,
}

impl Report {
    pub fn new(json: bool) -> Self {
        Report { json, rows: Vec::new() }
    }

    /// Adds a row; in JSON mode it is printed at once, so a long run shows progress.
    pub fn row(&mut self, row: &impl Serialize) {
        let Value::Object(map) = serde_json::to_value(row).expect("row serializes") else {
            panic!("a report row must serialize to a JSON object");
        };
        if self.json {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", Value::Object(map.clone()));
            let _ = out.flush();
        }
        self.rows.push(map);
    }

    pub fn rows(&self) -> &[Map<String, Value>] {
        &self.rows
    }

    /// Prints the table (nothing in JSON mode, where rows went out as they came).
    pub fn finish(&self) {
        if self.json || self.rows.is_empty() {
            return;
        }
        print!("{}", self.table());
    }

    /// The rows as an aligned text table, columns in the order of the first row.
    pub fn table(&self) -> String {
        let columns: Vec<&String> = self.rows[0].keys().collect();
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| columns.iter().map(|c| r.get(*c).map(cell).unwrap_or_default()).collect())
            .collect();
        let widths: Vec<usize> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| cells.iter().map(|r| r[i].len()).chain([c.len()]).max().unwrap_or(0))
            .collect();
        let mut s = String::new();
        let line = |s: &mut String, items: &mut dyn Iterator<Item = String>| {
            let parts: Vec<String> =
                items.zip(&widths).map(|(v, w)| format!("{v:>w$}", w = *w)).collect();
            s.push_str(parts.join("  ").trim_end());
            s.push('\n');
        };
        line(&mut s, &mut columns.iter().map(|c| c.to_string()));
        for r in &cells {
            line(&mut s, &mut r.iter().cloned());
        }
        s
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => {
                if f.abs() >= 100.0 {
                    format!("{f:.0}")
                } else if f.abs() >= 1.0 {
                    format!("{f:.2}")
                } else {
                    format!("{f:.4}")
                }
            }
            _ => n.to_string(),
        },
        other => other.to_string(),
    }
}
