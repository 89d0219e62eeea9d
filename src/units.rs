//! Units on the command line and in query parameters: durations
//! (`500ms`, `30s`, `1m30s`), sizes (`64MiB`) and listen addresses. Used
//! by every subcommand's arguments and by the HTTP layer; depends on
//! nothing.

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

/// Writes a duration as `parse_duration` reads it, to the millisecond:
/// `500ms`, `30s`, `1.5s`, `5m`, `1h30m`, `7d` is `168h`.
pub fn format_duration(d: Duration) -> String {
    Shown(d).to_string()
}

/// A duration as `format_duration` writes it, written straight into a
/// formatter: an answer writes one per task under a TTL, and building a
/// `String` for each costs (measured: see BENCHMARKS.md, "Where a
/// report's time goes (2026-11-26)").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shown(pub Duration);

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0.as_millis();
        if ms == 0 {
            return f.write_str("0s");
        }
        if ms < 1000 {
            return write!(f, "{ms}ms");
        }
        let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
        let (m, rest) = (rest / 60_000, rest % 60_000);
        let (s, frac) = (rest / 1000, rest % 1000);
        if h > 0 {
            write!(f, "{h}h")?;
        }
        if m > 0 {
            write!(f, "{m}m")?;
        }
        if s > 0 || frac > 0 {
            write!(f, "{s}")?;
            if frac > 0 {
                // Milliseconds as a decimal fraction without trailing
                // zeros: 500 is ".5", 50 ".05", 5 ".005".
                let (mut digits, mut width) = (frac, 3);
                while digits % 10 == 0 {
                    digits /= 10;
                    width -= 1;
                }
                write!(f, ".{digits:0width$}")?;
            }
            f.write_str("s")?;
        }
        Ok(())
    }
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

/// A size in bytes as [`byte_size`] reads it, or `0` for "none": what a
/// flag whose 0 hands the choice back to the kernel takes.
pub fn byte_size_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    byte_size(s)
}

/// A listen address as operators write it: `127.0.0.1:8080`,
/// `[::1]:8080`, a host name (`localhost:8080`, its first address), or
/// `:8080` for every interface.
pub fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::{SocketAddr, ToSocketAddrs};
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Some(port) = s.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{s:?}: expected HOST:PORT or :PORT"))?;
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if !s.contains(':') {
        return Err(format!(
            "{s:?}: expected HOST:PORT or :PORT (the port is required)"
        ));
    }
    let mut addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("{s:?}: {e}"))?
        .collect();
    // `localhost` is both 127.0.0.1 and ::1: take IPv4 first, as clients
    // that try `localhost:PORT` usually do.
    addrs.sort_by_key(|a| !a.is_ipv4());
    addrs
        .into_iter()
        .next()
        .ok_or_else(|| format!("{s:?}: the name has no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_size_is_none_only_where_it_may_be() {
        assert_eq!(byte_size_or_zero("0"), Ok(0));
        assert_eq!(byte_size_or_zero("256KiB"), Ok(256 << 10));
        assert!(byte_size_or_zero("").is_err());
        assert!(byte_size_or_zero("0 parsecs").is_err());
        assert!(byte_size("0").is_err());
    }

    #[test]
    fn durations_are_written_as_they_are_read() {
        for (d, text) in [
            (Duration::from_millis(500), "500ms"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(1250), "1.25s"),
            (Duration::from_secs(300), "5m"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(5400), "1h30m"),
            (Duration::from_secs(7 * 24 * 3600), "168h"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(format_duration(d), text);
            assert_eq!(parse_duration(text), Ok(d), "{text} reads back");
        }
        // Below a millisecond is cut, never rounded up.
        assert_eq!(format_duration(Duration::from_micros(1_999_999)), "1.999s");
    }

    /// `Shown` written the plain way, with `String`s: the reference it must
    /// match.
    fn format_duration_by_strings(d: Duration) -> String {
        let ms = d.as_millis();
        if ms == 0 {
            return "0s".to_owned();
        }
        if ms < 1000 {
            return format!("{ms}ms");
        }
        let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
        let (m, rest) = (rest / 60_000, rest % 60_000);
        let (s, frac) = (rest / 1000, rest % 1000);
        let mut out = String::new();
        if h > 0 {
            out.push_str(&format!("{h}h"));
        }
        if m > 0 {
            out.push_str(&format!("{m}m"));
        }
        if s > 0 || frac > 0 {
            if frac == 0 {
                out.push_str(&format!("{s}s"));
            } else {
                let frac = format!("{frac:03}");
                out.push_str(&format!("{s}.{}s", frac.trim_end_matches('0')));
            }
        }
        out
    }

    #[test]
    fn shown_writes_what_a_string_building_writer_writes() {
        let mut ms: Vec<u64> = (0..5_000).collect();
        ms.extend((0..2_000).map(|i| i * 997));
        ms.extend([
            59_999,
            60_000,
            60_001,
            3_599_999,
            3_600_000,
            3_600_500,
            3_661_010,
            86_400_000 * 400 + 7,
        ]);
        for ms in ms {
            for d in [
                Duration::from_millis(ms),
                Duration::from_micros(ms * 1000 + 999),
            ] {
                assert_eq!(Shown(d).to_string(), format_duration_by_strings(d), "{d:?}");
            }
        }
    }

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

    #[test]
    fn listen_addresses_as_operators_write_them() {
        use std::net::SocketAddr;
        let a = |s: &str| parse_listen(s).unwrap();
        assert_eq!(
            a("127.0.0.1:8080"),
            SocketAddr::from(([127, 0, 0, 1], 8080))
        );
        assert_eq!(a(":8080"), SocketAddr::from(([0, 0, 0, 0], 8080)));
        assert_eq!(a("[::1]:9"), "[::1]:9".parse::<SocketAddr>().unwrap());
        let local = a("localhost:8080");
        assert!(local.ip().is_loopback() && local.port() == 8080, "{local}");
        assert!(parse_listen("localhost").unwrap_err().contains("port"));
        assert!(parse_listen(":http").is_err());
    }
}
