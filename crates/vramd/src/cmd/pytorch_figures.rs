//! PyTorch's own fragmentation figures for a trace, read from the README beside it: the row of
//! its table whose first cell is the trace's name, in the columns headed "fragmentation, default"
//! and "fragmentation, expandable segments" (percentages). A folder without such a table, or a
//! trace without a row, has no figures; nothing else is read.

use std::path::Path;

/// PyTorch's fragmentation on one workload, as fractions (`1 - peak allocated / peak reserved`,
/// PyTorch's `memory_stats()`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PytorchFigures {
    pub default: Option<f64>,
    pub expandable: Option<f64>,
}

/// The figures for the trace named `name` (its file name without `.pickle.gz`) in the README.md
/// of `dir`, if it has them.
pub fn for_trace(dir: &Path, name: &str) -> PytorchFigures {
    std::fs::read_to_string(dir.join("README.md"))
        .map(|text| parse(&text, name))
        .unwrap_or_default()
}

/// The figures for `name` in a markdown text (see the module documentation).
pub fn parse(text: &str, name: &str) -> PytorchFigures {
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_lowercase())
            .collect()
    };
    let mut columns: Option<(Option<usize>, Option<usize>)> = None;
    for line in text.lines().filter(|l| l.trim_start().starts_with('|')) {
        let row = cells(line);
        let find = |what: &str| row.iter().position(|c| c.starts_with(what));
        if let Some(d) = find("fragmentation, default") {
            columns = Some((Some(d), find("fragmentation, expandable")));
            continue;
        }
        if let Some((d, e)) = columns {
            if row.first().map(String::as_str) == Some(&name.to_lowercase()) {
                let percent = |i: Option<usize>| {
                    let cell = row.get(i?)?;
                    let v: f64 = cell.trim_end_matches('%').trim().parse().ok()?;
                    Some(v / 100.0)
                };
                return PytorchFigures {
                    default: percent(d),
                    expandable: percent(e),
                };
            }
        }
    }
    PytorchFigures::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const README: &str = "\
| workload | peak allocated | fragmentation, default | fragmentation, expandable segments |
|---|---|---|---|
| resnet50_train | 5.91 GB | 15.9 % | 1.9 % |
| lstm_lm_train | 6.09 GB | 27.4 % | n/a |
";

    #[test]
    fn figures_come_from_the_row_of_the_trace() {
        let f = parse(README, "resnet50_train");
        assert!((f.default.unwrap() - 0.159).abs() < 1e-12);
        assert!((f.expandable.unwrap() - 0.019).abs() < 1e-12);
        let partial = parse(README, "lstm_lm_train");
        assert!(partial.default.is_some() && partial.expandable.is_none());
        assert_eq!(parse(README, "unknown"), PytorchFigures::default());
        assert_eq!(
            parse("no table here", "resnet50_train"),
            PytorchFigures::default()
        );
    }
}
