"""A small in-process HTTP server on 127.0.0.1 that answers like SGLang 0.5.23 with
--enable-return-routed-experts: native /generate (meta_info.routed_experts) and
/v1/chat/completions (sglext.routed_experts + usage). Routing is a deterministic function of
the prompt, so tests can check every id that lands in a trace.

Token counts: prompt_tokens = number of whitespace-separated words; completion_tokens =
max_new_tokens. routed_experts has prompt_tokens + completion_tokens - 1 rows (SGLang never
runs the last generated token through the model) and `num_hidden_layers` layers, of which
the first `dense` are all zeros.

Fault injection by prompt text: "FAIL500" always answers HTTP 500, "FLAKY" answers 500 the
first time only, "BADREQ" answers 400. `die_after=N`: after N successful answers the
server drops every further connection without answering (a crashed server).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from eldr_sglang.testing.payloads import encode_routed_experts

HIDDEN, DENSE, TOPK, EXPERTS = 6, 2, 2, 8


def routing_for(text: str, completion_tokens: int, hidden=HIDDEN, dense=DENSE, k=TOPK, E=EXPERTS) -> np.ndarray:
    """int32 [P + C - 1, hidden, k]: what the fake server returns for this prompt."""
    P = len(text.split())
    rows = P + completion_tokens - 1
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    out = np.zeros((rows, hidden, k), dtype=np.int32)
    if rows > 0:
        scores = rng.random((rows, hidden - dense, E))
        out[:, dense:, :] = np.argsort(-scores, axis=-1)[..., :k]
    return out


class FakeSGLang:
    def __init__(self, return_experts: bool = True, die_after: int | None = None, hidden: int = HIDDEN,
                 delay_s: float = 0.0, signature: bool = False):
        self.return_experts = return_experts
        self.signature = signature  # answer with meta_info.eldr_signature, as a patched prefill does
        self.bodies = []  # every request body received
        self.die_after = die_after
        self.hidden = hidden
        self.delay_s = delay_s  # answer this much later (manual Ctrl-C checks)
        self.received = Counter()  # prompt text -> requests received
        self.answered = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                if self.path == "/generate":
                    text = body["text"]
                    max_new = body["sampling_params"]["max_new_tokens"]
                elif self.path == "/v1/chat/completions":
                    text = " ".join(m["content"] for m in body["messages"])
                    max_new = body["max_tokens"]
                else:
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                with fake.lock:
                    fake.received[text] += 1
                    count = fake.received[text]
                    fail = "FAIL500" in text or ("FLAKY" in text and count == 1) or "BADREQ" in text
                    if fake.die_after is not None and fake.answered >= fake.die_after:
                        self.close_connection = True
                        self.connection.close()  # crashed: no answer at all
                        return
                    if not fail:
                        fake.answered += 1  # checked and counted under one lock: no race
                if "BADREQ" in text:
                    return self._send(400, {"error": {"message": "bad request (injected)"}})
                if fail:
                    return self._send(500, {"error": {"message": "internal server error (injected)"}})
                if fake.delay_s:
                    time.sleep(fake.delay_s)
                P = len(text.split())
                b64 = encode_routed_experts(routing_for(text, max_new, hidden=fake.hidden))
                with fake.lock:
                    fake.bodies.append(body)
                sig = None
                if fake.signature:
                    from eldr_sglang.sglang_ext.payload import encode_counts

                    ids = routing_for(text, max_new, hidden=fake.hidden)[:P, DENSE:, :]
                    counts = np.zeros((fake.hidden - DENSE, EXPERTS), dtype=np.int64)
                    np.add.at(counts, (np.arange(fake.hidden - DENSE)[None, :, None], ids), 1)
                    sig = encode_counts(counts, list(range(DENSE, fake.hidden)), P)
                if self.path == "/generate":
                    meta = {"id": f"rid{count}", "prompt_tokens": P, "completion_tokens": max_new,
                            "finish_reason": {"type": "length", "length": max_new}, "cached_tokens": 0}
                    if sig is not None:
                        meta["eldr_signature"] = sig
                    if body.get("return_routed_experts") and fake.return_experts:
                        meta["routed_experts"] = b64
                    return self._send(200, {"text": "x " * max_new, "output_ids": list(range(max_new)),
                                            "meta_info": meta})
                resp = {"id": "chatcmpl-1", "object": "chat.completion",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": P, "completion_tokens": max_new,
                                  "total_tokens": P + max_new}}
                if body.get("return_routed_experts") and fake.return_experts:
                    resp["sglext"] = {"routed_experts": b64}
                if sig is not None:
                    resp.setdefault("sglext", {})["eldr_signature"] = sig
                return self._send(200, resp)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that went away: not news
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "FakeSGLang":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
