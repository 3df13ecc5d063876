//! Facts about the machine and the installed tools, for the report header.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::runner::first_line_of;
use crate::tools::Tool;

#[derive(Debug, Clone, Default)]
pub struct Machine {
    pub date_utc: String,
    pub nproc: usize,
    pub cpu: String,
    pub mem_total_kib: u64,
    pub kernel: String,
    pub os: String,
    pub work_fs: String,
}

fn read(path: &str) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

fn command_line(cmd: &str, args: &[&str]) -> String {
    first_line_of(cmd.as_ref(), args).unwrap_or_else(|| "unknown".into())
}

impl Machine {
    pub fn probe(work: &Path) -> Self {
        let field = |text: &str, key: &str| {
            text.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_once([':', '=']))
                .map(|(_, v)| v.trim().trim_matches('"').to_string())
                .unwrap_or_else(|| "unknown".into())
        };
        let meminfo = read("/proc/meminfo");
        Machine {
            date_utc: command_line("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]),
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu: field(&read("/proc/cpuinfo"), "model name"),
            mem_total_kib: field(&meminfo, "MemTotal")
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            os: field(&read("/etc/os-release"), "PRETTY_NAME"),
            work_fs: fs_type(work),
        }
    }
}

/// Filesystem type of `dir` (`stat -f` would say "ext2/ext3" for ext4).
/// The file system type of `dir` (`df --output=fstype`).
pub fn fs_type(dir: &Path) -> String {
    Command::new("df")
        .arg("--output=fstype")
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .nth(1)
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// 1/5/15-minute load average: the machine may be shared, and a busy
/// neighbour shows up here rather than silently in the timings.
pub fn loadavg() -> String {
    read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Debug, Clone)]
pub struct ToolVersion {
    pub tool: Tool,
    /// First line of `--version`, or None when the binary is missing.
    pub version: Option<String>,
    /// Debian package version, when installed from a package.
    pub package: Option<String>,
}

pub fn tool_version(tool: Tool, labsync: &Path) -> ToolVersion {
    let program = tool.program(labsync);
    let version = crate::fsutil::find_program(&program).map(|p| {
        first_line_of(p.as_os_str(), tool.version_args()).unwrap_or_else(|| "unknown".into())
    });
    let package = tool.debian_package().and_then(|pkg| {
        let out = Command::new("dpkg-query")
            .args(["-W", "-f", "${Version}", pkg])
            .output()
            .ok()?;
        let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !v.is_empty()).then(|| format!("{pkg} {v}"))
    });
    ToolVersion {
        tool,
        version,
        package,
    }
}
