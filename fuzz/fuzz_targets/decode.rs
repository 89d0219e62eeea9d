//! Requests through the whole router: see `taskgate::fuzzing::request`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| taskgate::fuzzing::request(data));
