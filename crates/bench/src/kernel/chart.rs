//! One PNG bar chart per workload: its main figure for every config (groups) and
//! system (bars). Text needs a TrueType font; one is looked for on the machine
//! (DejaVu Sans first), and without one there is no chart, only a message.

use super::{KernelRow, Status};
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const PALETTE: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

/// The figure charted for a workload, and its axis label.
fn figure(workload: &str) -> (&'static str, fn(&KernelRow) -> Option<f64>) {
    match workload {
        "usemem" => ("read-back MB/s (swap-in)", |r| r.in_mbps),
        "usemem-procs" => ("read-back MB/s, summed over the processes", |r| r.in_mbps),
        "usemem-threads" => ("read-back MB/s, all threads", |r| r.in_mbps),
        "fork" => ("forks (and waits) per second", |r| r.ops_per_sec),
        "build" => ("builds per minute", |r| r.main_figure()),
        "seqswap" => ("write MB/s (swap-out)", |r| r.out_mbps),
        "incompressible" => ("read-modify-writes per second", |r| r.ops_per_sec),
        "tree" => ("million operations per second", |r| r.ops_per_sec.map(|o| o / 1e6)),
        _ => ("memory per original byte (lower is better)", |r| r.ratio),
    }
}

/// Registers a font for plotters once; Err says why there is none.
fn font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let path = find_font().ok_or("no TrueType font found under /usr/share/fonts")?;
        let bytes = std::fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
        // plotters keeps the font for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a usable font", path.display()))
    })
    .clone()
}

fn find_font() -> Option<PathBuf> {
    let preferred = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ];
    if let Some(p) = preferred.iter().map(PathBuf::from).find(|p| p.exists()) {
        return Some(p);
    }
    fn walk(dir: &Path, depth: usize) -> Option<PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if p.is_dir() && depth > 0 {
                if let Some(f) = walk(&p, depth - 1) {
                    return Some(f);
                }
            } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
                return Some(p);
            }
        }
        None
    }
    walk(Path::new("/usr/share/fonts"), 4)
}

/// Draws `dir/kernel-<workload>.png` from the workload's rows; returns its path.
pub fn draw(dir: &Path, workload: &str, rows: &[&KernelRow]) -> Result<PathBuf, String> {
    font()?;
    std::fs::create_dir_all(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    let path = dir.join(format!("kernel-{workload}.png"));
    let (label, value) = figure(workload);
    let mut configs: Vec<&str> = Vec::new();
    let mut systems: Vec<&str> = Vec::new();
    for r in rows {
        if !configs.contains(&r.config.as_str()) {
            configs.push(&r.config);
        }
        if !systems.contains(&r.system.as_str()) {
            systems.push(&r.system);
        }
    }
    let bars: Vec<(usize, usize, f64)> = rows
        .iter()
        .filter(|r| r.status == Status::Ok)
        .filter_map(|r| {
            let c = configs.iter().position(|c| *c == r.config)?;
            let s = systems.iter().position(|s| *s == r.system)?;
            Some((c, s, value(r)?))
        })
        .collect();
    // Runs without a figure get a mark where their bar would be.
    let missing: Vec<(usize, usize, &'static str)> = rows
        .iter()
        .filter(|r| r.status != Status::Ok)
        .filter_map(|r| {
            let c = configs.iter().position(|c| *c == r.config)?;
            let s = systems.iter().position(|s| *s == r.system)?;
            let mark = match r.status {
                Status::Failed => "failed",
                _ => "n/a",
            };
            Some((c, s, mark))
        })
        .collect();
    let top = bars.iter().map(|b| b.2).fold(0.0, f64::max);
    if top <= 0.0 {
        return Err("no figures to chart".into());
    }
    plot(&path, workload, label, &Bars { configs: &configs, systems: &systems, bars: &bars, missing: &missing, top })?;
    Ok(path)
}

/// What a chart shows: groups, series, (group, series, value) bars and marks.
struct Bars<'a> {
    configs: &'a [&'a str],
    systems: &'a [&'a str],
    bars: &'a [(usize, usize, f64)],
    missing: &'a [(usize, usize, &'static str)],
    top: f64,
}

fn plot(path: &Path, workload: &str, label: &str, b: &Bars) -> Result<(), String> {
    let Bars { configs, systems, bars, missing, top } = *b;
    let e = |e: DrawingAreaErrorKind<_>| format!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(&path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("uzswap bench kernel: {workload}"), ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..configs.len() as f64, 0f64..top * 1.4)
        .map_err(e)?;
    let names = configs.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(configs.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 && i < names.len() {
                names[i].to_string()
            } else {
                String::new()
            }
        })
        .y_desc(label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    let width = 0.8 / systems.len() as f64;
    for (s, system) in systems.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        let mine: Vec<(usize, f64)> = bars.iter().filter(|b| b.1 == s).map(|b| (b.0, b.2)).collect();
        chart
            .draw_series(mine.iter().map(|(c, v)| {
                let x = *c as f64 + 0.1 + s as f64 * width;
                Rectangle::new([(x, 0.0), (x + width * 0.92, *v)], color.filled())
            }))
            .map_err(e)?
            .label(*system)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .draw_series(missing.iter().map(|(c, s, mark)| {
            let x = *c as f64 + 0.1 + (*s as f64 + 0.3) * width;
            Text::new(*mark, (x, top * 0.02), ("sans-serif", 11).into_font().transform(FontTransform::Rotate270))
        }))
        .map_err(e)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
