//! Requests through the whole router: see `taskgate_fuzzing::request`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| taskgate_fuzzing::request(data));
