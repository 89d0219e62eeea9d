//! The query string: strict form decoding and `?pretty`. Below the
//! extractors, the edge and auth, which all read it.

/// The query parameter that turns on pretty-printing.
pub const PRETTY: &str = "pretty";

/// Parses a raw query string; `None` if it is not valid form encoding,
/// including percent escapes that do not decode to UTF-8 (the decoder
/// would otherwise replace them with U+FFFD and go on).
pub fn query_pairs(query: Option<&str>) -> Option<Vec<(String, String)>> {
    let query = query.unwrap_or_default();
    if !escapes_are_utf8(query) {
        return None;
    }
    serde_urlencoded::from_str(query).ok()
}

/// Whether every `&`/`=`-separated part of `query` percent-decodes to
/// valid UTF-8.
fn escapes_are_utf8(query: &str) -> bool {
    if !query.contains('%') {
        return true;
    }
    query.split(['&', '=']).all(|part| {
        let bytes = part.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            match (
                bytes[i],
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) {
                (b'%', Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                (b, _, _) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        std::str::from_utf8(&out).is_ok()
    })
}

/// `?pretty`, `?pretty=true` and `?pretty=1` turn pretty-printing on,
/// `false` and `0` off; anything else is not a value of it (`None`).
pub fn pretty_on(value: &str) -> Option<bool> {
    match value {
        "" | "true" | "1" => Some(true),
        "false" | "0" => Some(false),
        _ => None,
    }
}
