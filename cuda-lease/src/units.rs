//! Human sizes and durations for the programs' flags: `1G`, `512M`,
//! `64KiB` or a plain number of bytes; `90s`, `1h`, `500ms` or a plain
//! number in the flag's own unit.

use std::time::Duration;

/// Bytes from `4096`, `64K`, `512M`, `1G`, `2T` (powers of 1024; an
/// optional `i`, `B` or `iB` after the letter, any case).
///
/// # Errors
/// What is wrong with the text, for the flag's error message.
///
/// # Examples
///
/// ```
/// use cuda_lease::units::parse_bytes;
/// assert_eq!(parse_bytes("1G"), Ok(1 << 30));
/// assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
/// assert_eq!(parse_bytes("4096"), Ok(4096));
/// assert!(parse_bytes("1Q").is_err());
/// ```
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a size (write 4096, 64K, 512M, 1G...)"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        other => {
            return Err(format!(
                "`{s}`: unknown size unit `{other}` (use K, M, G or T: powers of 1024)"
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// A duration from `500ms`, `90s`, `15m`, `1h`, `2d`, or a plain number
/// of `plain` units (the flag's unit before units were accepted).
///
/// # Errors
/// What is wrong with the text, for the flag's error message.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use cuda_lease::units::parse_duration;
/// let secs = Duration::from_secs(1);
/// assert_eq!(parse_duration("1h", secs), Ok(Duration::from_secs(3600)));
/// assert_eq!(parse_duration("250ms", secs), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_duration("90", secs), Ok(Duration::from_secs(90)));
/// ```
pub fn parse_duration(s: &str, plain: Duration) -> Result<Duration, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let n: u32 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (write 500ms, 90s, 15m, 1h...)"))?;
    let one = match unit.trim().to_ascii_lowercase().as_str() {
        "" => plain,
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" | "min" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        other => {
            return Err(format!(
                "`{s}`: unknown duration unit `{other}` (use ms, s, m, h or d)"
            ))
        }
    };
    one.checked_mul(n)
        .ok_or_else(|| format!("`{s}` is too long"))
}

/// [`parse_duration`] whose plain numbers are seconds (for clap).
///
/// # Errors
/// As [`parse_duration`].
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    parse_duration(s, Duration::from_secs(1))
}

/// [`parse_duration`] whose plain numbers are milliseconds (for clap).
///
/// # Errors
/// As [`parse_duration`].
pub fn parse_millis(s: &str) -> Result<Duration, String> {
    parse_duration(s, Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse_and_bad_ones_say_why() {
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2gb"), Ok(2 << 30));
        assert_eq!(parse_bytes(" 7 "), Ok(7));
        assert!(parse_bytes("").unwrap_err().contains("not a size"));
        assert!(parse_bytes("1.5G")
            .unwrap_err()
            .contains("unknown size unit"));
        assert!(parse_bytes("99999999999T")
            .unwrap_err()
            .contains("too large"));
        let ms = Duration::from_millis(1);
        assert_eq!(parse_duration("5000", ms), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2d", ms), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_secs("15m"), Ok(Duration::from_secs(900)));
        assert!(parse_secs("1w")
            .unwrap_err()
            .contains("unknown duration unit"));
        assert!(parse_secs("h").unwrap_err().contains("not a duration"));
    }
}
