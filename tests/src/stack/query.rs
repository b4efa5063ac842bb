//! What a test asks of a running stack: its URLs, Envoy's counters and
//! admin pages, the store's records and histories, and every log line.

use super::Stack;

impl Stack {
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// An admin page of Envoy as text (empty when it does not answer).
    pub async fn admin_text(&self, path: &str) -> String {
        match self.client.get(self.admin_url(path)).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Each of Envoy's listeners by name and the port it is bound to, as
    /// its admin reports it: a listener on port 0 takes one the kernel
    /// hands to Envoy itself, which no other process can take meanwhile.
    pub async fn listeners(&self) -> Vec<(String, u16)> {
        let page = self.admin_text("/listeners?format=json").await;
        let page: serde_json::Value = serde_json::from_str(&page).unwrap_or_default();
        let statuses = page["listener_statuses"].as_array().cloned().unwrap_or_default();
        statuses
            .iter()
            .filter_map(|l| {
                let port = l["local_address"]["socket_address"]["port_value"].as_u64()?;
                Some((l["name"].as_str()?.to_string(), u16::try_from(port).ok()?))
            })
            .collect()
    }

    /// A POST through Envoy with an optional key, as alice of tenant-a.
    pub fn post(&self, path: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
        self.post_as("tenant-a", "alice", path, key, body)
    }

    /// A POST through Envoy with an optional key, as `user` of `tenant`
    /// (the identity headers `envoy/e2e.yaml` trusts).
    pub fn post_as(
        &self,
        tenant: &str,
        user: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .header("x-tenant-id", tenant)
            .header("x-user-id", user)
            .body(body.to_string());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req
    }

    /// The filter's counter `name` as Envoy's Prometheus endpoint shows it,
    /// summed over policies: `requests_<outcome>` and `records_<outcome>` are
    /// `idemgate_requests_total{outcome="<outcome>"}` and
    /// `idemgate_records_total{outcome="<outcome>"}` (labels the bootstrap's
    /// `stats_tags` cut out of the stat names), anything else `idemgate_<name>`.
    pub async fn counter(&self, name: &str) -> u64 {
        let text = self.admin_text("/stats/prometheus").await;
        let (metric, outcome) = match name.split_once('_') {
            Some((family @ ("requests" | "records"), outcome)) => (
                format!("idemgate_{family}_total"),
                Some(format!("outcome=\"{outcome}\"")),
            ),
            _ => (format!("idemgate_{name}_total"), None),
        };
        text.lines()
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(n, _)| n.split('{').next() == Some(metric.as_str()))
            .filter(|(n, _)| outcome.as_ref().is_none_or(|o| n.contains(o.as_str())))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }

    /// Envoy's counter or gauge `name` from `/stats` (0 when absent).
    pub async fn stat(&self, name: &str) -> u64 {
        let text = self.admin_text(&format!("/stats?filter=^{name}$")).await;
        text.lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(n, _)| *n == name)
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }

    /// Every generation of the key (current ones have `ended_at: null`) and
    /// every event, as the admin lookup answers them: `{"records", "events"}`
    /// (any replica that answers).
    pub async fn history(
        &self,
        tenant: &str,
        principal: &str,
        route: &str,
        key: &str,
    ) -> Option<serde_json::Value> {
        let query = serde_json::json!({
            "tenant": tenant, "principal": principal, "route": route, "key": key, "limit": 1000
        });
        for i in 0..self.stores.len() {
            let res = self
                .client
                .post(self.store_url(i, "/admin/v1/records/lookup"))
                .bearer_auth(self.options.admin_token)
                .header("content-type", "application/json")
                .body(query.to_string())
                .send()
                .await;
            if let Ok(r) = res {
                if r.status() == 200 {
                    let bytes = r.bytes().await.unwrap_or_default();
                    if let Ok(v @ serde_json::Value::Object(_)) = serde_json::from_slice(&bytes) {
                        if v["records"].is_array() && v["events"].is_array() {
                            return Some(v);
                        }
                    }
                }
            }
        }
        None
    }

    /// The store's current records with this tenant and key (any replica
    /// that answers); earlier generations (released, abandoned, replaced)
    /// are history, not records.
    /// The key's transitions (its events' names), oldest first.
    pub async fn transitions(&self, tenant: &str, principal: &str, route: &str, key: &str) -> Vec<String> {
        let history = self.history(tenant, principal, route, key).await;
        let events = history.as_ref().and_then(|h| h["events"].as_array());
        events
            .unwrap_or_else(|| panic!("no history of {key}: {history:?}"))
            .iter()
            .filter_map(|e| e["transition"].as_str().map(str::to_string))
            .collect()
    }

    pub async fn records(
        &self,
        tenant: &str,
        principal: &str,
        route: &str,
        key: &str,
    ) -> Option<Vec<serde_json::Value>> {
        let mut history = self.history(tenant, principal, route, key).await?;
        let records = history["records"].as_array_mut().map(std::mem::take)?;
        Some(records.into_iter().filter(|r| r["ended_at"].is_null()).collect())
    }

    /// The key's current generation (`null` when there is none: never
    /// claimed, or released).
    pub async fn current_record(
        &self,
        tenant: &str,
        principal: &str,
        route: &str,
        key: &str,
    ) -> serde_json::Value {
        let history = self.history(tenant, principal, route, key).await;
        match history.as_ref().and_then(|h| h["records"].as_array()?.first()) {
            Some(r) if r["ended_at"].is_null() => r.clone(),
            _ => serde_json::Value::Null,
        }
    }

    /// Records still in progress (any age).
    pub async fn in_progress(&self) -> Option<Vec<serde_json::Value>> {
        let res = self
            .client
            .get(self.store_url(0, "/admin/v1/records/stuck?older_than_ms=0&limit=1000"))
            .bearer_auth(self.options.admin_token)
            .send()
            .await
            .ok()?;
        let bytes = res.bytes().await.ok()?;
        match serde_json::from_slice(&bytes).ok()? {
            serde_json::Value::Array(v) => Some(v),
            _ => None,
        }
    }

    /// Every log line any process of this stack wrote, with its file name.
    pub fn log_lines(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for path in &self.logs {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read(path).unwrap_or_default();
            for line in String::from_utf8_lossy(&text).lines() {
                out.push((name.clone(), line.to_string()));
            }
        }
        out
    }
}
