//! A real browser for the console's tests: headless Chromium driven by
//! chromedriver (Debian's `chromium` and `chromium-driver`), spoken to in
//! plain W3C WebDriver JSON over HTTP. The test starts chromedriver itself on
//! a free port, with a profile of its own in the test's directory; Chromium's
//! background traffic (updates, safe browsing, metrics, sync) is switched
//! off, so the only addresses it reaches are the ones the test opens.
//! Missing binaries fail the test with what to install; it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{eventually, free_port, Proc};

/// WebDriver's key for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn binary(var: &str, candidates: &[&str], package: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return PathBuf::from(p);
    }
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "{} not found: install Debian's {package} (scripts/setup.sh does), or set {var}",
                candidates[0]
            )
        })
}

pub struct Browser {
    driver: Option<Proc>,
    port: u16,
    session: Option<String>,
    client: reqwest::Client,
}

/// Chromium's switches: headless, as root in a container, and quiet on the network.
const CHROMIUM_ARGS: &[&str] = &[
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-client-side-phishing-detection",
    "--disable-domain-reliability",
    "--no-pings",
    "--metrics-recording-only",
    "--safebrowsing-disable-auto-update",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication,CertificateTransparencyComponentUpdater",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
];

impl Browser {
    /// Starts chromedriver on a free port and opens a session of headless
    /// Chromium, `width` × `height`, with its profile and logs under `dir`.
    pub async fn start(dir: &Path, width: u32, height: u32) -> Browser {
        let chromium = binary(
            "CHROMIUM_BIN",
            &["/usr/bin/chromium", "/usr/bin/chromium-browser"],
            "chromium",
        );
        let chromedriver = binary(
            "CHROMEDRIVER_BIN",
            &["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"],
            "chromium-driver",
        );
        let port = free_port();
        let driver = Proc::spawn(
            "chromedriver",
            Command::new(&chromedriver).arg(format!("--port={port}")),
            dir.join("chromedriver.log"),
        );
        let mut browser = Browser {
            driver: Some(driver),
            port,
            session: None,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap_or_else(|e| panic!("client: {e}")),
        };
        let status = format!("http://127.0.0.1:{port}/status");
        eventually("chromedriver to be ready", Duration::from_secs(20), || async {
            match browser.client.get(&status).send().await {
                Ok(r) => r.text().await.is_ok_and(|t| t.contains("\"ready\":true")),
                Err(_) => false,
            }
        })
        .await;
        let mut args: Vec<String> = CHROMIUM_ARGS.iter().map(|a| a.to_string()).collect();
        args.push(format!("--window-size={width},{height}"));
        args.push(format!(
            "--user-data-dir={}",
            dir.join("chromium-profile").display()
        ));
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "pageLoadStrategy": "normal",
            "goog:chromeOptions": { "binary": chromium, "args": args },
        } } });
        let created = browser.call("POST", "/session", Some(caps)).await;
        let id = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {created}"))
            .to_string();
        browser.session = Some(id);
        browser
    }

    /// One WebDriver command; its `value`. A WebDriver error fails the test.
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let req = match method {
            "GET" => self.client.get(&url),
            "DELETE" => self.client.delete(&url),
            _ => self
                .client
                .post(&url)
                .header("content-type", "application/json")
                .body(body.unwrap_or_else(|| json!({})).to_string()),
        };
        let res = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        let status = res.status();
        let text = res.text().await.unwrap_or_default();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if !status.is_success() {
            panic!(
                "WebDriver {method} {path}: {status} {}",
                v["value"]["message"].as_str().unwrap_or(&text)
            );
        }
        v.get("value").cloned().unwrap_or(v)
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session.as_deref().unwrap_or(""))
    }

    async fn session_call(&self, method: &str, rest: &str, body: Option<Value>) -> Value {
        self.call(method, &self.session_path(rest), body).await
    }

    pub async fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(json!({ "url": url })))
            .await;
    }

    /// The address of the page shown.
    pub async fn url(&self) -> String {
        self.session_call("GET", "/url", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    async fn find_by(&self, using: &str, value: &str) -> Option<String> {
        let url = format!("http://127.0.0.1:{}{}", self.port, self.session_path("/elements"));
        let body = json!({ "using": using, "value": value }).to_string();
        let res = self
            .client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .ok()?;
        let v: Value = serde_json::from_str(&res.text().await.ok()?).ok()?;
        v["value"].as_array()?.first()?[ELEMENT]
            .as_str()
            .map(str::to_string)
    }

    /// The first element `css` (or `xpath`, when it starts with `/`) picks,
    /// once the page has one (within 10 s).
    pub async fn find(&self, selector: &str) -> String {
        let using = if selector.starts_with('/') {
            "xpath"
        } else {
            "css selector"
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(id) = self.find_by(using, selector).await {
                return id;
            }
            if Instant::now() > deadline {
                let source = self.session_call("GET", "/source", None).await;
                panic!(
                    "no element {selector} on {}:\n{}",
                    self.url().await,
                    source.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the page has an element `selector`.
    pub async fn wait_for(&self, selector: &str) {
        self.find(selector).await;
    }

    pub async fn click(&self, selector: &str) {
        let id = self.find(selector).await;
        self.session_call("POST", &format!("/element/{id}/click"), None)
            .await;
    }

    /// Clears the field, then types `text` into it (`\n` is Enter).
    pub async fn type_into(&self, selector: &str, text: &str) {
        let id = self.find(selector).await;
        self.session_call("POST", &format!("/element/{id}/clear"), None)
            .await;
        self.session_call(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// The rendered text of the first element `selector` picks.
    pub async fn text(&self, selector: &str) -> String {
        let id = self.find(selector).await;
        self.session_call("GET", &format!("/element/{id}/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs `script` in the page (WebDriver's own, not subject to the page's
    /// content security policy) and returns its result.
    pub async fn script(&self, script: &str) -> Value {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// Every address the page links, posts or loads from.
    pub async fn addresses(&self) -> Vec<String> {
        let v = self
            .script(
                "return Array.from(document.querySelectorAll('[href],[action],[src]'))\
                 .map(e => e.getAttribute('href') || e.getAttribute('action') || e.getAttribute('src'));",
            )
            .await;
        v.as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
            .unwrap_or_default()
    }

    /// The visible part of the page, as PNG.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let v = self.session_call("GET", "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("screenshot: {e}"))
    }
}

/// Whether `answer` holds a whole HTTP response with a `Content-Length` body.
fn whole_response(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    body.len() >= length
}

impl Drop for Browser {
    /// Ends the session (Chromium exits with it; chromedriver answers once it
    /// has), then chromedriver. Plain blocking HTTP: a drop cannot await.
    fn drop(&mut self) {
        if let Some(id) = self.session.take() {
            use std::io::{Read, Write};
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = write!(
                    s,
                    "DELETE /session/{id} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    self.port
                );
                let mut answer = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    answer.extend_from_slice(&buf[..n]);
                    if whole_response(&answer) {
                        break;
                    }
                }
            }
        }
        drop(self.driver.take());
    }
}
