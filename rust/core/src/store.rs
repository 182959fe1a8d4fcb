//! Hot-reloadable centroids behind an atomic pointer swap (arc-swap).
//!
//! A route loads the current `Arc<CentroidSet>` once and finishes on that snapshot even if a
//! reload swaps in a new one meanwhile. A reload validates the new file completely first; a
//! bad file is rejected, the old set keeps serving, and the error is kept for reporting.
//! The set and its generation number are swapped as one value, so a decision's generation is
//! always that of the centroids it was computed from.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use arc_swap::ArcSwap;

use crate::centroid_file::{CentroidFileError, CentroidSet};

/// Identity of the file on disk; a rename-replace changes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileId {
    modified: Option<SystemTime>,
    len: u64,
    #[cfg(unix)]
    ino: u64,
}

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileId {
        modified: m.modified().ok(),
        len: m.len(),
        #[cfg(unix)]
        ino: std::os::unix::fs::MetadataExt::ino(&m),
    })
}

/// A loaded centroid set and the generation it was loaded as (1 for the first file, +1 per
/// successful reload).
#[derive(Debug)]
pub struct Snapshot {
    pub set: Arc<CentroidSet>,
    pub generation: u64,
}

pub struct CentroidStore {
    path: PathBuf,
    current: ArcSwap<Snapshot>,
    loaded_id: Mutex<Option<FileId>>,
    /// (L, E) every later file must keep: the prefill count shape is fixed.
    shape: (usize, usize),
    /// K a later file must have: the decode members now (membership changes set it).
    workers: AtomicUsize,
    failures: AtomicU64,
    interval_ms: u64,
    epoch: Instant,
    next_check_ms: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl CentroidStore {
    /// Load the file; `expect_workers` (if given) must equal its K.
    pub fn open(path: impl AsRef<Path>, expect_workers: Option<usize>, interval_ms: u64) -> Result<Self, CentroidFileError> {
        let path = path.as_ref().to_path_buf();
        let id = file_id(&path);
        let set = CentroidSet::open(&path)?;
        if let Some(k) = expect_workers {
            if set.num_workers() != k {
                return Err(CentroidFileError::Mismatch {
                    path: path.display().to_string(),
                    msg: format!("K mismatch: the file has {} centroids, the router has {k} decode workers", set.num_workers()),
                });
            }
        }
        let shape = (set.num_layers(), set.num_experts());
        Ok(CentroidStore {
            path,
            workers: AtomicUsize::new(set.num_workers()),
            current: ArcSwap::from_pointee(Snapshot { set: Arc::new(set), generation: 1 }),
            loaded_id: Mutex::new(id),
            shape,
            failures: AtomicU64::new(0),
            interval_ms,
            epoch: Instant::now(),
            next_check_ms: AtomicU64::new(interval_ms),
            last_error: Mutex::new(None),
        })
    }

    /// The K a reloaded file must have from now on (the decode members after a change).
    pub fn set_expected_workers(&self, k: usize) {
        self.workers.store(k, Ordering::Release);
    }

    pub fn expected_workers(&self) -> usize {
        self.workers.load(Ordering::Acquire)
    }

    /// The snapshot a route should use from start to finish.
    #[inline]
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// The current centroid set.
    pub fn set(&self) -> Arc<CentroidSet> {
        Arc::clone(&self.current.load().set)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Increases by one on every successful swap.
    pub fn generation(&self) -> u64 {
        self.current.load().generation
    }

    /// Increases by one on every rejected file.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Acquire)
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap().clone()
    }

    /// Reload now. On error the old set stays and the error is recorded and returned.
    pub fn reload(&self) -> Result<(), CentroidFileError> {
        let mut loaded = self.loaded_id.lock().unwrap();
        let id = file_id(&self.path);
        let result = CentroidSet::open(&self.path).and_then(|set| {
            let got = (set.num_workers(), set.num_layers(), set.num_experts());
            let want = (self.expected_workers(), self.shape.0, self.shape.1);
            if got != want {
                return Err(CentroidFileError::Mismatch {
                    path: self.path.display().to_string(),
                    msg: format!(
                        "the new file has K={}, L={}, E={}; the router serves K={} (its decode workers now), L={}, E={}",
                        got.0, got.1, got.2, want.0, want.1, want.2
                    ),
                });
            }
            Ok(set)
        });
        // Remember this file version either way, so a bad file is reported once, not re-read
        // on every check; the next replacement triggers a new attempt.
        *loaded = id;
        match result {
            Ok(set) => {
                // Reloads are serialized by `loaded_id`, so no generation is skipped or repeated.
                let generation = self.current.load().generation + 1;
                self.current.store(Arc::new(Snapshot { set: Arc::new(set), generation }));
                *self.last_error.lock().unwrap() = None;
                Ok(())
            }
            Err(e) => {
                *self.last_error.lock().unwrap() = Some(e.to_string());
                self.failures.fetch_add(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Reload if the file was replaced, checking the disk at most every `interval_ms`.
    /// Cheap when not due: one clock read and one atomic load.
    pub fn maybe_reload(&self) -> Result<bool, CentroidFileError> {
        let now = self.epoch.elapsed().as_millis() as u64;
        let due = self.next_check_ms.load(Ordering::Relaxed);
        if now < due || self.next_check_ms.compare_exchange(due, now + self.interval_ms, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return Ok(false);
        }
        self.reload_if_changed()
    }

    /// Reload if the file on disk differs from the one loaded (no rate limit).
    pub fn reload_if_changed(&self) -> Result<bool, CentroidFileError> {
        let id = file_id(&self.path);
        if id.is_none() || *self.loaded_id.lock().unwrap() == id {
            return Ok(false);
        }
        self.reload().map(|_| true)
    }
}
