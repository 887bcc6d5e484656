//! Duration flag values: a Go duration (`250ms`, `2s`, `1m30s`) or a bare
//! integer in the flag's own unit (`--drain-timeout-ms=120000` keeps meaning
//! milliseconds, `--prefix-ttl-secs=900` seconds), so existing command lines,
//! environment variables and charts keep working.

use std::time::Duration;

/// Parses `s` as a Go duration, or as a bare integer through `unit`.
fn parse_in(s: &str, unit: fn(u64) -> Duration) -> Result<Duration, String> {
    let t = s.trim();
    match t.parse::<u64>() {
        Ok(n) => Ok(unit(n)),
        Err(_) => parse_go_duration(t),
    }
}

/// A duration flag whose bare integers count milliseconds.
pub fn millis(s: &str) -> Result<Duration, String> {
    parse_in(s, Duration::from_millis)
}

/// A duration flag whose bare integers count seconds.
pub fn secs(s: &str) -> Result<Duration, String> {
    parse_in(s, Duration::from_secs)
}

/// [`millis`], refusing zero.
pub fn positive_millis(s: &str) -> Result<Duration, String> {
    match millis(s)? {
        d if d.is_zero() => Err("must be above zero".into()),
        d => Ok(d),
    }
}

/// Parses a Go `time.Duration` string such as `50ms`, `2s`, `1m30s` or `1.5h`.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = s;
    let mut total = 0f64;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{s:?}: missing unit (ns, us, ms, s, m, h)"))?;
        let value: f64 = rest[..num_end]
            .parse()
            .map_err(|_| format!("{s:?}: bad number"))?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            u => return Err(format!("{s:?}: unknown unit {u:?}")),
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).map_err(|_| format!("{s:?}: out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("50ms"), Ok(Duration::from_millis(50)));
        assert_eq!(parse_go_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_go_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m"), Ok(Duration::from_secs(3720)));
        assert_eq!(parse_go_duration("0"), Ok(Duration::ZERO));
        assert!(parse_go_duration("5").is_err());
        assert!(parse_go_duration("5d").is_err());
        assert!(parse_go_duration("").is_err());
    }

    #[test]
    fn bare_integers_keep_the_flags_unit() {
        assert_eq!(millis("250"), Ok(Duration::from_millis(250)));
        assert_eq!(secs("900"), Ok(Duration::from_secs(900)));
        assert_eq!(millis("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(secs("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(millis("0"), Ok(Duration::ZERO));
        assert!(positive_millis("0").is_err() && positive_millis("0s").is_err());
        assert!(millis("-1").is_err() && millis("5d").is_err() && secs("").is_err());
        assert!(millis("99999999999999999999h").is_err());
    }
}
