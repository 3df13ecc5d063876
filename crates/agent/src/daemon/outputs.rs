//! The outputs saver: a job's `--outputs` folder pushed to the store as
//! `runs/<job-id>` every few minutes while it runs, and once more when it
//! ends, retried with backoff until that last push succeeds.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use labsync_store::{push, Codec, NoProgress, NodeCache, PushOptions, RunAs};

use super::logs::JobLogs;
use crate::blocking::{chain, off_runtime};
use crate::ids::JobId;
use crate::leases::{JobRecord, JobState};
use crate::node::Node;

/// How long a file in a running job's outputs must have been left alone
/// before a periodic push takes it as it is: `torch.save` writes in place,
/// and a copy taken mid-write would be the checkpoint a crash leaves.
const OUTPUTS_SETTLE: Duration = Duration::from_secs(5);

/// Outputs pushes running at once on a node, all jobs together: each lists
/// the store and reads its index, so a thousand jobs due at once must not
/// mean a thousand pushes at once. A periodic push due while these are
/// taken waits for the next tick; a final push waits for a place.
pub(crate) const OUTPUTS_AT_ONCE: usize = 2;

/// One push counted as running while it lives.
struct Running(
    Arc<(
        std::sync::atomic::AtomicUsize,
        std::sync::atomic::AtomicUsize,
    )>,
);

impl Running {
    /// Counts a push in; says in the log when more run at once than ever.
    fn start(
        counts: &Arc<(
            std::sync::atomic::AtomicUsize,
            std::sync::atomic::AtomicUsize,
        )>,
    ) -> Running {
        use std::sync::atomic::Ordering;
        let now = counts.0.fetch_add(1, Ordering::SeqCst) + 1;
        if counts.1.fetch_max(now, Ordering::SeqCst) < now {
            tracing::info!(
                "outputs pushes at once: {now}, the most so far (the node runs at most \
                 {OUTPUTS_AT_ONCE})"
            );
        }
        Running(counts.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Tries of a final outputs push that fails reading the outputs themselves.
const UNREADABLE_TRIES: u32 = 3;

/// The longest wait between two tries of a final outputs push: a store
/// outage of hours is normal, and the checkpoints wait for it.
const OUTPUTS_RETRY_MAX: Duration = Duration::from_secs(600);

/// Pushes jobs' outputs when they are due.
pub(crate) struct OutputsSaver {
    node: Arc<Node>,
    /// The store, once labd reached it: until then a push fails as it
    /// does while the store is down, and is tried again.
    store: Arc<super::StoreLink>,
    cache: Arc<NodeCache>,
    logs: Arc<JobLogs>,
    /// Recorded as the versions' host.
    node_name: String,
    compression: Codec,
    /// First wait before a failed final push is tried again.
    retry: Duration,
    /// Jobs whose outputs are being pushed right now.
    pushing: Mutex<HashSet<JobId>>,
    /// When each running job's outputs were last pushed, failed final
    /// pushes, and of those the ones that failed on the outputs themselves.
    pushed_at: Mutex<HashMap<JobId, (Instant, u32, u32)>>,
    /// Places for pushes running at once ([`OUTPUTS_AT_ONCE`]).
    places: Arc<tokio::sync::Semaphore>,
    /// Pushes running now, and the most that ever ran at once (said in
    /// the log each time it grows).
    running: Arc<(
        std::sync::atomic::AtomicUsize,
        std::sync::atomic::AtomicUsize,
    )>,
}

/// What the saver needs besides the engine and the store.
pub(crate) struct OutputsConfig {
    pub node_name: String,
    pub compression: Codec,
    pub retry: Duration,
}

impl OutputsSaver {
    pub fn new(
        node: Arc<Node>,
        store: Arc<super::StoreLink>,
        cache: Arc<NodeCache>,
        logs: Arc<JobLogs>,
        cfg: OutputsConfig,
    ) -> OutputsSaver {
        OutputsSaver {
            node,
            store,
            cache,
            logs,
            node_name: cfg.node_name,
            compression: cfg.compression,
            retry: cfg.retry,
            pushing: Mutex::new(HashSet::new()),
            pushed_at: Mutex::new(HashMap::new()),
            places: Arc::new(tokio::sync::Semaphore::new(OUTPUTS_AT_ONCE)),
            running: Arc::default(),
        }
    }

    /// Starts, each in its own task, the pushes of `jobs` (the active ones)
    /// that are due and not already running.
    pub fn start_due(self: &Arc<Self>, jobs: Vec<JobRecord>) {
        for j in jobs {
            if j.meta.outputs.is_none() {
                continue;
            }
            let ended = matches!(j.state, JobState::Exited { .. } | JobState::Failed { .. });
            if !self.due(&j, ended) {
                continue;
            }
            // A periodic push finds a place now or waits for the next tick
            // (and stays due); a final push waits for one.
            let place = match self.places.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) if ended => None,
                Err(_) => continue,
            };
            if self
                .pushing
                .lock()
                .expect("labd poisoned")
                .insert(j.id.clone())
            {
                /// Takes the job off `pushing` however its push ends (a
                /// panic too: else it would never be pushed again).
                struct Done(Arc<OutputsSaver>, JobId);
                impl Drop for Done {
                    fn drop(&mut self) {
                        let mut p = self.0.pushing.lock().unwrap_or_else(|e| e.into_inner());
                        p.remove(&self.1);
                    }
                }
                let done = Done(self.clone(), j.id.clone());
                let places = self.places.clone();
                tokio::spawn(async move {
                    let _place = match place {
                        Some(p) => p,
                        None => match places.acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => return,
                        },
                    };
                    let _running = Running::start(&done.0.running);
                    done.0.push(j, ended).await;
                    drop(done);
                });
            }
        }
    }

    /// A running job's periodic push after `outputs_every_s`; an ended job's
    /// final push at once, and after a failure once its backoff has passed.
    fn due(&self, j: &JobRecord, ended: bool) -> bool {
        match j.state {
            _ if ended => {
                j.meta.outputs_pending
                    && match self.pushed_at.lock().expect("labd poisoned").get(&j.id) {
                        Some(&(t, failed, _)) if failed > 0 => {
                            t.elapsed() >= self.retry_delay(failed)
                        }
                        _ => true,
                    }
            }
            JobState::Running { .. } => {
                let every = Duration::from_secs(j.meta.outputs_every_s);
                let at = self
                    .pushed_at
                    .lock()
                    .expect("labd poisoned")
                    .get(&j.id)
                    .copied();
                match at {
                    Some((t, _, _)) => t.elapsed() >= every,
                    None => j.started_at.is_some_and(|s| {
                        crate::leases::unix_now().saturating_sub(s) >= every.as_secs()
                    }),
                }
            }
            _ => false,
        }
    }

    /// Pushes `job`'s outputs (`last`: the push after it ended) and records
    /// the outcome in the job.
    async fn push(&self, job: JobRecord, last: bool) {
        let (Some(work), Some(out)) = (&job.meta.work, &job.meta.outputs) else {
            return;
        };
        let dir = work.join(out);
        let (result, unreadable) = self.push_folder(&job, &dir, out, last).await;
        let left_none = outputs_folder_is_there(&job, &dir).await == Ok(false);
        // Failed final pushes are counted (periodic ones are not: a store
        // that was down during the run must not cost the last checkpoint).
        // And those that failed on the outputs themselves, apart: a store
        // that was down twice must not make one passing error final.
        let (attempts, unreadable_attempts) = {
            let mut at = self.pushed_at.lock().expect("labd poisoned");
            let e = at.entry(job.id.clone()).or_insert((Instant::now(), 0, 0));
            let failed = last && result.is_err();
            *e = (
                Instant::now(),
                e.1 + u32::from(failed),
                e.2 + u32::from(failed && unreadable),
            );
            (e.1, e.2)
        };
        match &result {
            Ok(label) => tracing::info!("job {}: outputs saved as {label}", job.id),
            // The error names the job's files: the user's own names.
            Err(e) if last => tracing::warn!(
                "job {}: outputs not saved yet ({attempts} tries): {}; next try in {} s",
                job.id,
                crate::error::logged(e),
                self.retry_delay(attempts).as_secs()
            ),
            Err(e) => tracing::warn!(
                "job {}: outputs not saved: {}",
                job.id,
                crate::error::logged(e)
            ),
        }
        // Until the final push succeeds the job stays active, so its working
        // folder (the only copy of its checkpoints) is never swept. A job
        // that left no outputs folder has nothing to wait for; one whose
        // outputs cannot be read as its user gets UNREADABLE_TRIES tries, not
        // an eternity of them holding its folder and trees.
        let gave_up = unreadable && unreadable_attempts >= UNREADABLE_TRIES;
        let settled = last && (result.is_ok() || left_none || gave_up);
        let result = match result {
            Err(e) if gave_up => Err(format!(
                "{e} (gave up after {unreadable_attempts} tries: its outputs cannot be saved as \
                 they are)"
            )),
            r => r,
        };
        let node = self.node.clone();
        let id = job.id.clone();
        let r = off_runtime(move || {
            node.update_meta(&id, |m| {
                match result {
                    Ok(label) => {
                        m.outputs_saved = Some(label);
                        m.outputs_error = None;
                    }
                    Err(e) => m.outputs_error = Some(e),
                }
                m.outputs_failures = if last && !settled { attempts } else { 0 };
                if settled {
                    m.outputs_pending = false;
                }
            })
        })
        .await;
        if let Err(e) = r {
            tracing::error!("job state: {e}");
        }
        self.logs.wake(&job.id, None);
        if settled {
            self.pushed_at
                .lock()
                .expect("labd poisoned")
                .remove(&job.id);
        }
    }

    /// Pushes `dir` as `runs/<job>`, read as the job's user: the version's
    /// label, or the error and whether it was the outputs themselves that
    /// could not be read (a file the job's user made unreadable, a symlink
    /// out of the folder: that will not heal by waiting, unlike a store that
    /// is down or full).
    async fn push_folder(
        &self,
        job: &JobRecord,
        dir: &std::path::Path,
        out: &str,
        last: bool,
    ) -> (Result<String, String>, bool) {
        match outputs_folder_is_there(job, dir).await {
            Ok(true) => {}
            Ok(false) => return (Err(format!("the job left no {out} folder to save")), false),
            Err(e) => return (Err(e.message), e.denied),
        }
        let opts = PushOptions {
            name: format!("runs/{}", job.id),
            files_cache: Some(self.cache.files_cache_dir()),
            threads: 2,
            user: job.user.clone(),
            host: self.node_name.clone(),
            read_as: job.meta.run_as,
            settle: if last {
                settle_after_end(job, std::time::SystemTime::now())
            } else {
                // While the job runs, a checkpoint may be half saved: keep
                // its previous copy until it has been still for a while.
                Some(OUTPUTS_SETTLE)
            },
            compression: self.compression,
            provenance: Some(provenance(job, &self.node_name)),
        };
        let repo = match self.store.get() {
            Ok(r) => r.clone(),
            Err(why) => return (Err(why), false),
        };
        match push(&repo, dir, &opts, Arc::new(NoProgress)).await {
            // Named with its snapshot's id (`runs/j12@v3#ID`): the job's
            // record, `labrun ps` and a requeued run's LABRUN_RESUME_FROM
            // pin what this push wrote, and a record anyone overwrites
            // later is refused, not followed.
            Ok(o) => (
                Ok(format!("{}#{}", o.record.label(), o.record.snapshot)),
                false,
            ),
            Err(e) => {
                let (d, who) = (dir.to_path_buf(), job.meta.run_as);
                let canon = off_runtime(move || {
                    labsync_store::as_user(who, || d.canonicalize().ok())
                        .ok()
                        .flatten()
                })
                .await;
                // A push's only Invalid errors are about its source (a
                // tree deeper than a snapshot keeps, a nameless root).
                let unreadable = matches!(&e, labsync_store::Error::Invalid { .. })
                    || matches!(&e, labsync_store::Error::Io { path, .. }
                        if path.starts_with(dir)
                            || canon.as_ref().is_some_and(|c| path.starts_with(c)));
                (Err(chain(&e)), unreadable)
            }
        }
    }

    /// How long to wait after the `failed`-th failure of a final outputs push.
    fn retry_delay(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(20);
        self.retry
            .checked_mul(1u32 << doublings)
            .map_or(OUTPUTS_RETRY_MAX, |d| d.min(OUTPUTS_RETRY_MAX))
    }
}

/// The settle window of an ended job's final push. A job a signal ended
/// (`labrun kill`, preemption past the grace, the OOM killer) may have died
/// halfway through `torch.save`: a file modified in the [`OUTPUTS_SETTLE`]
/// before its end keeps the copy an earlier push recorded (or is left
/// out), as in the periodic pushes, so the version `LABRUN_RESUME_FROM`
/// names holds the last checkpoint that was whole. Any other end (it
/// exited by itself, or ended while labd was away, its status unknown) is
/// taken as it is.
fn settle_after_end(job: &JobRecord, now: std::time::SystemTime) -> Option<Duration> {
    if !matches!(
        job.state,
        JobState::Exited {
            signal: Some(_),
            ..
        }
    ) {
        return None;
    }
    // The end is known to the second, and recorded after the last write:
    // one second more covers the rounding.
    let ended = std::time::UNIX_EPOCH + Duration::from_secs(job.ended_at.unwrap_or(0));
    let since = now.duration_since(ended).unwrap_or_default();
    Some(OUTPUTS_SETTLE + Duration::from_secs(1) + since)
}

/// Whether `job`'s outputs folder `dir` is a folder, as the job's user
/// sees it (the job controls that path: a symlink to `/root/…` must not
/// tell root's answer), looked at off the runtime (a symlink into an
/// automount or a dead NFS server blocks a look).
/// Only "not there" is "no outputs": any other failure is an error (see
/// [`LookError`]), so the push is tried again and the folder kept.
async fn outputs_folder_is_there(
    job: &JobRecord,
    dir: &std::path::Path,
) -> Result<bool, LookError> {
    let (d, who) = (dir.to_path_buf(), job.meta.run_as);
    off_runtime(move || look_at_outputs(who, &d)).await
}

/// Why labd could not tell whether a job's outputs folder is there.
#[derive(Debug, PartialEq, Eq)]
struct LookError {
    message: String,
    /// The job's user may not look there (EACCES, EPERM: a link into a
    /// folder only root may enter): that will not heal by waiting, and is
    /// given up after [`UNREADABLE_TRIES`] as unreadable outputs are. Any
    /// other failure (EIO, ESTALE: a disk or an NFS server in trouble) is
    /// retried for as long as a store outage is.
    denied: bool,
}

/// [`outputs_folder_is_there`], blocking.
fn look_at_outputs(who: Option<RunAs>, dir: &std::path::Path) -> Result<bool, LookError> {
    let shown = || crate::error::logged(&dir.display().to_string());
    let looked = labsync_store::as_user(who, || std::fs::metadata(dir)).map_err(|e| LookError {
        message: format!("cannot look at {} as the job's user: {e}", shown()),
        denied: false,
    })?;
    match looked {
        Ok(m) => Ok(m.is_dir()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            Ok(false)
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(LookError {
            message: format!(
                "the job's user may not look at its outputs folder {}: {e}",
                shown()
            ),
            denied: true,
        }),
        Err(e) => Err(LookError {
            message: format!(
                "cannot look at the outputs folder {}: {e}; tried again, and the job's folder \
                 is kept until it is saved",
                shown()
            ),
            denied: false,
        }),
    }
}

/// What made `job`'s outputs, as its outputs' versions record it.
fn provenance(job: &JobRecord, node: &str) -> labsync_store::Provenance {
    let req = job.meta.request.as_ref();
    let tree = |t: &crate::proto::TreeRef| (t.label.clone(), t.snapshot);
    labsync_store::Provenance {
        job: job.id.to_string(),
        command: job.argv.clone(),
        code: req.and_then(|r| r.code.as_ref()).map(tree),
        data: req.map_or_else(Vec::new, |r| r.data.iter().map(|d| tree(&d.tree)).collect()),
        node: node.to_string(),
        gpus: job.meta.gpus_held.clone(),
        tier: req.and_then(|r| r.priority.clone()),
        started: job.started_at,
        ended: job.ended_at,
        exit: match &job.state {
            JobState::Exited { code: Some(c), .. } => Some(format!("exit {c}")),
            JobState::Exited {
                signal: Some(s), ..
            } => Some(format!("signal {s}")),
            JobState::Exited { .. } => Some("exited".into()),
            JobState::Failed { reason } => Some(format!("failed: {reason}")),
            JobState::Queued | JobState::Running { .. } => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, UNIX_EPOCH};

    use super::{look_at_outputs, settle_after_end, OUTPUTS_SETTLE};
    use crate::leases::{JobRecord, JobState};

    /// Issue 40, point 13: the final push of a killed job settles files
    /// as of its end; a job that exited by itself is taken as it is.
    #[test]
    fn a_killed_jobs_last_push_settles_as_of_its_end() {
        let job = |state: JobState| JobRecord {
            id: "j1".into(),
            user: "alice".into(),
            argv: vec![],
            gpus_wanted: 0,
            gpus: vec![],
            state,
            submitted_at: 0,
            started_at: Some(1_000),
            ended_at: Some(2_000),
            meta: Default::default(),
            queued: None,
        };
        let now = UNIX_EPOCH + Duration::from_secs(2_030);
        let exited = |code: i32, signal: Option<i32>| JobState::Exited {
            code: (signal.is_none()).then_some(code),
            signal,
        };
        assert_eq!(settle_after_end(&job(exited(0, None)), now), None);
        assert_eq!(settle_after_end(&job(exited(1, None)), now), None);
        let window = OUTPUTS_SETTLE + Duration::from_secs(31);
        assert_eq!(
            settle_after_end(&job(exited(137, Some(9))), now),
            Some(window)
        );
        let unknown = JobState::Failed {
            reason: "ended while labd was restarting; exit status unknown".into(),
        };
        assert_eq!(settle_after_end(&job(unknown), now), None);
    }

    /// Issue 40, point 14: only "not there" is "no outputs". A folder the
    /// job's user may not look into (EACCES) is an error given up after a
    /// few tries, as unreadable outputs are; any other failure (EIO, ESTALE)
    /// an error tried again for as long as it takes, the folder kept. Both
    /// were taken for "the job left no outputs", and its folder swept.
    #[test]
    fn an_outputs_folder_that_cannot_be_looked_at_is_not_no_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("ckpt")).unwrap();
        std::fs::write(work.join("file"), "").unwrap();
        assert_eq!(look_at_outputs(None, &work.join("ckpt")), Ok(true));
        assert_eq!(look_at_outputs(None, &work.join("none")), Ok(false));
        assert_eq!(look_at_outputs(None, &work.join("file/ckpt")), Ok(false));
        assert_eq!(look_at_outputs(None, &work.join("file")), Ok(false));
        // ELOOP stands in for EIO and ESTALE, which a test cannot make.
        std::os::unix::fs::symlink("loop", work.join("loop")).unwrap();
        let e = look_at_outputs(None, &work.join("loop")).unwrap_err();
        assert!(!e.denied && e.message.contains("tried again"), "{e:?}");
        if !rustix::process::geteuid().is_root() {
            return; // Looking as another user needs root.
        }
        // As nobody, behind a folder only root may enter.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = look_at_outputs(
            Some(labsync_store::RunAs {
                uid: 65534,
                gid: 65534,
            }),
            &work.join("ckpt"),
        )
        .unwrap_err();
        assert!(e.denied && e.message.contains("ermission denied"), "{e:?}");
    }
}
