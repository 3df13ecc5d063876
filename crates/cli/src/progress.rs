//! indicatif behind the store's `Progress` trait; bars only on a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use labsync_store::Progress;

/// Draws one bar on stderr, restyled per phase.
pub struct Bar {
    bar: ProgressBar,
    quiet: bool,
}

impl Bar {
    /// A bar when stderr is a terminal and output is for humans.
    pub fn new(quiet: bool) -> Bar {
        let bar = if quiet || !std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden())
        } else {
            ProgressBar::new_spinner()
        };
        Bar { bar, quiet }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Progress for Bar {
    fn phase(&self, name: &str, total_bytes: Option<u64>, total_items: Option<u64>) {
        self.bar.reset();
        match total_bytes {
            Some(t) => {
                self.bar.set_length(t);
                self.bar.set_style(
                    ProgressStyle::with_template(
                        "{msg:>8} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} ({prefix} files)",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
            }
            None => {
                self.bar.set_style(
                    ProgressStyle::with_template("{spinner} {msg} {prefix}")
                        .expect("valid template"),
                );
                self.bar
                    .enable_steady_tick(std::time::Duration::from_millis(120));
            }
        }
        self.bar.set_prefix(match total_items {
            Some(n) => format!("0/{n}"),
            None => String::new(),
        });
        self.bar.set_message(name.to_string());
    }

    fn advance(&self, bytes: u64, items: u64) {
        self.bar.inc(bytes);
        if items > 0 {
            let p = self.bar.prefix();
            if let Some((done, total)) = p.split_once('/') {
                let done: u64 = done.parse().unwrap_or(0) + items;
                self.bar.set_prefix(format!("{done}/{total}"));
            }
        }
    }

    fn warn(&self, message: &str) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("warning: {message}"));
        }
    }
}
