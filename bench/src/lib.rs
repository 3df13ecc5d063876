//! `labsync-bench`: a reproducible benchmark of `labsync push`/`pull` against
//! rsync, rclone, restic, borg and casync on seeded data sets.
//!
//! The binary `sync-bench` drives it; the library split exists so each part
//! (data generation, chunk accounting, command lines, reporting) is testable
//! on its own and so `chunks::changed_chunk_bytes` can later be swapped for
//! the store's chunker.
// An internal harness: its modules are not a published API.
#![allow(missing_docs)]

pub mod bench;
pub mod browser;
pub mod chunks;
pub mod cli;
pub mod datagen;
pub mod fsutil;
pub mod machine;
pub mod report;
pub mod runner;
pub mod sim;
pub mod tools;
