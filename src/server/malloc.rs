//! kvpick's allocator: jemalloc with a quarter-second decay, installed by each
//! kvpick binary with [`global_allocator!`](crate::global_allocator).
//!
//! Two loads pull an allocator in opposite directions. A flooding KV-event
//! publisher fills the ingest queue with batches of a few MiB; glibc's malloc
//! raises its mmap threshold to the size of every large block freed, so later
//! batches come from the heap, interleave with the prefix index's long-lived
//! entries and are not returned (`kvpick-bench flood` peaks at up to 519 MiB
//! with a 256 MiB budget). Pinning that threshold bounds the flood but makes
//! every buffer of 256 KiB or more a fresh mapping, faulted in and unmapped per
//! request: a 1 MiB body then costs about 1.4× the CPU it costs on jemalloc
//! (`kvpick-bench overhead`).
//!
//! jemalloc keeps large buffers in extents apart from small objects and reuses
//! a freed extent while its pages are still resident, so the request path
//! reuses warm buffers. Pages unused for [`MALLOC_CONF`]'s decay time go back
//! to the system from a background thread, not on the request path, so a
//! flood's memory follows the queue's budget. Measured in `BENCHMARKS.md` §1
//! and `docs/kvevents.md`.
//!
//! Only binaries that invoke the macro use it: a library user of `kvpick`
//! keeps its own allocator. `_RJEM_MALLOC_CONF` in the environment overrides
//! the settings at start-up.

/// The allocator, for [`global_allocator!`](crate::global_allocator).
pub use tikv_jemallocator::Jemalloc;

/// jemalloc's settings, NUL-terminated: dirty pages unused for 250 ms are
/// purged (the default is 10 s), without a second, "muzzy" stage, by jemalloc's
/// background thread. A request's buffers are reused within milliseconds, so
/// the request path does not feel the decay, while a flood's freed batches go
/// back soon after the queue drains (the choice is measured in `BENCHMARKS.md` §1).
pub const MALLOC_CONF: &[u8] = b"background_thread:true,dirty_decay_ms:250,muzzy_decay_ms:0\0";

/// Installs kvpick's allocator ([`Jemalloc`], with [`MALLOC_CONF`]) as the
/// global allocator of the binary whose crate root invokes it.
#[macro_export]
macro_rules! global_allocator {
    () => {
        #[global_allocator]
        static KVPICK_ALLOCATOR: $crate::server::malloc::Jemalloc =
            $crate::server::malloc::Jemalloc;

        /// Read by jemalloc at its initialisation (its `malloc_conf`, under
        /// the prefix `tikv-jemalloc-sys` gives its symbols).
        #[used]
        #[export_name = "_rjem_malloc_conf"]
        static KVPICK_MALLOC_CONF: &u8 = &$crate::server::malloc::MALLOC_CONF[0];
    };
}
