//! Demo identity: ES256 tokens signed with the demo-only key in
//! `examples/keys/demo-only.pem`, which is public on purpose. Envoy's
//! `jwt_authn` in `envoy/demo.yaml` trusts exactly this key (inline JWKS), so a
//! token minted here works against the demo and nowhere else.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use p256::ecdsa::signature::Signer;
use p256::ecdsa::{Signature, SigningKey};
use p256::pkcs8::DecodePrivateKey;
use serde_json::{json, Value};

/// The demo-only signing key, compiled in so `mint-token` works from anywhere.
pub const DEMO_KEY_PEM: &str = include_str!("../../keys/demo-only.pem");
pub const ISSUER: &str = "https://demo.idemgate.invalid";
pub const AUDIENCE: &str = "payments-demo";
pub const KEY_ID: &str = "idemgate-demo-only";
/// 2100-01-01T00:00:00Z: the ready-made tokens should outlive the demo.
pub const FAR_FUTURE: u64 = 4_102_444_800;

pub fn demo_key() -> Result<SigningKey, String> {
    SigningKey::from_pkcs8_pem(DEMO_KEY_PEM).map_err(|e| format!("the demo key does not parse: {e}"))
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// A compact JWS (ES256) carrying `tenant` and `sub`.
pub fn mint(key: &SigningKey, tenant: &str, sub: &str, issued_at: u64, expires_at: u64) -> String {
    mint_claims(key, json!(tenant), json!(sub), issued_at, expires_at)
}

/// [`mint`] with claims of any JSON type (numeric tenants exist).
pub fn mint_claims(key: &SigningKey, tenant: Value, sub: Value, issued_at: u64, expires_at: u64) -> String {
    let claims = json!({
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": sub,
        "tenant": tenant,
        "iat": issued_at,
        "exp": expires_at,
    });
    sign(key, &claims)
}

/// A compact JWS (ES256, the demo's key id) of any claims.
pub fn sign(key: &SigningKey, claims: &Value) -> String {
    let header = json!({"alg": "ES256", "typ": "JWT", "kid": KEY_ID});
    let signing_input = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    // JWS ES256 signatures are r || s, 32 bytes each: exactly `Signature::to_bytes`.
    let signature: Signature = key.sign(signing_input.as_bytes());
    format!("{signing_input}.{}", b64(&signature.to_bytes()))
}

/// The public half as a JWKS document, as `local_jwks` in envoy/demo.yaml.
pub fn jwks(key: &SigningKey) -> Value {
    let point = key.verifying_key().to_encoded_point(false);
    let coord = |c: Option<&p256::FieldBytes>| c.map(|c| b64(c)).unwrap_or_default();
    json!({"keys": [{
        "kty": "EC",
        "crv": "P-256",
        "alg": "ES256",
        "use": "sig",
        "kid": KEY_ID,
        "x": coord(point.x()),
        "y": coord(point.y()),
    }]})
}

#[cfg(test)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Verifier;

    #[test]
    fn a_minted_token_verifies_with_the_published_key_and_carries_the_claims() {
        let key = demo_key().unwrap();
        let token = mint(&key, "tenant-a", "alice", 1, FAR_FUTURE);
        let parts: Vec<&str> = token.split('.').collect();
        assert_eq!(parts.len(), 3);
        let claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(claims["tenant"], "tenant-a");
        assert_eq!(claims["sub"], "alice");
        let signature = Signature::from_slice(&URL_SAFE_NO_PAD.decode(parts[2]).unwrap()).unwrap();
        let input = format!("{}.{}", parts[0], parts[1]);
        key.verifying_key().verify(input.as_bytes(), &signature).unwrap();
    }

    #[test]
    fn the_jwks_in_envoy_demo_yaml_is_the_public_half_of_the_demo_key() {
        let jwks = jwks(&demo_key().unwrap());
        let yaml =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../envoy/demo.yaml")).unwrap();
        for coord in ["x", "y"] {
            let value = jwks["keys"][0][coord].as_str().unwrap();
            assert!(
                yaml.contains(value),
                "envoy/demo.yaml lacks the demo key's {coord}: {value}"
            );
        }
    }
}
