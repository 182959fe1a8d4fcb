"""ELDR trace format, version 2: per-request prefill counts first, decode routing optional.

A v2 trace is one uncompressed ZIP of `.npy` members (an `.npz` that `np.load` opens), written
member by member as a stream, so neither the writer nor the reader ever holds more than one
chunk of requests. The ZIP central directory is the index; `meta_json` lists the chunks.

| member                  | dtype, shape            | meaning                                         |
|-------------------------|-------------------------|-------------------------------------------------|
| `meta_json`             | str scalar              | format, version 2, model, num_layers, num_experts, top_k, num_requests, chunks |
| `prefill_len`           | int32 [R]               | prompt tokens of each request                   |
| `decode_len`            | int32 [R]               | decode tokens of each request                   |
| `counts_exact`          | bool [R]                | False where the counts came from a lossy (log-quantized) signature payload |
| `domain`, `subdomain`   | str [R]                 | optional labels, for evaluation only            |
| `arrival_s`             | float64 [R]             | optional arrival times                          |
| `c{i}_indptr`           | int64 [R_i + 1]         | chunk i's requests, CSR row pointers            |
| `c{i}_index`            | uint16 or uint32 [nnz]  | column `l * num_experts + e` (uint16 when L*E <= 65536) |
| `c{i}_count`            | uint16 or uint32 [nnz]  | prompt tokens of the request that chose e at layer l (uint32 only in a chunk with a count > 65535) |
| `d{i}_requests`         | int64 [m_i]             | optional: requests of chunk i whose decode routing is kept |
| `d{i}_offsets`          | int64 [m_i + 1]         | their rows in `d{i}_expert_ids`                  |
| `d{i}_expert_ids`       | integer [T_i, L, k]     | top-k ids of every kept decode token, in order   |

Counts are the record the patched prefill already streams (the `eldr_signature` payload,
`eldr_sglang.sglang_ext.payload`): a fit needs nothing else. Decode routing is kept for as
many requests as asked (the simulator needs it, the fit does not).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zipfile
import zlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator

import numpy as np
import scipy.sparse as sp

from .format import TRACE_FORMAT, Trace, TraceError, check_meta, load_trace, read_member
from .source import TraceSource

COUNTS_VERSION = 2
DEFAULT_CHUNK_REQUESTS = 4096
_PER_REQUEST = ("prefill_len", "decode_len", "counts_exact", "domain", "subdomain", "arrival_s")


def _index_dtype(columns: int) -> np.dtype:
    return np.dtype(np.uint16 if columns <= 1 << 16 else np.uint32)


def _count_dtype(max_count: int) -> np.dtype:
    return np.dtype(np.uint16 if max_count <= np.iinfo(np.uint16).max else np.uint32)


def is_counts_trace(path: str | os.PathLike) -> bool:
    """Whether `path` is a readable v2 trace (a `c0_indptr` member); False for v1 or junk."""
    try:
        with zipfile.ZipFile(path) as z:
            return "meta_json.npy" in z.namelist() and "prefill_len.npy" in z.namelist() and "expert_ids.npy" not in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


class CountsTraceWriter:
    """Stream a v2 trace to `path`: `write_chunk(...)` per chunk of requests, then `close()`.

    The file is staged beside `path` and renamed over it only by a successful `close()`
    (eldr_sglang.io_safe): an interrupted or failed write leaves what stood there untouched.
    Per-request scalars (a few bytes a request) are held until `close()`; counts and decode
    routing go to disk as they come."""

    def __init__(self, path: str | os.PathLike, *, num_layers: int, num_experts: int, top_k: int,
                 meta: dict | None = None, inputs=()):
        from eldr_sglang.io_safe import Staged

        meta = dict(meta or {})
        meta.update(format=TRACE_FORMAT, version=COUNTS_VERSION, num_layers=int(num_layers),
                    num_experts=int(num_experts), top_k=int(top_k))
        self.meta = check_meta(meta)
        self.L, self.E, self.k = int(num_layers), int(num_experts), int(top_k)
        self._staged = Staged(path, what="trace", inputs=inputs)
        self._zip = zipfile.ZipFile(self._staged.tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._per_request: dict[str, list] = {k: [] for k in _PER_REQUEST}
        self._chunks: list[dict] = []
        self._requests = 0
        self._decode_kept = 0
        self._closed = False

    def _put(self, name: str, arr: np.ndarray) -> None:
        with self._zip.open(name + ".npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array(fh, np.asarray(arr), allow_pickle=False)

    def write_chunk(self, counts: sp.csr_matrix, prefill_len, decode_len, *, exact=None, domain=None,
                    subdomain=None, arrival_s=None, decode: tuple | None = None) -> None:
        """One chunk of n requests: `counts` CSR [n, L*E] of non-negative integer prefill
        counts; `decode` = (local request indices [m], offsets [m+1], ids [T, L, k]) or None."""
        counts = sp.csr_matrix(counts)
        n = counts.shape[0]
        if counts.shape[1] != self.L * self.E:
            raise TraceError(f"counts have {counts.shape[1]} columns, expected num_layers*num_experts = {self.L * self.E}")
        if n == 0:
            return
        counts.sum_duplicates()
        counts.eliminate_zeros()
        data = counts.data
        if data.size and (data.min() < 0 or not np.all(np.equal(np.mod(data, 1), 0))):
            raise TraceError("prefill counts must be non-negative integers")
        cols = {"prefill_len": np.asarray(prefill_len, dtype=np.int32), "decode_len": np.asarray(decode_len, dtype=np.int32),
                "counts_exact": np.ones(n, dtype=bool) if exact is None else np.asarray(exact, dtype=bool),
                "domain": domain, "subdomain": subdomain,
                "arrival_s": None if arrival_s is None else np.asarray(arrival_s, dtype=np.float64)}
        for name, a in cols.items():
            have = self._per_request[name]
            if a is None:
                if have:
                    raise TraceError(f"chunk {len(self._chunks)} has no {name}, earlier chunks do")
                continue
            a = np.asarray(a)
            if a.shape != (n,):
                raise TraceError(f"{name} has shape {a.shape}, expected ({n},)")
            if not have and self._requests > 0:
                raise TraceError(f"chunk {len(self._chunks)} has {name}, earlier chunks do not")
            have.append(a)
        if np.any(cols["prefill_len"] < 0) or np.any(cols["decode_len"] < 0):
            raise TraceError("prefill_len and decode_len must be >= 0")
        i = len(self._chunks)
        self._put(f"c{i}_indptr", counts.indptr.astype(np.int64))
        self._put(f"c{i}_index", counts.indices.astype(_index_dtype(self.L * self.E)))
        self._put(f"c{i}_count", data.astype(_count_dtype(int(data.max()) if data.size else 0)))
        kept = 0
        if decode is not None:
            req, off, ids = (np.asarray(x) for x in decode)
            req = req.astype(np.int64)
            if req.ndim != 1 or off.shape != (len(req) + 1,) or ids.ndim != 3 or ids.shape[1:] != (self.L, self.k):
                raise TraceError(f"decode routing must be (requests [m], offsets [m+1], ids [T, {self.L}, {self.k}])")
            if len(req) and (req.min() < 0 or req.max() >= n or np.any(np.diff(req) <= 0)):
                raise TraceError("decode requests must be increasing indices into the chunk")
            if off[0] != 0 or off[-1] != ids.shape[0] or np.any(np.diff(off) != cols["decode_len"][req]):
                raise TraceError("decode offsets must hold each kept request's decode_len rows")
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.E):
                raise TraceError(f"decode expert ids out of range 0..{self.E - 1}")
            if len(req):
                self._put(f"d{i}_requests", req + self._requests)
                self._put(f"d{i}_offsets", off.astype(np.int64))
                self._put(f"d{i}_expert_ids", ids)
                kept = len(req)
        self._chunks.append({"first": self._requests, "requests": n, "nnz": int(data.size), "decode_requests": kept})
        self._requests += n
        self._decode_kept += kept

    def close(self) -> Path:
        """Write the per-request arrays and meta_json, then rename the file into place."""
        if self._closed:
            raise TraceError("trace writer already closed")
        if self._requests == 0:
            raise TraceError("empty trace: it holds no requests")
        for name, parts in self._per_request.items():
            if parts:
                self._put(name, np.concatenate(parts))
        meta = dict(self.meta, num_requests=self._requests, chunks=self._chunks,
                    decode_requests=self._decode_kept)
        self._put("meta_json", np.array(json.dumps(meta)))
        self._zip.close()
        self._closed = True
        return self._staged.commit()

    def discard(self) -> None:
        """Remove the staged file. Never raises for the ZIP's own close: on a full disk that close
        (it writes the central directory) fails too, and the file must go all the same."""
        try:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(Exception):  # ZipFile.close closes the file in a finally
                    self._zip.close()
        finally:
            self._staged.discard()

    def __enter__(self) -> "CountsTraceWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and not self._staged.done:
            try:
                self.close()
            except BaseException:  # a full disk at the last member, the fsync or the rename
                self.discard()
                raise
        else:
            self.discard()


@dataclass
class CountsTrace:
    """A v2 trace opened for reading: per-request arrays in memory, counts and decode routing
    read one chunk at a time (use as a context manager, or call close())."""

    path: Path
    meta: dict
    prefill_len: np.ndarray  # int32 [R]
    decode_len_: np.ndarray  # int32 [R]
    counts_exact: np.ndarray  # bool [R]
    domain: np.ndarray | None
    subdomain: np.ndarray | None
    arrival_s: np.ndarray | None
    _z: object
    _fh: object = None  # the file, for reading stored members straight into arrays
    _verified: set = dataclasses.field(default_factory=set)  # members whose CRC was checked
    _stat: tuple = ()  # (size, mtime) of the file when they were

    counts_only: ClassVar[bool] = True  # a TraceSource: prompts by their counts alone

    @property
    def num_requests(self) -> int:
        return int(self.meta["num_requests"])

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @property
    def model(self) -> str:
        return str(self.meta.get("model", "unknown"))

    @property
    def chunks(self) -> list[dict]:
        return self.meta["chunks"]

    def decode_len(self) -> np.ndarray:
        return self.decode_len_.astype(np.int64)

    def validate(self) -> None:
        """The checks that need no chunk (open_counts_trace made them; each chunk is checked
        as it is read)."""
        check_meta(self.meta)
        if self.num_requests < 1:
            raise TraceError("empty trace: it holds no requests")

    def _member(self, name: str) -> np.ndarray:
        try:
            info = self._z.zip.getinfo(name + ".npy")
        except KeyError:
            raise TraceError(f"{self.path}: member {name!r} is missing") from None
        try:
            if self._fh is not None and info.compress_type == zipfile.ZIP_STORED:
                # a fit reads every chunk twice (IDF, then signatures): the CRC is checked on the
                # first read, and again only if the file changed since it was opened
                st = os.fstat(self._fh.fileno())
                if (st.st_size, st.st_mtime_ns) != self._stat:
                    self._verified, self._stat = set(), (st.st_size, st.st_mtime_ns)
                a = _read_stored(self._fh, info, verify=name not in self._verified)
                if a is not None:
                    self._verified.add(name)
                    return a
            return self._z[name]
        except TraceError as exc:
            raise TraceError(f"{self.path}: member {name!r} {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a truncated or corrupt member
            raise TraceError(f"{self.path}: member {name!r} is unreadable ({exc})") from None

    def chunk_arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk i's prefill counts as the stored CSR arrays (indptr int64 [n_i+1], index and
        count unsigned [nnz], column l*E + e), validated; no conversion, no copy beyond the read."""
        c = self.chunks[i]
        n, cols = int(c["requests"]), self.num_layers * self.num_experts
        indptr, index, count = (self._member(f"c{i}_{x}") for x in ("indptr", "index", "count"))
        if indptr.shape != (n + 1,) or indptr[0] != 0 or indptr[-1] != index.shape[0] or index.shape != count.shape \
                or np.any(np.diff(indptr) < 0):
            raise TraceError(f"{self.path}: chunk {i}'s counts are inconsistent (indptr/index/count shapes)")
        if index.size and int(index.max()) >= cols:
            raise TraceError(f"{self.path}: chunk {i} has a column {int(index.max())} outside num_layers*num_experts = {cols}")
        if not (np.issubdtype(index.dtype, np.unsignedinteger) and np.issubdtype(count.dtype, np.unsignedinteger)):
            raise TraceError(f"{self.path}: chunk {i}'s index and count must be unsigned integers")
        return indptr.astype(np.int64, copy=False), index, count

    def chunk_counts(self, i: int) -> sp.csr_matrix:
        """Chunk i's prefill counts, CSR [n_i, L*E] (column l*E + e), validated."""
        indptr, index, count = self.chunk_arrays(i)
        return sp.csr_matrix((count, index, indptr), shape=(len(indptr) - 1, self.num_layers * self.num_experts))

    def iter_counts(self) -> Iterator[tuple[int, sp.csr_matrix]]:
        """(first request, counts CSR) of each chunk, in order."""
        for i, c in enumerate(self.chunks):
            yield int(c["first"]), self.chunk_counts(i)

    def counts(self, requests=None) -> sp.csr_matrix:
        """Counts of the given requests (all by default), CSR [len(requests), L*E], in that order.
        Reads the chunks that hold them, one at a time."""
        if requests is None:
            return sp.vstack([m for _, m in self.iter_counts()], format="csr")
        req = np.asarray(requests, dtype=np.int64)
        firsts = np.array([c["first"] for c in self.chunks], dtype=np.int64)
        which = np.searchsorted(firsts, req, side="right") - 1
        parts, order = [], []
        for i in np.unique(which):
            sel = np.flatnonzero(which == i)
            parts.append(self.chunk_counts(int(i))[req[sel] - firsts[i]])
            order.append(sel)
        if not parts:
            return sp.csr_matrix((0, self.num_layers * self.num_experts), dtype=np.uint32)
        out = sp.vstack(parts, format="csr")
        inv = np.empty(len(req), dtype=np.int64)
        inv[np.concatenate(order)] = np.arange(len(req))
        return out[inv]

    def decode_requests(self) -> np.ndarray:
        """int64 indices of the requests whose decode routing is kept."""
        parts = [self._member(f"d{i}_requests") for i, c in enumerate(self.chunks) if c.get("decode_requests")]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def iter_decode(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(requests [m], offsets [m+1], ids [T, L, k]) of each chunk with kept decode routing."""
        for i, c in enumerate(self.chunks):
            if c.get("decode_requests"):
                req, off, ids = (self._member(f"d{i}_{x}") for x in ("requests", "offsets", "expert_ids"))
                if off.shape != (len(req) + 1,) or off[-1] != ids.shape[0] or ids.ndim != 3 \
                        or ids.shape[1:] != (self.num_layers, self.top_k):
                    raise TraceError(f"{self.path}: chunk {i}'s decode routing is inconsistent")
                yield req, off, ids

    def decode_trace(self) -> Trace:
        """The kept decode routing as a v1 Trace of those requests with no prefill rows
        (prefill_len 0): what the simulator's decode side reads. Labels and arrivals follow."""
        req = self.decode_requests()
        if not len(req):
            raise TraceError(f"{self.path}: the trace keeps no decode routing (synthesize or collect with decode kept)")
        off = np.zeros(len(req) + 1, dtype=np.int64)
        np.cumsum(self.decode_len()[req], out=off[1:])
        ids = None
        at = 0
        for _, chunk_off, chunk_ids in self.iter_decode():  # into one preallocated array: no 2x peak
            if ids is None:
                ids = np.empty((int(off[-1]),) + chunk_ids.shape[1:], dtype=chunk_ids.dtype)
            ids[at : at + chunk_ids.shape[0]] = chunk_ids
            at += chunk_ids.shape[0]
        if at != off[-1]:
            raise TraceError(f"{self.path}: the kept decode rows ({at}) do not match decode_len ({int(off[-1])})")
        pick = lambda a: None if a is None else a[req]  # noqa: E731
        return Trace(expert_ids=ids, req_offsets=off,
                     prefill_len=np.zeros(len(req), dtype=np.int32), meta=dict(self.meta, decode_of_requests=len(req)),
                     domain=pick(self.domain), subdomain=pick(self.subdomain), arrival_s=pick(self.arrival_s))

    def close(self) -> None:
        self._z.close()
        if self._fh is not None:
            self._fh.close()

    def __enter__(self) -> "CountsTrace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a ZIP local file header (zipfile.sizeFileHeader bytes)


def _read_stored(fh, info: zipfile.ZipInfo, verify: bool = True) -> np.ndarray | None:
    """A stored (uncompressed) `.npy` member read with one `readinto` into its array, CRC-checked
    against the ZIP directory: what `np.load`'s member read does, without its copy through
    small buffers (a DeepSeek-V3 chunk is 130 MB). None for a dtype that needs pickle."""
    fh.seek(info.header_offset)
    head = fh.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise TraceError("has a bad ZIP local header")
    fields = _LOCAL_HEADER.unpack(head)
    start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    fh.seek(start)
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    else:
        return None
    if dtype.hasobject:
        return None
    header_len = fh.tell() - start
    arr = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
    if header_len + arr.nbytes != info.file_size:
        raise TraceError(f"holds {info.file_size} bytes, its header says {header_len + arr.nbytes}")
    fh.seek(start)
    crc = zlib.crc32(fh.read(header_len))
    buf = memoryview(arr.reshape(-1, order="A")).cast("B") if arr.size else memoryview(b"")
    if arr.size and fh.readinto(buf) != arr.nbytes:
        raise TraceError("is truncated")
    if verify and zlib.crc32(buf, crc) != info.CRC:
        raise TraceError("is corrupt (CRC mismatch)")
    return arr


def open_counts_trace(path: str | os.PathLike) -> CountsTrace:
    """Open a v2 trace: meta and per-request arrays are read and checked, chunks stay on disk.
    Raises TraceError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - zipfile/npy errors come in many types
        raise TraceError(f"{path}: not a readable trace ({exc})") from None
    try:
        if not hasattr(z, "files") or "meta_json" not in z.files:
            raise TraceError(f"{path}: not an ELDR trace (no meta_json)")
        meta_text = str(read_member(z, "meta_json", path))
        try:
            meta = check_meta(json.loads(meta_text))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: meta_json is not valid JSON ({exc})") from None
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        if meta.get("format", TRACE_FORMAT) != TRACE_FORMAT or meta.get("version") != COUNTS_VERSION:
            raise TraceError(f"{path}: not an ELDR trace version {COUNTS_VERSION} (format {meta.get('format')!r}, "
                             f"version {meta.get('version')!r})")
        chunks = meta.get("chunks")
        R = meta.get("num_requests")
        if not isinstance(R, int) or R < 1 or not isinstance(chunks, list) or not chunks:
            raise TraceError(f"{path}: meta_json needs num_requests >= 1 and a non-empty chunk list")
        first = 0
        for i, c in enumerate(chunks):
            if not (isinstance(c, dict) and c.get("first") == first and isinstance(c.get("requests"), int) and c["requests"] > 0):
                raise TraceError(f"{path}: chunk {i} of meta_json does not follow the previous one")
            first += c["requests"]
        if first != R:
            raise TraceError(f"{path}: the chunks hold {first} requests, meta_json says {R}")
        arrays = {}
        for name in _PER_REQUEST:
            if name in z.files:
                a = read_member(z, name, path)
                if a.shape != (R,):
                    raise TraceError(f"{path}: {name} has shape {a.shape}, expected ({R},)")
                arrays[name] = a
        for name in ("prefill_len", "decode_len"):
            if name not in arrays:
                raise TraceError(f"{path}: missing array {name!r}")
            if np.any(arrays[name] < 0):
                raise TraceError(f"{path}: {name} holds negative lengths")
        if "arrival_s" in arrays and not np.all(np.isfinite(arrays["arrival_s"])):
            raise TraceError(f"{path}: arrival_s holds NaN or infinite values")
        return CountsTrace(
            path=path, meta=meta, prefill_len=arrays["prefill_len"].astype(np.int32, copy=False),
            decode_len_=arrays["decode_len"].astype(np.int32, copy=False),
            counts_exact=arrays.get("counts_exact", np.ones(R, dtype=bool)).astype(bool, copy=False),
            domain=arrays.get("domain"), subdomain=arrays.get("subdomain"),
            arrival_s=None if "arrival_s" not in arrays else arrays["arrival_s"].astype(np.float64, copy=False), _z=z,
            _fh=open(path, "rb"))
    except BaseException:
        z.close()
        raise


# ------------------------------------------------------------------------------ from v1
def prefill_counts(ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray, num_experts: int) -> sp.csr_matrix:
    """CSR [R, L*E] of each request's prompt counts from v1 ids (request r is rows
    offsets[r]:offsets[r]+prefill_len[r]), counted by the Rust `count_topk` (the router's)."""
    from eldr_sglang import _core

    R = len(prefill_len)
    L = ids.shape[1]
    indptr = np.zeros(R + 1, dtype=np.int64)
    index_parts, count_parts = [], []
    for r in range(R):
        s = int(offsets[r])
        c = np.asarray(_core.count_topk(ids[s : s + int(prefill_len[r])], num_experts)).reshape(-1)
        nz = np.flatnonzero(c)
        index_parts.append(nz.astype(np.uint32))
        count_parts.append(c[nz])
        indptr[r + 1] = indptr[r] + nz.size
    index = np.concatenate(index_parts) if R else np.zeros(0, np.uint32)
    count = np.concatenate(count_parts) if R else np.zeros(0, np.uint32)
    return sp.csr_matrix((count, index, indptr), shape=(R, L * num_experts))


def write_v1_as_counts(trace: Trace, path: str | os.PathLike, *, keep_decode: int | None = None,
                       chunk_requests: int = DEFAULT_CHUNK_REQUESTS, inputs=(), progress=None) -> Path:
    """Convert a v1 trace to v2: counts of every request's prompt; decode routing of the first
    `keep_decode` requests (all when None, none when 0)."""
    trace.validate()
    R = trace.num_requests
    keep = R if keep_decode is None else max(0, min(int(keep_decode), R))
    meta = {k: v for k, v in trace.meta.items() if k not in ("format", "version")}
    off, pl = trace.req_offsets, trace.prefill_len.astype(np.int64)
    dl = trace.decode_len()
    with CountsTraceWriter(path, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=trace.top_k,
                           meta=meta, inputs=inputs) as w:
        for a in range(0, R, chunk_requests):
            b = min(R, a + chunk_requests)
            counts = prefill_counts(trace.expert_ids, off[a:b], pl[a:b], trace.num_experts)
            decode = None
            if keep > a:
                m = min(b, keep) - a
                req = np.arange(m, dtype=np.int64)
                d_off = np.zeros(m + 1, dtype=np.int64)
                np.cumsum(dl[a : a + m], out=d_off[1:])
                rows = np.concatenate([np.arange(off[a + j] + pl[a + j], off[a + j + 1]) for j in range(m)])
                decode = (req, d_off, trace.expert_ids[rows.astype(np.int64)])
            pick = lambda x: None if x is None else x[a:b]  # noqa: E731
            w.write_chunk(counts, pl[a:b], dl[a:b], domain=pick(trace.domain), subdomain=pick(trace.subdomain),
                          arrival_s=pick(trace.arrival_s), decode=decode)
            if progress is not None:
                progress(b - a)
    return Path(path)


def open_trace(path: str | os.PathLike) -> TraceSource:
    """A trace of either version: a v1 `Trace` (in memory) or a v2 `CountsTrace` (chunks
    read on demand; close it when done, or open it in a `with` block). Raises TraceError. It lives here, not in `format`,
    so that v2 builds on v1 and never the other way round."""
    return open_counts_trace(path) if is_counts_trace(path) else load_trace(path)
