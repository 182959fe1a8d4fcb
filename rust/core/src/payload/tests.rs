use super::event::*;
use super::format::*;
use super::header::*;
use super::kernels::*;
use super::log::*;
use super::unpack::*;
use crate::centroid_file::CentroidSet;
use crate::signature::{NoSignature, SignatureSpec, SparseSignature};

fn dec(s: &str) -> Result<Payload, PayloadError> {
    decode(s.as_bytes(), &DecodeLimits::default())
}

#[test]
fn dense_three_bits() {
    // values 1..=8 masked to 3 bits: 1,2,3,4,5,6,7,0 packed little-endian
    let vals: Vec<u32> = (1..=8).map(|v| v % 8).collect();
    let mut bitsv = Vec::new();
    for v in &vals {
        for b in 0..3 {
            bitsv.push((v >> b) & 1);
        }
    }
    let bytes: Vec<u8> = bitsv.chunks(8).map(|c| c.iter().enumerate().map(|(i, &b)| (b as u8) << i).sum()).collect();
    let d = base64_simd::STANDARD.encode_to_string(&bytes);
    let p = format!(r#"{{"v":1,"layers":[0,1],"E":4,"n":1,"enc":"dense","bits":3,"d":"{d}"}}"#);
    let Payload::Counts(c) = dec(&p).unwrap() else { panic!() };
    assert_eq!(c.to_dense(), vals.iter().map(|&v| v as f32).collect::<Vec<_>>());
}

proptest::proptest! {
    /// The direct list reader gives serde's `Vec<u64>` answer whenever it answers, and
    /// answers for every list of plain integers however spaced.
    #[test]
    fn plain_lists_read_as_serde_reads_them(vals in proptest::collection::vec(proptest::num::u64::ANY, 0..20), sep in "[ \t\n\r]{0,2}", junk in "[-0-9.eE+ ,\\[\\]a]{0,12}") {
        let text = format!("[{sep}{}{sep}]", vals.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(&format!("{sep},{sep}")));
        proptest::prop_assert_eq!(plain_u64_list(text.as_bytes()), Some(vals.clone()));
        for t in [junk.clone(), format!("[{junk}]"), format!("[1,{junk}]")] {
            if let Some(got) = plain_u64_list(t.as_bytes()) {
                proptest::prop_assert_eq!(Some(got), serde_json::from_str::<Vec<u64>>(&t).ok(), "{}", t);
            }
        }
    }
}

#[test]
fn plain_list_reader_refuses_what_serde_must_judge() {
    for t in ["[00]", "[1,007]", "[-0]", "[1.0]", "[1e3]", "[18446744073709551616]", "[1,]", "[,1]", "[1 2]", "{}", "[1]x", "1"] {
        assert_eq!(plain_u64_list(t.as_bytes()), None, "{t}");
    }
    assert_eq!(plain_u64_list(b" [ 0 , 18446744073709551615 ] "), Some(vec![0, u64::MAX]));
    assert_eq!(plain_u64_list(b"[]"), Some(vec![]));
}

#[test]
fn malformed_is_typed() {
    assert!(matches!(dec("nope"), Err(PayloadError::NotJson(_))));
    assert!(matches!(dec("3"), Err(PayloadError::NotObject(_))));
    assert!(matches!(dec(r#"{"v":2}"#), Err(PayloadError::Version(_))));
    assert!(matches!(dec(r#"{"v":1,"layers":[0,0],"E":1,"n":0,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::RepeatedLayer)));
    assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":0,"bits":1,"enc":"dense","d":"***"}"#), Err(PayloadError::Base64(_))));
    assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":0,"bits":1,"enc":"dense","d":"AAAA"}"#), Err(PayloadError::DataLength { .. })));
    assert!(matches!(dec(r#"{"v":1,"layers":[true],"E":1,"n":0,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::Field { field: "layers", .. })));
    assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":-1,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::Field { field: "n", .. })));
    assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":1e400,"bits":1,"enc":"dense","d":""}"#), Err(_)));
    // crafted to allocate: refused before anything is made
    let big = format!(r#"{{"v":1,"layers":[{}],"E":65536,"n":1,"enc":"sparse","bits":1,"nnz":0,"d":""}}"#, (0..4096).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
    assert!(matches!(dec(&big), Err(PayloadError::TooManyEntries { .. })));
    assert_eq!(dec(r#"{"v":1,"none":"too_long"}"#), Ok(Payload::NoCounts("too_long".into())));
}


/// A dense (`q` None) or log payload of `codes` `[rows, e]`, rows at hidden-layer `ids`.
fn payload_of(codes: &[u32], ids: &[u32], e: usize, bits: u32, q: Option<&[u64]>) -> DecodedCounts {
    let d = base64_simd::STANDARD.encode_to_string(pack_bits(codes, bits));
    let enc = match q {
        None => r#""enc":"dense""#.to_owned(),
        Some(q) => format!(r#""enc":"log","q":{q:?}"#),
    };
    let p = format!(r#"{{"v":1,"layers":{ids:?},"E":{e},"n":5,"bits":{bits},{enc},"d":"{d}"}}"#);
    let Payload::Counts(c) = dec(&p).unwrap() else { panic!("{p}") };
    c
}

fn bits_of(sig: &SparseSignature) -> (Vec<u32>, Vec<u32>, u64) {
    (sig.index.clone(), sig.value.iter().map(|v| v.to_bits()).collect(), sig.norm.to_bits())
}

fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

proptest::proptest! {
    /// The AVX2 row kernel and the portable one give the same signature to the bit, and both
    /// the one `fill_dense` gives for the decoded counts, for dense and log rows, every bit
    /// width, widths of E that leave a scalar tail, and rows placed by id out of order.
    #[test]
    fn kernels_agree(
        rows in 1usize..6, e in 1usize..40, bits in 1u32..=24, log in proptest::bool::ANY, seed in 0u64..u64::MAX,
        zeros in 0u32..4, by_id in proptest::bool::ANY,
    ) {
        let bits = if log { bits.min(16) } else { bits };
        let mut s = seed | 1;
        let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
        let codes: Vec<u32> = (0..rows * e).map(|_| if next() % 4 < zeros as u64 { 0 } else { (next() & ((1u64 << bits) - 1)) as u32 }).collect();
        let q: Vec<u64> = (0..rows).map(|_| next() % (1 << (next() % 41))).collect();
        let num_layers = if by_id { rows + 2 } else { rows };
        let mut ids: Vec<u32> = (0..num_layers as u32).collect();
        if by_id {
            ids.reverse();
            ids.truncate(rows);
        } else {
            ids.truncate(rows);
        }
        let c = payload_of(&codes, &ids, e, bits, log.then_some(&q[..]));
        let weights: Vec<f32> = (0..num_layers).map(|l| if l % 3 == 1 { 0.0 } else { 0.5 + (next() % 100) as f32 / 50.0 }).collect();
        proptest::prop_assume!(weights.iter().any(|&w| w > 0.0));
        let idf: Vec<f32> = (0..num_layers * e).map(|_| (next() % 400) as f32 / 100.0).collect();
        let spec = SignatureSpec::new(&weights, &idf).unwrap();
        let dense = c.to_layout(num_layers, e).unwrap();
        let want = spec.from_dense(&dense);
        let mut got = SparseSignature::default();
        let portable = c.fill_signature_with(&spec, &mut got, RowKernel::Portable).map(|_| bits_of(&got));
        proptest::prop_assert_eq!(&portable, &want.as_ref().map(bits_of).map_err(|e| *e));
        let auto = c.fill_signature(&spec, &mut got).map(|_| bits_of(&got));
        proptest::prop_assert_eq!(&auto, &portable);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let simd = c.fill_signature_with(&spec, &mut got, RowKernel::Avx2).map(|_| bits_of(&got));
            proptest::prop_assert_eq!(&simd, &portable);
        }
    }

    /// The fused wire route (values dotted as they are unpacked) against the signature it
    /// replaces (`fill_signature`, then the sparse dot), to the bit: distances, and the kept
    /// signature's indices, values and norm; for dense and log rows, E a multiple of 8 or
    /// not (which leaves the fused path), K with and without a SIMD kernel, rows placed by
    /// id out of order, and selected layers the payload lacks.
    #[test]
    fn fused_matches_fill(
        rows in 1usize..6, e8 in 1usize..6, ragged in proptest::bool::ANY, bits in 1u32..=24, log in proptest::bool::ANY,
        seed in 0u64..u64::MAX, zeros in 0u32..4, by_id in proptest::bool::ANY,
        k in proptest::sample::select(vec![1usize, 3, 8, 16, 32]),
    ) {
        let e = if ragged { 8 * e8 + 3 } else { 8 * e8 };
        let bits = if log { bits.min(16) } else { bits };
        let mut s = seed | 1;
        let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
        let codes: Vec<u32> = (0..rows * e).map(|_| if next() % 4 < zeros as u64 { 0 } else { (next() & ((1u64 << bits) - 1)) as u32 }).collect();
        let q: Vec<u64> = (0..rows).map(|_| next() % (1 << (next() % 41))).collect();
        let num_layers = if by_id { rows + 2 } else { rows };
        let mut ids: Vec<u32> = (0..num_layers as u32).collect();
        if by_id {
            ids.reverse();
        }
        ids.truncate(rows);
        let c = payload_of(&codes, &ids, e, bits, log.then_some(&q[..]));
        let weights: Vec<f32> = (0..num_layers).map(|l| if l % 3 == 1 { 0.0 } else { 0.5 + (next() % 100) as f32 / 50.0 }).collect();
        proptest::prop_assume!(weights.iter().any(|&w| w > 0.0));
        let idf: Vec<f32> = (0..num_layers * e).map(|_| (next() % 400) as f32 / 100.0).collect();
        let dim = weights.iter().filter(|&&w| w > 0.0).count() * e;
        let cents: Vec<f32> = (0..k * dim).map(|_| (next() % 1000) as f32 / 997.0).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.eldr");
        crate::CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| i.to_string()).collect(), provenance: "" }
            .write(&path)
            .unwrap();
        let set = CentroidSet::open(&path).unwrap();
        let mut want_sig = SparseSignature::default();
        let want = crate::distance::from_fill(&set, Some(&mut want_sig), |spec, sig| c.fill_signature_with(spec, sig, RowKernel::Portable));
        let bits_of_d = |d: &Result<Vec<f64>, NoSignature>| d.clone().map(|d| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        let mut kernels = vec![RowKernel::Portable];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            kernels.push(RowKernel::Avx2);
        }
        for kernel in kernels {
            let mut sig = SparseSignature { index: vec![7], value: vec![1.0], norm: 1.0 };
            let got = c.distances_with(&set, Some(&mut sig), kernel);
            proptest::prop_assert_eq!(bits_of_d(&got), bits_of_d(&want), "{:?}", kernel);
            if want.is_ok() {
                proptest::prop_assert_eq!(bits_of(&sig), bits_of(&want_sig), "{:?}", kernel);
            }
            let unkept = c.distances_with(&set, None, kernel);
            proptest::prop_assert_eq!(bits_of_d(&unkept), bits_of_d(&want), "{:?}", kernel);
        }
    }

    /// Many rows' small tables at once are each row's own table, bit for bit (zeros past
    /// the codes included: the permutes read whole blocks), for any row count.
    #[test]
    fn small_tables_match_row_tables(qs in proptest::collection::vec(0u64..=MAX_COUNT, 0..11), bits in 1u32..=6) {
        let mut tables = Vec::new();
        LogRow::prepare_small(qs.iter().copied(), bits, &mut tables);
        proptest::prop_assert_eq!(tables.len(), qs.len() * LogRow::SMALL_BLOCKS);
        for (i, &q) in qs.iter().enumerate() {
            let mut lut = LogRow::default();
            lut.prepare(q, bits, 8);
            let want: Vec<u32> = lut.small.iter().flat_map(|b| b.0).map(f32::to_bits).collect();
            let got: Vec<u32> = tables[i * LogRow::SMALL_BLOCKS..(i + 1) * LogRow::SMALL_BLOCKS].iter().flat_map(|b| b.0).map(f32::to_bits).collect();
            proptest::prop_assert_eq!(got, want, "row {} (q {})", i, q);
        }
    }

    /// The log table against the formula it replaces, `expm1(code * ln(1 + q) / levels)`
    /// in f64 rounded to f32: within one f32 ulp for every code, 0 for code 0, and the
    /// decoded counts (which read the table) agree with the formula the same way.
    #[test]
    fn lut_matches_formula(qexp in 0u32..=40, qfrac in 0u64..u64::MAX, bits in 1u32..=16, experts in 1usize..300) {
        let q = if qexp == 0 { 0 } else { (1u64 << (qexp - 1)) + qfrac % (1u64 << (qexp - 1)) };
        let mut lut = LogRow::default();
        lut.prepare(q, bits, experts);
        let levels = (1u32 << bits) - 1;
        let scale = (q as f64).ln_1p() / levels as f64;
        let formula = |code: u32| (code as f64 * scale).exp_m1() as f32;
        if levels as usize <= experts.max(64) {
            proptest::prop_assert_eq!(lut.table().len(), 1usize << bits);
        }
        proptest::prop_assert_eq!(lut.value(0), 0.0);
        for code in 0..=levels.min(5000) {
            let (a, b) = (lut.value(code), formula(code));
            proptest::prop_assert!(ulps(a, b) <= 1, "code {} of {}: table {} vs formula {}", code, levels, a, b);
        }
        // the decoded counts of one row, through the table
        let e = (levels as usize + 1).min(64);
        let codes: Vec<u32> = (0..e as u32).map(|i| i * levels / (e as u32 - 1).max(1)).collect();
        let c = payload_of(&codes, &[0], e, bits, Some(&[q]));
        for (&code, &got) in codes.iter().zip(&c.to_dense()) {
            proptest::prop_assert!(ulps(got, formula(code)) <= 1, "code {}: {} vs {}", code, got, formula(code));
        }
    }
}

/// The event parsed with its base64 field cut out gives what the whole-event parse gives,
/// for events where the cut is right and where it must be refused (a decoy key `d`
/// elsewhere, a payload sent as a JSON string, an escaped `d`, text outside the base64
/// alphabet), with either separator style; and it is taken for a plain event.
#[test]
fn split_parse_matches_whole_parse() {
    let lim = DecodeLimits::default();
    let d = base64_simd::STANDARD.encode_to_string([1u8, 2, 3, 4, 5, 6]);
    let head = r#""v":1,"layers":[0,1],"E":3,"n":1,"enc":"dense","bits":8"#;
    let payload = format!(r#"{{{head},"d":"{d}"}}"#);
    let spaced = format!(r#"{{"v": 1, "layers": [0, 1], "E": 3, "n": 1, "enc": "dense", "bits": 8, "d" :  "{d}"}}"#);
    let as_text = serde_json::to_string(&payload).unwrap();
    let events = [
        format!(r#"{{"text":"","meta_info":{{"id":"r0","eldr_signature":[{payload}]}}}}"#),
        format!(r#"{{"text": "", "meta_info": {{"id": "r0", "eldr_signature": [{spaced}]}}}}"#),
        format!(r#"{{"sglext":{{"eldr_signature":{payload}}}}}"#),
        format!(r#"{{"meta_info":{{"x":{{"d":"BwgJCgsM"}},"eldr_signature":{payload}}}}}"#),
        format!(r#"{{"meta_info":{{"d":"BwgJCgsM","eldr_signature":{payload}}}}}"#),
        format!(r#"{{"text":"say "d":"AAAA"","meta_info":{{"eldr_signature":{payload}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{as_text}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQID\/AUG"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQ ID"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAU"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG""#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG","d":"AQIDBAUG"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,1.0],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,-0],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[[0],1],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":{{"a":1}},"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,1],"E":3,"n":1,"enc":"log","bits":4,"q":[3,"x"],"d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"none":"too_long","d":"{d}"}}}}}}"#),
        format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"{}"}}}}}}"#, "A".repeat(DEFAULT_MAX_BYTES + 4)),
    ];
    for ev in &events {
        assert_eq!(decode_event(ev.as_bytes(), &lim), decode_event_whole(ev.as_bytes(), &lim), "{ev}");
    }
    for ev in &events[..3] {
        assert!(matches!(decode_event_split(ev.as_bytes(), &lim), Some(Ok(Some(Payload::Counts(_))))), "{ev}");
    }
    let Ok(Some(Payload::Counts(c))) = decode_event(events[1].as_bytes(), &lim) else { panic!() };
    assert_eq!(c.to_dense(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    for ev in &events[3..7] {
        assert!(decode_event_split(ev.as_bytes(), &lim).is_none(), "{ev}");
    }
}

/// A number past f64's range in a header list is that field's error (the payload is
/// malformed), not a failed parse of the whole event (which reads as "no payload here").
#[test]
fn out_of_range_numbers_in_header_lists_are_field_errors() {
    let lim = DecodeLimits::default();
    let huge = format!("1{}", "0".repeat(400));
    for (list, field) in [(format!(r#""layers":[0,1],"q":[{huge},3]"#), "q"), (format!(r#""layers":[0,{huge}],"q":[3,3]"#), "layers"), (r#""layers":[0,1],"q":[1e400,3]"#.to_string(), "q")] {
        let ev = format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,{list},"E":32,"n":5,"enc":"log","bits":4,"d":"AAAA"}}}}}}"#);
        match decode_event(ev.as_bytes(), &lim) {
            Err(PayloadError::Field { field: f, .. }) => assert_eq!(f, field, "{ev}"),
            other => panic!("{ev}: {other:?}"),
        }
    }
}

#[test]
fn event_finds_meta_info_and_sglext() {
    let lim = DecodeLimits::default();
    let inner = r#"{"v":1,"layers":[0],"E":2,"n":1,"enc":"dense","bits":8,"d":"AQI="}"#;
    for ev in [format!(r#"{{"text":"x","meta_info":{{"id":"a","eldr_signature":[{inner}]}}}}"#), format!(r#"{{"sglext":{{"eldr_signature":{inner}}},"meta_info":null}}"#)] {
        let Some(Payload::Counts(c)) = decode_event(ev.as_bytes(), &lim).unwrap() else { panic!("{ev}") };
        assert_eq!(c.to_dense(), vec![1.0, 2.0]);
    }
    assert_eq!(decode_event(br#"{"meta_info":{"eldr_signature":null}}"#, &lim), Ok(None));
    assert_eq!(decode_event(b"[1]", &lim), Ok(None));
    assert!(decode_event(br#"{"meta_info":{"eldr_signature":{"v":1}}}"#, &lim).is_err());
}
