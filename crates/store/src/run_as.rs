//! Whom a job's files are read and written as.

use serde::{Deserialize, Serialize};

/// The Unix user and group a job runs as, and its folders and outputs are
/// read and written as, where labd runs jobs as their submitters (`None`
/// where they run as labd's own user). Stored as `[uid, gid]`, the pair it
/// replaced: the job databases do not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "(u32, u32)", into = "(u32, u32)")]
pub struct RunAs {
    /// The user's id.
    pub uid: u32,
    /// Their primary group's id.
    pub gid: u32,
}

impl From<(u32, u32)> for RunAs {
    fn from((uid, gid): (u32, u32)) -> RunAs {
        RunAs { uid, gid }
    }
}

impl From<RunAs> for (u32, u32) {
    fn from(r: RunAs) -> (u32, u32) {
        (r.uid, r.gid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_is_stored_as_the_pair_it_replaced() {
        let r = RunAs {
            uid: 1000,
            gid: 100,
        };
        assert_eq!(serde_json::to_string(&Some(r)).unwrap(), "[1000,100]");
        let back: Option<RunAs> = serde_json::from_str("[1000,100]").unwrap();
        assert_eq!(back, Some(r));
    }
}
