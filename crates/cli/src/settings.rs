//! Settings: flags beat environment beat the config file beat defaults.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use labsync_agent::Secret;
use labsync_store::Codec;
use serde::Deserialize;

/// The config file (`~/.config/labsync/config.toml` or `--config`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Store URL.
    pub store: Option<String>,
    /// Node cache folder.
    pub cache_dir: Option<PathBuf>,
    /// Node cache cap, e.g. `200G`.
    pub cache_max: Option<String>,
    /// S3 endpoint, e.g. `http://10.0.0.5:9000`.
    pub s3_endpoint: Option<String>,
    /// S3 region.
    pub s3_region: Option<String>,
    /// Where `labrun` finds labd: `unix:///run/labsync/labd.sock` or `http://gpu1:7420`.
    pub labd: Option<String>,
    /// `labrun`'s token for that labd.
    pub token: Option<Secret>,
    /// For an `https://` labd: the lab's CA file (PEM) its certificate is
    /// checked against; the system's roots without it.
    pub labd_ca: Option<PathBuf>,
    /// How pushes compress compressible chunks: `lz4` (default) or `zstd`.
    pub compression: Option<String>,
    /// Who runs `labrun`'s jobs: `labd` (default) or `slurm`.
    pub backend: Option<String>,
    /// With the Slurm backend.
    pub slurm: Option<SlurmFile>,
    /// Where labd tells you that your jobs ended: webhook URLs (Slack,
    /// Mattermost, Discord) or `mailto:you@lab`.
    #[serde(default)]
    pub notify: Vec<String>,
}

/// `[slurm]` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmFile {
    /// Longest wait for one Slurm command (`10s`).
    pub timeout: Option<String>,
    /// Partition jobs are submitted to (Slurm's default without it).
    pub partition: Option<String>,
    /// How long before its time limit a job is told to stop (SIGTERM), so
    /// its outputs are saved (`2m`).
    pub grace: Option<String>,
}

/// Who runs `labrun`'s jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// labd: one node's, or a cluster's coordinator.
    #[default]
    Labd,
    /// Slurm, with labd's agents staging the data.
    Slurm,
}

impl std::str::FromStr for Backend {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "labd" => Ok(Backend::Labd),
            "slurm" => Ok(Backend::Slurm),
            _ => bail!("backend {s:?}: labd or slurm"),
        }
    }
}

/// The Slurm backend's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmSettings {
    /// Longest wait for one Slurm command.
    pub timeout: std::time::Duration,
    /// Partition jobs are submitted to.
    pub partition: Option<String>,
    /// Seconds before its time limit a job gets SIGTERM.
    pub grace_s: u64,
}

impl SlurmSettings {
    fn from_file(f: Option<SlurmFile>, env: &[(String, String)]) -> Result<SlurmSettings> {
        let f = f.unwrap_or_default();
        let var = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let secs = |what: &str, v: Option<String>, default: u64| -> Result<u64> {
            match v {
                Some(v) => {
                    crate::local::parse_duration(&v).with_context(|| format!("slurm {what} {v:?}"))
                }
                None => Ok(default),
            }
        };
        let timeout = secs("timeout", var("LABRUN_SLURM_TIMEOUT").or(f.timeout), 10)?;
        if timeout == 0 {
            bail!("slurm timeout 0: give Slurm's commands at least 1 s");
        }
        Ok(SlurmSettings {
            timeout: std::time::Duration::from_secs(timeout),
            partition: var("LABRUN_SLURM_PARTITION").or(f.partition),
            grace_s: secs("grace", f.grace, 120)?,
        })
    }
}

/// What the flags and environment gave (clap merges those two).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--store` / `LABSYNC_STORE`.
    pub store: Option<String>,
    /// `--cache-dir` / `LABSYNC_CACHE`.
    pub cache_dir: Option<PathBuf>,
    /// `--cache-max` / `LABSYNC_CACHE_MAX`.
    pub cache_max: Option<String>,
    /// `--config` / `LABSYNC_CONFIG`.
    pub config: Option<PathBuf>,
    /// `--s3-endpoint` / `AWS_ENDPOINT`.
    pub s3_endpoint: Option<String>,
    /// `--s3-region` / `AWS_REGION`.
    pub s3_region: Option<String>,
    /// `--compression` / `LABSYNC_COMPRESSION`.
    pub compression: Option<String>,
}

/// Fully resolved settings. `Debug` shows no token or store credential.
#[derive(Clone)]
pub struct Settings {
    /// Store URL.
    pub store: String,
    /// Backend options for `object_store` (`aws_endpoint`, credentials, …).
    pub store_options: Vec<(String, String)>,
    /// Node cache folder.
    pub cache_dir: PathBuf,
    /// Node cache cap in bytes.
    pub cache_max: u64,
    /// labd's address from the config file.
    pub labd: Option<String>,
    /// labrun's token from the config file.
    pub token: Option<Secret>,
    /// The CA an `https://` labd's certificate is checked against
    /// (`LABRUN_CA`, else the config file's `labd_ca`).
    pub labd_ca: Option<PathBuf>,
    /// How pushes compress compressible chunks.
    pub compression: Codec,
    /// Who runs `labrun`'s jobs (`backend`, `LABRUN_BACKEND`).
    pub backend: Backend,
    /// The Slurm backend's settings (`[slurm]`).
    pub slurm: SlurmSettings,
    /// Where labd tells of a job's end (`notify`, `LABRUN_NOTIFY`:
    /// targets separated by spaces).
    pub notify: Vec<String>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store)
            .field(
                "store_options",
                &labsync_agent::RedactedOptions(&self.store_options),
            )
            .field("cache_dir", &self.cache_dir)
            .field("cache_max", &self.cache_max)
            .field("labd", &self.labd)
            .field("token", &self.token)
            .field("labd_ca", &self.labd_ca)
            .field("compression", &self.compression)
            .field("backend", &self.backend)
            .field("slurm", &self.slurm)
            .field("notify", &self.notify.len())
            .finish()
    }
}

const DEFAULT_CACHE_MAX: u64 = 50 << 30;

impl Settings {
    /// Resolves settings; `env` is the process environment (passed in for tests).
    pub fn resolve(o: &Overrides, env: &[(String, String)]) -> Result<Settings> {
        let file = load_file(o.config.as_deref())?;
        let store = match o.store.clone().or(file.store) {
            Some(s) => normalise_store(&s)?,
            None => {
                let dir = dirs::data_dir()
                    .context("no data directory (set HOME or LABSYNC_STORE)")?
                    .join("labsync")
                    .join("store");
                format!("file://{}", dir.display())
            }
        };
        let cache_dir = match o.cache_dir.clone().or(file.cache_dir) {
            Some(d) => d,
            None => dirs::cache_dir()
                .context("no cache directory (set HOME or LABSYNC_CACHE)")?
                .join("labsync"),
        };
        let cache_max = match o.cache_max.clone().or(file.cache_max) {
            Some(s) => parse_size(&s).with_context(|| format!("invalid cache size {s:?}"))?,
            None => DEFAULT_CACHE_MAX,
        };
        // object_store's own keys, from the usual variables: AWS_ACCESS_KEY_ID → aws_access_key_id.
        let mut store_options: Vec<(String, String)> = env
            .iter()
            .filter(|(k, _)| {
                k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")
            })
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
            .collect();
        let endpoint = o.s3_endpoint.clone().or(file.s3_endpoint);
        if let Some(e) = endpoint {
            if e.starts_with("http://") {
                store_options.push(("aws_allow_http".into(), "true".into()));
            }
            store_options.push(("aws_endpoint".into(), e));
        }
        if let Some(r) = o.s3_region.clone().or(file.s3_region) {
            store_options.push(("aws_region".into(), r));
        }
        // An http:// endpoint from the environment alone (labd has no
        // --s3-endpoint flag) needs the same permission as one from a flag.
        let plain_http =
            |(k, v): &(String, String)| k == "aws_endpoint" && v.starts_with("http://");
        if store_options.iter().any(plain_http)
            && !store_options.iter().any(|(k, _)| k == "aws_allow_http")
        {
            store_options.push(("aws_allow_http".into(), "true".into()));
        }
        let from_env = env
            .iter()
            .find(|(k, _)| k == "LABSYNC_COMPRESSION")
            .map(|(_, v)| v.clone());
        let compression = match o.compression.clone().or(from_env).or(file.compression) {
            Some(c) => c.parse::<Codec>()?,
            None => Codec::default(),
        };
        let backend = match env.iter().find(|(k, _)| k == "LABRUN_BACKEND") {
            Some((_, v)) => v.parse().context("LABRUN_BACKEND")?,
            None => match &file.backend {
                Some(b) => b.parse().context("backend in the config file")?,
                None => Backend::Labd,
            },
        };
        let slurm = SlurmSettings::from_file(file.slurm, env)?;
        let notify = match env.iter().find(|(k, _)| k == "LABRUN_NOTIFY") {
            Some((_, v)) => v.split_whitespace().map(str::to_string).collect(),
            None => file.notify,
        };
        Ok(Settings {
            notify,
            backend,
            slurm,
            compression,
            store,
            store_options,
            cache_dir,
            cache_max,
            labd: file.labd,
            token: file.token,
            labd_ca: env
                .iter()
                .find(|(k, v)| k == "LABRUN_CA" && !v.is_empty())
                .map(|(_, v)| PathBuf::from(v))
                .or(file.labd_ca),
        })
    }
}

fn load_file(explicit: Option<&Path>) -> Result<FileConfig> {
    match explicit {
        Some(p) => read_config(p, true),
        None => match dirs::config_dir() {
            Some(d) => read_config(&d.join("labsync").join("config.toml"), false),
            None => Ok(FileConfig::default()),
        },
    }
}

/// The config at `path`. One named (`--config`) must be read; the default
/// one may be absent, and so it is where it cannot be seen to exist (a
/// job whose `HOME` is a folder it may not enter, a `~/.config` that is a
/// file): then there is no config, not an error. One that is there and
/// cannot be read is an error either way.
fn read_config(path: &Path, named: bool) -> Result<FileConfig> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
        }
        Err(_) if !named && std::fs::symlink_metadata(path).is_err() => Ok(FileConfig::default()),
        Err(e) => Err(e).with_context(|| format!("cannot read config file {}", path.display())),
    }
}

/// A bare path becomes a `file://` URL.
fn normalise_store(s: &str) -> Result<String> {
    if s.contains("://") {
        return Ok(s.to_string());
    }
    let p = Path::new(s);
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    Ok(format!("file://{}", abs.display()))
}

/// `1234`, `500M`, `50G`, `2T`, `10GiB`, `1.5G` → bytes (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("{s:?} does not start with a number"))?;
    let mult: u64 = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        u => bail!("unknown unit {u:?} in {s:?} (use K, M, G or T)"),
    };
    Ok((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1234").unwrap(), 1234);
        assert_eq!(parse_size("50G").unwrap(), 50 << 30);
        assert_eq!(parse_size("10GiB").unwrap(), 10 << 30);
        assert_eq!(parse_size("1.5M").unwrap(), 3 << 19);
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5X").unwrap_err().to_string().contains("unit"));
    }

    /// Issue 43: a default config that cannot be seen to exist is no
    /// config (a job whose `HOME` it may not enter failed on it); one named,
    /// or one there but unreadable, is an error.
    #[test]
    fn a_default_config_that_cannot_be_seen_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let under_a_file = file.join("config.toml");
        assert!(read_config(&under_a_file, false).is_ok());
        assert!(read_config(&dir.path().join("none.toml"), false).is_ok());
        let e = read_config(&dir.path().join("none.toml"), true).unwrap_err();
        assert!(
            format!("{e:#}").contains("cannot read config file"),
            "{e:#}"
        );
        // A folder nobody may enter, looked at as nobody (as root: the
        // thread's file-system ids switch).
        let shut = dir.path().join("shut");
        std::fs::create_dir(&shut).unwrap();
        let there = shut.join("config.toml");
        std::fs::write(&there, "store = \"file:///s\"").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&shut, std::fs::Permissions::from_mode(0o700)).unwrap();
        if labsync_agent::euid() == 0 {
            let nobody = labsync_store::RunAs {
                uid: 65534,
                gid: 65534,
            };
            let (hidden, named) = labsync_store::as_user(Some(nobody), || {
                (read_config(&there, false), read_config(&there, true))
            })
            .unwrap();
            assert!(hidden.is_ok(), "{hidden:?}");
            assert!(named.is_err());
            // Seen to be there but unreadable: said.
            std::fs::set_permissions(&shut, std::fs::Permissions::from_mode(0o711)).unwrap();
            std::fs::set_permissions(&there, std::fs::Permissions::from_mode(0o600)).unwrap();
            let seen = labsync_store::as_user(Some(nobody), || read_config(&there, false)).unwrap();
            assert!(seen.is_err(), "there but unreadable: an error");
        }
        assert_eq!(
            read_config(&there, false).unwrap().store.as_deref(),
            Some("file:///s")
        );
    }

    #[test]
    fn flags_beat_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "store = \"file:///from/file\"\ncache_max = \"1G\"\n").unwrap();
        let o = Overrides {
            config: Some(cfg.clone()),
            ..Default::default()
        };
        let s = Settings::resolve(&o, &[]).unwrap();
        assert_eq!(
            (s.store.as_str(), s.cache_max),
            ("file:///from/file", 1 << 30)
        );
        let o = Overrides {
            config: Some(cfg),
            store: Some("s3://b/p".into()),
            s3_endpoint: Some("http://127.0.0.1:9".into()),
            ..Default::default()
        };
        let s = Settings::resolve(&o, &[("AWS_ACCESS_KEY_ID".into(), "k".into())]).unwrap();
        assert_eq!(s.store, "s3://b/p");
        assert!(s
            .store_options
            .contains(&("aws_access_key_id".into(), "k".into())));
        assert!(s
            .store_options
            .contains(&("aws_allow_http".into(), "true".into())));
        // labd has no --s3-endpoint: an http:// AWS_ENDPOINT alone is allowed too.
        let env = [("AWS_ENDPOINT".to_string(), "http://127.0.0.1:9".to_string())];
        let s = Settings::resolve(&Overrides::default(), &env).unwrap();
        let allowed = ("aws_allow_http".to_string(), "true".to_string());
        assert_eq!(s.store_options.iter().filter(|o| **o == allowed).count(), 1);
    }

    #[test]
    fn compression_flag_beats_environment_beats_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "compression = \"zstd\"\n").unwrap();
        let env = |v: &str| vec![("LABSYNC_COMPRESSION".to_string(), v.to_string())];
        let mut o = Overrides::default();
        assert_eq!(Settings::resolve(&o, &[]).unwrap().compression, Codec::Lz4);
        o.config = Some(cfg);
        assert_eq!(Settings::resolve(&o, &[]).unwrap().compression, Codec::Zstd);
        assert_eq!(
            Settings::resolve(&o, &env("lz4")).unwrap().compression,
            Codec::Lz4
        );
        o.compression = Some("zstd".into());
        assert_eq!(
            Settings::resolve(&o, &env("lz4")).unwrap().compression,
            Codec::Zstd
        );
        o.compression = Some("gzip".into());
        let err = Settings::resolve(&o, &[]).unwrap_err().to_string();
        assert!(err.contains("gzip") && err.contains("lz4 or zstd"), "{err}");
    }

    #[test]
    fn bad_config_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "stor = 1\n").unwrap();
        let o = Overrides {
            config: Some(cfg),
            ..Default::default()
        };
        assert!(format!("{:#}", Settings::resolve(&o, &[]).unwrap_err())
            .contains("invalid config file"));
        let o = Overrides {
            config: Some(dir.path().join("missing.toml")),
            ..Default::default()
        };
        assert!(Settings::resolve(&o, &[]).is_err());
    }
}
