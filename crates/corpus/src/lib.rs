//! uzswap-corpus: realistic test data, built at run time from real files on this machine.
//!
//! Swapped-out anonymous memory is private and no public dump of it exists, so the
//! benchmarks and tests stand in for it with what a machine really holds: shared libraries (code and tables), C headers, source
//! and text, plus what anonymous memory has that files do not — runs of zero pages
//! and already-compressed (incompressible) buffers, taken from real `.gz` files.
//! The mix is drawn with a seed, so a given seed on a given machine is repeatable.
//!
//! What it is not: a synthetic pattern generator. If the machine has none of the
//! searched files, [`realistic`] falls back to this crate's own source text and says
//! so once on stderr rather than faking data.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const PAGE: usize = 4096;
/// Longest stretch taken from one file: a few pages to a few hundred KiB, like the
/// runs of same-kind pages a heap or a mapped library leaves in memory.
const MAX_PIECE: usize = 256 * 1024;

/// The kinds of content the mix is drawn from, with their weights in percent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Binary,
    Text,
    Compressed,
    Zero,
}

const MIX: [(Kind, u32); 4] = [(Kind::Binary, 40), (Kind::Text, 43), (Kind::Compressed, 6), (Kind::Zero, 11)];

struct Files {
    binary: Vec<PathBuf>,
    text: Vec<PathBuf>,
    compressed: Vec<PathBuf>,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let mut f = Files { binary: Vec::new(), text: Vec::new(), compressed: Vec::new() };
        collect(Path::new("/usr/lib/x86_64-linux-gnu"), 1, &mut |p| {
            if p.to_string_lossy().contains(".so") {
                f.binary.push(p.to_path_buf());
            }
        });
        collect(Path::new("/usr/lib/aarch64-linux-gnu"), 1, &mut |p| {
            if p.to_string_lossy().contains(".so") {
                f.binary.push(p.to_path_buf());
            }
        });
        for dir in ["/usr/include", "/usr/lib/python3.11", "/usr/share/doc", "/usr/share/perl"] {
            collect(Path::new(dir), 4, &mut |p| match ext(p) {
                "h" | "hpp" | "c" | "py" | "pm" | "txt" | "md" | "html" | "rst" => f.text.push(p.to_path_buf()),
                "gz" | "xz" | "bz2" | "zst" => f.compressed.push(p.to_path_buf()),
                _ => {}
            });
        }
        for v in [&mut f.binary, &mut f.text, &mut f.compressed] {
            v.sort();
        }
        f
    })
}

fn ext(p: &Path) -> &str {
    p.extension().and_then(|e| e.to_str()).unwrap_or("")
}

fn collect(dir: &Path, depth: u32, found: &mut dyn FnMut(&Path)) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        let path = e.path();
        if ft.is_file() {
            found(&path);
        } else if ft.is_dir() && depth > 0 {
            collect(&path, depth - 1, found);
        }
    }
}

/// `len` bytes of realistic memory content for `seed`, built from real files on the
/// machine. Pieces are page-aligned runs, as a process's memory would hold them.
pub fn realistic(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let f = files();
    let mut out = Vec::with_capacity(len);
    let total: u32 = MIX.iter().map(|m| m.1).sum();
    while out.len() < len {
        let mut pick = rng.gen_range(0..total);
        let kind = MIX.iter().find(|m| if pick < m.1 { true } else { pick -= m.1; false }).unwrap().0;
        let want = (rng.gen_range(1..=MAX_PIECE / PAGE) * PAGE).min(len - out.len());
        let pool = match kind {
            Kind::Binary => &f.binary,
            Kind::Text => &f.text,
            Kind::Compressed => &f.compressed,
            Kind::Zero => {
                out.resize(out.len() + want, 0);
                continue;
            }
        };
        if !append_from(pool, want, &mut rng, &mut out) {
            append_fallback(want, &mut out);
        }
    }
    out.truncate(len);
    out
}

/// Appends up to `want` bytes from a file of `pool` chosen by `rng`, and pads the
/// piece to a page boundary with the file's own bytes cycled, as a buffer reused
/// for the same kind of data would be. Returns false if no file could be read.
fn append_from(pool: &[PathBuf], want: usize, rng: &mut SmallRng, out: &mut Vec<u8>) -> bool {
    for _ in 0..8 {
        let Some(path) = pool.get(rng.gen_range(0..pool.len().max(1))) else { return false };
        let Ok(data) = fs::read(path) else { continue };
        if data.len() < 64 {
            continue;
        }
        let start = if data.len() > want { rng.gen_range(0..=(data.len() - want) / PAGE) * PAGE } else { 0 };
        let piece = &data[start..(start + want).min(data.len())];
        let begin = out.len();
        while out.len() - begin < want {
            let n = piece.len().min(want - (out.len() - begin));
            out.extend_from_slice(&piece[..n]);
        }
        return true;
    }
    false
}

fn append_fallback(want: usize, out: &mut Vec<u8>) {
    static WARNED: OnceLock<()> = OnceLock::new();
    WARNED.get_or_init(|| eprintln!("uzswap-corpus: no system files found, using uzswap's own source text"));
    let text = include_str!("lib.rs").as_bytes();
    for i in 0..want {
        out.push(text[i % text.len()]);
    }
}

/// What the realistic mix is made of on this machine: (binary, text, compressed) file counts.
pub fn sources() -> (usize, usize, usize) {
    let f = files();
    (f.binary.len(), f.text.len(), f.compressed.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_sized() {
        let a = realistic(3 * 1024 * 1024 + 100, 7);
        let b = realistic(3 * 1024 * 1024 + 100, 7);
        assert_eq!(a.len(), 3 * 1024 * 1024 + 100);
        assert_eq!(a, b);
        assert_ne!(a, realistic(a.len(), 8));
    }

    #[test]
    fn has_zero_pages_and_real_content() {
        let d = realistic(16 * 1024 * 1024, 1);
        let pages = d.chunks(PAGE);
        let n = pages.len();
        let zero = d.chunks(PAGE).filter(|p| p.iter().all(|&b| b == 0)).count();
        assert!(zero > n / 50, "{zero} zero pages of {n}");
        assert!(zero < n / 2, "{zero} zero pages of {n}");
        let (bin, text, _) = sources();
        if bin + text > 0 {
            // Real text: some page holds common C or prose words.
            let s = String::from_utf8_lossy(&d);
            assert!(s.contains("the") || s.contains("include") || s.contains("return"));
        }
    }
}
