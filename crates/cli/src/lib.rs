//! The labsync command-line tools: clap arguments become [`Settings`], then
//! one call into [`commands`], one module per subcommand. Progress bars
//! (indicatif) and printing live only here.

pub mod commands;
#[cfg(test)]
mod config_reference;
pub mod labd_config;
pub mod local;
pub mod progress;
pub mod settings;
pub mod slurm;

pub use settings::{parse_size, Backend, Overrides, Settings, SlurmSettings};

/// Caps glibc's malloc arenas at 2 (unless `MALLOC_ARENA_MAX` says
/// otherwise), for `labsync push`. glibc gives every thread that contends
/// an arena of its own, up to 8 per core, and a push's reader, hasher and
/// uploader threads each kept one: a million-file push peaked at 238-241 MB
/// RSS with the default and 209-214 MB with 2 arenas, in the same time
/// (8.6-9.4 s, warm). Pulls keep the default (one run was slower with the
/// cap; not measured enough to say). Call it before any thread starts.
pub fn cap_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before
        // any other thread exists.
        #[allow(unsafe_code)]
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

/// Whether logs on stderr are coloured: only for a terminal, and not
/// where `NO_COLOR` is set (<https://no-color.org>). labd's stderr is
/// mostly a file or the journal, where colour codes are noise.
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// What the binaries share before their one library call: logs on stderr
/// (filtered by `log_var`, else `default_filter`, coloured only on a
/// terminal) and a multi-threaded runtime. `None` (after saying why) when
/// the runtime cannot start.
pub fn start(bin: &str, log_var: &str, default_filter: &str) -> Option<tokio::runtime::Runtime> {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env(log_var)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR"),
        ))
        .init();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("{bin}: cannot start the runtime: {e}");
            None
        }
    }
}

/// `s` with its control characters (C0, DEL and C1, newlines too) and the
/// invisible marks that reorder or hide text (bidirectional overrides and
/// isolates, zero-width characters) written as escapes (`\u{1b}`), for one
/// field of a listing: other users' job commands, and what the store's
/// records say about who pushed, reach a terminal only as text, never as
/// bytes it acts on (colours, the window's title, the clipboard, a
/// carriage return over another row) nor as a row that reads otherwise
/// than it is.
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    shown_but(s, &[])
}

/// [`shown`], leaving the characters in `keep` as they are (a whole
/// listing's own newlines).
pub fn shown_but<'a>(s: &'a str, keep: &[char]) -> std::borrow::Cow<'a, str> {
    let escape = |c: char| (c.is_control() || invisible(c)) && !keep.contains(&c);
    if !s.chars().any(escape) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Characters that change how the text around them reads, or hide: the
/// bidirectional marks, embeddings, overrides and isolates, the zero-width
/// ones, the soft hyphen, the line and paragraph separators and the tags.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{ad}'
            | '\u{61c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{2069}'
            | '\u{feff}'
            | '\u{e0000}'..='\u{e007f}'
    )
}

pub use labsync_agent::human_bytes;

/// An error and its causes on one line, each cause said once: an error
/// whose message already quotes its cause (`cannot reach labd at …:
/// Connection refused`) does not get it again (`{e:#}` would print it twice).
pub fn said_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out += ": ";
        }
        out += &text;
    }
    out
}

/// `2026-12-03 03:04 +09:00`: Unix seconds in the reader's time zone
/// (`TZ`, else the system's), with its offset: a lab in Seoul reads its
/// own clock, and anyone can tell the instant (issue 43: times were UTC).
pub fn human_time(secs: i64) -> String {
    human_time_at(secs, labsync_store::utc_offset(secs).unwrap_or(0))
}

/// [`human_time`] at `offset` seconds from UTC.
pub fn human_time_at(secs: i64, offset: i32) -> String {
    let sign = if offset < 0 { '-' } else { '+' };
    let off = offset.unsigned_abs();
    format!(
        "{} {sign}{:02}:{:02}",
        labsync_agent::utc_time(secs + i64::from(offset)),
        off / 3600,
        off % 3600 / 60
    )
}

#[cfg(test)]
mod tests {

    #[test]
    fn control_characters_are_shown_as_text() {
        assert_eq!(shown("train.py --lr 0.1"), "train.py --lr 0.1");
        assert_eq!(
            shown("a\x1b]52;c;aGk=\x07b\rc\u{9b}2J\nd"),
            "a\\u{1b}]52;c;aGk=\\u{7}b\\rc\\u{9b}2J\\nd"
        );
        assert_eq!(
            shown_but("row one\nrow\x1b two", &['\n']),
            "row one\nrow\\u{1b} two"
        );
        // A right-to-left override makes a command read otherwise.
        assert_eq!(
            shown("python \u{202e}yp.niart\u{202c} x\u{200b}y\u{2066}z"),
            "python \\u{202e}yp.niart\\u{202c} x\\u{200b}y\\u{2066}z"
        );
        assert_eq!(
            shown("a\u{2028}b\u{ad}c\u{e0041}"),
            "a\\u{2028}b\\u{ad}c\\u{e0041}"
        );
        assert_eq!(shown("données ✓ 数据"), "données ✓ 数据");
    }

    use super::*;

    #[test]
    fn an_errors_causes_are_said_once() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let client = labsync_agent::ClientError::Connect {
            endpoint: "https://10.0.0.1:7420".into(),
            source: io,
        };
        let e = anyhow::Error::from(client).context("labd status");
        let said = said_error(&e);
        assert_eq!(said.matches("connection refused").count(), 1, "{said}");
        assert!(said.starts_with("labd status: cannot reach labd at https://10.0.0.1:7420"));
        // A cause the message does not quote is said.
        let e = anyhow::anyhow!("disk full").context("cannot write x");
        assert_eq!(said_error(&e), "cannot write x: disk full");
    }

    #[test]
    fn formats() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_020_000_000), "972.75 MiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_time_at(0, 0), "1970-01-01 00:00 +00:00");
        assert_eq!(human_time_at(1_796_220_000, 0), "2026-12-02 14:00 +00:00");
        assert_eq!(
            human_time_at(1_796_220_000, 9 * 3600),
            "2026-12-02 23:00 +09:00"
        );
        assert_eq!(
            human_time_at(1_796_220_000, -(3 * 3600 + 1800)),
            "2026-12-02 10:30 -03:30"
        );
    }

    #[test]
    fn logs_are_coloured_on_a_terminal_only_and_never_under_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a file or the journal: no codes");
        assert!(!colour(true, Some("1".into())));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
    }
}
