#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idemgate_fuzz::store_request(data));
