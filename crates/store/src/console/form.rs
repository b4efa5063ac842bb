//! The console's forms: an `application/x-www-form-urlencoded` body read
//! field by field, and what each form asks of the admin calls (a lookup, a
//! resolution). Their values are checked by the same functions the admin API
//! uses ([`admin::validate_reason`], [`admin::parse_header`]).

use axum::body::Body;
use idemgate_core::scope::Namespace;

use crate::admin;
use crate::api::read_body;
use crate::backend::{Action, Lookup};
use crate::problem::Refusal;
use crate::AppState;

/// An `application/x-www-form-urlencoded` body, field by field.
pub struct Form(Vec<(String, String)>);

impl Form {
    pub async fn read(state: &AppState, body: Body) -> Result<Form, Refusal> {
        let bytes = read_body(state, body).await?;
        serde_urlencoded::from_bytes(&bytes)
            .map(Form)
            .map_err(|_| Refusal::bad_request("the form could not be read"))
    }

    /// The field's value, trimmed; empty when absent.
    pub fn get(&self, name: &str) -> &str {
        self.raw(name).trim()
    }

    /// The field's value as sent, line breaks as `\n`.
    pub fn text(&self, name: &str) -> String {
        self.raw(name).replace("\r\n", "\n")
    }

    fn raw(&self, name: &str) -> &str {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("")
    }

    pub fn optional(&self, name: &str) -> Option<String> {
        Some(self.get(name)).filter(|v| !v.is_empty()).map(str::to_string)
    }
}

/// The lookup a form asks for: tenant and key, and any other part of the
/// scope it names.
pub fn lookup_of(form: &Form) -> Lookup {
    Lookup {
        tenant: form.get("tenant").to_string(),
        key: form.get("key").to_string(),
        route: form.optional("route"),
        principal: form.optional("principal"),
        namespace: [Namespace::Client, Namespace::Server]
            .into_iter()
            .find(|n| n.as_str() == form.get("namespace")),
    }
}

/// What the resolve form asks for, or why it cannot be done.
pub fn resolution_of(form: &Form) -> Result<(Action, String), String> {
    let reason = form.text("reason");
    if admin::validate_reason(Some(&reason))?.is_none() {
        return Err("Say why: a reason is required, and it is kept in the record's history.".into());
    }
    let how = match form.get("action") {
        "release" => Action::Release,
        "complete" => {
            let status = form
                .get("status")
                .parse::<u16>()
                .map_err(|_| "The status must be a number between 100 and 599.".to_string())?;
            let headers = form
                .text("headers")
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(admin::parse_header)
                .collect::<Result<Vec<_>, _>>()?;
            Action::Complete {
                status,
                headers,
                body: form.text("body"),
            }
        }
        _ => return Err("Choose to store a response or to release the key.".into()),
    };
    Ok((how, reason))
}
