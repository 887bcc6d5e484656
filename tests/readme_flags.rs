//! The README's flag tables against the binary: every flag a table names must be in
//! `kvpick --help`, with the environment variable and the default the table states.
//!
//! A table is one whose first header cell names a flag (`flag`, `weight (flag)`) and that
//! has a `default` column. A row may name several flags; its default (and env) cell then
//! lists one value per flag, separated by `,`, `;` or ` / `, or one value for all of
//! them. A default is compared as:
//! - `–`: the flag has no default in `--help`;
//! - a number, with a unit where the flag's name implies one (`500 ms`, `600 s`,
//!   `8 MiB`): numerically equal to the default;
//! - `off` / `on`: the default is `false` / `true` (or, for `off`, a switch without one);
//! - any other single word: the same text;
//! - prose (a value computed at start-up, such as "¼ of the container memory limit"):
//!   the flag has no fixed default in `--help`.
//!
//! Parenthesised remarks in a cell are not part of its value.

use std::collections::HashMap;
use std::process::Command;

/// What `--help` says of one flag.
#[derive(Debug, Default)]
struct HelpFlag {
    env: Option<String>,
    default: Option<String>,
}

/// One flag named by a README table row.
#[derive(Debug)]
struct ReadmeFlag {
    line: usize,
    flag: String,
    env: Option<String>,
    default: String,
}

fn help_text() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .arg("--help")
        .output()
        .expect("run kvpick --help");
    assert!(out.status.success(), "kvpick --help failed: {out:?}");
    String::from_utf8(out.stdout).expect("--help is UTF-8")
}

/// Flags of `--help`'s long form: a line starting with `--name` (or `-x, --name`) opens a
/// flag; its `[env: NAME=]` and `[default: VALUE]` lines follow before the next one.
fn parse_help(help: &str) -> HashMap<String, HelpFlag> {
    let mut flags = HashMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let opener = trimmed
            .strip_prefix("--")
            .or_else(|| trimmed.split_once(", --").map(|(_, rest)| rest));
        if let (Some(rest), true) = (opener, (2..=8).contains(&indent)) {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            flags.insert(name.clone(), HelpFlag::default());
            current = Some(name);
            continue;
        }
        let Some(flag) = current.as_ref().and_then(|name| flags.get_mut(name)) else {
            continue;
        };
        if let Some(env) = trimmed.strip_prefix("[env: ") {
            flag.env = env.split('=').next().map(str::to_owned);
        } else if let Some(default) = trimmed.strip_prefix("[default: ") {
            flag.default = default.strip_suffix(']').map(str::to_owned);
        }
    }
    flags
}

/// The cell without its parenthesised remarks.
fn without_remarks(cell: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in cell.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.trim().to_owned()
}

/// Every backticked `--flag` in a cell.
fn flags_in(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| code.strip_prefix("--"))
        .map(|name| {
            name.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect()
        })
        .collect()
}

/// A cell's values for `n` flags: the whole cell when it holds one value for all.
fn values_for(cell: &str, n: usize) -> Vec<String> {
    let cell = without_remarks(cell);
    if n > 1 {
        let parts: Vec<String> = cell
            .split([',', ';'])
            .flat_map(|part| part.split(" / "))
            .map(|part| part.trim().to_owned())
            .collect();
        if parts.len() == n {
            return parts;
        }
    }
    vec![cell; n]
}

/// The README's flag tables, row by row.
fn parse_readme(readme: &str) -> Vec<ReadmeFlag> {
    let lines: Vec<&str> = readme.lines().collect();
    let cells = |line: &str| -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner.split('|').map(|c| c.trim().to_owned()).collect()
    };
    let mut rows = Vec::new();
    let mut i = 0;
    while i + 1 < lines.len() {
        let is_table = lines[i].starts_with('|') && lines[i + 1].starts_with("| ---");
        if !is_table {
            i += 1;
            continue;
        }
        let header = cells(lines[i]);
        let flag_col = header.first().is_some_and(|h| h.contains("flag"));
        let default_col = header.iter().position(|h| h == "default");
        let env_col = header.iter().position(|h| h == "env");
        i += 2;
        while i < lines.len() && lines[i].starts_with('|') {
            if let (true, Some(default_col)) = (flag_col, default_col) {
                let row = cells(lines[i]);
                let flags = flags_in(&row[0]);
                let defaults = values_for(&row[default_col], flags.len());
                let envs: Vec<Option<String>> = match env_col {
                    Some(col) => {
                        let named: Vec<String> = row[col]
                            .split('`')
                            .skip(1)
                            .step_by(2)
                            .map(str::to_owned)
                            .collect();
                        // `KVPICK_MM_*` and the like name a family, not each variable.
                        if named.len() == flags.len() && named.iter().all(|e| !e.contains('*')) {
                            named.into_iter().map(Some).collect()
                        } else {
                            vec![None; flags.len()]
                        }
                    }
                    None => vec![None; flags.len()],
                };
                for ((flag, default), env) in flags.into_iter().zip(defaults).zip(envs) {
                    rows.push(ReadmeFlag {
                        line: i + 1,
                        flag,
                        env,
                        default,
                    });
                }
            }
            i += 1;
        }
    }
    rows
}

/// A README number with an optional unit, in the unit the flag's name implies.
fn number(flag: &str, value: &str) -> Option<f64> {
    let (num, unit) = match value.split_once(' ') {
        Some((num, unit)) => (num, unit.trim()),
        None => (value, ""),
    };
    let num: f64 = num.replace(',', "").parse().ok()?;
    let scale = match unit {
        "" => 1.0,
        "ms" if flag.ends_with("-ms") => 1.0,
        "s" if flag.ends_with("-ms") => 1000.0,
        "s" if flag.ends_with("-secs") => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(num * scale)
}

/// Why the README's default for `flag` disagrees with `--help`'s, if it does.
fn default_mismatch(flag: &str, readme: &str, help: Option<&str>) -> Option<String> {
    let readme = readme.trim();
    let agrees = match (readme, help) {
        ("–" | "-", None) => true,
        ("–" | "-", Some(_)) => false,
        ("off", None | Some("false")) | ("on", Some("true")) => true,
        (value, Some(help)) if number(flag, value).is_some() => {
            help.parse::<f64>().ok() == number(flag, value)
        }
        (value, Some(help)) if !value.contains(' ') => value == help,
        // Prose: a value computed at start-up has no fixed default to show.
        (value, None) => value.contains(' '),
        (_, Some(_)) => false,
    };
    (!agrees).then(|| format!("README default {readme:?}, --help default {help:?}"))
}

#[test]
fn every_readme_flag_is_in_help_with_its_env_and_default() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let rows = parse_readme(&readme);
    let help = parse_help(&help_text());
    // Guards against a parser that finds nothing and so checks nothing.
    assert!(
        help.len() > 60,
        "parsed only {} flags from --help",
        help.len()
    );
    assert!(
        rows.len() > 40,
        "parsed only {} flags from the README's tables",
        rows.len()
    );

    let mut wrong = Vec::new();
    for row in &rows {
        let Some(found) = help.get(&row.flag) else {
            wrong.push(format!(
                "README.md:{}: --{} is not in kvpick --help",
                row.line, row.flag
            ));
            continue;
        };
        if let Some(env) = &row.env {
            if found.env.as_ref() != Some(env) {
                wrong.push(format!(
                    "README.md:{}: --{}: README env {env}, --help env {:?}",
                    row.line, row.flag, found.env
                ));
            }
        }
        if let Some(why) = default_mismatch(&row.flag, &row.default, found.default.as_deref()) {
            wrong.push(format!("README.md:{}: --{}: {why}", row.line, row.flag));
        }
    }
    assert!(
        wrong.is_empty(),
        "README flag tables disagree with kvpick --help:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn a_wrong_default_or_name_is_caught() {
    let readme = "\
| flag | env | default | meaning |
| --- | --- | --- | --- |
| `--grpc-port` | `KVPICK_GRPC_PORT` | 9003 | wrong default |
| `--grpc-portt` | `KVPICK_GRPC_PORT` | 9002 | wrong name |
| `--eject-base-ms` / `--eject-max-ms` | `KVPICK_EJECT_BASE_MS` / `KVPICK_EJECT_MAX_MS` | 1000 / 6 s | one wrong of two |
";
    let help = parse_help(&help_text());
    let rows = parse_readme(readme);
    assert_eq!(rows.len(), 4);
    assert!(default_mismatch("grpc-port", "9003", help["grpc-port"].default.as_deref()).is_some());
    assert!(!help.contains_key("grpc-portt"));
    let base = &rows[2];
    let max = &rows[3];
    assert_eq!(
        (base.flag.as_str(), max.flag.as_str()),
        ("eject-base-ms", "eject-max-ms")
    );
    assert!(default_mismatch(
        &base.flag,
        &base.default,
        help[&base.flag].default.as_deref()
    )
    .is_none());
    assert!(
        default_mismatch(&max.flag, &max.default, help[&max.flag].default.as_deref()).is_some()
    );
}
