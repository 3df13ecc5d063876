//! Issue 44: the lab's page in a real headless Chromium, and `/metrics`
//! read by Prometheus' own parser, from a cluster of three labd processes
//! with fake GPUs.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use labsync_agent::proto::ClusterStatus;
use labsync_agent::{GpuState, JobState};

use crate::browser::Browser;
use crate::lab::*;

/// `GET path` from node `i` with `token`: the status and the body.
fn get(lab: &Lab, i: usize, path: &str, token: Option<&str>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", lab.nodes[i].port)).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: labd\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    (status, body.to_string())
}

/// Where the test's screenshots go: `target/tmp/web/` (linked from
/// docs/web.md, which holds a copy).
fn shots() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("web")
}

const STATES: &str = "return Array.from(document.querySelectorAll('td.gpu'))\
    .map(e => e.dataset.node + ':' + e.dataset.gpu + ':' + e.dataset.state).join(' ')";

/// The page shows each GPU state the grid knows (free, leased, foreign,
/// unknown, down), a job started after it loaded appears without a
/// reload, a command's markup stays text, and a job's log is its user's.
#[test]
fn the_page_shows_every_gpu_state_live_and_a_jobs_log_only_to_its_user() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let Some(mut lab) = Lab::start(3) else { return };
    // gpu1: both GPUs held by a process labd did not start; gpu2: its
    // inventory hangs (unknown), and later the node dies (down).
    lab.hold_gpus(1, true);
    std::fs::write(lab.dir.path().join("gpu2/control.toml"), "hang = true\n").unwrap();
    let j1 = lab.ok(&[
        "--gpus",
        "1",
        "--detach",
        "--",
        "sh",
        "-c",
        "echo hello-from-j1; sleep 300",
    ]);
    let j1 = j1.trim();
    assert_eq!(lab.running(j1), "gpu0");

    // A logged-out browser is sent to the login page; a wrong token is told.
    browser.open(&format!("{}/", lab.url(0)));
    browser.wait_for(
        "the login form",
        10,
        "return !!document.querySelector('input[name=token]')",
    );
    browser.type_into("input[name=token]", "not-a-token-of-this-lab");
    browser.click("form.login button");
    browser.wait_for(
        "the refusal",
        10,
        "return document.body.innerText.includes('not a token')",
    );
    browser.type_into("input[name=token]", ALICE);
    browser.click("form.login button");
    browser.wait_for(
        "the grid",
        20,
        "return document.querySelectorAll('td.gpu').length == 6",
    );
    browser.wait_for(
        "each state",
        20,
        &format!(
            "var s = (function(){{ {STATES} }})(); return s.includes('gpu0:0:leased') && \
             s.includes('gpu0:1:free') && s.includes('gpu1:0:foreign') && s.includes('gpu1:1:foreign') \
             && s.includes('gpu2:0:unknown') && s.includes('gpu2:1:unknown')"
        ),
    );
    let leased = browser.eval("return document.querySelector('td.gpu.leased').innerText");
    let leased = leased.as_str().unwrap();
    assert!(leased.contains(j1) && leased.contains("alice"), "{leased}");
    let foreign = browser.eval("return document.querySelector('td.gpu.foreign').innerText");
    assert!(foreign.as_str().unwrap().contains("pid 4242"), "{foreign}");

    // A job submitted now shows up in place: the page was not loaded again
    // (the marker set on it stays), and its command's markup is text.
    browser.eval("window.__same_page = 42; return true");
    let sent = Instant::now();
    let j2 = lab.ok(&[
        "--gpus",
        "1",
        "--detach",
        "--",
        "sh",
        "-c",
        "sleep 300",
        "<img src=x onerror=window.__pwned=1>",
    ]);
    let j2 = j2.trim().to_string();
    let took = browser.wait_for(
        "the new job, without a reload",
        30,
        &format!(
            "return window.__same_page === 42 && !!document.querySelector('tr[data-job=\"{j2}\"]') \
             && Array.from(document.querySelectorAll('td.gpu')).some(e => e.dataset.state == 'leased' \
             && e.innerText.includes('{j2}'))"
        ),
    );
    eprintln!(
        "{j2} on the page {:.1} s after labrun returned ({:.1} s after it was sent)",
        took.as_secs_f64(),
        sent.elapsed().as_secs_f64()
    );
    assert_eq!(browser.eval("return window.__pwned === undefined"), true);
    assert_eq!(
        browser.eval("return document.querySelectorAll('main img').length"),
        0
    );
    let row = browser.eval(&format!(
        "return document.querySelector('tr[data-job=\"{j2}\"]').innerText"
    ));
    assert!(row.as_str().unwrap().contains("<img src=x"), "{row}");

    // Every GPU taken or out: a third job waits, and the queue says why.
    let j3 = lab.ok(&["--gpus", "1", "--detach", "--", "sleep", "300"]);
    let j3 = j3.trim().to_string();
    browser.wait_for(
        "the waiting job and why",
        30,
        &format!(
            "var r = document.querySelector('table.queue tr[data-job=\"{j3}\"]'); \
             return !!r && r.cells.length == 6 && r.cells[2].innerText == 'alice' \
             && r.cells[3].innerText == '1' && r.cells[5].innerText.length > 10"
        ),
    );
    // Both read the coordinator's words for it, which a pass may reword:
    // the same within a few reads.
    let mut said = (String::new(), String::new());
    let same = (0..50).any(|_| {
        let page = browser.eval(&format!(
            "return document.querySelector('table.queue tr[data-job=\"{j3}\"]').cells[5].innerText"
        ));
        said = (
            page.as_str().unwrap().to_string(),
            lab.job(&j3).why.unwrap_or_default(),
        );
        said.0 == said.1 || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            false
        }
    });
    assert!(
        same,
        "the page and labrun ps say why {j3} waits differently: {said:?}"
    );

    // A dataset warmed and pinned on gpu1 shows in the data table, whole.
    lab.dataset("div2k", 3);
    let o = lab.labsync_as(ADMIN, &["warm", "div2k", "--nodes", "gpu1"]);
    assert!(o.status.success(), "{o:?}");
    browser.wait_for(
        "div2k pinned on gpu1 in the data table",
        30,
        "return Array.from(document.querySelectorAll('table.data tr')).some(r => \
         r.cells.length == 4 && r.cells[0].innerText == 'gpu1' && r.cells[1].innerText == 'div2k@v1' \
         && r.cells[2].innerText.startsWith('100% of ') && r.cells[3].innerText.includes('pinned'))",
    );

    // gpu2 dies: its GPUs read down, without a reload.
    lab.crash(2);
    browser.wait_for(
        "gpu2 down",
        30,
        &format!(
            "return window.__same_page === 42 && (function(){{ {STATES} }})().includes('gpu2:0:down')"
        ),
    );
    browser.screenshot(&shots().join("grid.png"));
    // On a phone: one column of nodes, nothing wider than the screen.
    browser.phone(390, 844);
    browser.open(&format!("{}/", lab.url(0)));
    browser.wait_for(
        "the grid on a phone",
        20,
        "return document.querySelectorAll('td.gpu').length == 6 && \
         document.documentElement.scrollWidth <= window.innerWidth + 1",
    );
    browser.screenshot(&shots().join("phone.png"));
    browser.phone(1280, 1400);

    // The job's page: command, snapshots, history and its log, live.
    browser.open(&format!("{}/job/{j1}", lab.url(0)));
    browser.wait_for(
        "j1's log",
        20,
        "return !!document.querySelector('pre.log') && \
         document.querySelector('pre.log').innerText.includes('hello-from-j1')",
    );
    let facts = browser.eval("return document.querySelector('table.facts').innerText");
    let facts = facts.as_str().unwrap();
    for want in [
        "alice",
        "echo hello-from-j1",
        "gpu0",
        "submitted",
        "started",
        "code/alice/code@v",
        "labrun rerun",
        "placed on gpu0",
    ] {
        assert!(facts.contains(want), "{want} in {facts}");
    }
    browser.screenshot(&shots().join("job.png"));

    // bob sees the job but not its log; his own page lists his standing.
    browser.click("header form button");
    browser.wait_for(
        "logged out",
        10,
        "return !!document.querySelector('input[name=token]')",
    );
    browser.type_into("input[name=token]", BOB);
    browser.click("form.login button");
    browser.wait_for(
        "the grid as bob",
        20,
        "return document.querySelectorAll('td.gpu').length == 6",
    );
    browser.open(&format!("{}/job/{j1}", lab.url(0)));
    browser.wait_for(
        "j1's page without its log",
        20,
        "return document.body.innerText.includes('only its user and admins') && \
         !document.querySelector('pre.log')",
    );
    browser.open(&format!("{}/user/alice", lab.url(0)));
    browser.wait_for(
        "alice's jobs and standing",
        20,
        &format!(
            "return document.body.innerText.includes('Fair share') && \
             document.body.innerText.includes('{j1}')"
        ),
    );
}

/// The values of a metrics text, by `name{labels}` as written.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

/// `/metrics` parses with `promtool check metrics` (Prometheus' own
/// parser and linter) and says what `labrun status --json` says; the
/// alert rules and dashboard shipped in `dist/` are built on its names.
#[test]
fn metrics_parse_with_promtool_and_agree_with_labrun_status() {
    let Some(lab) = Lab::start(3) else { return };
    let promtool = Path::new("/usr/bin/promtool");
    if !promtool.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is needed (scripts/test.sh installs it)"
        );
        eprintln!("skipped: no promtool (apt-get install prometheus)");
        return;
    }
    lab.hold_gpus(1, true);
    let j1 = lab.ok(&["--gpus", "1", "--detach", "--", "sleep", "300"]);
    lab.running(j1.trim());
    // Two GPUs free on gpu2 and one on gpu0: the second pair waits.
    let j2 = lab.ok(&["--gpus", "2", "--detach", "--", "sleep", "300"]);
    lab.running(j2.trim());
    let j3 = lab.ok(&["--gpus", "2", "--detach", "--", "sleep", "300"]);
    let j3 = j3.trim();
    crate::common::wait_until("j3 to wait", 20, || lab.job(j3).state == JobState::Queued);
    // One that ends at once, for the outcome counter.
    lab.ok(&["--gpus", "0", "--", "true"]);

    // `labrun status --watch` draws the grid again and again.
    let mut w = lab
        .labrun_cmd(&["status", "--watch"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(4500));
    w.kill().unwrap();
    let out = w.wait_with_output().unwrap();
    let drawn = String::from_utf8_lossy(&out.stdout);
    assert!(
        drawn.matches("cluster of 3 node(s)").count() >= 2,
        "{drawn}"
    );
    assert!(drawn.contains("(every 2 s; Ctrl-C to stop;"), "{drawn}");
    let o = lab.labrun(&["status", "--watch", "--json"]);
    assert!(!o.status.success(), "{o:?}");

    // Without a token: refused.
    assert_eq!(get(&lab, 0, "/metrics", None).0, 401);
    // The view both read settles with the heartbeats: read until they agree.
    let mut last = String::new();
    let mut wrong = Vec::new();
    let agreed = (0..60).any(|_| {
        let (code, text) = get(&lab, 0, "/metrics", Some(ALICE));
        assert_eq!(code, 200, "{text}");
        let status: ClusterStatus = serde_json::from_str(&lab.ok(&["status", "--json"])).unwrap();
        let m = samples(&text);
        last = text.clone();
        let mut found = Vec::new();
        let mut want = |k: String, v: f64| {
            if m.get(&k).copied() != Some(v) {
                found.push(format!("{k} = {:?}, not {v}", m.get(&k)));
            }
        };
        for n in &status.nodes {
            let node = n.name.as_str();
            want(format!("labsync_node_up{{node=\"{node}\"}}"), 1.0);
            want(
                format!("labsync_node_cache_bytes{{node=\"{node}\"}}"),
                n.cache_used as f64,
            );
            want(
                format!("labsync_node_fetched_bytes_total{{node=\"{node}\",from=\"store\"}}"),
                n.fetched.from_store as f64,
            );
            for g in &n.gpus {
                let i = g.index;
                let info = g.info.as_ref().unwrap();
                want(
                    format!("labsync_gpu_memory_used_bytes{{node=\"{node}\",gpu=\"{i}\"}}"),
                    info.memory_used as f64,
                );
                want(
                    format!("labsync_gpu_memory_total_bytes{{node=\"{node}\",gpu=\"{i}\"}}"),
                    info.memory_total as f64,
                );
                let state = match &g.state {
                    GpuState::Free => "free",
                    GpuState::Leased { .. } => "leased",
                    GpuState::Foreign { .. } => "foreign",
                    GpuState::Unknown { .. } => "unknown",
                };
                want(
                    format!("labsync_gpu_state{{node=\"{node}\",gpu=\"{i}\",state=\"{state}\"}}"),
                    1.0,
                );
            }
        }
        let jobs = lab.jobs();
        let queued = jobs.iter().filter(|j| j.state == JobState::Queued).count();
        let in_queue: f64 = (m.iter())
            .filter(|(k, _)| k.starts_with("labsync_queue_jobs{"))
            .map(|(_, v)| v)
            .sum();
        if in_queue != queued as f64 || queued != 1 {
            want(
                format!("labsync_queue_jobs, all tiers ({in_queue}; {queued} in labrun ps)"),
                1.0,
            );
        }
        // j1, j2 and the quick one placed; the quick one ended.
        let placed = jobs.iter().filter(|j| j.node.is_some()).count();
        want("labsync_cluster_jobs_started_total".into(), placed as f64);
        want(
            "labsync_cluster_jobs_ended_total{outcome=\"succeeded\"}".into(),
            1.0,
        );
        // The quick one's staging, estimated and as it went.
        want(
            "labsync_cluster_staging_estimated_seconds_count".into(),
            1.0,
        );
        want("labsync_cluster_staging_actual_seconds_count".into(), 1.0);
        wrong = found;
        let ok = wrong.is_empty();
        if !ok {
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
        ok
    });
    assert!(
        agreed,
        "the metrics never agreed with labrun status: {wrong:#?}\n{last}"
    );
    let m = samples(&last);
    assert_eq!(
        m["labsync_gpu_state{node=\"gpu1\",gpu=\"0\",state=\"foreign\"}"],
        1.0
    );
    assert!(m["labsync_gpu_foreign_memory_bytes{node=\"gpu1\",gpu=\"0\"}"] >= 3000.0 * 1048576.0);
    assert!(m["labsync_queue_oldest_wait_seconds"] >= 0.0);
    assert!(m
        .keys()
        .any(|k| k.starts_with("labsync_request_duration_seconds_bucket{route=\"/v1/jobs\"")));
    // The alert rules and the dashboard in dist/ name only families
    // served here, and the rules pass promtool.
    let families: Vec<&str> = (last.lines())
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist");
    let rules = dist.join("labsync-alerts.yml");
    let dashboard = std::fs::read_to_string(dist.join("grafana-labsync.json")).unwrap();
    let _: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let text = std::fs::read_to_string(&rules).unwrap() + &dashboard;
    let mut named = 0;
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("labsync_") {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .fold(word, |w, s| w.strip_suffix(s).unwrap_or(w));
            assert!(
                families.contains(&family),
                "{word} in dist/ is no metric labd serves"
            );
            named += 1;
        }
    }
    assert!(named >= 10, "{named}");
    let out = Command::new(promtool)
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(last.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A webhook receiver on loopback: answers 500 to its first request and
/// 200 to the rest; every request's path and body, with what it answered.
struct Receiver {
    port: u16,
    got: std::sync::Arc<std::sync::Mutex<Vec<(String, String, u16)>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let g = got.clone();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { continue };
                let mut raw = Vec::new();
                let mut buf = [0u8; 8192];
                let (head, body) = loop {
                    let n = s.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        break (String::new(), String::new());
                    }
                    raw.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&raw).to_string();
                    if let Some((h, b)) = text.split_once("\r\n\r\n") {
                        let len = (h.lines())
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().to_string())
                            })
                            .and_then(|v| v.parse::<usize>().ok())
                            .unwrap_or(0);
                        if b.len() >= len {
                            break (h.to_string(), b.to_string());
                        }
                    }
                };
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                let mut got = g.lock().unwrap();
                let status = if got.is_empty() { 500 } else { 200 };
                got.push((path, body, status));
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        Receiver { port, got }
    }

    fn got(&self) -> Vec<(String, String, u16)> {
        self.got.lock().unwrap().clone()
    }
}

/// Issue 44: a job's end and failure are told to its user's webhook once
/// each (the one the receiver answered 500 to, again), and by mail
/// through sendmail; a webhook to a host the lab did not name is refused
/// at submission; the webhook's address is never shown nor recorded, and
/// the job's page says how the telling went.
#[test]
fn each_end_is_told_once_and_a_failed_webhook_is_tried_again() {
    let rx = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let mailbox = dir.path().join("mail.txt");
    let sendmail = dir.path().join("sendmail");
    std::fs::write(
        &sendmail,
        format!(
            "#!/bin/sh\n{{ echo \"ARGS $*\"; cat; }} >> {}\n",
            mailbox.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &sendmail,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let extra = format!(
        "[notify]\nhosts = [\"127.0.0.1\"]\nsendmail = \"{}\"\n",
        sendmail.display()
    );
    let Some(lab) = Lab::start_full(2, false, "", &extra) else {
        return;
    };
    let hook = format!("http://127.0.0.1:{}/hooks/secret-path", rx.port);

    // Refused at once: a host the lab's [notify] hosts does not name.
    let o = lab.labrun(&[
        "--notify",
        "https://evil.example/x",
        "--gpus",
        "0",
        "--",
        "true",
    ]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("ask an admin to add evil.example"),
        "{e}"
    );

    lab.ok(&["--notify", &hook, "--gpus", "0", "--", "true"]);
    let ok = lab.jobs().last().unwrap().id.to_string();
    let o = lab.labrun(&[
        "--notify",
        &hook,
        "--notify",
        "mailto:alice@lab.example",
        "--gpus",
        "0",
        "--",
        "false",
    ]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let failed = lab.jobs().last().unwrap().id.to_string();

    crate::common::wait_until("both told", 30, || {
        rx.got().iter().filter(|(_, _, s)| *s == 200).count() >= 2
    });
    crate::common::wait_until("the mail", 30, || {
        std::fs::read_to_string(&mailbox).is_ok_and(|m| m.contains(&failed))
    });
    // Nothing more comes: one message per event.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let got = rx.got();
    assert_eq!(got.len(), 3, "two events, one of them tried twice: {got:?}");
    assert_eq!(got[0].2, 500);
    let delivered: Vec<serde_json::Value> = (got.iter())
        .filter(|(_, _, s)| *s == 200)
        .map(|(p, b, _)| {
            assert_eq!(p, "/hooks/secret-path");
            serde_json::from_str(b).unwrap()
        })
        .collect();
    for v in &delivered {
        assert_eq!(v["text"], v["content"], "Slack's and Discord's field alike");
    }
    let said = |id: &str| {
        (delivered.iter())
            .filter(|v| {
                v["text"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("labsync: {id} (alice)"))
            })
            .count()
    };
    assert_eq!((said(&ok), said(&failed)), (1, 1), "{delivered:?}");
    assert!(delivered.iter().any(|v| v["text"]
        .as_str()
        .unwrap()
        .contains(&format!("{failed} (alice) failed: exit 1"))));
    let mail = std::fs::read_to_string(&mailbox).unwrap();
    assert!(mail.contains("ARGS -i -- alice@lab.example"), "{mail}");
    assert!(
        mail.contains(&format!("Subject: labsync: {failed} failed")),
        "{mail}"
    );

    // The page says how it went; the webhook's path is in no page nor record.
    let first = if got[0].1.contains(&format!("labsync: {ok} ")) {
        &ok
    } else {
        &failed
    };
    let (_, page) = get(&lab, 0, &format!("/job/{first}?live=1"), Some(ALICE));
    assert!(page.contains("told http://127.0.0.1/… (2 tries)"), "{page}");
    assert!(!page.contains("secret-path"), "{page}");
    let ps = lab.ok(&["ps", "--all", "--json"]);
    assert!(!ps.contains("secret-path"), "{ps}");
}

/// Issue 44: a hold on the grid says how long its GPUs have shown no use,
/// and its user is told when it is given back for that.
#[test]
fn a_holds_idle_time_is_on_the_grid_and_its_giving_back_is_told() {
    let rx = Receiver::start();
    let extra = "[notify]\nhosts = [\"127.0.0.1\"]\n";
    let Some(lab) = Lab::start_full(1, false, "idle_hold_s = 8\n", extra) else {
        return;
    };
    let control = lab.dir.path().join("gpu0").join("control.toml");
    let busy = "utilization = [{ gpu = 0, percent = 60 }, { gpu = 1, percent = 60 }]\n";
    std::fs::write(&control, busy).unwrap();
    let hook = format!("http://127.0.0.1:{}/hook", rx.port);
    let o = lab.labrun(&["--hold", "1h", "--gpus", "1", "--notify", &hook]);
    assert!(o.status.success(), "{o:?}");
    let page = || get(&lab, 0, "/?live=1", Some(ALICE)).1;
    crate::common::wait_until("the hold in use on the grid", 30, || {
        page().contains("hold of 1 h 00 min, in use")
    });
    std::fs::write(&control, "").unwrap();
    crate::common::wait_until("the hold idle on the grid", 30, || {
        page().contains("hold of 1 h 00 min, <span class=\"warn\">idle ")
    });
    // Given back after 8 s idle; told (the receiver's first answer is a
    // 500, so the second try carries it).
    crate::common::wait_until("the giving back told", 60, || {
        rx.got()
            .iter()
            .any(|(_, b, s)| *s == 200 && b.contains("hold given back"))
    });
    let told: Vec<_> = rx.got().into_iter().filter(|(_, _, s)| *s == 200).collect();
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].1.contains("showed no utilisation"), "{told:?}");
}
