//! The trade-off plot of `kvsparse eval --out`: relative output error (median and p99, log scale) against
//! the fraction of KV blocks visited, one curve per policy family (a sweep of its main knob), one labelled
//! point per setting. Drawn with plotters' bitmap backend and a font shipped in assets/ (no system fonts).

use std::path::Path;

use plotters::prelude::*;

use crate::eval::Row;

static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

/// One colour per family (Tableau's ten, then navy, black and magenta), and below one marker shape per
/// family: every family differs from every other in both.
const COLORS: [RGBColor; 13] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 128),
    RGBColor(0, 0, 0),
    RGBColor(200, 0, 200),
];

/// Marker shapes, in the order families get them.
#[derive(Clone, Copy)]
enum Shape {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Pentagon,
    Star,
    Hexagon,
    Plus,
    TriangleLeft,
    Cross,
    TriangleRight,
    Star4,
}

const SHAPES: [Shape; 13] = [
    Shape::Circle,
    Shape::Square,
    Shape::TriangleUp,
    Shape::Diamond,
    Shape::TriangleDown,
    Shape::Pentagon,
    Shape::Star,
    Shape::Hexagon,
    Shape::Plus,
    Shape::TriangleLeft,
    Shape::Cross,
    Shape::TriangleRight,
    Shape::Star4,
];

/// Colour and marker of the `i`-th family (they repeat, as a pair, only past 13 families).
fn style_of(i: usize) -> (RGBColor, Shape) {
    (COLORS[i % COLORS.len()], SHAPES[i % SHAPES.len()])
}

/// Vertices around `(x, y)` at radii alternating `radii` (one radius: a regular polygon), the first at
/// angle `rot` degrees (0 = right, 90 = down in pixel coordinates).
fn ring(x: i32, y: i32, n: usize, radii: &[f64], rot: f64) -> Vec<(i32, i32)> {
    (0..n)
        .map(|k| {
            let a = (rot + 360.0 * k as f64 / n as f64).to_radians();
            let r = radii[k % radii.len()];
            (x + (r * a.cos()).round() as i32, y + (r * a.sin()).round() as i32)
        })
        .collect()
}

/// The outline of a marker of radius `r` at `(x, y)` (None: a circle).
fn outline(shape: Shape, x: i32, y: i32, r: f64) -> Option<Vec<(i32, i32)>> {
    let plus = |rot: f64| {
        // A cross of arms `w` wide: 12 vertices at two radii, as angles around the centre.
        let w = 0.38 * r;
        let (a, b) = ((w * w + r * r).sqrt(), w * std::f64::consts::SQRT_2);
        let t = (w / r).atan().to_degrees();
        let mut v = Vec::new();
        for k in 0..4 {
            let c = rot + 90.0 * k as f64;
            for (rad, ang) in [(a, c - t), (a, c + t), (b, c + 45.0)] {
                let ang = ang.to_radians();
                v.push((x + (rad * ang.cos()).round() as i32, y + (rad * ang.sin()).round() as i32));
            }
        }
        v
    };
    Some(match shape {
        Shape::Circle => return None,
        Shape::Square => ring(x, y, 4, &[r * 1.1], 45.0),
        Shape::Diamond => ring(x, y, 4, &[r * 1.25], 0.0),
        Shape::TriangleUp => ring(x, y, 3, &[r * 1.3], -90.0),
        Shape::TriangleDown => ring(x, y, 3, &[r * 1.3], 90.0),
        Shape::TriangleLeft => ring(x, y, 3, &[r * 1.3], 180.0),
        Shape::TriangleRight => ring(x, y, 3, &[r * 1.3], 0.0),
        Shape::Pentagon => ring(x, y, 5, &[r * 1.15], -90.0),
        Shape::Hexagon => ring(x, y, 6, &[r * 1.1], 0.0),
        Shape::Star => ring(x, y, 10, &[r * 1.5, r * 0.65], -90.0),
        Shape::Star4 => ring(x, y, 8, &[r * 1.5, r * 0.5], -90.0),
        Shape::Plus => plus(0.0),
        Shape::Cross => plus(45.0),
    })
}

/// Draws a marker in pixel coordinates: filled, or hollow (white inside, coloured outline).
fn draw_marker(area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>, (color, shape): (RGBColor, Shape), (x, y): (i32, i32), r: f64, hollow: bool) -> Result<(), String> {
    let err = |e: plotters::drawing::DrawingAreaErrorKind<_>| format!("plot: {e}");
    match outline(shape, x, y, r) {
        None => {
            let ri = r.round() as i32;
            if hollow {
                area.draw(&Circle::new((x, y), ri, WHITE.filled())).map_err(err)?;
                area.draw(&Circle::new((x, y), ri, color.stroke_width(2))).map_err(err)?;
            } else {
                area.draw(&Circle::new((x, y), ri, color.filled())).map_err(err)?;
            }
        }
        Some(pts) => {
            let fill = if hollow { WHITE.filled() } else { color.filled() };
            area.draw(&Polygon::new(pts.clone(), fill)).map_err(err)?;
            let mut closed = pts.clone();
            closed.push(pts[0]);
            area.draw(&PathElement::new(closed, color.stroke_width(if hollow { 2 } else { 1 }))).map_err(err)?;
        }
    }
    Ok(())
}

/// Smallest error drawn: exact settings (error 0) sit on the bottom edge instead of vanishing.
const FLOOR: f64 = 1e-6;

type PixelBox = (i32, i32, i32, i32);

/// A label placer for one panel: keeps the pixel boxes of the markers and labels drawn so far and the
/// curves' segments, and puts each new label at the first of a few offsets around its point where it
/// overlaps none of them and stays inside the panel (or leaves it out).
#[derive(Default)]
struct Labels {
    boxes: Vec<PixelBox>,
    segments: Vec<((f64, f64), (f64, f64))>,
}

/// Does the segment `a`–`b` cross the box `r` (Liang–Barsky clipping)?
fn segment_hits(a: (f64, f64), b: (f64, f64), r: PixelBox) -> bool {
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let (mut t0, mut t1) = (0.0f64, 1.0f64);
    for (p, q) in [(-dx, a.0 - r.0 as f64), (dx, r.2 as f64 - a.0), (-dy, a.1 - r.1 as f64), (dy, r.3 as f64 - a.1)] {
        if p == 0.0 {
            if q < 0.0 {
                return false;
            }
        } else {
            let t = q / p;
            if p < 0.0 {
                t0 = t0.max(t);
            } else {
                t1 = t1.min(t);
            }
            if t0 > t1 {
                return false;
            }
        }
    }
    true
}

impl Labels {
    /// Reserves the box of a marker so labels avoid it too.
    fn reserve(&mut self, x: i32, y: i32, r: i32) {
        self.boxes.push((x - r, y - r, x + r, y + r));
    }

    /// Reserves a curve's segment (pixel coordinates) so no label is drawn over it.
    fn reserve_segment(&mut self, a: (i32, i32), b: (i32, i32)) {
        self.segments.push(((a.0 as f64, a.1 as f64), (b.0 as f64, b.1 as f64)));
    }

    /// A free position for `text` (font size `size`) next to pixel `(x, y)` inside `area` (x0, y0, x1, y1).
    fn place(&mut self, text: &str, size: i32, x: i32, y: i32, area: PixelBox) -> Option<(i32, i32)> {
        let w = (text.chars().count() as f64 * size as f64 * 0.62).ceil() as i32;
        let h = size + 1;
        let mut offsets = Vec::new();
        for gap in [8, 13] {
            offsets.extend([(gap, -h / 2), (-w - gap, -h / 2), (-w / 2, -h - gap), (-w / 2, gap), (gap - 2, -h - gap + 2), (gap - 2, gap - 2), (-w - gap + 2, -h - gap + 2), (-w - gap + 2, gap - 2)]);
        }
        for (dx, dy) in offsets {
            let b = (x + dx, y + dy, x + dx + w, y + dy + h);
            let inside = b.0 >= area.0 && b.1 >= area.1 && b.2 <= area.2 && b.3 <= area.3;
            // Two pixels of air around the text.
            let padded = (b.0 - 2, b.1 - 2, b.2 + 2, b.3 + 2);
            let free = !self.boxes.iter().any(|o| padded.0 < o.2 && o.0 < padded.2 && padded.1 < o.3 && o.1 < padded.3)
                && !self.segments.iter().any(|&(a, c)| segment_hits(a, c, padded));
            if inside && free {
                self.boxes.push(b);
                return Some((b.0, b.1));
            }
        }
        None
    }
}

/// A knob value as a label: `512`, `0.95`, `1e-5`.
fn knob_label(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Writes a four-panel PNG of the sweep rows, grouped into curves by family in order of appearance: output
/// error (median | p99) against blocks visited, and attention mass recovered (mean | 1st percentile)
/// against the estimated attention time relative to dense (bytes read — K, V and the policy's metadata —
/// over the bytes dense attention reads; decode attention is memory bound). One legend on the right;
/// point labels (the knob's value) are placed where they overlap no marker, label or curve, else left out.
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
    let root = BitMapBackend::new(path, (2000, 1560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(130);
    let text = |t: &DrawingArea<_, _>, s: String, y: i32, size: u32| t.draw(&Text::new(s, (20, y), ("sans-serif", size).into_font()));
    text(&title, "Sparse decode policies on real attention traces: quality against cost".into(), 8, 30).map_err(err)?;
    text(&title, subtitle.to_string(), 48, 19).map_err(err)?;
    text(&title, format!("One point per setting of each policy family's main knob, labelled with its value where there is room (every point: eval.csv). A row = (layer, step, query head). Hollow: error below {FLOOR:.0e}."), 74, 19).map_err(err)?;
    text(&title, "Top row: x = KV blocks visited. Bottom row: x = estimated attention time (bytes read, K + V + the policy's metadata, % of dense; over 100% where metadata costs more than it saves).".into(), 100, 19).map_err(err)?;
    let (plots, legend) = body.split_horizontally(1600);
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
            0 => "relative output error (median over rows) vs blocks visited",
            1 => "relative output error (99th percentile over rows) vs blocks visited",
            2 => "attention mass recovered (mean over rows) vs estimated time",
            _ => "attention mass recovered (1st percentile over rows) vs estimated time",
        };
        let mut builder = ChartBuilder::on(panel);
        builder.margin(16).caption(caption, ("sans-serif", 21)).x_label_area_size(56).y_label_area_size(84);
        let xdesc = if is_err { "KV blocks visited, % of the blocks dense attention reads" } else { "estimated attention time, % of dense: bytes read incl. metadata (not blocks)" };
        let xr = if is_err { 0.0f64..100.0f64 } else { 0.0f64..xmax_cost };
        let points: Vec<(usize, f64, f64, String)> = families
            .iter()
            .enumerate()
            .flat_map(|(i, (_, pts))| pts.iter().map(move |r| (i, r)))
            .map(|(i, r)| (i, x(r), y(r), knob_label(r.value)))
            .collect();
        if is_err {
            let ymax = points.iter().map(|p| p.2).fold(FLOOR * 10.0, f64::max) * 2.0;
            let ymin = (points.iter().map(|p| p.2).fold(ymax, f64::min) / 3.0).max(FLOOR / 2.0);
            let mut chart = builder.build_cartesian_2d(xr, (ymin..ymax).log_scale()).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(xdesc)
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_desc(format!("rel. error vs dense ({}, log scale)", if q == 0.5 { "median" } else { "p99" }))
                .y_label_formatter(&|v| format!("{v:.0e}"))
                .label_style(("sans-serif", 16))
                .axis_desc_style(("sans-serif", 18))
                .draw()
                .map_err(err)?;
            draw_curves(&chart, &families, &points, is_err, &mut labels, &root)?;
        } else {
            let ymin = (points.iter().map(|p| p.2).fold(1.0, f64::min) - 0.03).max(0.0);
            let mut chart = builder.build_cartesian_2d(xr, ymin..1.01f64).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(xdesc)
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_desc(format!("true attention mass on the attended keys ({})", if q == 0.0 { "mean" } else { "p1" }))
                .label_style(("sans-serif", 16))
                .axis_desc_style(("sans-serif", 18))
                .draw()
                .map_err(err)?;
            draw_curves(&chart, &families, &points, is_err, &mut labels, &root)?;
        }
    }
    // The legend: one line per family, with its knob; the marker and colour as on the curves.
    legend.draw(&Text::new("policy family (knob)", (10, 40), ("sans-serif", 20).into_font())).map_err(err)?;
    for (i, (fam, pts)) in families.iter().enumerate() {
        let style = style_of(i);
        let y0 = 84 + 38 * i as i32;
        legend.draw(&PathElement::new(vec![(10, y0), (50, y0)], style.0.stroke_width(3))).map_err(err)?;
        draw_marker(&legend, style, (30, y0), 7.0, false)?;
        legend.draw(&Text::new(format!("{fam} ({})", pts[0].knob), (60, y0 - 10), ("sans-serif", 18).into_font())).map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

type Chart<'a, Y> = ChartContext<'a, BitMapBackend<'a>, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>;

/// One curve per family (sorted by x), its markers (hollow at the error floor when `floored`), and the labels the
/// placer finds room for, drawn on `root` in pixel coordinates.
fn draw_curves<Y>(chart: &Chart<'_, Y>, families: &[(&str, Vec<&Row>)], points: &[(usize, f64, f64, String)], floored: bool, labels: &mut Labels, root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<(), String>
where
    Y: Ranged<ValueType = f64>,
{
    let err = |e: plotters::drawing::DrawingAreaErrorKind<_>| format!("plot: {e}");
    let area = {
        let (xr, yr) = chart.plotting_area().get_pixel_range();
        (xr.start, yr.start, xr.end, yr.end)
    };
    let sorted = |i: usize| {
        let mut xy: Vec<&(usize, f64, f64, String)> = points.iter().filter(|p| p.0 == i).collect();
        xy.sort_by(|a, b| a.1.total_cmp(&b.1));
        xy
    };
    // Lines first, then every marker over them, so no line hides a marker.
    for i in 0..families.len() {
        let xy = sorted(i);
        chart.plotting_area().draw(&PathElement::new(xy.iter().map(|p| (p.1, p.2)).collect::<Vec<_>>(), style_of(i).0.stroke_width(2))).map_err(err)?;
        let px: Vec<(i32, i32)> = xy.iter().map(|p| chart.backend_coord(&(p.1, p.2))).collect();
        for w in px.windows(2) {
            labels.reserve_segment(w[0], w[1]);
        }
    }
    for i in 0..families.len() {
        for p in sorted(i) {
            let (px, py) = chart.backend_coord(&(p.1, p.2));
            draw_marker(root, style_of(i), (px, py), 6.0, floored && p.2 <= FLOOR)?;
            labels.reserve(px, py, 9);
        }
    }
    for i in 0..families.len() {
        for p in sorted(i) {
            let (px, py) = chart.backend_coord(&(p.1, p.2));
            if let Some((lx, ly)) = labels.place(&p.3, 13, px, py, area) {
                root.draw(&Text::new(p.3.clone(), (lx, ly), ("sans-serif", 13).into_font().color(&style_of(i).0))).map_err(err)?;
            }
        }
    }
    Ok(())
}
