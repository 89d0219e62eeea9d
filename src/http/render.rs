//! The allocation view's JSON, written straight from the record: byte for
//! byte what serde_json writes for `AllocationView` (which stays the
//! reference: the OpenAPI document is made from it, and the tests here
//! compare the two on views whose strings need escaping and views whose
//! strings do not).
//!
//! A full answer to a report is one of these, with every task's event
//! history, and through serde writing it is the largest part of a
//! report's cost: every key and every string scanned byte by byte for
//! characters to escape, every time formatted into a `String` of its own,
//! and the view's strings copied out of the record first. Here keys are
//! literals, a string is scanned eight bytes at a time and copied whole
//! when nothing in it needs escaping (serde_json escapes the rest), and
//! a UTC time is written digit by digit (any other goes through `time`'s
//! own RFC 3339 formatter). Nothing is kept between answers: no memory
//! per event body or per string. Measured: see BENCHMARKS.md, "What
//! mattered" and "Current numbers".

use serde::Serializer as _;
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use super::views::{Liveness, TroubleView};
use crate::lifecycle::{Allocation, DepState, StopReason};

type Result = std::result::Result<(), serde_json::Error>;

/// `AllocationView::new(a, live)` as JSON, appended to `out`.
pub fn allocation(out: &mut Vec<u8>, a: &Allocation, live: &Liveness) -> Result {
    out.extend_from_slice(b"{\"id\":");
    string(out, a.id.as_str());
    out.extend_from_slice(b",\"coordinator_state\":");
    string(out, a.state.as_str());
    let waiting = a.waiting();
    out.extend_from_slice(b",\"waiting_on\":[");
    for (n, (name, _)) in waiting.iter().enumerate() {
        comma(out, n);
        string(out, name.as_str());
    }
    out.extend_from_slice(b"],\"waiting\":[");
    for (n, (_, why)) in waiting.iter().enumerate() {
        comma(out, n);
        string(out, why.as_str());
    }
    out.extend_from_slice(b"],\"outcome\":");
    let outcome = a.outcome();
    match &outcome {
        Some((o, _)) => string(out, o.as_str()),
        None => null(out),
    }
    out.extend_from_slice(b",\"failed_tasks\":[");
    for (n, name) in outcome.iter().flat_map(|(_, f)| f).enumerate() {
        comma(out, n);
        string(out, name.as_str());
    }
    out.extend_from_slice(b"],\"create_index\":");
    number(out, a.create_index)?;
    out.extend_from_slice(b",\"modify_index\":");
    number(out, a.modify_index)?;
    out.extend_from_slice(b",\"created_at\":");
    time(out, a.created_at)?;
    out.extend_from_slice(b",\"modified_at\":");
    time(out, a.modified_at)?;
    out.extend_from_slice(b",\"deadlines\":");
    let d = a.spec.deadlines();
    if d.is_empty() {
        null(out);
    } else {
        out.extend_from_slice(b"{\"prestart\":");
        duration(out, d.prestart);
        out.extend_from_slice(b",\"main\":");
        duration(out, d.main);
        out.extend_from_slice(b",\"poststart\":");
        duration(out, d.poststart);
        out.extend_from_slice(b",\"poststop\":");
        duration(out, d.poststop);
        out.push(b'}');
    }
    out.extend_from_slice(b",\"deadline_at\":");
    optional_time(out, a.deadline_at)?;
    out.extend_from_slice(b",\"trouble\":");
    // Rare, and words made for people: serde writes it.
    serde_json::to_writer(&mut *out, &TroubleView::all(a, &a.troubles()))?;
    out.extend_from_slice(b",\"tasks\":[");
    for i in 0..a.tasks.len() {
        comma(out, i);
        task(out, a, i, live)?;
    }
    out.extend_from_slice(b"]}");
    Ok(())
}

/// `StreamLine::change` for a change that leaves `a`: `{"type":
/// "Allocation", "index", "alloc_id", "allocation"}`, appended to `out`.
pub fn change_line(out: &mut Vec<u8>, index: u64, a: &Allocation, live: &Liveness) -> Result {
    out.extend_from_slice(b"{\"type\":\"Allocation\",\"index\":");
    number(out, index)?;
    out.extend_from_slice(b",\"alloc_id\":");
    string(out, a.id.as_str());
    out.extend_from_slice(b",\"allocation\":");
    allocation(out, a, live)?;
    out.push(b'}');
    Ok(())
}

/// Room for `a`'s view, so that it is written without growing its
/// buffer (a view with full histories is ~10 KiB).
pub fn size_hint(a: &Allocation) -> usize {
    let events: usize = a.tasks.iter().map(|t| t.events.len()).sum();
    512 + 640 * a.tasks.len() + 192 * events
}

/// `TaskView::new(a, i, live)` as JSON.
fn task(out: &mut Vec<u8>, a: &Allocation, i: usize, live: &Liveness) -> Result {
    let spec = &a.spec.tasks()[i];
    let t = &a.tasks[i];
    let desired = a.desired(i);
    out.extend_from_slice(b"{\"name\":");
    string(out, spec.name.as_str());
    out.extend_from_slice(b",\"lifecycle\":");
    match spec.lifecycle {
        Some(l) => {
            out.extend_from_slice(b"{\"hook\":");
            string(out, l.hook.as_str());
            out.extend_from_slice(b",\"sidecar\":");
            boolean(out, l.sidecar);
            out.push(b'}');
        }
        None => null(out),
    }
    out.extend_from_slice(b",\"leader\":");
    boolean(out, spec.leader);
    out.extend_from_slice(b",\"readiness\":");
    boolean(out, spec.readiness);
    out.extend_from_slice(b",\"stage\":");
    string(out, spec.stage().as_str());
    out.extend_from_slice(b",\"allowed\":");
    boolean(out, a.allowed(i));
    out.extend_from_slice(b",\"state\":");
    string(out, t.state.as_str());
    out.extend_from_slice(b",\"failed\":");
    boolean(out, t.failed);
    out.extend_from_slice(b",\"ready\":");
    boolean(out, t.ready);
    out.extend_from_slice(b",\"ready_at\":");
    optional_time(out, t.ready_at)?;
    out.extend_from_slice(b",\"restarts\":");
    number(out, t.restarts)?;
    out.extend_from_slice(b",\"started_at\":");
    optional_time(out, t.started_at)?;
    out.extend_from_slice(b",\"finished_at\":");
    optional_time(out, t.finished_at)?;
    out.extend_from_slice(b",\"last_restart\":");
    optional_time(out, t.last_restart)?;
    out.extend_from_slice(b",\"events\":[");
    for (n, e) in t.events.all().iter().enumerate() {
        comma(out, n);
        out.extend_from_slice(b"{\"type\":");
        string(out, e.kind.as_str());
        out.extend_from_slice(b",\"time\":");
        time(out, e.time())?;
        out.extend_from_slice(b",\"message\":");
        string(out, e.message.as_str());
        out.extend_from_slice(b",\"details\":{");
        for (n, (k, v)) in e.details.iter().enumerate() {
            comma(out, n);
            string(out, k);
            out.push(b':');
            string(out, v);
        }
        out.extend_from_slice(b"}}");
    }
    out.extend_from_slice(b"],\"desired\":");
    string(out, desired.kind().as_str());
    out.extend_from_slice(b",\"stop_reason\":");
    match desired.reason() {
        Some(r) => stop_reason(out, r),
        None => null(out),
    }
    out.extend_from_slice(b",\"restart_generation\":");
    number(out, t.restart_generation)?;
    out.extend_from_slice(b",\"modify_index\":");
    number(out, t.modify_index)?;
    out.extend_from_slice(b",\"run\":");
    match t.run {
        Some(run) => {
            out.push(b'"');
            number(out, run)?;
            out.push(b'"');
        }
        None => null(out),
    }
    out.extend_from_slice(b",\"liveness\":");
    match live.ttl(a, i) {
        Some(ttl) => {
            out.extend_from_slice(b"{\"ttl\":");
            duration(out, Some(ttl));
            out.push(b'}');
        }
        None => null(out),
    }
    out.extend_from_slice(b",\"lost\":");
    boolean(out, t.lost());
    out.extend_from_slice(b",\"last_seen\":");
    optional_time(out, live.last_seen(a, i))?;
    out.extend_from_slice(b",\"depends_on\":[");
    for (n, d) in spec.depends_on.iter().enumerate() {
        comma(out, n);
        out.extend_from_slice(b"{\"task\":");
        string(out, d.task.as_str());
        out.extend_from_slice(b",\"allocation\":");
        match &d.allocation {
            Some(id) => string(out, id.as_str()),
            None => null(out),
        }
        out.extend_from_slice(b",\"condition\":");
        string(out, d.condition.as_str());
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"blocked_by\":[");
    let mut n = 0;
    for (j, state) in a.blocked_by(i) {
        // As `views::dependencies`: a verdict without a dependency or a
        // reason is not shown.
        let (Some(d), Some(why)) = (spec.depends_on.get(j), state.why()) else {
            continue;
        };
        comma(out, n);
        n += 1;
        out.extend_from_slice(b"{\"allocation\":");
        string(out, d.allocation.as_ref().unwrap_or(&a.id).as_str());
        out.extend_from_slice(b",\"task\":");
        string(out, d.task.as_str());
        out.extend_from_slice(b",\"condition\":");
        string(out, d.condition.as_str());
        out.extend_from_slice(b",\"why\":");
        string(out, why.as_str());
        match state {
            DepState::Cycle(path) => {
                out.extend_from_slice(b",\"path\":[");
                for (n, step) in path.iter().enumerate() {
                    comma(out, n);
                    string(out, step);
                }
                out.push(b']');
            }
            DepState::Holds | DepState::Blocked(_) => {}
        }
        out.push(b'}');
    }
    for b in super::views::semaphores_blocking(live, i) {
        comma(out, n);
        n += 1;
        out.extend_from_slice(b"{\"semaphore\":");
        string(out, &b.semaphore);
        out.extend_from_slice(b",\"why\":");
        string(out, b.why.as_str());
        if let Some(p) = b.position {
            out.extend_from_slice(b",\"position\":");
            number(out, p as u64)?;
        }
        out.push(b'}');
    }
    if let Some(b) = super::views::barrier_blocking(live, i) {
        comma(out, n);
        out.extend_from_slice(b"{\"barrier\":");
        string(out, &b.barrier);
        out.extend_from_slice(b",\"why\":");
        string(out, b.why.as_str());
        if let Some(k) = b.arrived {
            out.extend_from_slice(b",\"arrived\":");
            number(out, k as u64)?;
        }
        out.extend_from_slice(b",\"size\":");
        number(out, u64::from(b.size))?;
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"acquire\":[");
    for (n, s) in spec.acquire.iter().enumerate() {
        comma(out, n);
        string(out, s.as_str());
    }
    out.extend_from_slice(b"],\"grants\":[");
    for (n, g) in super::views::grants(a, i).iter().enumerate() {
        comma(out, n);
        out.extend_from_slice(b"{\"semaphore\":");
        string(out, &g.semaphore);
        out.extend_from_slice(b",\"fence\":");
        number(out, g.fence)?;
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"barrier\":");
    match &spec.barrier {
        Some(b) => {
            out.extend_from_slice(b"{\"name\":");
            string(out, b.name.as_str());
            out.extend_from_slice(b",\"size\":");
            number(out, u64::from(b.size))?;
            out.extend_from_slice(b",\"timeout\":");
            duration(out, b.timeout);
            out.push(b'}');
        }
        None => null(out),
    }
    out.push(b'}');
    Ok(())
}

fn stop_reason(out: &mut Vec<u8>, r: &StopReason) {
    out.extend_from_slice(b"{\"type\":");
    string(out, r.kind.as_str());
    out.extend_from_slice(b",\"task\":");
    match &r.task {
        Some(t) => string(out, t.as_str()),
        None => null(out),
    }
    out.extend_from_slice(b",\"stage\":");
    match r.stage {
        Some(s) => string(out, s.as_str()),
        None => null(out),
    }
    if let Some(b) = &r.barrier {
        out.extend_from_slice(b",\"barrier\":");
        string(out, b.as_str());
    }
    out.push(b'}');
}

fn comma(out: &mut Vec<u8>, n: usize) {
    if n > 0 {
        out.push(b',');
    }
}

fn null(out: &mut Vec<u8>) {
    out.extend_from_slice(b"null");
}

fn boolean(out: &mut Vec<u8>, b: bool) {
    out.extend_from_slice(if b { b"true" } else { b"false" });
}

fn number(out: &mut Vec<u8>, n: u64) -> Result {
    serde_json::Serializer::new(out).serialize_u64(n)
}

/// A duration as `units::format_duration` writes it, or `null`.
fn duration(out: &mut Vec<u8>, d: Option<std::time::Duration>) {
    use std::io::Write;
    match d {
        // Its text is digits and unit letters: nothing to escape.
        Some(d) => {
            // Writing to a `Vec` cannot fail.
            let _ = write!(out, "\"{}\"", crate::units::Shown(d));
        }
        None => null(out),
    }
}

/// A JSON string: copied whole when nothing in it needs escaping, else
/// escaped by serde_json.
pub fn string(out: &mut Vec<u8>, s: &str) {
    if plain(s.as_bytes()) {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing to a `Vec` cannot fail.
        let _ = serde_json::Serializer::new(out).serialize_str(s);
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether a byte of `word` is below `n` (`n` ≤ 128): exact, since a
/// borrow only starts at such a byte.
fn has_below(word: u64, n: u8) -> bool {
    word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS != 0
}

/// Whether a byte of `word` is `b`.
fn has_byte(word: u64, b: u8) -> bool {
    has_below(word ^ (ONES * u64::from(b)), 1)
}

/// Whether serde_json writes `bytes` as they are: none of them a control
/// character (below 0x20), `"` or `\` (its `ESCAPE` table). Eight bytes
/// at a time.
pub fn plain(bytes: &[u8]) -> bool {
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut word = [0; 8];
        word.copy_from_slice(w);
        let word = u64::from_le_bytes(word);
        if has_below(word, 0x20) || has_byte(word, b'"') || has_byte(word, b'\\') {
            return false;
        }
    }
    words
        .remainder()
        .iter()
        .all(|&b| b >= 0x20 && b != b'"' && b != b'\\')
}

fn optional_time(out: &mut Vec<u8>, t: Option<OffsetDateTime>) -> Result {
    match t {
        Some(t) => time(out, t),
        None => {
            null(out);
            Ok(())
        }
    }
}

/// A time as `time::serde::rfc3339` writes it: a UTC time of years 0 to
/// 9999 digit by digit, any other through `time`'s formatter (which
/// refuses some, as it does for serde).
pub fn time(out: &mut Vec<u8>, t: OffsetDateTime) -> Result {
    let year = t.year();
    if !t.offset().is_utc() || !(0..10_000).contains(&year) {
        let text = t
            .format(&Rfc3339)
            .map_err(<serde_json::Error as serde::ser::Error>::custom)?;
        string(out, &text);
        return Ok(());
    }
    let (hour, minute, second, nanos) = t.to_hms_nano();
    let mut b = [0u8; 32];
    let digits = |b: &mut [u8], mut n: u32| {
        for d in b.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    b[0] = b'"';
    digits(&mut b[1..5], year.unsigned_abs());
    b[5] = b'-';
    digits(&mut b[6..8], u32::from(u8::from(t.month())));
    b[8] = b'-';
    digits(&mut b[9..11], u32::from(t.day()));
    b[11] = b'T';
    digits(&mut b[12..14], u32::from(hour));
    b[14] = b':';
    digits(&mut b[15..17], u32::from(minute));
    b[17] = b':';
    digits(&mut b[18..20], u32::from(second));
    let mut end = 20;
    if nanos != 0 {
        // The fraction without its trailing zeros.
        b[20] = b'.';
        digits(&mut b[21..30], nanos);
        end = 30;
        while b[end - 1] == b'0' {
            end -= 1;
        }
    }
    b[end] = b'Z';
    b[end + 1] = b'"';
    out.extend_from_slice(&b[..end + 2]);
    Ok(())
}

#[cfg(test)]
mod tests;
