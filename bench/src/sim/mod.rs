//! The trace-driven placement simulator (`placement-sim`): a discrete-event
//! cluster replaying a workload through each placement policy, labsync's
//! being `labsync-placer` itself.

pub mod engine;
pub mod report;
pub mod workload;

pub use engine::{simulate, Outcome, Policy, Setup};
pub use report::{summarise, Summary};
pub use workload::{Job, Kind, Workload};
