//! Test helpers: seeded trees, tree comparison, and a real S3 server.

#![allow(dead_code)]

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use labsync_store::Remote;

/// Deterministic bytes (BLAKE3 XOF keyed by the seed).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    blake3::Hasher::new()
        .update(&seed.to_le_bytes())
        .finalize_xof()
        .fill(&mut v);
    v
}

fn set_mtime(p: &Path, secs: i64, nanos: u32) {
    let t = filetime::FileTime::from_unix_time(secs, nanos);
    filetime::set_symlink_file_times(p, t, t).unwrap();
}

/// A tree with what datasets and code trees hold: a multi-chunk file, an
/// empty file, odd modes, nested folders, symlinks (one dangling), a non-UTF-8
/// name and sub-second mtimes.
pub fn write_tree(root: &Path, seed: u64) {
    std::fs::create_dir_all(root.join("a/b/c")).unwrap();
    std::fs::write(
        root.join("big.bin"),
        random_bytes(9_000_000 + seed as usize, seed),
    )
    .unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    std::fs::write(
        root.join("a/train.py"),
        format!("print('seed {seed}')\n").repeat(100),
    )
    .unwrap();
    std::fs::set_permissions(
        root.join("a/train.py"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(root.join("a/b/secret"), b"s").unwrap();
    std::fs::set_permissions(
        root.join("a/b/secret"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    for i in 0..20 {
        std::fs::write(
            root.join(format!("a/b/c/img{i:03}.png")),
            random_bytes(1000 + i * 997, seed * 100 + i as u64),
        )
        .unwrap();
    }
    std::fs::write(
        root.join(std::ffi::OsStr::from_bytes(b"caf\xe9.txt")),
        b"latin-1 name",
    )
    .unwrap();
    std::os::unix::fs::symlink("a/train.py", root.join("link")).unwrap();
    std::os::unix::fs::symlink("does/not/exist", root.join("dangling")).unwrap();
    for (i, p) in files_under(root).iter().enumerate() {
        set_mtime(p, 1_700_000_000 + i as i64, 123_456_789);
    }
    set_mtime(&root.join("link"), 1_600_000_000, 5);
    std::fs::set_permissions(root.join("a/b"), std::fs::Permissions::from_mode(0o750)).unwrap();
    set_mtime(&root.join("a/b"), 1_650_000_000, 7);
}

/// Overwrites `n` bytes in the middle of a file (keeping its size).
pub fn overwrite_middle(p: &Path, n: usize) {
    let mut b = std::fs::read(p).unwrap();
    let mid = b.len() / 2;
    for (i, x) in b[mid..mid + n].iter_mut().enumerate() {
        *x = x.wrapping_add((i as u8).wrapping_add(1));
    }
    std::fs::write(p, b).unwrap();
}

/// Every regular file and symlink under `root`.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

fn describe(root: &Path) -> Vec<(Vec<u8>, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec();
            let mtime = (m.mtime(), m.mtime_nsec());
            let what = if m.is_dir() {
                stack.push(p.clone());
                format!("dir mode {:o} mtime {:?}", m.mode() & 0o7777, mtime)
            } else if m.file_type().is_symlink() {
                format!(
                    "link -> {:?} mtime {:?}",
                    std::fs::read_link(&p).unwrap(),
                    mtime
                )
            } else {
                let h = blake3::hash(&std::fs::read(&p).unwrap());
                format!(
                    "file mode {:o} size {} mtime {:?} blake3 {}",
                    m.mode() & 0o7777,
                    m.len(),
                    mtime,
                    h
                )
            };
            out.push((rel, what));
        }
    }
    out.sort();
    out
}

/// True when `a` and `b` hold byte-identical contents, modes, symlink
/// targets and mtimes.
pub fn same_tree(a: &Path, b: &Path) -> bool {
    b.is_dir() && describe(a) == describe(b)
}

/// Byte-identical contents, modes, symlink targets and mtimes.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let (da, db) = (describe(a), describe(b));
    if da != db {
        for (x, y) in da.iter().zip(&db) {
            if x != y {
                panic!(
                    "trees differ at {:?}:\n  {}\n  {}",
                    String::from_utf8_lossy(&x.0),
                    x.1,
                    y.1
                );
            }
        }
        panic!(
            "trees differ in length: {} vs {} entries",
            da.len(),
            db.len()
        );
    }
}

/// The S3-compatible servers the store is tried against, each installed
/// from a package registry by `scripts/s3-servers.sh` (which
/// `scripts/test.sh` runs) and started by the tests on 127.0.0.1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    /// `s3s-fs` 0.14.1 (crates.io): files in a folder.
    S3sFs,
    /// moto server 5.2.5 (PyPI).
    Moto,
    /// ministack 1.5.33 (PyPI).
    Ministack,
    /// s3rver 3.7.1 (npm): ignores conditional writes.
    S3rver,
}

impl ServerKind {
    /// Every kind, in the order the matrix reports them.
    pub const ALL: [ServerKind; 4] = [
        ServerKind::S3sFs,
        ServerKind::Moto,
        ServerKind::Ministack,
        ServerKind::S3rver,
    ];

    /// Name and version, as the README's table gives them.
    pub fn label(self) -> &'static str {
        match self {
            ServerKind::S3sFs => "s3s-fs 0.14.1",
            ServerKind::Moto => "moto server 5.2.5",
            ServerKind::Ministack => "ministack 1.5.33",
            ServerKind::S3rver => "s3rver 3.7.1",
        }
    }

    /// The variable naming its program, set by `scripts/test.sh`.
    fn variable(self) -> &'static str {
        match self {
            ServerKind::S3sFs => "LABSYNC_S3S_FS",
            ServerKind::Moto => "LABSYNC_MOTO_SERVER",
            ServerKind::Ministack => "LABSYNC_MINISTACK",
            ServerKind::S3rver => "LABSYNC_S3RVER",
        }
    }

    /// Credentials it accepts.
    fn keys(self) -> (&'static str, &'static str) {
        match self {
            ServerKind::S3sFs => (ACCESS_KEY, SECRET_KEY),
            ServerKind::Moto | ServerKind::Ministack => ("test", "test"),
            ServerKind::S3rver => ("S3RVER", "S3RVER"),
        }
    }

    fn program(self) -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(self.variable()) {
            return Some(PathBuf::from(p));
        }
        (self == ServerKind::S3sFs).then(find_s3s_fs).flatten()
    }
}

/// A real S3-compatible server on 127.0.0.1, stopped on drop.
pub struct S3Server {
    child: Child,
    port: u16,
    kind: ServerKind,
    _dir: tempfile::TempDir,
}

pub const ACCESS_KEY: &str = "labsync-test";
pub const SECRET_KEY: &str = "labsync-test-secret";

fn find_s3s_fs() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(h).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join("s3s-fs"))
        .find(|p| p.is_file())
}

/// A free port on 127.0.0.1 for a server a test starts, below the kernel's
/// ephemeral range: a port from `bind(0)` lies in that range, and between
/// this check and the server's own bind the outgoing connection of some
/// other test could take it (a cluster test then saw another process answer
/// on its node's port and waited in vain for the node).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static TRIES: AtomicU64 = AtomicU64::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Ports from 1/3 of `low` up to it: tests in parallel processes pick
    // at random among them; one process never hands out one twice.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let (from, span) = (u64::from(low / 3), u64::from(low - low / 3).max(1));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32);
    for _ in 0..1000 {
        let k = TRIES.fetch_add(1, Ordering::Relaxed);
        let mix =
            (seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let port = (from + (mix >> 17) % span) as u16;
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends one bodiless request and returns the status line.
fn http_request(port: u16, method: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or_default().to_string()
}

impl S3Server {
    /// Starts `s3s-fs`; `None` (with a note) when it is not installed
    /// outside CI. In CI (`CI` set) a missing server is a failure.
    pub fn start() -> Option<S3Server> {
        S3Server::start_kind(ServerKind::S3sFs, true)
    }

    /// Starts `s3s-fs` without authentication: requests are not signed,
    /// so a proxy in front may change their headers
    /// ([`S3Server::unsigned_options`]).
    pub fn start_unsigned() -> Option<S3Server> {
        S3Server::start_kind(ServerKind::S3sFs, false)
    }

    /// Starts a server of `kind` with a bucket `labsync` (`auth`: whether
    /// `s3s-fs` checks signatures; the others check them or not as they do).
    pub fn start_kind(kind: ServerKind, auth: bool) -> Option<S3Server> {
        let Some(bin) = kind.program() else {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "{} not found: CI must run scripts/test.sh, which installs it",
                    kind.label()
                );
            }
            eprintln!(
                "SKIPPED: {} not installed; scripts/test.sh installs it and runs the S3 tests",
                kind.label()
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cmd = Command::new(&bin);
        match kind {
            ServerKind::S3sFs => {
                std::fs::create_dir_all(dir.path().join("labsync")).unwrap();
                cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
                if auth {
                    cmd.args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY]);
                }
                cmd.arg(dir.path());
            }
            ServerKind::Moto => {
                cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
            }
            ServerKind::Ministack => {
                cmd.env("GATEWAY_PORT", port.to_string())
                    .env("BIND_HOST", "127.0.0.1")
                    .env("TMPDIR", dir.path())
                    .env("S3_DATA_DIR", dir.path().join("s3"));
            }
            ServerKind::S3rver => {
                cmd.arg("-d")
                    .arg(dir.path())
                    .args(["-a", "127.0.0.1", "-p", &port.to_string(), "--silent"])
                    .args(["--configure-bucket", "labsync"]);
            }
        }
        // `LABSYNC_SERVER_LOGS=DIR` keeps each server's output there.
        let (out, err) = match std::env::var_os("LABSYNC_SERVER_LOGS") {
            Some(logs) => {
                std::fs::create_dir_all(&logs).unwrap();
                let name = format!("{}-{port}.log", kind.label().replace(' ', "-"));
                let f = std::fs::File::create(Path::new(&logs).join(name)).unwrap();
                (Stdio::from(f.try_clone().unwrap()), Stdio::from(f))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let child = cmd
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let server = S3Server {
            child,
            port,
            kind,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not listen on port {port}",
                kind.label()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(kind, ServerKind::Moto | ServerKind::Ministack) {
            let status = http_request(port, "PUT", "/labsync");
            assert!(status.contains(" 200"), "create bucket: {status}");
        }
        Some(server)
    }

    /// Where the server keeps its objects (`s3s-fs`: the bucket `labsync`
    /// is the folder of that name, each object a file).
    pub fn data_dir(&self) -> &Path {
        self._dir.path()
    }

    /// Which server this is.
    pub fn kind(&self) -> ServerKind {
        self.kind
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Backend options for `Remote::open`.
    pub fn options(&self) -> Vec<(String, String)> {
        let (key, secret) = self.kind.keys();
        vec![
            ("aws_endpoint".into(), self.endpoint()),
            ("aws_allow_http".into(), "true".into()),
            ("aws_access_key_id".into(), key.into()),
            ("aws_secret_access_key".into(), secret.into()),
            ("aws_region".into(), "us-east-1".into()),
        ]
    }

    /// The environment that points the `labsync` command at this server.
    pub fn env(&self) -> Vec<(String, String)> {
        let (key, secret) = self.kind.keys();
        vec![
            ("AWS_ACCESS_KEY_ID".into(), key.into()),
            ("AWS_SECRET_ACCESS_KEY".into(), secret.into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ENDPOINT".into(), self.endpoint()),
        ]
    }

    /// The server's address.
    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// Backend options for an unsigned server reached at `endpoint` (the
    /// server itself, or a proxy in front of it).
    pub fn unsigned_options(endpoint: &str) -> Vec<(String, String)> {
        vec![
            ("aws_endpoint".into(), endpoint.into()),
            ("aws_allow_http".into(), "true".into()),
            ("aws_skip_signature".into(), "true".into()),
            ("aws_region".into(), "us-east-1".into()),
        ]
    }

    /// A store under `s3://labsync/<prefix>`.
    pub fn remote(&self, prefix: &str) -> Remote {
        Remote::open(&format!("s3://labsync/{prefix}"), &self.options()).unwrap()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small file system mounted for one test (the tests run as root, as CI
/// does): ext4 on a loop device, or tmpfs. Unmounted when dropped.
pub struct Mounted {
    _dir: tempfile::TempDir,
    /// Where it is mounted.
    pub path: PathBuf,
}

impl Mounted {
    /// ext4 with 128-byte inodes: timestamps in whole seconds, as on NFS
    /// servers and old ext4 file systems that lab servers still have.
    pub fn coarse_ext4(mib: u64) -> Mounted {
        let m = Mounted::ext4(mib, &["-I", "128"]);
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(m._dir.path().join("fs.img"))
            .arg(&m.path));
        m
    }

    /// ext4 that loses what was not synced when [`Mounted::lose_power`]
    /// cuts it: metadata journaled (names, sizes, renames survive a cut),
    /// data neither ordered before it nor allocated late
    /// (`data=writeback,nodelalloc`), as XFS and ext4 in writeback mode
    /// behave. Files written and renamed but not synced come back at their
    /// size, full of zeros.
    pub fn ext4_losing_unsynced(mib: u64) -> Mounted {
        let m = Mounted::ext4(mib, &[]);
        m.mount_losing_unsynced();
        m
    }

    /// An ext4 image of `mib` MiB made with `mkfs` options `args`, and the
    /// folder to mount it on (not mounted yet).
    fn ext4(mib: u64, args: &[&str]) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("fs.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .args(args)
            .arg(&img));
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        Mounted { _dir: dir, path }
    }

    fn mount_losing_unsynced(&self) {
        run(Command::new("mount")
            .args(["-o", "loop,data=writeback,nodelalloc"])
            .arg(self._dir.path().join("fs.img"))
            .arg(&self.path));
    }

    /// A power cut, then the machine back up: the journal is committed (so
    /// every name and size written so far survives), the file system shut
    /// down without writing any data still in memory
    /// (`EXT4_IOC_SHUTDOWN`, `EXT4_GOING_FLAGS_LOGFLUSH`, as xfstests cut
    /// power), unmounted and mounted again. Only an
    /// [`Mounted::ext4_losing_unsynced`] file system.
    pub fn lose_power(&self) {
        use std::os::fd::AsRawFd;
        /// `_IOR('X', 125, __u32)`.
        const EXT4_IOC_SHUTDOWN: libc::c_ulong = 0x8004_587d;
        const EXT4_GOING_FLAGS_LOGFLUSH: u32 = 1;
        let root = std::fs::File::open(&self.path).unwrap();
        let flags = EXT4_GOING_FLAGS_LOGFLUSH;
        // SAFETY: the ioctl reads one u32 through a valid pointer.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::ioctl(root.as_raw_fd(), EXT4_IOC_SHUTDOWN as _, &flags) };
        assert_eq!(rc, 0, "shutdown: {}", std::io::Error::last_os_error());
        drop(root);
        run(Command::new("umount").arg(&self.path));
        self.mount_losing_unsynced();
    }

    /// tmpfs of `kib` KiB: a disk that fills up.
    pub fn tmpfs(kib: u64) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(&path));
        Mounted { _dir: dir, path }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

fn run(c: &mut Command) {
    let o = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(
        o.status.success(),
        "{c:?} failed (these tests need root, as CI has): {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Waits until every entry under `root` last changed more than 0.2 s ago, as
/// a dataset at rest has. A push records a file as unchanged only once its
/// times are older than the push's start by more than the file system's
/// timestamp granularity (the "racy git" rule); tests that count files read
/// by an unchanged re-push let the tree they just wrote come to rest first.
pub fn wait_until_at_rest(root: &Path) {
    let mut newest = 0i64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            newest = newest.max(m.ctime() * 1_000_000_000 + m.ctime_nsec());
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    };
    while now() < newest + 200_000_000 {
        std::thread::sleep(Duration::from_millis(10));
    }
}
