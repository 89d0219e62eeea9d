//! The lifecycle evaluator: see `taskgate_fuzzing::lifecycle`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| taskgate_fuzzing::lifecycle(data));
