//! Report rows, their goals, the markdown table and the JSON file.
//!
//! A row compares one raw path with the library's version of it. Its ratio
//! is always `cuda-async / raw` of the medians: for times (lower is better)
//! a goal reads `<= x`, for rates (higher is better) `>= x`, so "pinned
//! copies >= 0.95 of raw" is the goal `>= 0.95`.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::stats::Summary;

/// The unit of a row's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Microseconds per operation (lower is better).
    Micros,
    /// Milliseconds per operation (lower is better).
    Millis,
    /// Operations per second (higher is better).
    OpsPerSec,
    /// Gigabytes (1e9 bytes) per second (higher is better).
    GBps,
    /// Gibibytes (2^30 bytes) per second (higher is better): the remote
    /// rows' unit.
    GiBps,
    /// Percent of one CPU core (lower is better).
    PercentCore,
    /// Tera floating-point operations per second (higher is better).
    TflopsPerSec,
    /// Mebibytes (2^20 bytes) of memory (lower is better).
    MiB,
}

impl Unit {
    /// Whether a larger value is better (a rate).
    pub fn higher_is_better(self) -> bool {
        matches!(
            self,
            Unit::OpsPerSec | Unit::GBps | Unit::GiBps | Unit::TflopsPerSec
        )
    }

    /// The unit's short name (in the JSON file).
    pub fn name(self) -> &'static str {
        match self {
            Unit::Micros => "us",
            Unit::Millis => "ms",
            Unit::OpsPerSec => "ops/s",
            Unit::GBps => "GB/s",
            Unit::GiBps => "GiB/s",
            Unit::TflopsPerSec => "TFLOP/s",
            Unit::PercentCore => "% of a core",
            Unit::MiB => "MiB",
        }
    }

    /// `v` with its unit, for the table.
    ///
    /// # Examples
    ///
    /// ```
    /// use benches::Unit;
    /// assert_eq!(Unit::Micros.format(7.314), "7.31 us");
    /// assert_eq!(Unit::OpsPerSec.format(91_234.0), "91.2k ops/s");
    /// ```
    pub fn format(self, v: f64) -> String {
        match self {
            Unit::OpsPerSec if v >= 1e6 => format!("{:.2}M ops/s", v / 1e6),
            Unit::OpsPerSec if v >= 1e3 => format!("{:.1}k ops/s", v / 1e3),
            Unit::OpsPerSec => format!("{v:.0} ops/s"),
            Unit::GBps => format!("{v:.2} GB/s"),
            Unit::GiBps => format!("{v:.2} GiB/s"),
            Unit::TflopsPerSec => format!("{v:.1} TFLOP/s"),
            Unit::PercentCore => format!("{v:.3} % of a core"),
            Unit::MiB => format!("{v:.2} MiB"),
            Unit::Micros | Unit::Millis if v >= 100.0 => format!("{v:.1} {}", self.name()),
            Unit::Micros | Unit::Millis => format!("{v:.2} {}", self.name()),
        }
    }
}

/// What a row's ratio (`cuda-async / raw`) must satisfy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    /// No goal: the row informs.
    None,
    /// `ratio <= x`.
    AtMost(f64),
    /// `ratio >= x`.
    AtLeast(f64),
}

impl Goal {
    /// Whether `ratio` meets the goal; `None` when there is no goal.
    pub fn check(self, ratio: f64) -> Option<bool> {
        match self {
            Goal::None => None,
            Goal::AtMost(x) => Some(ratio <= x),
            Goal::AtLeast(x) => Some(ratio >= x),
        }
    }

    /// `<= 1.05`, `>= 0.95` or `-`.
    pub fn label(self) -> String {
        match self {
            Goal::None => "-".into(),
            Goal::AtMost(x) => format!("<= {x}"),
            Goal::AtLeast(x) => format!(">= {x}"),
        }
    }
}

/// One comparison: a raw path against the library's.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The topic (`overhead`, `await_latency`, ...).
    pub group: &'static str,
    /// What is measured, in words.
    pub metric: String,
    /// The unit of `raw` and `lib`.
    pub unit: Unit,
    /// The raw path's statistics; `None` when it has no raw side.
    pub raw: Option<Summary>,
    /// The library's statistics; `None` when it could not be measured.
    pub lib: Option<Summary>,
    /// The goal on `lib / raw`.
    pub goal: Goal,
    /// Where the goal comes from when not this issue (e.g. `issue 5`).
    pub goal_from: Option<&'static str>,
    /// Why a side is missing, or anything to know to read the row.
    pub note: Option<String>,
}

impl Row {
    /// A row with no values yet and no goal.
    pub fn new(group: &'static str, metric: impl Into<String>, unit: Unit) -> Self {
        Row {
            group,
            metric: metric.into(),
            unit,
            raw: None,
            lib: None,
            goal: Goal::None,
            goal_from: None,
            note: None,
        }
    }

    /// A row that says a group failed with `error`.
    pub fn error(group: &'static str, error: impl std::fmt::Display) -> Self {
        Row::new(group, group, Unit::Micros).note(format!("error: {error}"))
    }

    /// Sets the raw side.
    pub fn raw(mut self, s: Option<Summary>) -> Self {
        self.raw = s;
        self
    }

    /// Sets the library side.
    pub fn lib(mut self, s: Option<Summary>) -> Self {
        self.lib = s;
        self
    }

    /// Sets the goal.
    pub fn goal(mut self, g: Goal) -> Self {
        self.goal = g;
        self
    }

    /// Marks the goal as another issue's.
    pub fn goal_from(mut self, from: &'static str) -> Self {
        self.goal_from = Some(from);
        self
    }

    /// Adds a note.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    /// `lib / raw` of the medians, when both exist.
    pub fn ratio(&self) -> Option<f64> {
        match (self.raw, self.lib) {
            (Some(r), Some(l)) if r.median != 0.0 => Some(l.median / r.median),
            _ => None,
        }
    }

    /// Whether the goal is met; `None` without a goal or a ratio.
    pub fn pass(&self) -> Option<bool> {
        self.goal.check(self.ratio()?)
    }

    /// The goal as the table shows it (where it came from stays in the
    /// JSON: the book's chapters cite no issue numbers).
    fn goal_label(&self) -> String {
        match self.goal {
            Goal::None => "-".into(),
            g => g.label(),
        }
    }

    fn verdict(&self) -> &'static str {
        match (self.goal, self.pass()) {
            (Goal::None, _) => "-",
            (_, Some(true)) => "pass",
            (_, Some(false)) => "FAIL",
            (_, None) => "n/a",
        }
    }

    fn cell(&self, s: Option<Summary>) -> String {
        match (s, &self.note) {
            (Some(s), _) => self.unit.format(s.median),
            (None, Some(n)) if n.starts_with("n/a") => n.clone(),
            (None, Some(n)) if n.starts_with("error") => "error".into(),
            (None, _) => "-".into(),
        }
    }
}

/// Everything one report run produced.
#[derive(Debug, Clone)]
pub struct Report {
    /// The GPU's name; with no local topic, the remote node's device.
    pub device: String,
    /// Its compute capability; `None` with no local topic (no GPU used
    /// here).
    pub compute_capability: Option<(u32, u32)>,
    /// `cuDriverGetVersion`.
    pub driver_version: Option<i32>,
    /// Where the kernels came from (`ptx` or `nvrtc`; `-` with no local
    /// topic).
    pub kernels: &'static str,
    /// The `REPORT_SCALE` the run used.
    pub scale: f64,
    /// Seconds since the Unix epoch when the run finished.
    pub unix_time: u64,
    /// Wall time of the whole run, in seconds.
    pub wall_s: f64,
    /// The rows, in order.
    pub rows: Vec<Row>,
}

impl Report {
    /// Seconds since the Unix epoch, now.
    pub fn now_unix() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// The rows that did not meet their goal, or could not be measured
    /// (an error row).
    pub fn failed(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| {
                r.verdict() == "FAIL" || r.note.as_deref().is_some_and(|n| n.starts_with("error"))
            })
            .collect()
    }

    /// The run's verdict: `Err` naming the failed rows ([`Report::failed`])
    /// unless there are none.
    ///
    /// # Errors
    ///
    /// One line per failed row.
    pub fn verdict(&self) -> std::result::Result<(), String> {
        let failed = self.failed();
        if failed.is_empty() {
            return Ok(());
        }
        let mut s = format!("{} of {} rows FAIL:", failed.len(), self.rows.len());
        for r in failed {
            let ratio = r.ratio().map_or_else(|| "-".into(), |x| format!("{x:.3}"));
            let _ = write!(
                s,
                "\n  {}: ratio {ratio}, goal {}",
                r.metric,
                r.goal_label()
            );
        }
        Err(s)
    }

    /// The markdown table: metric | raw | cuda-async | ratio | goal |
    /// pass/fail, then the notes.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "| metric | raw | cuda-async | ratio | goal | pass/fail |"
        );
        let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- |");
        for r in &self.rows {
            let ratio = r.ratio().map_or_else(|| "-".into(), |x| format!("{x:.3}"));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                r.metric,
                r.cell(r.raw),
                r.cell(r.lib),
                ratio,
                r.goal_label(),
                r.verdict()
            );
        }
        let notes: Vec<_> = self
            .rows
            .iter()
            .filter_map(|r| r.note.as_ref().map(|n| (r, n)))
            .filter(|(_, n)| !n.starts_with("n/a"))
            .collect();
        if !notes.is_empty() {
            let _ = writeln!(s);
            for (r, n) in notes {
                let one_line = n.split_whitespace().collect::<Vec<_>>().join(" ");
                let _ = writeln!(s, "- {}: {one_line}", r.metric);
            }
        }
        s
    }

    /// The report as JSON: device, driver, timestamp, and every row with
    /// its medians (`raw`, `lib`; `null` when a side is missing), their
    /// spread (`raw_stats`, `lib_stats`: median, p10, p90, n), ratio, goal
    /// and verdict (`pass`: `null` without a goal or a ratio).
    pub fn json(&self) -> String {
        let mut s = String::from("{\n");
        let cc = self
            .compute_capability
            .map_or_else(|| "null".into(), |(a, b)| json_str(&format!("{a}.{b}")));
        let _ = writeln!(s, "  \"device\": {},", json_str(&self.device));
        let _ = writeln!(s, "  \"compute_capability\": {cc},");
        let _ = writeln!(
            s,
            "  \"driver_version\": {},",
            self.driver_version
                .map_or_else(|| "null".into(), |v| v.to_string())
        );
        let _ = writeln!(s, "  \"kernels\": {},", json_str(self.kernels));
        let _ = writeln!(s, "  \"scale\": {},", json_num(Some(self.scale)));
        let _ = writeln!(
            s,
            "  \"timestamp\": {},",
            json_str(&rfc3339_utc(self.unix_time))
        );
        let _ = writeln!(s, "  \"unix_time\": {},", self.unix_time);
        let _ = writeln!(s, "  \"wall_s\": {},", json_num(Some(self.wall_s)));
        s.push_str("  \"ratio\": \"cuda-async / raw, of the medians\",\n");
        s.push_str("  \"rows\": [");
        for (i, r) in self.rows.iter().enumerate() {
            s.push_str(if i == 0 { "\n" } else { ",\n" });
            let side = |x: Option<Summary>| match x {
                None => "null".to_string(),
                Some(x) => format!(
                    "{{\"median\": {}, \"p10\": {}, \"p90\": {}, \"n\": {}}}",
                    json_num(Some(x.median)),
                    json_num(Some(x.p10)),
                    json_num(Some(x.p90)),
                    x.n
                ),
            };
            let (kind, bound) = match r.goal {
                Goal::None => ("null".to_string(), None),
                Goal::AtMost(x) => (json_str("<="), Some(x)),
                Goal::AtLeast(x) => (json_str(">="), Some(x)),
            };
            let _ = write!(
                s,
                "    {{\"group\": {}, \"metric\": {}, \"unit\": {}, \"raw\": {}, \"lib\": {}, \
                 \"raw_stats\": {}, \"lib_stats\": {}, \
                 \"ratio\": {}, \"goal\": {}, \"goal_op\": {}, \"goal_value\": {}, \
                 \"goal_from\": {}, \"pass\": {}, \"note\": {}}}",
                json_str(r.group),
                json_str(&r.metric),
                json_str(r.unit.name()),
                json_num(r.raw.map(|x| x.median)),
                json_num(r.lib.map(|x| x.median)),
                side(r.raw),
                side(r.lib),
                json_num(r.ratio()),
                json_str(&r.goal_label()),
                kind,
                json_num(bound),
                r.goal_from.map_or_else(|| "null".into(), json_str),
                r.pass().map_or_else(|| "null".into(), |p| p.to_string()),
                r.note.as_deref().map_or_else(|| "null".into(), json_str),
            );
        }
        s.push_str("\n  ]\n}\n");
        s
    }
}

/// `s` as a JSON string literal.
///
/// # Examples
///
/// ```
/// assert_eq!(benches::report::json_str("a\"b\\c\n"), r#""a\"b\\c\n""#);
/// ```
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A JSON number, or `null` for `None` and non-finite values.
pub fn json_num(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x}"),
        _ => "null".into(),
    }
}

/// `unix` seconds as an RFC 3339 UTC timestamp (`2026-01-31T12:00:00Z`).
///
/// # Examples
///
/// ```
/// assert_eq!(benches::report::rfc3339_utc(0), "1970-01-01T00:00:00Z");
/// assert_eq!(benches::report::rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
/// ```
pub fn rfc3339_utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3_600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(m: f64) -> Option<Summary> {
        Some(Summary {
            median: m,
            p10: m,
            p90: m,
            n: 1,
        })
    }

    #[test]
    fn a_report_fails_on_a_failed_goal_or_an_error_row_only() {
        let row = |lib| {
            Row::new("g", "time", Unit::Micros)
                .raw(s(10.0))
                .lib(s(lib))
                .goal(Goal::AtMost(1.05))
        };
        let mut report = Report {
            device: "d".into(),
            compute_capability: None,
            driver_version: None,
            kernels: "-",
            scale: 1.0,
            unix_time: 0,
            wall_s: 0.0,
            rows: vec![
                row(10.0),
                Row::new("g", "no goal", Unit::Micros)
                    .raw(s(1.0))
                    .lib(s(9.0)),
            ],
        };
        assert!(report.verdict().is_ok());
        report.rows.push(row(11.0));
        let e = report.verdict().unwrap_err();
        assert!(e.starts_with("1 of 3 rows FAIL"), "{e}");
        report.rows.pop();
        report.rows.push(Row::error("g", "the GPU fell off"));
        assert!(report.verdict().is_err());
    }

    #[test]
    fn ratios_are_lib_over_raw_and_goals_point_the_right_way() {
        let t = Row::new("g", "time", Unit::Micros)
            .raw(s(10.0))
            .lib(s(10.4));
        assert!((t.ratio().unwrap() - 1.04).abs() < 1e-12);
        assert_eq!(t.clone().goal(Goal::AtMost(1.05)).pass(), Some(true));
        assert_eq!(t.clone().goal(Goal::AtMost(1.03)).pass(), Some(false));
        assert_eq!(t.pass(), None);
        let r = Row::new("g", "rate", Unit::GBps).raw(s(25.0)).lib(s(24.0));
        assert_eq!(r.clone().goal(Goal::AtLeast(0.95)).pass(), Some(true));
        assert_eq!(r.goal(Goal::AtLeast(0.97)).pass(), Some(false));
        let missing = Row::new("g", "graph", Unit::Micros)
            .raw(s(1.0))
            .goal(Goal::AtMost(1.1));
        assert_eq!((missing.ratio(), missing.pass()), (None, None));
    }

    #[test]
    fn markdown_has_the_columns_and_marks_missing_sides() {
        let rep = Report {
            device: "Test GPU".into(),
            compute_capability: Some((9, 0)),
            driver_version: Some(12080),
            kernels: "ptx",
            scale: 1.0,
            unix_time: 0,
            wall_s: 1.0,
            rows: vec![
                Row::new("overhead", "sync", Unit::Micros)
                    .raw(s(7.0))
                    .lib(s(8.0))
                    .goal(Goal::AtMost(1.05)),
                Row::new("graph", "replay per node", Unit::Micros)
                    .raw(s(0.6))
                    .goal(Goal::AtMost(1.1))
                    .note("n/a: needs two GPUs"),
                Row::error("zip", "boom\nsecond line\n"),
            ],
        };
        let md = rep.markdown();
        assert!(md.starts_with("| metric | raw | cuda-async | ratio | goal | pass/fail |"));
        assert!(
            md.contains("| sync | 7.00 us | 8.00 us | 1.143 | <= 1.05 | FAIL |"),
            "{md}"
        );
        assert!(
            md.contains("| n/a: needs two GPUs | - | <= 1.1 | n/a |"),
            "{md}"
        );
        assert!(md.contains("| zip | error | error | - | - | - |"), "{md}");
        assert!(md.contains("- zip: error: boom second line\n"), "{md}");
        let js = rep.json();
        assert!(js.contains("\"device\": \"Test GPU\""));
        assert!(js.contains("\"pass\": false"));
        assert!(
            js.contains("\"lib\": null, \"raw_stats\": {\"median\": 0.6"),
            "{js}"
        );
        assert!(js.contains("\"raw\": 7, \"lib\": 8,"), "{js}");
        assert!(js.contains("\"timestamp\": \"1970-01-01T00:00:00Z\""));
        assert_eq!(js.matches("\"metric\"").count(), 3);
    }

    #[test]
    fn json_escapes_and_numbers() {
        assert_eq!(json_str("tab\there"), "\"tab\\there\"");
        assert_eq!(json_str("\u{1}"), "\"\\u0001\"");
        assert_eq!(json_num(Some(f64::NAN)), "null");
        assert_eq!(json_num(Some(1.5)), "1.5");
        assert_eq!(json_num(None), "null");
    }

    #[test]
    fn timestamps_are_civil_dates() {
        assert_eq!(rfc3339_utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339_utc(4_102_444_799), "2099-12-31T23:59:59Z");
    }
}
