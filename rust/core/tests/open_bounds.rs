//! `CentroidSet::open` reads the header before the body: a huge file that is not a centroid
//! file, or whose header disagrees with its size, is rejected without being read into memory.
//! Its own test binary, so the peak-RSS reading is this process's alone.

use std::io::{Seek, SeekFrom, Write};

use eldr_core::{CentroidFileError, CentroidSet, CentroidWriter};

const HUGE: u64 = 3 << 30; // 3 GiB, sparse: costs no disk

/// Peak resident memory of this process, from /proc/self/status (VmHWM, kB).
fn peak_rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn sparse_file(path: &std::path::Path, head: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(head).unwrap();
    f.set_len(HUGE).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn huge_files_are_rejected_from_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");

    sparse_file(&p, b"NOTELDR!");
    let e = CentroidSet::open(&p).unwrap_err();
    assert!(matches!(e, CentroidFileError::BadMagic { .. }), "{e}");

    // A real header (it says a few hundred bytes) in front of 3 GiB: trailing data.
    let (weights, idf) = (vec![1.0f32, 1.0], vec![1.0f32; 8]);
    let good = CentroidWriter { centroids: &[1.0; 16], k: 2, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: vec!["a".into(), "b".into()], provenance: "{}" }
        .to_bytes()
        .unwrap();
    sparse_file(&p, &good[..128]);
    let e = CentroidSet::open(&p).unwrap_err();
    assert!(e.to_string().contains("trailing data"), "{e}");

    // A header that claims the 3 GiB: over the size limit.
    let mut head = good[..128].to_vec();
    head[96..104].copy_from_slice(&HUGE.to_le_bytes());
    sparse_file(&p, &head);
    let e = CentroidSet::open(&p).unwrap_err();
    assert!(matches!(e, CentroidFileError::TooLarge { .. }), "{e}");

    let peak = peak_rss_bytes();
    assert!(peak < 256 << 20, "peak RSS {peak} bytes: the body was read");
}
