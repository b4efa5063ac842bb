//! RFC 8785 JSON Canonicalization Scheme. STUB.
