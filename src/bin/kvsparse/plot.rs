//! The trade-off plot of `kvsparse eval --out`: relative output error (median and p99, log scale) against
//! the fraction of KV blocks visited, one curve per policy family (a sweep of its main knob), one labelled
//! point per setting. Drawn with plotters' bitmap backend and a font shipped in assets/ (no system fonts).

use std::path::Path;

use plotters::prelude::*;

use crate::eval::Row;

static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

const COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(127, 127, 127),
];

/// Smallest error drawn: exact settings (error 0) sit on the bottom edge instead of vanishing.
const FLOOR: f64 = 1e-6;

/// Writes a two-panel PNG (median error | p99 error vs blocks visited) of the sweep rows, grouped into
/// curves by family in order of appearance.
pub fn error_vs_visited(path: &Path, rows: &[&Row], subtitle: &str) -> Result<(), String> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).map_err(|_| "the embedded font does not parse".to_string())?;
    let mut families: Vec<(&str, Vec<&Row>)> = Vec::new();
    for r in rows {
        match families.iter_mut().find(|(f, _)| *f == r.family) {
            Some((_, v)) => v.push(r),
            None => families.push((&r.family, vec![r])),
        }
    }
    let err = |e: plotters::drawing::DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (1800, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(70);
    title.draw(&Text::new("Sparse decode policies on real attention traces: output error vs KV blocks visited", (20, 8), ("sans-serif", 26).into_font())).map_err(err)?;
    title.draw(&Text::new(format!("{subtitle}; one point per setting of each policy's main knob; error per (layer, step, query head) row vs dense; hollow: below {FLOOR:.0e}, drawn at {FLOOR:.0e}"), (20, 42), ("sans-serif", 16).into_font())).map_err(err)?;
    let panels = body.split_evenly((1, 2));
    let stats: [(&str, f64); 2] = [("median", 0.5), ("99th percentile", 0.99)];
    for (panel, (label, q)) in panels.iter().zip(stats) {
        let y = |r: &Row| kvsparse::eval::quantile(&r.pooled.errs, q).max(FLOOR);
        let ymax = rows.iter().map(|r| y(r)).fold(FLOOR * 10.0, f64::max) * 2.0;
        let ymin = (rows.iter().map(|r| y(r)).fold(ymax, f64::min) / 3.0).max(FLOOR);
        let mut chart = ChartBuilder::on(panel)
            .margin(16)
            .caption(format!("relative output error, {label} over rows"), ("sans-serif", 20))
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0f64..100.0f64, (ymin..ymax).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("KV blocks visited (% of the blocks dense attention reads)")
            .y_desc(format!("rel. error vs dense ({label}, log)"))
            .y_label_formatter(&|v| format!("{v:.0e}"))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()
            .map_err(err)?;
        for (i, (fam, pts)) in families.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let mut xy: Vec<(f64, f64, String)> = pts.iter().map(|r| (r.pooled.visited_pct(), y(r), format!("{}={}", r.knob, r.value))).collect();
            xy.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(xy.iter().map(|p| (p.0, p.1)), color.stroke_width(2)))
                .map_err(err)?
                .label(format!("{fam} ({})", pts[0].knob))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
            // Hollow markers: settings whose error is below the floor (exact for most rows).
            chart
                .draw_series(xy.iter().map(|p| Circle::new((p.0, p.1), 5, if p.1 > FLOOR { color.filled() } else { color.stroke_width(2) })))
                .map_err(err)?;
            if q == 0.5 {
                chart
                    .draw_series(xy.iter().map(|p| Text::new(p.2.clone(), (p.0, p.1), ("sans-serif", 11).into_font().color(&color))))
                    .map_err(err)?;
            }
        }
        if q == 0.5 {
            continue; // one legend, in the p99 panel's empty lower left
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
