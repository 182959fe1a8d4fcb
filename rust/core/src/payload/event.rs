//! The payload in a stream event (`data:` JSON of an SSE line, under `meta_info` or
//! `sglext`): found by a byte search and read in place when the event allows it, else from
//! one parse of the whole event.

use std::borrow::Cow;

use serde::Deserialize;

use super::format::{DecodeLimits, Payload, PayloadError};
use super::header::{decode, from_header, from_header_own_d, Header, Text};

#[derive(Deserialize)]
struct Holder<'a> {
    #[serde(borrow, default)]
    eldr_signature: Option<Found<'a>>,
}

/// The value under the payload key, read in the same pass as the event: a payload object, a
/// list (meta_info lists per-request values: its first item), a JSON string of a payload, or
/// anything else (refused).
enum Found<'a> {
    Header(Header<'a>),
    Text(Cow<'a, str>),
    Null,
    Other(&'static str),
}

impl<'de: 'a, 'a> Deserialize<'de> for Found<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Found<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a counts payload")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Header::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Found::Header)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Found<'a>>()?.unwrap_or(Found::Other("an empty list"));
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(first)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Found::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Found::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Found::Null)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Found::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Found::Other("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A stream event, parsed in one pass: the payload is captured unparsed. An event whose
/// `meta_info` / `sglext` is not an object fails this parse and is left to the caller's parser.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    meta_info: Option<Holder<'a>>,
    #[serde(borrow, default)]
    sglext: Option<Holder<'a>>,
}

/// Find and decode the payload in one stream event (`data:` JSON of an SSE line). `Ok(None)`:
/// the event is not JSON, not an object, or carries no payload; the caller's own parser sees it.
pub fn decode_event(event: &[u8], limits: &DecodeLimits) -> Result<Option<Payload>, PayloadError> {
    if let Some(Ok(found)) = decode_event_split(event, limits) {
        return Ok(found);
    }
    // No `d` to split off, or a refusal: the one-pass parse of the whole event decides (and
    // words every error as it always has).
    decode_event_whole(event, limits)
}

/// [`decode_event`] with the base64 field cut out before the JSON parse. That field is almost
/// all of an event's bytes, and a JSON parser reads a string byte by byte; base64 has no
/// escapes, so its end is the next quote, which memchr finds with SIMD. The event less the
/// field's text is parsed as usual (a few hundred bytes), and the cut is taken for the
/// payload's `d` only if serde's `d` is the empty string left at the very place of the cut:
/// then the whole event would have parsed the same, with that text as `d`. Base64 decoding
/// then validates the text (anything outside the alphabet fails it). None: no such field, or
/// serde's `d` is another one (a key `d` elsewhere, a payload sent as a JSON string).
pub(super) fn decode_event_split(event: &[u8], limits: &DecodeLimits) -> Option<Result<Option<Payload>, PayloadError>> {
    let (start, end) = find_data_field(event)?;
    let mut rest = Vec::with_capacity(event.len() - (end - start));
    rest.extend_from_slice(&event[..start]);
    rest.extend_from_slice(&event[end..]);
    let ev = serde_json::from_slice::<Event>(&rest).ok()?;
    let cut = rest.as_ptr().wrapping_add(start);
    for h in [ev.meta_info, ev.sglext].into_iter().flatten() {
        match h.eldr_signature {
            None | Some(Found::Null) => continue,
            Some(Found::Header(h)) => {
                let at_cut = matches!(&h.d, Some(Text(Cow::Borrowed(d))) if d.is_empty() && d.as_ptr() == cut);
                return at_cut.then(|| from_header(h, Some(&event[start..end]), limits).map(Some));
            }
            _ => return None,
        }
    }
    None
}

/// The byte range of the text of the first `"d": "..."` in `event` whose text holds no quote
/// and no backslash (so it ends at the next quote).
fn find_data_field(event: &[u8]) -> Option<(usize, usize)> {
    let skip_ws = |mut i: usize| {
        while i < event.len() && matches!(event[i], b' ' | b'\t' | b'\n' | b'\r') {
            i += 1;
        }
        i
    };
    for key in memchr::memmem::find_iter(event, b"\"d\"") {
        let colon = skip_ws(key + 3);
        if event.get(colon) != Some(&b':') {
            continue;
        }
        let quote = skip_ws(colon + 1);
        if event.get(quote) != Some(&b'"') {
            continue;
        }
        let start = quote + 1;
        let len = memchr::memchr2(b'"', b'\\', &event[start..])?;
        return (event[start + len] == b'"').then_some((start, start + len));
    }
    None
}

/// [`decode_event`] by one serde pass over the whole event.
pub(super) fn decode_event_whole(event: &[u8], limits: &DecodeLimits) -> Result<Option<Payload>, PayloadError> {
    // One pass over the event; one that does not fit the schema (a field of another type,
    // a payload header serde cannot read) is left to the caller's parser.
    let Ok(ev) = serde_json::from_slice::<Event>(event) else { return Ok(None) };
    for h in [ev.meta_info, ev.sglext].into_iter().flatten() {
        match h.eldr_signature {
            None | Some(Found::Null) => continue,
            Some(Found::Header(h)) => return from_header_own_d(h, limits).map(Some),
            Some(Found::Text(t)) => return decode(t.as_bytes(), limits).map(Some),
            Some(Found::Other(kind)) => return Err(PayloadError::NotObject(kind)),
        }
    }
    Ok(None)
}
