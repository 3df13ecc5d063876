//! What a caller may ask of labd: who is calling ([`Caller`]), and the
//! checks every submission passes before anything is reserved for it
//! (bounded strings, a command, an outputs folder inside the code, data
//! variables that are ones). The node and the coordinator both check a
//! request here, so neither has to name the other.

use crate::error::JobError;
use crate::proto::SubmitRequest;
use crate::trees::check_outputs;

/// Who is calling, from the token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The user.
    pub user: String,
    /// May kill and read every job.
    pub admin: bool,
}

/// A log read.
#[derive(Debug)]
pub struct LogRead {
    /// The bytes from the offset asked for.
    pub bytes: Vec<u8>,
    /// Offset to ask for next.
    pub next: u64,
    /// The job ended, its outputs are saved, and this is the end of its log.
    pub done: bool,
}

/// Whether `caller` may `what` job `id` of `owner`'s: its owner or an
/// admin. The one ownership check, for a node's jobs and a cluster's.
pub(crate) fn own(caller: &Caller, id: &str, owner: &str, what: &str) -> Result<(), JobError> {
    if caller.admin || caller.user == owner {
        Ok(())
    } else {
        Err(JobError::Forbidden(format!(
            "job {id} is {owner}'s; only they or an admin may {what} it"
        )))
    }
}

/// [`check_request`] for a user's own submission: what only the
/// coordinator sets when it requeues a preempted job is refused.
pub(crate) fn check_user_request(req: &SubmitRequest) -> Result<(), JobError> {
    if req.restarts != 0 || req.resume_from.is_some() {
        return Err(JobError::Invalid(
            "restarts and resume_from are set by the coordinator when it requeues a preempted \
             job, not by a submission"
                .into(),
        ));
    }
    check_request(req)
}

/// The longest hold: a week.
pub const MAX_HOLD_S: u64 = 7 * 86_400;

/// The most bytes a job's command and environment may take together, and
/// the most datasets it may name: far past any real job's (Linux itself
/// takes at most 128 KiB in one argument), and small enough that a
/// user's queued and recent jobs, which labd keeps, heartbeats and lists,
/// cannot fill its memory or a heartbeat.
pub const MAX_COMMAND_BYTES: usize = 256 << 10;
/// See [`MAX_COMMAND_BYTES`].
pub const MAX_DATASETS: usize = 64;

/// A request labd refuses before reserving anything: no command, one or
/// an environment past [`MAX_COMMAND_BYTES`], an outputs folder outside
/// the code, a data variable that is not one.
pub(crate) fn check_request(req: &SubmitRequest) -> Result<(), JobError> {
    if req.argv.is_empty() {
        return Err(JobError::Invalid("no command to run".into()));
    }
    check_size(req)?;
    if let Some(s) = req.hold_s {
        if s == 0 || s > MAX_HOLD_S {
            return Err(JobError::Invalid(format!(
                "--hold of {s} s: hold GPUs for 1 s to {} days",
                MAX_HOLD_S / 86_400
            )));
        }
        if req.argv != ["sleep".to_string(), s.to_string()] {
            return Err(JobError::Invalid(
                "a hold runs no command of its own (its command is `sleep` for the hold's length)"
                    .into(),
            ));
        }
    }
    check_data_vars(&req.data)
}

/// The bytes a command and its environment take, as
/// [`MAX_COMMAND_BYTES`] counts them (labrun checks with the same count).
pub fn command_bytes(argv: &[String], env: &[(String, String)]) -> usize {
    argv.iter().map(|a| a.len() + 1).sum::<usize>() + env.iter().map(variable_bytes).sum::<usize>()
}

/// The bytes one variable of an environment takes (`NAME=value` and its end).
pub fn variable_bytes((k, v): &(String, String)) -> usize {
    k.len() + v.len() + 2
}

/// The longest time limit a job may ask for: a year.
pub const MAX_TIME_LIMIT_S: u64 = 365 * 86_400;

/// The longest label of a tree (`NAME@vN`) a job may name.
pub const MAX_LABEL_BYTES: usize = 1024;

/// A tree a request names: a snapshot id, a label of a sane length.
pub(crate) fn check_tree_ref(t: &crate::proto::TreeRef) -> Result<(), JobError> {
    if t.label.len() > MAX_LABEL_BYTES {
        return Err(JobError::Invalid(format!(
            "a tree label of {} bytes: at most {MAX_LABEL_BYTES}",
            t.label.len()
        )));
    }
    Ok(())
}

/// A request's command, environment and datasets within
/// [`MAX_COMMAND_BYTES`] and [`MAX_DATASETS`], and every other string it
/// carries bounded: all of them are kept with the job, listed and sent in
/// heartbeats (one job with megabytes of outputs path made a node's
/// heartbeat too large for the coordinator, which marked it down).
pub(crate) fn check_size(req: &SubmitRequest) -> Result<(), JobError> {
    if let Some(o) = &req.outputs {
        check_outputs(o)?;
    }
    for t in req.code.iter().chain(req.data.iter().map(|d| &d.tree)) {
        check_tree_ref(t)?;
    }
    let short = |what: &str, s: &Option<String>| match s {
        Some(s) if s.len() > MAX_LABEL_BYTES => Err(JobError::Invalid(format!(
            "{what} of {} bytes: at most {MAX_LABEL_BYTES}",
            s.len()
        ))),
        _ => Ok(()),
    };
    short("a priority", &req.priority)?;
    if let Some(t) = req.time_limit_s {
        if t == 0 || t > MAX_TIME_LIMIT_S {
            return Err(JobError::Invalid(format!(
                "a time limit of {t} s: give 1 s to {} days",
                MAX_TIME_LIMIT_S / 86_400
            )));
        }
    }
    short("resume_from", &req.resume_from)?;
    let others = req.data.iter().map(|d| d.env.len()).sum::<usize>();
    let bytes = command_bytes(&req.argv, &req.env).saturating_add(others);
    if bytes > MAX_COMMAND_BYTES {
        return Err(JobError::Invalid(format!(
            "the command and its environment take {bytes} bytes: at most {} KiB; put long \
             scripts in a file of the code, and leave large variables out of the environment",
            MAX_COMMAND_BYTES >> 10
        )));
    }
    if req.data.len() > MAX_DATASETS {
        return Err(JobError::Invalid(format!(
            "{} datasets: at most {MAX_DATASETS} per job",
            req.data.len()
        )));
    }
    Ok(())
}

/// Each dataset's variable is `LABRUN_DATA_` and capitals, digits or `_`.
pub(crate) fn check_data_vars(data: &[crate::proto::DataRef]) -> Result<(), JobError> {
    for d in data {
        let ok = d.env.starts_with("LABRUN_DATA_")
            && d.env
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !ok {
            return Err(JobError::Invalid(format!(
                "data variable {:?} must be LABRUN_DATA_ and capitals, digits or _",
                d.env
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{DataRef, TreeRef};

    fn tree(label: &str) -> TreeRef {
        TreeRef {
            label: label.into(),
            snapshot: "ab".repeat(32).parse().unwrap(),
        }
    }

    /// Every string of a request is bounded: they are all kept with the
    /// job, listed and heartbeated.
    #[test]
    fn every_string_of_a_request_is_bounded() {
        let ok = SubmitRequest {
            argv: vec!["train.py".into()],
            code: Some(tree("code@v1")),
            data: vec![DataRef {
                env: "LABRUN_DATA_DIV2K".into(),
                tree: tree("div2k@v3"),
            }],
            outputs: Some("ckpt".into()),
            ..Default::default()
        };
        check_request(&ok).unwrap();
        let refused = |f: &dyn Fn(&mut SubmitRequest), why: &str| {
            let mut r = ok.clone();
            f(&mut r);
            let e = check_request(&r).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        };
        refused(&|r| r.time_limit_s = Some(0), "a time limit of 0 s");
        refused(
            &|r| r.time_limit_s = Some(MAX_TIME_LIMIT_S + 1),
            "give 1 s to 365 days",
        );
        let mut limited = ok.clone();
        limited.time_limit_s = Some(MAX_TIME_LIMIT_S);
        check_request(&limited).unwrap();
        let mega = "x".repeat(2 << 20);
        refused(
            &|r| r.outputs = Some(format!("x{}", "/".repeat(2 << 20))),
            "at most 4096",
        );
        refused(
            &|r| r.code.as_mut().unwrap().label = mega.clone(),
            "at most 1024",
        );
        refused(&|r| r.data[0].tree.label = mega.clone(), "at most 1024");
        // A snapshot that is no id does not make it past the wire.
        let mut body = serde_json::to_value(&ok).unwrap();
        body["data"][0]["tree"]["snapshot"] = mega.clone().into();
        assert!(serde_json::from_value::<SubmitRequest>(body).is_err());
        // Nor one that would name a folder elsewhere: a tree's folder is
        // the id's own spelling, and these are no ids.
        for path in ["../../../etc", "/etc", "ab/../../x", ""] {
            let mut body = serde_json::to_value(&ok).unwrap();
            body["data"][0]["tree"]["snapshot"] = path.into();
            assert!(
                serde_json::from_value::<SubmitRequest>(body).is_err(),
                "{path:?} read as a snapshot id"
            );
        }
        refused(&|r| r.priority = Some(mega.clone()), "at most 1024");
        refused(
            &|r| r.data[0].env = format!("LABRUN_DATA_{}", "X".repeat(MAX_COMMAND_BYTES)),
            "KiB",
        );
    }
}
