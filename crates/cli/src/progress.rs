//! indicatif behind the store's `Progress` trait; bars only on a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use labsync_store::Progress;

/// Draws one bar on stderr, restyled per phase.
pub struct Bar {
    bar: ProgressBar,
    quiet: bool,
    /// Items done in this phase, and its total when known (readers advance
    /// from several threads at once).
    items: std::sync::atomic::AtomicU64,
    total_items: std::sync::atomic::AtomicU64,
}

impl Bar {
    /// A bar when stderr is a terminal and output is for humans.
    pub fn new(quiet: bool) -> Bar {
        let bar = if quiet || !std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden())
        } else {
            ProgressBar::new_spinner()
        };
        Bar {
            bar,
            quiet,
            items: Default::default(),
            total_items: Default::default(),
        }
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
                // A push streams the tree, so it knows no totals: what was
                // done so far and how fast.
                self.bar.set_style(
                    ProgressStyle::with_template(
                        "{spinner} {msg} {bytes} {binary_bytes_per_sec} {prefix}",
                    )
                    .expect("valid template"),
                );
                self.bar
                    .enable_steady_tick(std::time::Duration::from_millis(120));
            }
        }
        use std::sync::atomic::Ordering::Relaxed;
        self.items.store(0, Relaxed);
        self.total_items
            .store(total_items.unwrap_or(u64::MAX), Relaxed);
        self.bar.set_prefix(match total_items {
            Some(n) => format!("0/{n}"),
            None => String::new(),
        });
        self.bar.set_message(name.to_string());
    }

    fn advance(&self, bytes: u64, items: u64) {
        self.bar.inc(bytes);
        if items > 0 {
            use std::sync::atomic::Ordering::Relaxed;
            let done = self.items.fetch_add(items, Relaxed) + items;
            self.bar.set_prefix(match self.total_items.load(Relaxed) {
                u64::MAX => format!("{done} files"),
                total => format!("{done}/{total}"),
            });
        }
    }

    fn warn(&self, message: &str) {
        if !self.quiet {
            self.bar
                .suspend(|| eprintln!("warning: {}", crate::shown(message)));
        }
    }
}
