//! `fencelock bench --plot`: ops/s and p99 per backend and scenario, as SVG.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::bench::RunResult;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

type Metric = fn(&RunResult) -> f64;

/// A number as short as its size allows: `230000`, `14.0`, `0.022`.
fn short(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Draws two bar charts side by side, throughput and p99 latency, on log
/// scales: one bar per run, grouped by scenario on the x axis, coloured by
/// backend (with a legend), each bar labelled with its value.
pub fn draw(path: &Path, results: &[RunResult]) -> Result<(), Box<dyn std::error::Error>> {
    let width = (300 + 110 * results.len() as u32).max(900);
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("fencelock bench", ("sans-serif", 22))?;
    let (left, right) = root.split_horizontally(width / 2);
    let mut backends: Vec<&str> = Vec::new();
    for r in results {
        if !backends.contains(&r.backend.as_str()) {
            backends.push(&r.backend);
        }
    }
    let colour =
        |b: &str| PALETTE[backends.iter().position(|x| *x == b).unwrap_or(0) % PALETTE.len()];
    let panels: [(_, &str, Metric); 2] = [
        (
            &left,
            "throughput, ops/s (log scale, higher is better)",
            |r| r.ops_per_sec(),
        ),
        (
            &right,
            "p99 latency, ms (log scale, lower is better)",
            |r| r.p99_ms,
        ),
    ];
    let n = results.len() as u32;
    for (area, title, value) in panels {
        let values: Vec<f64> = results.iter().map(value).map(|v| v.max(1e-3)).collect();
        let lo = values.iter().copied().fold(f64::MAX, f64::min) / 3.0;
        let hi = values.iter().copied().fold(0.0, f64::max) * 3.0;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 14))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d((0..n).into_segmented(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(results.len().max(1))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => results
                    .get(*i as usize)
                    .map(|r| r.scenario.to_string())
                    .unwrap_or_default(),
                _ => String::new(),
            })
            .y_label_formatter(&|v| short(*v))
            .draw()?;
        for backend in &backends {
            let c = colour(backend);
            chart
                .draw_series(
                    results
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.backend == *backend)
                        .map(|(i, _)| {
                            let i = i as u32;
                            let mut bar = Rectangle::new(
                                [
                                    (SegmentValue::Exact(i), lo),
                                    (SegmentValue::Exact(i + 1), values[i as usize]),
                                ],
                                c.filled(),
                            );
                            bar.set_margin(0, 0, 8, 8);
                            bar
                        }),
                )?
                .label(*backend)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        chart.draw_series(values.iter().enumerate().map(|(i, v)| {
            let style = TextStyle::from(("sans-serif", 11).into_font())
                .pos(Pos::new(HPos::Center, VPos::Bottom));
            Text::new(
                short(*v),
                (SegmentValue::CenterOf(i as u32), *v * 1.05),
                style,
            )
        }))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
