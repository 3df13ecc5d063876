//! `labd`'s library, first part: what a GPU server's GPUs are doing and who
//! may use them.
//!
//! - [`GpuInventory`]: NVML ([`Nvml`]), a config-driven [`FakeGpus`] for tests
//!   and demos (with injectable foreign processes and hangs), or [`NoGpus`] on a
//!   node without the NVML library — chosen by [`detect`] and logged.
//! - [`Watchdog`]: inventory reads off the caller's thread under a deadline; a
//!   hang gives [`Reading::Unknown`], and unknown GPUs are never leased.
//! - [`classify`]: free / leased / foreign (pid, user, memory) / unknown.
//! - [`Leases`]: atomic, persistent GPU leases and job records (redb), with
//!   [`Leases::reconcile`] adopting live jobs and freeing dead ones after a restart.
//! - [`Node`]: the engine: a FIFO queue over the GPUs, leases, the runner.
//! - [`spawn`] / [`kill_session`]: a job is a Unix session, and a cgroup of
//!   its own ([`Cgroups`]) where labd can make one; killing it leaves no
//!   process of it alive, whatever it forked, ignored or `setsid`ed.
//! - [`Daemon`]: labd, split by role: the engine, shared read-only trees of
//!   code and data ([`Trees`]) with their housekeeping, the outputs saver
//!   (`runs/<job-id>`) and the job logs, behind the API's operations;
//!   [`serve`]d over HTTP ([`proto`] lists the routes) to a [`Client`].
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use labsync_agent::{classify, free_gpus, FakeGpus, Watchdog};
//!
//! let fake = FakeGpus::new("4x11GiB", None).unwrap();
//! let dog = Watchdog::new(Arc::new(fake), Duration::from_secs(2));
//! let status = classify(&dog.poll(), &[], &Default::default(), &|_| None, &|_| None, 256 << 20);
//! assert_eq!(free_gpus(&status, 10 << 30), vec![0, 1, 2, 3]);
//! ```
#![deny(missing_docs)]

mod api;
mod auth;
mod blocking;
mod buffers;
mod cgroup;
mod client;
mod clock;
pub mod cluster;
mod daemon;
pub mod devices;
mod error;
mod fake;
mod gpu;
mod ids;
mod jobs;
pub mod keeper;
mod lane;
mod leases;
mod metrics;
mod node;
mod notify;
pub mod proto;
mod request;
pub mod rlimits;
mod runner;
mod secret;
pub mod slurm;
mod status;
mod store_guard;
pub mod tls;
pub mod tokens;
pub mod trees;
mod users;
mod watchdog;
mod web;
mod wire;

pub use api::{router, serve, Listener};
pub use blocking::off_runtime;
pub use cgroup::{Cgroups, Flavor, JobLimits};
pub use client::{Client, Endpoint, LogPiece};
pub use clock::{utc_time, Clock, Hand};
pub use daemon::shares::human_bytes;
pub use daemon::{ConnLimits, Daemon, DaemonConfig, DaemonError, SlurmCheck, CACHE_CAP_FILE};
pub use devices::GpuDevices;
pub use error::{
    ApiError, ClientError, InventoryError, JobError, LeaseError, PrepareError, SetupError,
};
pub use fake::FakeGpus;
pub use gpu::{detect, GpuInfo, GpuInventory, GpuProcess, NoGpus, Nvml};
pub use jobs::Jobs;
pub use keeper::{keep_log_if_asked, KEEP_LOG};
pub use leases::{unix_now, JobMeta, JobRecord, JobState, Leases, QueuedSpec};
pub use node::{probe_cgroups, Node, NodeConfig, NodeError, Submit};
pub use notify::{target_ok as notify_target_ok, NotifyConfig};
pub use request::{
    command_bytes, variable_bytes, Caller, LogRead, MAX_COMMAND_BYTES, MAX_DATASETS,
    MAX_TIME_LIMIT_S,
};
pub use rlimits::LoginLimits;
pub use runner::{alive, kill_session, session_members, spawn, JobSpec, Started};
pub use secret::{RedactedOptions, Secret};
pub use status::{
    classify, free_gpus, process_session, process_user, ForeignProcess, GpuState, GpuStatus,
};
pub use store_guard::check_root_store;
pub use trees::{check_outputs, make_workdir, remove_tree, Trees};
pub use users::{current_user, euid, user_by_name, user_by_uid, UnixUser};
pub use watchdog::{Reading, Watchdog};
pub use web::{Access, LogsTo, WebConfig};
