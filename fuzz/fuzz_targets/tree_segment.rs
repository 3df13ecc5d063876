#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| labsync_store::fuzzing::tree_segment(data));
