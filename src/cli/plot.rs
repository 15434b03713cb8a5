//! A self-contained SVG of a bench report: decode tokens/s against batch size, and the
//! serving run's latency percentiles for both modes.

use serde_json::Value;
use std::fmt::Write;

const W: f64 = 900.0;
const H: f64 = 380.0;

pub fn svg(report: &Value) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="15">weft bench: {}</text>"#,
        W / 2.0,
        report["model"].as_str().unwrap_or("")
    );
    if let Some(rows) = report["batched"].as_array() {
        let pts: Vec<(f64, f64)> =
            rows.iter().map(|r| (r["batch"].as_f64().unwrap_or(0.0), r["tg_tok_s"].as_f64().unwrap_or(0.0))).collect();
        bars(
            &mut s,
            40.0,
            "decode tokens/s by batch size",
            &pts.iter().map(|(b, v)| (format!("B={b}"), *v, "#4a7ab5")).collect::<Vec<_>>(),
        );
    }
    if let Some(modes) = report["serving"]["modes"].as_array() {
        let mut items = Vec::new();
        for m in modes {
            let name = m["mode"].as_str().unwrap_or("");
            let color = if name == "continuous" { "#3a9a5b" } else { "#c0623a" };
            for key in ["ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"] {
                let label = format!("{} {}", &name[..3], key.trim_end_matches("_s").replace('_', " "));
                items.push((label, m[key].as_f64().unwrap_or(0.0) * 1e3, color));
            }
        }
        bars(&mut s, W / 2.0 + 20.0, "serving latency (ms)", &items);
    }
    s.push_str("</svg>");
    s
}

/// A bar chart in a 400×300 panel whose left edge is at `x0`.
fn bars(s: &mut String, x0: f64, title: &str, items: &[(String, f64, &str)]) {
    let (top, bottom, width) = (50.0, H - 70.0, 400.0);
    let max = items.iter().map(|i| i.1).fold(0.0, f64::max).max(1e-9);
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">{title}</text>"#,
        x0 + width / 2.0,
        top - 10.0
    );
    let _ = write!(s, r##"<line x1="{x0}" y1="{bottom}" x2="{}" y2="{bottom}" stroke="#333"/>"##, x0 + width);
    let slot = width / items.len().max(1) as f64;
    for (i, (label, v, color)) in items.iter().enumerate() {
        let h = (bottom - top) * v / max;
        let x = x0 + i as f64 * slot + slot * 0.15;
        let _ = write!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{color}"/>"#,
            bottom - h,
            slot * 0.7
        );
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{v:.1}</text>"#,
            x + slot * 0.35,
            bottom - h - 4.0
        );
        let _ = write!(
            s,
            r#"<text transform="translate({:.1},{:.1}) rotate(40)" font-size="10">{label}</text>"#,
            x + slot * 0.2,
            bottom + 12.0
        );
    }
}
