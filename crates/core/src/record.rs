//! Record lifecycle rules used by the store. STUB.
