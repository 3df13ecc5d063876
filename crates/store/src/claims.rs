//! Creating a key only if it does not exist, on any S3-compatible server.
//!
//! labsync numbers the versions of a name, and creates a store's config, by
//! writing a key that must not exist yet. Where the server honours
//! `If-None-Match: *` that could be one request. Many S3-compatible servers
//! in labs do not: some ignore the header (a second "create" overwrites the
//! first, and a version is lost without a word), some refuse it (`501`).
//! And one that answers a probe correctly may still not be atomic: `s3s-fs`
//! 0.14 refuses a second create of a key made one after the other, yet let
//! two racing pushes both create `v2`. A probe cannot see that.
//!
//! So on a server every such create takes a short-lived **claim** on its
//! key first (a local folder or memory creates atomically and needs none),
//! restic's lock protocol cut down to one key. What the server does with
//! the condition is probed once, when the store is created, and recorded in
//! its config ([`ConditionalWrites`]): where it is honoured, the final write
//! under the claim is a conditional create too, which also stops a client
//! that takes no claims (labsync before this scheme); elsewhere it is a
//! plain write. The protocol:
//!
//! 1. If the key exists, it is taken: answer "exists".
//! 2. Write a claim under a unique name, `claims/<hash of key>.<nonce>`.
//! 3. List the claims of that key (only those: the listing starts at their
//!    names). If any other claim is live (younger than
//!    [`CLAIM_STALE`] than ours, by the server's clock), withdraw ours
//!    (delete it), wait a random while, and start again.
//! 4. Alone: if the key exists now, withdraw and answer "exists"; otherwise
//!    write it, then withdraw the claim.
//! 5. Where that write was a plain one (the server ignores or refuses the
//!    condition), read the key back: other bytes there are a late write of
//!    a writer frozen past its claim, which replaced ours. The key stays
//!    theirs and the answer is "exists" (a version is then created under
//!    the next number). A late write landing after the read-back still
//!    replaces ours unseen; `verify` reports the snapshot it orphaned.
//!
//! Two writers of one key never both write it: whichever lists second sees
//! the other's claim, which was written before the first one listed, and is
//! only deleted after the first one's write of the key is complete (the
//! second then finds the key at step 4). Both may withdraw when they see
//! each other; random waits let one through. A writer must write the key
//! within [`WRITE_DEADLINE`] of sending its claim: one that is slower (a
//! paused process, a server answering `503` again and again) starts again
//! before writing, or, once its write is sent, gives up and leaves its
//! claim in place until it is stale, by when the write has landed or never
//! will. This needs the server to list and read
//! what was written before (strong read-after-write consistency), which
//! AWS S3 and the servers a lab runs give.
//!
//! Claims of writers that crashed are treated as gone after
//! [`CLAIM_STALE`], deleted by the next writer that sees them, and swept
//! by `gc`. A writer keeps trying for twice that long before it gives up.
//!
//! All claims sit in one folder that never empties (`claims/keep` stays):
//! s3rver removes a folder when its last object goes, and a claim written
//! into a folder being removed crashed it (`ENOENT`, an unhandled error
//! event) when every key had a folder of claims of its own.

use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{PutMode, PutOptions, PutPayload};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::http::random_fraction;
use crate::remote::Remote;

use crate::remote::is_refusal;
pub use crate::remote::ConditionalWrites;

/// A claim older than ours by this much is left by a writer that crashed.
/// Far above [`WRITE_DEADLINE`] plus the longest one request can take once
/// sent (object_store's 30 s timeout), so a slow writer's last request has
/// landed long before anyone takes its claim for dead.
pub(crate) const CLAIM_STALE: Duration = Duration::from_secs(120);

/// The most a claim is held from before it is written until the key is
/// written: past it the writer gives up its attempt instead of writing late.
const WRITE_DEADLINE: Duration = Duration::from_secs(30);

/// How long a writer keeps trying for one key before giving up with a
/// conflict: long enough to outlast a claim left by a crashed writer.
const PATIENCE: Duration = Duration::from_secs(2 * CLAIM_STALE.as_secs());

/// The folder of every claim.
pub(crate) const CLAIMS: &str = "claims/";

/// The object that keeps [`CLAIMS`] from ever being empty.
pub(crate) const KEEP: &str = "claims/keep";

/// How the names of the claims on `key` begin.
fn claim_prefix(key: &str) -> String {
    let h = blake3::hash(key.as_bytes()).to_hex();
    format!("{CLAIMS}{}.", &h[..32])
}

/// A name no other writer picks: time, process, a counter and randomness,
/// hashed.
pub(crate) fn nonce() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{:?}{}{}{}",
        std::time::SystemTime::now(),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        random_fraction()
    );
    blake3::hash(seed.as_bytes()).to_hex()[..32].to_string()
}

impl Remote {
    /// Asks the server what it does with a conditional create: a throw-away
    /// key is created twice. Local folders and memory honour it by
    /// construction and are not asked.
    pub async fn probe_conditional_writes(&self) -> Result<ConditionalWrites> {
        if !self.is_server() {
            return Ok(ConditionalWrites::Honoured);
        }
        let key = format!("probe/{}", nonce());
        let path = Path::from(key.as_str());
        let create = || {
            let opts = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            self.store()
                .put_opts(&path, PutPayload::from_static(b"probe"), opts)
        };
        let unavailable = |e| Error::Unavailable {
            op: "probe conditional writes with",
            key: key.clone(),
            error: e,
        };
        let answer = match create().await {
            Err(e) if is_refusal(&e) => ConditionalWrites::Refused,
            Err(e) => return Err(unavailable(e)),
            Ok(_) => match create().await {
                Err(object_store::Error::AlreadyExists { .. }) => ConditionalWrites::Honoured,
                Ok(_) => ConditionalWrites::Ignored,
                Err(e) if is_refusal(&e) => ConditionalWrites::Refused,
                Err(e) => return Err(unavailable(e)),
            },
        };
        // A client that may write but not delete leaves it for gc.
        if let Err(e) = self.delete(&key).await {
            tracing::warn!("cannot delete the probe {key}: {e}");
        }
        Ok(answer)
    }

    /// Writes `key` if it does not exist, with a claim (see the module);
    /// returns `false` when it already existed.
    pub(crate) async fn create_by_claim(&self, key: &str, data: Bytes) -> Result<bool> {
        let prefix = claim_prefix(key);
        let stale = CLAIM_STALE.as_secs() as i64;
        if !self.claims_kept() {
            self.put(KEEP, Bytes::from_static(b"keeps claims/ from being empty"))
                .await?;
            self.set_claims_kept();
        }
        let started = Instant::now();
        let mut attempt = 0u32;
        while started.elapsed() < PATIENCE {
            attempt += 1;
            if self.head(key).await?.is_some() {
                return Ok(false);
            }
            let mine = format!("{prefix}{}", nonce());
            // Counted from before the claim is sent: a slow answer counts too.
            let held = Instant::now();
            // The key, then who claims it: a name kept from others says whose.
            self.put(&mine, Bytes::from(format!("{key}\n{}", claimant())))
                .await?;
            // Only this key's claims: a folder of a million others (left
            // over, or planted) costs nothing here.
            let claims = self.list_beginning(CLAIMS, &prefix).await;
            let alone = match &claims {
                Ok(claims) => match claims.iter().find(|c| c.key == mine) {
                    // Not listed yet: the server is not consistent enough to
                    // tell; try again.
                    None => false,
                    Some(me) => {
                        let dead = |c: &&crate::remote::ObjectInfo| {
                            c.key != mine && c.modified < me.modified - stale
                        };
                        // Left by crashed writers: out of the others' way.
                        for c in claims.iter().filter(dead) {
                            let _ = self.delete(&c.key).await;
                        }
                        claims.iter().all(|c| c.key == mine || dead(&c))
                    }
                },
                Err(_) => false,
            };
            if let Some(left) = WRITE_DEADLINE.checked_sub(held.elapsed()).filter(|_| alone) {
                let write = async {
                    match self.head(key).await? {
                        Some(_) => Ok(false),
                        None if self.conditional() == ConditionalWrites::Honoured => {
                            self.create_if_absent(key, data.clone()).await
                        }
                        None => self.put(key, data.clone()).await.map(|()| true),
                    }
                };
                let Ok(written) = tokio::time::timeout(left, write).await else {
                    // The write may still land: the claim stays, so nobody
                    // writes the key until it is stale, long after that.
                    return Err(Error::Conflict {
                        what: format!("object {key}"),
                        detail: format!(
                            "the server did not answer its write within {} s; it may still \
                             land: run the command again (it finds what landed)",
                            WRITE_DEADLINE.as_secs()
                        ),
                    });
                };
                // What was written is recorded: a claim that cannot be
                // withdrawn only delays other writers until it is stale.
                if let Err(e) = self.delete(&mine).await {
                    tracing::warn!("cannot withdraw claim {mine}: {e}");
                }
                let written = written?;
                if written && self.conditional() != ConditionalWrites::Honoured {
                    return self.read_back(key, &data).await;
                }
                return Ok(written);
            }
            self.delete(&mine).await?;
            claims?;
            // Both may have stepped back: wait a random while (growing) so
            // one gets through.
            let cap = Duration::from_millis(20 << attempt.min(6));
            let cap = cap.min(PATIENCE.saturating_sub(started.elapsed()));
            tokio::time::sleep(cap.mul_f64(random_fraction())).await;
        }
        Err(Error::Conflict {
            what: format!("object {key}"),
            detail: format!(
                "{attempt} attempts in {} s to claim it met other writers' claims ({}); run \
                 the command again. A claim renewed for ever keeps the name from everyone: the \
                 store's admin removes it (`labsync claims --remove {key}`) and asks its \
                 writer why",
                PATIENCE.as_secs(),
                self.claimants(&prefix).await
            ),
        })
    }

    /// Whether `key`, just written with `data` by a plain write, still holds
    /// it. On a server that ignores conditional writes, a writer frozen past
    /// its claim's staleness (a stopped process, a paused VM) may still send
    /// its write after another took the key: the later write replaces the
    /// earlier without a word. Read back, a key holding other bytes was
    /// taken: it stays the other writer's, and the caller creates the next
    /// key (a version's next number) instead. `true`: the key is ours.
    async fn read_back(&self, key: &str, data: &Bytes) -> Result<bool> {
        match self.get_at_most(key, data.len() as u64).await {
            Ok(found) if found == *data => Ok(true),
            Ok(_) | Err(Error::Corrupt { .. }) => {
                tracing::warn!(
                    "{key} was written by another writer after this one wrote it (a write that \
                     landed late, past its claim): it is left as theirs, and this one is \
                     written under the next key"
                );
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Whose the claims beginning with `prefix` are, for a conflict's
    /// message: each key and what its writer said of itself (at most
    /// three, each read in bounded memory).
    async fn claimants(&self, prefix: &str) -> String {
        let Ok(claims) = self.list_beginning(CLAIMS, prefix).await else {
            return "they could not be listed".into();
        };
        let mut said = Vec::new();
        for c in claims.iter().take(3) {
            let who: String = match self.get_at_most(&c.key, 4096).await {
                Ok(b) => String::from_utf8_lossy(&b)
                    .lines()
                    .nth(1)
                    // Anyone's words: no control character reaches a terminal.
                    .map(words)
                    .unwrap_or_else(|| "a writer that does not say who".into()),
                Err(_) => "gone".into(),
            };
            said.push(format!("{} by {who}", c.key));
        }
        if claims.len() > 3 {
            said.push(format!("{} more", claims.len() - 3));
        }
        if said.is_empty() {
            "none left now".into()
        } else {
            said.join("; ")
        }
    }
}

/// A claim in the store, as `labsync claims` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Claim {
    /// Its own key, `claims/<hash>.<nonce>`.
    pub claim: String,
    /// The key it claims, as its writer said (anyone's words).
    pub key: String,
    /// Who wrote it, as its writer said: user, host and process.
    pub who: String,
    /// When the server last wrote it (Unix seconds): a claim renewed for
    /// ever stays young.
    pub modified: i64,
}

/// Claims `labsync claims` reads at most (a folder anyone can fill).
pub const MAX_CLAIMS_SHOWN: usize = 1000;

/// Anyone's words, made safe for a terminal and a line.
fn words(text: &str) -> String {
    text.chars()
        .take(200)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

impl Remote {
    /// The claims in the store (the first `MAX_CLAIMS_SHOWN` listed, each
    /// read in bounded memory), and how many more there are.
    pub async fn claims(&self) -> Result<(Vec<Claim>, u64)> {
        use futures::TryStreamExt;
        let mut listed = Vec::new();
        let mut more = 0u64;
        let mut stream = std::pin::pin!(self.list_stream(CLAIMS));
        while let Some(o) = stream.try_next().await? {
            if o.key == KEEP {
                continue;
            }
            if listed.len() < MAX_CLAIMS_SHOWN {
                listed.push(o);
            } else {
                more += 1;
            }
        }
        let mut out = Vec::with_capacity(listed.len());
        for o in listed {
            let body = match self.get_at_most(&o.key, 4096).await {
                Ok(b) => String::from_utf8_lossy(&b).into_owned(),
                // Withdrawn meanwhile.
                Err(e) if e.is_not_found() => continue,
                Err(_) => String::new(),
            };
            let mut lines = body.lines();
            out.push(Claim {
                claim: o.key,
                key: words(lines.next().unwrap_or("")),
                who: lines
                    .next()
                    .map(words)
                    .unwrap_or_else(|| "a writer that does not say who".into()),
                modified: o.modified,
            });
        }
        Ok((out, more))
    }

    /// Removes the claim `target` (a key under `claims/`), or every claim
    /// on the key `target` (as a conflict names it, e.g.
    /// `refs/ds/@/0000000002`): an admin's way past a claim renewed for
    /// ever. Returns the claims removed. A writer whose claim is removed
    /// while it writes is stopped by the next writer's read-back, not by
    /// this: remove only claims whose writer is gone or stuck.
    pub async fn remove_claims(&self, target: &str) -> Result<Vec<String>> {
        if target.starts_with(CLAIMS) {
            if target == KEEP {
                return Err(Error::invalid(
                    format!("claim {target}"),
                    "keeps claims/ from being empty; it is no claim",
                ));
            }
            return match self.head(target).await? {
                Some(_) => {
                    self.delete(target).await?;
                    Ok(vec![target.to_string()])
                }
                None => Err(Error::not_found(format!("claim {target}"))),
            };
        }
        let mut removed = Vec::new();
        for c in self.list_beginning(CLAIMS, &claim_prefix(target)).await? {
            self.delete(&c.key).await?;
            removed.push(c.key);
        }
        Ok(removed)
    }
}

/// Who this writer is, as its claims say: user, host and process.
pub(crate) fn claimant() -> String {
    format!(
        "{}@{} (pid {})",
        user_name(),
        host_name(),
        std::process::id()
    )
}

/// This process's user, as the environment names it (else its uid).
pub(crate) fn user_name() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| format!("uid {}", rustix::process::getuid().as_raw()))
}

/// This machine's host name.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "an unnamed host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name kept by someone's claim says whose it is, in words no
    /// terminal acts on, and this writer's claims say who it is.
    #[tokio::test]
    async fn a_blocking_claim_says_whose_it_is() {
        let remote = Remote::memory();
        let prefix = claim_prefix("refs/ds/@/2");
        let body = "refs/ds/@/2\nmallory@gpu9 (pid 7)\u{1b}[2J";
        remote
            .put(&format!("{prefix}x"), Bytes::from(body))
            .await
            .unwrap();
        let said = remote.claimants(&prefix).await;
        assert!(said.contains("by mallory@gpu9 (pid 7)?[2J"), "{said}");
        assert!(!said.contains('\u{1b}'));
        assert!(claimant().contains(&format!("(pid {})", std::process::id())));
        // The admin sees it, and whose it is, and removes it.
        remote.put(KEEP, Bytes::from_static(b"keep")).await.unwrap();
        let (all, more) = remote.claims().await.unwrap();
        assert_eq!((all.len(), more), (1, 0), "{all:?}");
        assert_eq!(all[0].key, "refs/ds/@/2");
        assert_eq!(all[0].who, "mallory@gpu9 (pid 7)?[2J");
        let removed = remote.remove_claims("refs/ds/@/2").await.unwrap();
        assert_eq!(removed, vec![format!("{prefix}x")]);
        assert!(remote.claims().await.unwrap().0.is_empty());
        assert!(remote.remove_claims(KEEP).await.is_err());
        assert!(remote.head(KEEP).await.unwrap().is_some());
        assert_eq!(
            remote.claimants(&claim_prefix("other")).await,
            "none left now"
        );
    }
}
