//! Small file-system helpers shared by the cache, the files cache and pull.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes `data` to `path` through a temporary file and a rename, so a reader
/// sees the old content or the new, never half of it.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
    }
    let tmp = tmp_name(path);
    let mut f = std::fs::File::create(&tmp).map_err(Error::io("create", &tmp))?;
    f.write_all(data).map_err(Error::io("write", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(Error::io("rename into place", path))
}

/// `dir/.name.<pid>.<n>.tmp`: hidden, unique per process and call.
pub(crate) fn tmp_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{n}.labsync-tmp", std::process::id()))
}

/// Runs blocking work (file I/O, hashing a tree) off the async runtime.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::Io {
            op: "run blocking task",
            path: PathBuf::new(),
            source: std::io::Error::other(e),
        }),
    }
}
