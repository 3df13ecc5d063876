//! Small helpers every role of labd uses: blocking work off the runtime,
//! and errors as one line.

/// Runs blocking work (the engine forks, waits and scans `/proc`; trees are
/// written and removed file by file) off the runtime: the store's helper,
/// the one of the workspace.
pub use labsync_store::off_runtime;

/// An error and its causes, as one line for a job's record: the store's
/// errors name the path and leave the OS's reason ("No space left on
/// device") to their source, which a user reading `labrun ps` needs too.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out += ": ";
            out += &s_text;
        }
        next = s.source();
    }
    out
}
