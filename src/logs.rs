//! How the text log writes fields: exactly as tracing-subscriber's own
//! formatter (`DefaultFields`) does, with one shortcut. Without styling, a
//! field is written directly (`name=` and its value; a string that needs
//! no escaping as itself between quotes), not through `core::fmt` with
//! styling that is off. Every request's span has three such fields
//! (method, route, request ID), and the log layer writes them when the
//! span is made, whether anything is logged in it or not: through
//! `DefaultFields` that was 11% of a heartbeat's instructions, and the
//! method (a `%` field) another 4% (`taskgate-bench --scenarios
//! instructions`).

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::{
    field::{RecordFields, VisitOutput},
    fmt::{
        FormatFields,
        format::{DefaultVisitor, Writer},
    },
};

/// The text log's field formatter (see the module's comment).
#[derive(Clone, Copy, Debug, Default)]
pub struct LogFields;

impl<'w> FormatFields<'w> for LogFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        // The buffer's `Writer::new` styles nothing and escapes control
        // characters in messages and errors: a writer that does otherwise
        // (a log layer told `with_ansi_sanitization(false)`) is written to
        // directly.
        if writer.has_ansi_escapes() || !writer.sanitizes_ansi_escapes() {
            return record(writer, fields);
        }
        // Without styling, into a buffer and then into the writer at
        // once: a span's fields are kept in a string that grew five times
        // when written piece by piece.
        let mut buffer = String::with_capacity(256);
        let recorded = record(Writer::new(&mut buffer), fields);
        writer.write_str(&buffer)?;
        recorded
    }
}

fn record<R: RecordFields>(writer: Writer<'_>, fields: R) -> fmt::Result {
    let mut visitor = Fields {
        writer,
        empty: true,
        result: Ok(()),
    };
    fields.record(&mut visitor);
    visitor.result
}

/// Writes one set of fields: plain strings itself, the rest through
/// `DefaultVisitor`, one field at a time, on the same writer.
struct Fields<'w> {
    writer: Writer<'w>,
    /// Nothing written yet (the next field needs no separating space).
    empty: bool,
    result: fmt::Result,
}

impl Fields<'_> {
    /// The field as `DefaultVisitor` writes it.
    fn default(&mut self, field: &Field, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        if self.result.is_err() {
            return;
        }
        let mut visitor = DefaultVisitor::new(self.writer.by_ref(), self.empty);
        record(&mut visitor);
        self.result = visitor.finish();
        // It writes every field but the `log.` ones (a `log` record's
        // metadata, written elsewhere).
        self.empty &= field.name().starts_with("log.");
    }
}

/// Whether `s` is written by `Debug` as itself between quotes: printable
/// ASCII, no quote and no backslash.
fn plain(s: &str) -> bool {
    s.bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
}

impl Fields<'_> {
    /// Whether this field is written here, not by `DefaultVisitor`: no
    /// styling, and not a name it writes in a way of its own.
    fn direct(&self, field: &Field) -> bool {
        let name = field.name();
        let special = name == "message" || name.starts_with("r#") || name.starts_with("log.");
        !special && !self.writer.has_ansi_escapes() && self.result.is_ok()
    }

    /// ` name=` and then the value, as `DefaultVisitor` writes it with
    /// styling off.
    fn write(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        let w = &mut self.writer;
        let pad = if self.empty { "" } else { " " };
        self.result = (|| {
            w.write_str(pad)?;
            w.write_str(field.name())?;
            w.write_char('=')?;
            value(w)
        })();
        self.empty = false;
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if !self.direct(field) || !plain(value) {
            return self.default(field, |v| v.record_str(field, value));
        }
        self.write(field, |w| {
            w.write_char('"')?;
            w.write_str(value)?;
            w.write_char('"')
        });
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.default(field, |v| v.record_error(field, value));
    }

    /// Also every number and bool (`Visit`'s defaults) and `%` fields
    /// (`DisplayValue`, whose `Debug` is its `Display`): the request span's
    /// method is one.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if !self.direct(field) {
            return self.default(field, |v| v.record_debug(field, value));
        }
        self.write(field, |w| write!(w, "{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use tracing::field::Empty;
    use tracing_subscriber::fmt::{MakeWriter, format::DefaultFields};

    use super::*;

    /// A log kept in memory.
    #[derive(Clone, Default)]
    struct Kept(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Kept {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Kept {
        type Writer = Kept;
        fn make_writer(&'a self) -> Kept {
            self.clone()
        }
    }

    /// A value whose formatting fails after writing part of it.
    struct Fails;

    impl fmt::Display for Fails {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("half")?;
            Err(fmt::Error)
        }
    }

    /// What the text log writes for spans and events of every kind of
    /// field, through `fields`, with ANSI styling or without, and with the
    /// control characters of messages and errors escaped or not.
    fn logged<N>(fields: N, ansi: bool, sanitized: bool) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let kept = Kept::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(kept.clone())
            .with_ansi(ansi)
            .with_ansi_sanitization(sanitized)
            .without_time()
            .fmt_fields(fields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let strings = [
                "/v1/allocations/{alloc_id}",
                "0123456789abcdef0123456789abcdef",
                "with space and 'single' quotes ~!",
                "a \"quote\"",
                "back\\slash",
                "new\nline",
                "tab\there",
                "\u{1b}[31mred",
                "ünïcode",
                "",
                "del\u{7f}",
                "c1 \u{9b}31m",
            ];
            for s in strings {
                let span =
                    tracing::info_span!("request", method = %"PUT", route = s, request_id = s);
                let _in = span.enter();
                tracing::info!(
                    field = s,
                    r#type = s,
                    n = 7u64,
                    f = 1.5,
                    yes = true,
                    "message {s}"
                );
                tracing::warn!(message = s, other = ?s, shown = %s);
                let e = io::Error::other(format!("failed: {s}"));
                tracing::error!(error = &e as &(dyn std::error::Error + 'static), after = s);
                span.record("route", "changed");
                tracing::info!(last = s);
            }
            tracing::info!(only = "plain");
            tracing::info!(n = 1i64, first = "plain", then = "plain too");
            tracing::info!(long = "x".repeat(1000), next = 1u8);
            // `log.` fields (a `log` record's metadata: not written, and no
            // space for them), fields recorded after their span was made,
            // and a value whose formatting fails (what was written of the
            // span's fields is kept; the event is not written).
            tracing::info!(log.target = "t", first = 1, log.file = "f", then = "x");
            let span = tracing::info_span!("later", a = Empty, b = Empty, c = 3);
            span.in_scope(|| {
                span.record("b", "plain");
                tracing::info!("recorded");
                span.record("a", tracing::field::display(Fails));
                span.record("b", 5);
                tracing::info!("after a failed record");
            });
            let span = tracing::info_span!("empty", a = Empty);
            span.in_scope(|| {
                tracing::info!("nothing recorded");
                span.record("a", "x");
                tracing::info!("recorded");
            });
            tracing::info!(a = 1, bad = %Fails, b = 2);
        });
        let bytes = kept.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn fields_are_written_exactly_as_tracing_subscriber_writes_them() {
        for (ansi, sanitized) in [(false, true), (true, true), (false, false), (true, false)] {
            let ours = logged(LogFields, ansi, sanitized);
            let theirs = logged(DefaultFields::new(), ansi, sanitized);
            assert!(
                ours.contains(r#"route="/v1/allocations/{alloc_id}""#) || ansi,
                "{ours}"
            );
            assert_eq!(ours, theirs, "ansi: {ansi}, sanitized: {sanitized}");
        }
    }

    #[test]
    fn only_printable_ascii_without_quotes_or_backslashes_is_plain() {
        for s in ["", "abc", "a b", "~!'{}", "/v1/x"] {
            assert!(plain(s), "{s:?}");
            assert_eq!(format!("{s:?}"), format!("\"{s}\""));
        }
        for s in ["\"", "\\", "\n", "\t", "\u{7f}", "é", "\u{1b}"] {
            assert!(!plain(s), "{s:?}");
        }
    }
}
