//! The allocator's one setting kvpick changes: glibc's mmap threshold, pinned.
//!
//! glibc serves an allocation above its mmap threshold with a mapping of its own
//! and returns it to the system when freed, but by default raises the threshold
//! to the size of every such block freed (up to 32 MiB). After a burst of large
//! KV-event batches, later ones then come from the heap, interleave with the
//! prefix index's long-lived entries and are never returned: a flooding
//! publisher left RSS 100–170 MiB above the ingest queue's byte budget
//! (`kvpick-bench flood`, docs/kvevents.md). Pinned, buffers of 256 KiB and
//! more are always mapped and unmapped, so memory follows the queue's budget.
//! Other allocators and C libraries are left as they are.

/// Allocations at least this large get mappings of their own.
pub const MMAP_THRESHOLD: usize = 256 << 10;

/// Pins glibc's mmap threshold at [`MMAP_THRESHOLD`] (which also stops its
/// dynamic adjustment). Call once, first thing in `main`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn pin_mmap_threshold() {
    // SAFETY: mallopt sets an allocator parameter under the allocator's own
    // lock; it touches no memory of ours.
    let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) };
    if ok != 1 {
        eprintln!("warning: could not pin the allocator's mmap threshold");
    }
}

/// Nothing to pin outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn pin_mmap_threshold() {}
