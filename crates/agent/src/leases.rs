//! GPU leases: which job holds which GPU, persisted so a restarted labd knows.
//!
//! Every change is one redb write transaction, and redb serialises write
//! transactions: racing submissions can never be handed the same GPU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::error::LeaseError;

/// GPU index → id of the job holding it.
const LEASES: TableDefinition<u32, &str> = TableDefinition::new("leases-v1");

/// The lease table of one node.
pub struct Leases {
    db: Database,
    path: PathBuf,
}

impl Leases {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<Leases, LeaseError> {
        let db = Database::create(path).map_err(|e| LeaseError::Db {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        let leases = Leases {
            db,
            path: path.to_path_buf(),
        };
        // Create the table up front so readers never see "no such table".
        let txn = leases.db.begin_write().map_err(|e| leases.err(e))?;
        txn.open_table(LEASES).map_err(|e| leases.err(e))?;
        txn.commit().map_err(|e| leases.err(e))?;
        Ok(leases)
    }

    fn err(&self, e: impl std::fmt::Display) -> LeaseError {
        LeaseError::Db {
            path: self.path.display().to_string(),
            detail: e.to_string(),
        }
    }

    /// Atomically leases `want` GPUs to `job`, choosing among `free` in order
    /// and skipping any already leased. Returns the GPUs, or `None` (and
    /// leases nothing) when fewer than `want` are available.
    pub fn acquire(
        &self,
        job: &str,
        want: usize,
        free: &[u32],
    ) -> Result<Option<Vec<u32>>, LeaseError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let chosen = {
            let mut t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
            let mut chosen = Vec::with_capacity(want);
            for &g in free {
                if chosen.len() == want {
                    break;
                }
                if t.get(g).map_err(|e| self.err(e))?.is_none() {
                    chosen.push(g);
                }
            }
            if chosen.len() < want {
                None
            } else {
                for &g in &chosen {
                    t.insert(g, job).map_err(|e| self.err(e))?;
                }
                Some(chosen)
            }
        };
        match chosen {
            Some(c) => {
                txn.commit().map_err(|e| self.err(e))?;
                Ok(Some(c))
            }
            None => {
                txn.abort().map_err(|e| self.err(e))?;
                Ok(None)
            }
        }
    }

    /// Frees every GPU `job` holds; returns them.
    pub fn release(&self, job: &str) -> Result<Vec<u32>, LeaseError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let freed = {
            let mut t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
            let mine: Vec<u32> = t
                .iter()
                .map_err(|e| self.err(e))?
                .filter_map(|r| r.ok())
                .filter(|(_, j)| j.value() == job)
                .map(|(g, _)| g.value())
                .collect();
            for g in &mine {
                t.remove(*g).map_err(|e| self.err(e))?;
            }
            mine
        };
        txn.commit().map_err(|e| self.err(e))?;
        Ok(freed)
    }

    /// Every current lease.
    pub fn all(&self) -> Result<BTreeMap<u32, String>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
        let mut out = BTreeMap::new();
        for r in t.iter().map_err(|e| self.err(e))? {
            let (g, j) = r.map_err(|e| self.err(e))?;
            out.insert(g.value(), j.value().to_string());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn acquire_release_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let l = Leases::open(&path).unwrap();
            assert_eq!(l.acquire("j1", 2, &[0, 1, 2, 3]).unwrap(), Some(vec![0, 1]));
            assert_eq!(
                l.acquire("j2", 3, &[0, 1, 2, 3]).unwrap(),
                None,
                "only two left"
            );
            assert_eq!(l.acquire("j2", 2, &[0, 1, 2, 3]).unwrap(), Some(vec![2, 3]));
        }
        let l = Leases::open(&path).unwrap();
        assert_eq!(l.all().unwrap().len(), 4, "leases survive a restart");
        assert_eq!(l.release("j1").unwrap(), vec![0, 1]);
        assert_eq!(
            l.all().unwrap().values().collect::<Vec<_>>(),
            vec!["j2", "j2"]
        );
    }

    #[test]
    fn racing_threads_never_share_a_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let l = Arc::new(Leases::open(&dir.path().join("s.redb")).unwrap());
        let winners: Vec<_> = (0..16)
            .map(|i| {
                let l = l.clone();
                std::thread::spawn(move || {
                    l.acquire(&format!("job{i}"), 1, &[0])
                        .unwrap()
                        .map(|g| (i, g))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "exactly one of 16 racers gets GPU 0: {winners:?}"
        );
        assert_eq!(l.all().unwrap().len(), 1);
    }
}
