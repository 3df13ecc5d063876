//! What `labrun` and `labd` say to each other over HTTP (JSON bodies).
//!
//! Every path is under `/v1/`; all but `/v1/health` need
//! `Authorization: Bearer <token>`.
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | GET | `/v1/health` | → `ok` |
//! | GET | `/v1/info` | → [`Info`] |
//! | GET | `/v1/gpus` | → `[GpuStatus]` |
//! | POST | `/v1/jobs` | [`SubmitRequest`] → [`JobView`] |
//! | GET | `/v1/jobs` | → `[JobView]`: everyone's active jobs and those that ended in the last day |
//! | GET | `/v1/jobs?history=true&before=N&limit=M` | → `[JobView]`: ended jobs numbered below `jN`, newest first, `M` ≤ 1000 (default 100) |
//! | GET | `/v1/jobs/{id}` | → [`JobView`] |
//! | GET | `/v1/jobs/{id}/log?offset=N&wait_ms=M` | → log bytes from `N`; headers [`NEXT_OFFSET`], [`DONE`] |
//! | POST | `/v1/jobs/{id}/kill` | → [`JobView`] |

use serde::{Deserialize, Serialize};

use crate::leases::{JobMeta, JobState};

/// Response header: the log offset to ask for next.
pub const NEXT_OFFSET: &str = "x-labd-next-offset";
/// Response header: `true` once the job has ended, its outputs are saved
/// and the answer holds the last of its log.
pub const DONE: &str = "x-labd-done";

/// A snapshot the job runs on, pinned to one version by `labrun`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeRef {
    /// `NAME@vN`.
    pub label: String,
    /// Its snapshot id, so labd can tell the version moved under it.
    pub snapshot: String,
}

/// A dataset and the variable that carries its path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataRef {
    /// `LABRUN_DATA_DIV2K`.
    pub env: String,
    /// The snapshot.
    pub tree: TreeRef,
}

/// A job as `labrun` submits it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitRequest {
    /// The command, run in the code's folder.
    pub argv: Vec<String>,
    /// The submitter's environment (srun-style: the job sees the caller's
    /// `PATH`, virtualenv, …).
    pub env: Vec<(String, String)>,
    /// The code, materialised as the working folder; `None` runs in an empty one.
    pub code: Option<TreeRef>,
    /// Datasets, materialised read-only and shared.
    pub data: Vec<DataRef>,
    /// GPUs wanted.
    pub gpus: u32,
    /// Free memory wanted on each GPU, bytes.
    pub gpu_mem: u64,
    /// Folder (relative to the working folder) pushed as `runs/<job-id>`.
    pub outputs: Option<String>,
    /// Seconds between pushes of the outputs; `None`: labd's default.
    pub outputs_every_s: Option<u64>,
}

/// A job as `labrun ps` shows it. Its own type, not the stored
/// `JobRecord`: the record keeps a queued job's environment, which must
/// never reach another user through the API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    /// Job id.
    pub id: String,
    /// Who submitted it.
    pub user: String,
    /// The command.
    pub argv: Vec<String>,
    /// GPUs asked for.
    pub gpus_wanted: u32,
    /// GPUs held.
    pub gpus: Vec<u32>,
    /// Where it is.
    pub state: JobState,
    /// Why it is not running yet, in words.
    pub why: Option<String>,
    /// Submitted, started, ended (Unix seconds).
    pub submitted_at: u64,
    /// Started.
    pub started_at: Option<u64>,
    /// Ended.
    pub ended_at: Option<u64>,
    /// Code, data, work folder, outputs.
    pub meta: JobMeta,
}

impl JobView {
    /// True once the job has ended (exited, failed or killed).
    pub fn ended(&self) -> bool {
        matches!(
            self.state,
            JobState::Exited { .. } | JobState::Failed { .. }
        )
    }

    /// The exit code `labrun` returns: the job's own, 128 + signal, or 1.
    pub fn exit_code(&self) -> Option<i32> {
        match &self.state {
            JobState::Exited { code: Some(c), .. } => Some(*c),
            JobState::Exited {
                signal: Some(s), ..
            } => Some(128 + s),
            JobState::Exited { .. } | JobState::Failed { .. } => Some(1),
            _ => None,
        }
    }
}

/// Who and where: what `labrun` learns first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    /// labd's version.
    pub version: String,
    /// This node's name.
    pub node: String,
    /// The store labd materialises from and pushes outputs to; `labrun`
    /// pushes code there.
    pub store: String,
    /// The user the token belongs to.
    pub user: String,
    /// Whether that user may kill and read every job.
    pub admin: bool,
    /// The GPU inventory, in words.
    pub inventory: String,
}

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong and what to do.
    pub error: String,
}
