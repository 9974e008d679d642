//! SVG plots of acceptance. The SVG backend writes text as `<text>` elements and sizes it with
//! plotters' built-in estimate, so no fonts are needed to render (here or in CI).

use crate::acceptance::{MergedCounts, POOLED};
use crate::ExperimentError;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

type Series = Vec<(String, Vec<(f64, f64)>)>;

fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    x_range: std::ops::Range<f64>,
    y_range: std::ops::Range<f64>,
    series: &Series,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (720, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x_range, y_range)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn plot_error(path: &Path, e: Box<dyn std::error::Error>) -> ExperimentError {
    ExperimentError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Unconditional acceptance per draft slot, one line per k (all datasets pooled).
pub fn per_position(
    path: &Path,
    title: &str,
    by_k: &BTreeMap<usize, BTreeMap<String, MergedCounts>>,
) -> Result<(), ExperimentError> {
    let series: Series = by_k
        .iter()
        .filter_map(|(k, m)| m.get(POOLED).map(|c| (k, c)))
        .map(|(k, c)| {
            let points = c
                .unconditional_rates()
                .iter()
                .enumerate()
                .map(|(i, &r)| ((i + 1) as f64, r))
                .collect();
            (format!("k={k}"), points)
        })
        .collect();
    let max_k = by_k.keys().max().copied().unwrap_or(1) as f64;
    line_chart(
        path,
        &format!("Per-position acceptance: {title}"),
        "draft slot",
        "unconditional acceptance rate",
        0.5..max_k + 0.5,
        0.0..1.05,
        &series,
    )
    .map_err(|e| plot_error(path, e))
}

/// AL against draft length, one line per dataset.
pub fn al_vs_k(
    path: &Path,
    title: &str,
    by_k: &BTreeMap<usize, BTreeMap<String, MergedCounts>>,
    datasets: &[String],
) -> Result<(), ExperimentError> {
    let series: Series = datasets
        .iter()
        .map(|d| {
            let points = by_k
                .iter()
                .filter_map(|(k, m)| {
                    m.get(d)
                        .and_then(MergedCounts::acceptance_length)
                        .map(|al| (*k as f64, al))
                })
                .collect::<Vec<_>>();
            (d.clone(), points)
        })
        .filter(|(_, p)| !p.is_empty())
        .collect();
    let max_k = by_k.keys().max().copied().unwrap_or(1) as f64;
    let min_k = by_k.keys().min().copied().unwrap_or(1) as f64;
    let max_al = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .fold(1.0f64, f64::max);
    line_chart(
        path,
        &format!("AL vs draft length: {title}"),
        "draft length k",
        "AL (tokens per verify step, bonus included)",
        (min_k - 0.5)..(max_k + 0.5),
        1.0..(max_al * 1.1).max(1.5),
        &series,
    )
    .map_err(|e| plot_error(path, e))
}
