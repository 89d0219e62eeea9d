//! Units on the command line and in query parameters: durations
//! (`500ms`, `30s`, `1m30s`) and sizes (`64MiB`). Used by every
//! subcommand's arguments and by the HTTP layer; depends on nothing.

use std::time::Duration;

/// Parses a duration with units, as Go and Consul write them: `500ms`,
/// `30s`, `5m`, `1m30s`, `1.5s`. A unit is required; negatives are refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    const UNITS: &[(&str, f64)] = &[
        ("ns", 1e-9),
        ("us", 1e-6),
        ("µs", 1e-6),
        ("ms", 1e-3),
        ("s", 1.0),
        ("m", 60.0),
        ("h", 3600.0),
    ];
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if s.starts_with('-') {
        return Err(format!("{s:?} is negative"));
    }
    let mut rest = s;
    let mut total = 0.0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(format!("{s:?} is not a duration such as 500ms, 30s or 5m"));
        }
        let value: f64 = rest[..num_len]
            .parse()
            .map_err(|_| format!("{s:?} has a bad number"))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        if unit.is_empty() {
            return Err(format!("{s:?} needs a unit (ms, s, m or h)"));
        }
        let scale = UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|(_, scale)| scale)
            .ok_or_else(|| format!("{s:?} has an unknown unit {unit:?}"))?;
        total += value * scale;
        rest = &rest[unit_len..];
    }
    // A wait longer than anything representable is simply very long: the
    // cap applies to it like to any other long wait.
    Ok(Duration::try_from_secs_f64(total).unwrap_or(Duration::MAX))
}

/// A size in bytes: a number, optionally with `KiB`, `MiB` or `GiB`.
pub fn byte_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?}: use a number of bytes, or KiB, MiB or GiB"
            ));
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 64MiB)"))?;
    match n.checked_mul(scale) {
        Some(0) => Err("the size must be at least 1 byte".into()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_a_unit_and_accept_go_forms() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "30", "-1s", "s", "1x", "1.2.3s", "1e3s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        // Longer than anything representable: very long, capped later.
        assert_eq!(parse_duration("99999999999999999999h"), Ok(Duration::MAX));
        assert_eq!(
            parse_duration(&format!("{}s", "9".repeat(400))),
            Ok(Duration::MAX)
        );
        assert_eq!(
            parse_duration("30").unwrap_err(),
            "\"30\" needs a unit (ms, s, m or h)"
        );
    }
}
