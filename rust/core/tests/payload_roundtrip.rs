//! The wire payload decoder against a small encoder of the same format (the prefill side's
//! encoder is Python's `eldr_sglang.sglang_ext.payload.encode_counts`; tests/test_signature_payload.py
//! checks that one against this decoder): decode(encode(x)) == x for the exact encodings, and
//! routing from the decoded payload gives the same decision and distances as routing from the
//! dense counts.

use eldr_core::distance::{from_counts, Counts};
use eldr_core::payload::{decode, decode_event, pack_bits, DecodeLimits, Payload, PayloadError};
use eldr_core::{CentroidWriter, PolicyConfig, Router, RouterSpec};
use proptest::prelude::*;


fn bits_for(max: u32) -> u32 {
    let b = (32 - max.leading_zeros()).max(1);
    if b <= 16 {
        b
    } else {
        32
    }
}

/// `counts` `[layers.len(), e]` row-major -> payload JSON (dense or sparse, both exact).
fn encode(counts: &[u32], layers: &[u32], e: usize, sparse: bool) -> String {
    let bits = bits_for(counts.iter().copied().max().unwrap_or(0));
    let head = format!(r#"{{"v":1,"layers":{layers:?},"E":{e},"n":7,"bits":{bits}"#);
    let b64 = base64_simd::STANDARD;
    if sparse {
        let nz: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
        let mut blob: Vec<u8> = if counts.len() <= 1 << 16 {
            nz.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect()
        } else {
            nz.iter().flat_map(|&i| (i as u32).to_le_bytes()).collect()
        };
        blob.extend(pack_bits(&nz.iter().map(|&i| counts[i]).collect::<Vec<_>>(), bits));
        format!(r#"{head},"enc":"sparse","nnz":{},"d":"{}"}}"#, nz.len(), b64.encode_to_string(blob))
    } else {
        format!(r#"{head},"enc":"dense","d":"{}"}}"#, b64.encode_to_string(pack_bits(counts, bits)))
    }
}

fn counts_strategy() -> impl Strategy<Value = (Vec<u32>, Vec<u32>, usize, bool)> {
    (1usize..6, 1usize..12, any::<bool>(), 0u32..3).prop_flat_map(|(rows, e, sparse, scale)| {
        let max = [3u32, 700, 100_000][scale as usize];
        (
            proptest::collection::vec(prop_oneof![3 => Just(0u32), 2 => 0..=max], rows * e),
            Just((0..8u32).collect::<Vec<_>>()).prop_shuffle().prop_map(move |ids| ids[..rows].to_vec()),
            Just(e),
            Just(sparse),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn decode_of_encode_is_identity((counts, layers, e, sparse) in counts_strategy()) {
        let json = encode(&counts, &layers, e, sparse);
        let Payload::Counts(d) = decode(json.as_bytes(), &DecodeLimits::default()).unwrap() else { panic!("no counts") };
        prop_assert_eq!(d.to_dense(), counts.iter().map(|&c| c as f32).collect::<Vec<_>>());
        prop_assert_eq!(d.layers(), &layers[..]);
        prop_assert!(d.exact());
        // the same payload inside a stream event, in meta_info's one-request list
        let ev = format!(r#"{{"text":"t","meta_info":{{"id":"x","eldr_signature":[{json}]}}}}"#);
        prop_assert_eq!(decode_event(ev.as_bytes(), &DecodeLimits::default()).unwrap(), Some(Payload::Counts(d)));
    }

    /// Route from the wire == route from the dense counts in the centroid layout, with the
    /// payload holding a subset of the file's layers (by hidden-layer id) or all of them.
    #[test]
    fn route_from_wire_equals_route_from_dense((counts, layers, e, sparse) in counts_strategy(), all_layers in any::<bool>(), seed in 0u32..50) {
        let num_layers = if all_layers { layers.len() } else { 8 };
        let weights: Vec<f32> = (0..num_layers).map(|l| [0.0, 1.0, 0.5, 2.0][(l + seed as usize) % 4]).collect();
        prop_assume!(weights.iter().any(|&w| w > 0.0));
        let idf: Vec<f32> = (0..num_layers * e).map(|i| 0.25 + ((i as u32 * 7 + seed) % 9) as f32 / 4.0).collect();
        let k = 4;
        let d = weights.iter().filter(|&&w| w > 0.0).count() * e;
        let cents: Vec<f32> = (0..k * d).map(|i| (((i as u32 + 3) * (seed + 11)) % 17) as f32 + 0.1).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.eldr");
        CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| format!("w{i}")).collect(), provenance: "{}" }
            .write(&path).unwrap();
        let router = Router::new(RouterSpec::of(PolicyConfig::Eldr), None, Some(&path), 0, 2000).unwrap();
        let json = encode(&counts, &layers, e, sparse);
        let Payload::Counts(wire) = decode(json.as_bytes(), &DecodeLimits { layout: Some((num_layers, e)), ..Default::default() }).unwrap() else { panic!() };
        let dense = wire.to_layout(num_layers, e).unwrap();
        let a = router.route(|set| from_counts::<u32, f32>(set, Counts::Dense(&dense)), true).unwrap();
        let b = router.route_counts(&wire, true, true).unwrap();
        prop_assert_eq!(a.decision, b.decision);
        prop_assert_eq!(&a.distances, &b.distances); // bit for bit: the same values in the same order
        match (&b.distances, &b.signature) {
            (Some(_), Some(sig)) => {
                let spec = router.store().unwrap().set().spec().clone();
                prop_assert_eq!(sig, &spec.from_dense(&dense).unwrap());
            }
            (None, None) => {}
            other => prop_assert!(false, "signature kept without distances or lost: {:?}", other),
        }
    }

    /// Any bytes: a typed error or a payload, never a panic.
    #[test]
    fn arbitrary_input_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes, &DecodeLimits::default());
        let _ = decode_event(&bytes, &DecodeLimits::default());
    }

    /// Corrupting an encoded payload (a byte flipped anywhere) is a typed error or a payload.
    #[test]
    fn corrupted_payloads_never_panic((counts, layers, e, sparse) in counts_strategy(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut json = encode(&counts, &layers, e, sparse).into_bytes();
        let i = at.index(json.len());
        json[i] = byte;
        let _ = decode(&json, &DecodeLimits::default());
    }
}

#[test]
fn layout_mismatch_is_refused() {
    let json = encode(&[1, 2, 3, 4], &[5, 6], 2, false);
    let lim = |l, e| DecodeLimits { layout: Some((l, e)), ..Default::default() };
    assert!(matches!(decode(json.as_bytes(), &lim(2, 4)), Err(PayloadError::Experts { .. })));
    assert!(matches!(decode(json.as_bytes(), &lim(4, 2)), Err(PayloadError::Layers { .. })));
    assert!(decode(json.as_bytes(), &lim(2, 2)).is_ok()); // the file holds just these two layers
    assert!(decode(json.as_bytes(), &lim(7, 2)).is_ok()); // placed by id
}
