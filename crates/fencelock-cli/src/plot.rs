//! `fencelock bench --plot`: ops/s and p99 per backend and scenario, as SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::bench::RunResult;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws two bar charts side by side: throughput and p99 latency, one bar per
/// run, labelled `backend/scenario`, coloured by backend.
pub fn draw(path: &Path, results: &[RunResult]) -> Result<(), Box<dyn std::error::Error>> {
    let width = 480 + 90 * results.len() as u32;
    let root = SVGBackend::new(path, (width.max(900), 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("fencelock bench", ("sans-serif", 22))?;
    let (left, right) = root.split_horizontally(width.max(900) / 2);
    let mut backends: Vec<&str> = results.iter().map(|r| r.backend.as_str()).collect();
    backends.dedup();
    let colour =
        |b: &str| PALETTE[backends.iter().position(|x| *x == b).unwrap_or(0) % PALETTE.len()];
    let labels: Vec<String> = results
        .iter()
        .map(|r| format!("{}/{}", r.backend, r.scenario))
        .collect();
    type Metric = fn(&RunResult) -> f64;
    let panels: [(_, &str, Metric); 2] = [
        (&left, "throughput (ops/s, higher is better)", |r| {
            r.ops_per_sec()
        }),
        (&right, "p99 latency (ms, lower is better)", |r| r.p99_ms),
    ];
    for (area, title, value) in panels {
        let max = results.iter().map(value).fold(0.0, f64::max).max(1e-3) * 1.15;
        let n = results.len() as i32;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(70)
            .y_label_area_size(70)
            .build_cartesian_2d(0..n, 0.0..max)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(results.len().max(1))
            .x_label_formatter(&|i| labels.get(*i as usize).cloned().unwrap_or_default())
            .x_label_style(
                ("sans-serif", 11)
                    .into_font()
                    .transform(FontTransform::Rotate90),
            )
            .draw()?;
        chart.draw_series(results.iter().enumerate().map(|(i, r)| {
            let i = i as i32;
            Rectangle::new([(i, 0.0), (i + 1, value(r))], colour(&r.backend).filled())
        }))?;
    }
    root.present()?;
    Ok(())
}
