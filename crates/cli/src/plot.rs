//! The trade-off plot of `kvsparse eval --out`: relative output error (median and p99, log scale) against
//! the fraction of KV blocks visited, one curve per policy family (a sweep of its main knob), one labelled
//! point per setting. Drawn with plotters' bitmap backend and a font shipped in assets/ (no system fonts).

use std::path::Path;

use plotters::prelude::*;

use crate::eval::Row;

static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

const COLORS: [RGBColor; 11] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(0, 0, 128),
];

/// Smallest error drawn: exact settings (error 0) sit on the bottom edge instead of vanishing.
const FLOOR: f64 = 1e-6;

/// A label placer: keeps the pixel boxes of the labels drawn so far and puts each new label at the first
/// of a few offsets around its point where it overlaps none of them (or leaves it out).
#[derive(Default)]
struct Labels {
    boxes: Vec<(i32, i32, i32, i32)>,
}

impl Labels {
    /// Reserves the box of a marker or line end so labels avoid it too.
    fn reserve(&mut self, x: i32, y: i32, r: i32) {
        self.boxes.push((x - r, y - r, x + r, y + r));
    }

    /// A free position for `text` (font size `size`) next to pixel `(x, y)` inside `area` (x0, y0, x1, y1).
    fn place(&mut self, text: &str, size: i32, x: i32, y: i32, area: (i32, i32, i32, i32)) -> Option<(i32, i32)> {
        let w = (text.chars().count() as f64 * size as f64 * 0.58).ceil() as i32;
        let h = size + 2;
        let offsets = [(8, -h / 2), (-w - 8, -h / 2), (-w / 2, -h - 6), (-w / 2, 6), (8, -h - 4), (8, 4), (-w - 8, -h - 4), (-w - 8, 4)];
        for (dx, dy) in offsets {
            let b = (x + dx, y + dy, x + dx + w, y + dy + h);
            let inside = b.0 >= area.0 && b.1 >= area.1 && b.2 <= area.2 && b.3 <= area.3;
            if inside && !self.boxes.iter().any(|o| b.0 < o.2 && o.0 < b.2 && b.1 < o.3 && o.1 < b.3) {
                self.boxes.push(b);
                return Some((b.0, b.1));
            }
        }
        None
    }
}

/// Writes a four-panel PNG of the sweep rows, grouped into curves by family in order of appearance: output
/// error (median | p99) against blocks visited, and attention mass recovered (mean | 1st percentile)
/// against the estimated attention time relative to dense (bytes read — K, V and the policy's metadata —
/// over the bytes dense attention reads; decode attention is memory bound). One legend on the right;
/// point labels (the knob's value) are placed where they overlap nothing, else left out.
pub fn error_vs_visited(path: &Path, rows: &[&Row], dense_bytes: f64, subtitle: &str) -> Result<(), String> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).map_err(|_| "the embedded font does not parse".to_string())?;
    let mut families: Vec<(&str, Vec<&Row>)> = Vec::new();
    for r in rows {
        match families.iter_mut().find(|(f, _)| *f == r.family) {
            Some((_, v)) => v.push(r),
            None => families.push((&r.family, vec![r])),
        }
    }
    let err = |e: plotters::drawing::DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (2000, 1500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(70);
    title.draw(&Text::new("Sparse decode policies on real attention traces: quality against cost", (20, 8), ("sans-serif", 26).into_font())).map_err(err)?;
    title.draw(&Text::new(format!("{subtitle}; one point per setting of each policy's main knob (labelled with its value where room); rows = (layer, step, query head); hollow: error below {FLOOR:.0e}"), (20, 42), ("sans-serif", 16).into_font())).map_err(err)?;
    let (plots, legend) = body.split_horizontally(1640);
    let panels = plots.split_evenly((2, 2));
    let cost = |r: &Row| 100.0 * r.pooled.counters.kv_bytes_read as f64 / dense_bytes.max(1.0);
    let xmax_cost = (rows.iter().map(|r| cost(r)).fold(100.0, f64::max) * 1.05).ceil();
    for (pi, panel) in panels.iter().enumerate() {
        let mut labels = Labels::default();
        let (q, is_err) = [(0.5, true), (0.99, true), (0.0, false), (0.01, false)][pi];
        let y = |r: &Row| -> f64 {
            if is_err {
                kvsparse_conformance::eval::quantile(&r.pooled.errs, q).max(FLOOR)
            } else if q == 0.0 {
                kvsparse_conformance::eval::mean(&r.pooled.mass)
            } else {
                kvsparse_conformance::eval::quantile(&r.pooled.mass, q)
            }
        };
        let x = |r: &Row| if is_err { r.pooled.visited_pct() } else { cost(r) };
        let caption = match pi {
            0 => "relative output error, median over rows".to_string(),
            1 => "relative output error, 99th percentile over rows".to_string(),
            2 => "attention mass recovered, mean over rows".to_string(),
            _ => "attention mass recovered, 1st percentile over rows".to_string(),
        };
        let mut builder = ChartBuilder::on(panel);
        builder.margin(16).caption(caption, ("sans-serif", 20)).x_label_area_size(50).y_label_area_size(80);
        let xdesc = if is_err { "KV blocks visited (% of the blocks dense attention reads)".to_string() } else { "estimated attention time, % of dense (bytes read: K, V, metadata)".to_string() };
        let xr = if is_err { 0.0f64..100.0f64 } else { 0.0f64..xmax_cost };
        let points: Vec<(usize, f64, f64, String)> = families
            .iter()
            .enumerate()
            .flat_map(|(i, (_, pts))| pts.iter().map(move |r| (i, r)))
            .map(|(i, r)| (i, x(r), y(r), format!("{}", r.value)))
            .collect();
        if is_err {
            let ymax = points.iter().map(|p| p.2).fold(FLOOR * 10.0, f64::max) * 2.0;
            let ymin = (points.iter().map(|p| p.2).fold(ymax, f64::min) / 3.0).max(FLOOR);
            let mut chart = builder.build_cartesian_2d(xr, (ymin..ymax).log_scale()).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(xdesc)
                .y_desc(format!("rel. error vs dense ({}, log)", if q == 0.5 { "median" } else { "p99" }))
                .y_label_formatter(&|v| format!("{v:.0e}"))
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 17))
                .draw()
                .map_err(err)?;
            draw_curves(&chart, &families, &points, &mut labels, &root)?;
        } else {
            let ymin = (points.iter().map(|p| p.2).fold(1.0, f64::min) - 0.03).max(0.0);
            let mut chart = builder.build_cartesian_2d(xr, ymin..1.01f64).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(xdesc)
                .y_desc(format!("true attention mass on the attended keys ({})", if q == 0.0 { "mean" } else { "p1" }))
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 17))
                .draw()
                .map_err(err)?;
            draw_curves(&chart, &families, &points, &mut labels, &root)?;
        }
    }
    // The legend: one line per family, with its knob.
    legend.draw(&Text::new("policy family (knob)", (10, 40), ("sans-serif", 18).into_font())).map_err(err)?;
    for (i, (fam, pts)) in families.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y0 = 80 + 34 * i as i32;
        legend.draw(&PathElement::new(vec![(10, y0), (40, y0)], color.stroke_width(4))).map_err(err)?;
        legend.draw(&Circle::new((25, y0), 5, color.filled())).map_err(err)?;
        legend.draw(&Text::new(format!("{fam} ({})", pts[0].knob), (48, y0 - 9), ("sans-serif", 16).into_font())).map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

type Chart<'a, Y> = ChartContext<'a, BitMapBackend<'a>, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>;

/// One curve per family (sorted by x), filled markers (hollow below the error floor), and the labels the
/// placer finds room for, drawn on `root` in pixel coordinates.
fn draw_curves<Y>(chart: &Chart<'_, Y>, families: &[(&str, Vec<&Row>)], points: &[(usize, f64, f64, String)], labels: &mut Labels, root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<(), String>
where
    Y: Ranged<ValueType = f64>,
{
    let err = |e: plotters::drawing::DrawingAreaErrorKind<_>| format!("plot: {e}");
    let area = {
        let (xr, yr) = chart.plotting_area().get_pixel_range();
        (xr.start, yr.start, xr.end, yr.end)
    };
    for (i, _) in families.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut xy: Vec<&(usize, f64, f64, String)> = points.iter().filter(|p| p.0 == i).collect();
        xy.sort_by(|a, b| a.1.total_cmp(&b.1));
        chart.plotting_area().draw(&PathElement::new(xy.iter().map(|p| (p.1, p.2)).collect::<Vec<_>>(), color.stroke_width(2))).map_err(err)?;
        for p in &xy {
            let style = if p.2 > FLOOR { color.filled() } else { color.stroke_width(2) };
            chart.plotting_area().draw(&Circle::new((p.1, p.2), 5, style)).map_err(err)?;
            let (px, py) = chart.backend_coord(&(p.1, p.2));
            labels.reserve(px, py, 6);
        }
    }
    for (i, _) in families.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        for p in points.iter().filter(|p| p.0 == i) {
            let (px, py) = chart.backend_coord(&(p.1, p.2));
            if let Some((lx, ly)) = labels.place(&p.3, 12, px, py, area) {
                root.draw(&Text::new(p.3.clone(), (lx, ly), ("sans-serif", 12).into_font().color(&color))).map_err(err)?;
            }
        }
    }
    Ok(())
}
