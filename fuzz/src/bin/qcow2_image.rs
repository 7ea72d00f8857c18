//! Fuzz target `qcow2_image`: see `ferrovm_fuzz::qcow2_image`.

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

fn main() {
    // An allocation sized by a field of the input becomes a crash the fuzzer reports.
    testkit::PeakAlloc::set_hard_cap(ferrovm_fuzz::ALLOC_CAP);
    afl::fuzz!(|data: &[u8]| ferrovm_fuzz::qcow2_image(data));
}
