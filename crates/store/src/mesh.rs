//! The filter's calls named by their mesh identity: the SPIFFE ID of the
//! caller's client certificate, which the store's own sidecar verified and
//! put in `x-forwarded-client-cert` (Envoy's `forward_client_cert_details:
//! SANITIZE_SET` with `set_current_client_cert_details: {uri: true}`).
//!
//! The header is believed only from the store's own sidecar (a configured
//! peer address, Istio's `127.0.0.6`): anyone else could write it. From any
//! other peer it is refused, a valid API token or not, since in a mesh it
//! can only be a forgery. Each identity may act only on the policies (the
//! scope's `route`) the store's settings give it ([`MeshIdentities`]);
//! an identity the settings do not name acts on none.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use axum::http::HeaderMap;
use idemgate_core::problem::ProblemKind;
use serde::Deserialize;

use crate::peers::{trusted, Network};
use crate::problem::Refusal;

/// The header the store's sidecar names the verified client certificate in.
pub const XFCC: &str = "x-forwarded-client-cert";

/// Which mesh identity may act on which policies, and the peers (the
/// store's own sidecar) whose [`XFCC`] header is believed. Empty: the store
/// reads no mesh identity and the API token decides.
#[derive(Debug, Clone, Default)]
pub struct MeshIdentities {
    pub trusted_peers: Vec<Network>,
    owners: HashMap<String, Arc<[String]>>,
}

/// The identities file as written: `identities:` mapping each SPIFFE ID to
/// the policy names (the filter's `policies[].name`) it owns.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentitiesFile {
    identities: HashMap<String, Vec<String>>,
}

impl MeshIdentities {
    /// The identities of `yaml` (an identities file), believed from
    /// `trusted_peers`.
    pub fn from_yaml(yaml: &str, trusted_peers: Vec<Network>) -> Result<MeshIdentities, String> {
        let file: IdentitiesFile = serde_norway::from_str(yaml).map_err(|e| e.to_string())?;
        MeshIdentities::new(trusted_peers, file.identities)
    }

    /// Every identity a SPIFFE ID owning at least one policy, and a sidecar
    /// to believe them from.
    pub fn new(
        trusted_peers: Vec<Network>,
        owners: impl IntoIterator<Item = (String, Vec<String>)>,
    ) -> Result<MeshIdentities, String> {
        let mut map = HashMap::new();
        for (identity, policies) in owners {
            spiffe_id(&identity)
                .ok_or_else(|| format!("{identity:?} is not a SPIFFE ID (spiffe://trust-domain/path)"))?;
            if policies.is_empty() || policies.iter().any(|p| p.trim().is_empty()) {
                return Err(format!(
                    "{identity}: name the policies it owns (the filter's policy names)"
                ));
            }
            map.insert(identity, policies.into());
        }
        if !map.is_empty() && trusted_peers.is_empty() {
            return Err(
                "mesh identities need the store's own sidecar as a trusted peer (127.0.0.6 in Istio)".into(),
            );
        }
        Ok(MeshIdentities {
            trusted_peers,
            owners: map,
        })
    }

    /// Whether the store reads mesh identities at all.
    pub fn configured(&self) -> bool {
        !self.owners.is_empty()
    }

    /// How many identities own policies (for the log).
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

/// Who a call of the API comes from, and so which policies it may act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A holder of an API token: outside a mesh the token is the only
    /// identity there is, and it acts on every policy.
    Token,
    /// A mesh identity, on the policies it owns.
    Mesh {
        identity: Arc<str>,
        policies: Arc<[String]>,
    },
}

impl Caller {
    /// Whether the caller may read or write records of `policy`, refused
    /// as 403 before anything is read.
    pub fn may_act_on(&self, policy: &str) -> Result<(), Refusal> {
        match self {
            Caller::Token => Ok(()),
            Caller::Mesh { policies, .. } if policies.iter().any(|p| p == policy) => Ok(()),
            Caller::Mesh { identity, .. } => Err(Refusal::new(
                ProblemKind::Forbidden,
                format!("{identity} does not own the policy {policy:?}: the store's mesh identities file gives it others"),
            )),
        }
    }
}

/// What a request says about its mesh identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    /// No [`XFCC`] header, or the store reads no mesh identity: the API
    /// token decides.
    Absent,
    Caller(Caller),
    /// Forged, malformed, or an identity that owns no policy.
    Refused(String),
}

/// The mesh identity `headers` carry, believed only from the store's own
/// sidecar (`peer` among `mesh.trusted_peers`).
pub fn identify(mesh: &MeshIdentities, headers: &HeaderMap, peer: Option<IpAddr>) -> Named {
    let mut values = headers.get_all(XFCC).iter();
    let Some(value) = values.next() else {
        return Named::Absent;
    };
    if !mesh.configured() {
        return Named::Absent;
    }
    if !trusted(&mesh.trusted_peers, peer) {
        tracing::warn!(
            ?peer,
            "a client certificate header from a peer other than the store's sidecar was refused"
        );
        return Named::Refused(format!(
            "{XFCC} is believed only from the store's own sidecar; this request did not come through it"
        ));
    }
    if values.next().is_some() {
        return Named::Refused(format!("more than one {XFCC} header"));
    }
    let Ok(value) = value.to_str() else {
        return Named::Refused(format!("{XFCC} is not printable ASCII"));
    };
    let identity = match uri_of_last_element(value) {
        Ok(uri) => uri,
        Err(why) => return Named::Refused(why.into()),
    };
    match mesh.owners.get_key_value(identity) {
        Some((identity, policies)) => Named::Caller(Caller::Mesh {
            identity: identity.as_str().into(),
            policies: policies.clone(),
        }),
        None => {
            tracing::warn!(identity, "a mesh identity that owns no policy was refused");
            Named::Refused(format!(
                "{identity} owns no policy: the store's mesh identities file does not name it"
            ))
        }
    }
}

/// The SPIFFE ID in the last element of an XFCC value: the one the store's
/// sidecar appended (with `SANITIZE_SET`, the only one).
fn uri_of_last_element(value: &str) -> Result<&str, &'static str> {
    let element = split_unquoted(value, ',').pop().unwrap_or_default();
    let mut uris = split_unquoted(element, ';').into_iter().filter_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("uri")
            .then(|| value.trim().trim_matches('"'))
    });
    let uri = uris
        .next()
        .ok_or("the client certificate names no SPIFFE ID (no URI)")?;
    if uris.next().is_some() {
        return Err("the client certificate names more than one URI");
    }
    spiffe_id(uri).ok_or("the client certificate's URI is not a SPIFFE ID")
}

/// `id` if it is a SPIFFE ID: `spiffe://` with a trust domain and no
/// space, quote or control character.
fn spiffe_id(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let domain = rest.split('/').next().unwrap_or_default();
    let clean = !id
        .chars()
        .any(|c| c.is_control() || c.is_whitespace() || c == '"');
    (!domain.is_empty() && clean).then_some(id)
}

/// `s` split at `sep` outside double quotes (Envoy quotes values that
/// hold `,`, `;` or `=`, escaping `"` with a backslash).
fn split_unquoted(s: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAYMENTS: &str = "spiffe://cluster.local/ns/shop/sa/payments";
    const LEDGER: &str = "spiffe://cluster.local/ns/ledger/sa/ledger";

    fn mesh() -> MeshIdentities {
        MeshIdentities::from_yaml(
            &format!("identities:\n  {PAYMENTS}: [payments.create, payments.refund]\n  {LEDGER}:\n    - ledger.transfer\n"),
            vec!["127.0.0.6".parse().unwrap()],
        )
        .unwrap()
    }

    fn xfcc(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.append(XFCC, value.parse().unwrap());
        h
    }

    const SIDECAR: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 6)));
    const ELSEWHERE: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9)));

    fn element(uri: &str) -> String {
        format!("By=spiffe://cluster.local/ns/idemgate/sa/store;Hash=ab12;Subject=\"CN=x,O=a;b\";URI={uri}")
    }

    #[test]
    fn the_sidecar_names_the_caller_and_its_policies() {
        let Named::Caller(caller) = identify(&mesh(), &xfcc(&element(PAYMENTS)), SIDECAR) else {
            panic!("not named");
        };
        assert!(caller.may_act_on("payments.create").is_ok());
        assert!(caller.may_act_on("payments.refund").is_ok());
        let refused = caller.may_act_on("ledger.transfer").unwrap_err();
        assert_eq!(refused.problem().kind, ProblemKind::Forbidden);
        assert!(Caller::Token.may_act_on("ledger.transfer").is_ok());
    }

    #[test]
    fn only_the_sidecar_is_believed_and_only_what_it_set() {
        let m = mesh();
        let refused = |h: &HeaderMap, peer| matches!(identify(&m, h, peer), Named::Refused(_));
        assert!(refused(&xfcc(&element(PAYMENTS)), ELSEWHERE));
        assert!(refused(&xfcc(&element(PAYMENTS)), None));
        assert_eq!(identify(&m, &HeaderMap::new(), ELSEWHERE), Named::Absent);
        assert_eq!(identify(&m, &HeaderMap::new(), SIDECAR), Named::Absent);
        // The last element is the sidecar's; an earlier one is a client's claim.
        let forged_first = format!("{},{}", element(LEDGER), element(PAYMENTS));
        let Named::Caller(Caller::Mesh { identity, .. }) = identify(&m, &xfcc(&forged_first), SIDECAR) else {
            panic!("not named");
        };
        assert_eq!(&*identity, PAYMENTS);
        let mut two = xfcc(&element(PAYMENTS));
        two.append(XFCC, element(LEDGER).parse().unwrap());
        assert!(refused(&two, SIDECAR));
        for bad in [
            "Hash=ab12".to_string(),
            element("https://example.com/x"),
            element("spiffe://"),
            element("spiffe://cluster.local/ns/other/sa/unknown"),
            format!("URI={PAYMENTS};URI={LEDGER}"),
        ] {
            assert!(refused(&xfcc(&bad), SIDECAR), "{bad}");
        }
        // A store without mesh identities reads none: the token decides.
        let none = MeshIdentities::default();
        assert_eq!(
            identify(&none, &xfcc(&element(PAYMENTS)), ELSEWHERE),
            Named::Absent
        );
    }

    #[test]
    fn an_identities_file_is_checked_before_it_is_used() {
        let peers = || vec!["127.0.0.6".parse().unwrap()];
        assert_eq!(mesh().len(), 2);
        for bad in [
            "identities:\n  https://x/y: [a]\n",
            "identities:\n  spiffe://td/a: []\n",
            "identities:\n  spiffe://td/a: [\"\"]\n",
            "identities: {}\nother: 1\n",
            "not yaml: [",
        ] {
            assert!(MeshIdentities::from_yaml(bad, peers()).is_err(), "{bad}");
        }
        assert!(MeshIdentities::from_yaml("identities:\n  spiffe://td/a: [p]\n", Vec::new()).is_err());
        assert!(MeshIdentities::from_yaml("identities: {}\n", Vec::new()).is_ok_and(|m| !m.configured()));
    }

    #[test]
    fn quoted_separators_do_not_split() {
        assert_eq!(split_unquoted(r#"a="x,y",b"#, ','), vec![r#"a="x,y""#, "b"]);
        assert_eq!(
            split_unquoted(r#"a="x\",y";b=1"#, ';'),
            vec![r#"a="x\",y""#, "b=1"]
        );
    }
}
