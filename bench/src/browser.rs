//! A real headless Chromium, driven through ChromeDriver's WebDriver
//! protocol (JSON over HTTP on loopback) with a few lines of std: Debian's
//! `chromium` and `chromium-driver`, which `scripts/test.sh` installs.
//! Shared by the web page's tests (`tests/cluster/web.rs`, which include
//! this file) and its benchmark (`web-bench`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// One browser session.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

impl Browser {
    /// A fresh headless Chromium; `None` (said) where it is not installed
    /// and this is not CI, which must have it.
    pub fn start() -> Option<Browser> {
        if !Path::new(CHROMIUM).exists() || !Path::new(CHROMEDRIVER).exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "{CHROMIUM} and {CHROMEDRIVER} are needed (scripts/test.sh installs them)"
            );
            eprintln!("skipped: no {CHROMIUM} or {CHROMEDRIVER} (apt-get install chromium chromium-driver)");
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver");
        let profile = tempfile::tempdir().unwrap();
        let mut b = Browser {
            driver,
            port,
            session: String::new(),
            _profile: profile,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while b.call("GET", "/status", None).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        // As the workplace's own probe starts it: no sandbox (root), and
        // none of the background traffic a closed network refuses.
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,1400",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--user-data-dir={}", b._profile.path().display())])
        .collect::<Vec<_>>();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args}
        }}});
        let v = b.call("POST", "/session", Some(caps)).expect("a session");
        b.session = v["sessionId"].as_str().expect("session id").to_string();
        Some(b)
    }

    /// Opens a new window and makes it the current one.
    pub fn new_window(&self) {
        let v = self.session_call("POST", "window/new", json!({"type": "window"}));
        let handle = v["handle"].as_str().expect("a window handle").to_string();
        self.session_call("POST", "window", json!({ "handle": handle }));
    }

    /// Shows pages as a phone of `width` × `height` CSS pixels would
    /// (Chrome's device emulation, through ChromeDriver's CDP command).
    pub fn phone(&self, width: u32, height: u32) {
        self.session_call(
            "POST",
            "goog/cdp/execute",
            json!({"cmd": "Emulation.setDeviceMetricsOverride", "params": {
                "width": width, "height": height, "deviceScaleFactor": 2, "mobile": true
            }}),
        );
    }

    /// Opens `url` (waits for the load).
    pub fn open(&self, url: &str) {
        self.session_call("POST", "url", json!({ "url": url }));
    }

    /// Runs `script` in the page; its `return` value.
    pub fn eval(&self, script: &str) -> Value {
        self.session_call(
            "POST",
            "execute/sync",
            json!({"script": script, "args": []}),
        )
    }

    /// Waits up to `secs` for `script` to return true; how long it took.
    pub fn wait_for(&self, what: &str, secs: u64, script: &str) -> Duration {
        let start = Instant::now();
        loop {
            if self.eval(script) == Value::Bool(true) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "{what}: not within {secs} s; the page says: {}",
                self.eval("return document.body ? document.body.innerText : ''")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Types `text` into the element `css` selects.
    pub fn type_into(&self, css: &str, text: &str) {
        let el = self.element(css);
        self.session_call(
            "POST",
            &format!("element/{el}/value"),
            json!({ "text": text }),
        );
    }

    /// Clicks the element `css` selects.
    pub fn click(&self, css: &str) {
        let el = self.element(css);
        self.session_call("POST", &format!("element/{el}/click"), json!({}));
    }

    fn element(&self, css: &str) -> String {
        let v = self.session_call(
            "POST",
            "element",
            json!({"using": "css selector", "value": css}),
        );
        let (_, id) = v
            .as_object()
            .and_then(|o| o.iter().next())
            .unwrap_or_else(|| panic!("no element {css}"));
        id.as_str().unwrap().to_string()
    }

    /// A PNG of the page, written to `path`.
    pub fn screenshot(&self, path: &Path) {
        let v = self.session_call("GET", "screenshot", Value::Null);
        let png = base64(v.as_str().expect("base64 PNG"));
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }

    fn session_call(&self, method: &str, what: &str, body: Value) -> Value {
        let path = format!("/session/{}/{what}", self.session);
        let body = (method == "POST").then_some(body);
        self.call(method, &path, body)
            .unwrap_or_else(|e| panic!("webdriver {method} {what}: {e}"))
    }

    /// One WebDriver command: its `value`, or the error it answered.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.port,
            body.len()
        )
        .map_err(|e| e.to_string())?;
        // ChromeDriver keeps the connection open whatever it is asked: the
        // answer is read by its length (or its chunks), not to the close.
        let mut raw = Vec::new();
        let mut buf = [0u8; 65536];
        let (split, head) = loop {
            let n = s.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("closed before the answer's head".into());
            }
            raw.extend_from_slice(&buf[..n]);
            if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break (at, String::from_utf8_lossy(&raw[..at]).to_ascii_lowercase());
            }
        };
        let chunked = head.contains("transfer-encoding: chunked");
        let length = (head.lines())
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        loop {
            let body = &raw[split + 4..];
            let whole = match length {
                Some(n) => body.len() >= n,
                None if chunked => body.ends_with(b"0\r\n\r\n"),
                None => false,
            };
            if whole {
                break;
            }
            let n = s.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
        }
        let mut payload = raw[split + 4..].to_vec();
        if chunked {
            payload = unchunk(&payload);
        }
        let v: Value = serde_json::from_slice(&payload).map_err(|e| format!("{e}: {head}"))?;
        let value = v.get("value").cloned().unwrap_or(Value::Null);
        if head.starts_with("http/1.1 2") {
            Ok(value)
        } else {
            Err(value.to_string())
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let path = format!("/session/{}", self.session);
            let _ = self.call("DELETE", &path, None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn unchunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

/// Standard base64, as WebDriver sends a screenshot.
fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let bytes: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= u32::from(val(*c)) << (18 - 6 * i);
        }
        let take = chunk.len() - 1;
        out.extend_from_slice(&n.to_be_bytes()[1..1 + take]);
    }
    out
}

#[cfg(test)]
#[test]
fn base64_decodes_as_the_standard_says() {
    assert_eq!(base64("aGVsbG8="), b"hello");
    assert_eq!(base64("aGVsbG8h"), b"hello!");
    assert_eq!(base64("aA=="), b"h");
}
